"""The OpenAI/vLLM request models (afd/serving/api_models.py) against the user guide: every request field
the models know is named there."""

from __future__ import annotations

from pathlib import Path

from afd.serving.api_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    TokenizeChatRequest,
)


def test_the_user_guide_names_every_request_field():
    guide = (Path(__file__).parents[2] / "docs" / "user-guide.md").read_text()
    names = {n for m in (CompletionRequest, ChatCompletionRequest, ChatMessage, StreamOptions, TokenizeChatRequest) for n in m.model_fields}
    missing = sorted(n for n in names if f"`{n}`" not in guide and f'"{n}"' not in guide)
    assert not missing, f"docs/user-guide.md does not mention: {missing}"
