"""From request bodies to engine inputs: prompts (tokenized, truncated, chat-rendered) and SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from afd.config import SamplingParams
from afd.serving.api_models import ChatMessage, CompletionRequest, _Request

#: used when the tokenizer config has no ``chat_template``: each message as a speaker's turn of a
#: play, then the assistant's cue (documented in docs/user-guide.md)
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)


class InputError(ValueError):
    """A request the server cannot turn into engine inputs (a 400); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    text: str  # what echo returns: the prompt string, or the decode of its token ids


@lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(template)


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> str:
    """The chat as text, through the request's template, else the tokenizer's, else the default.
    ``continue_final_message`` leaves the last (assistant) message open, as transformers does: the
    text ends where that message's content ends."""
    template = chat_template or tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
    try:
        text = _compiled(template).render(
            **(chat_template_kwargs or {}), messages=[m.for_template() for m in messages],
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "",
        )
    except Exception as e:  # noqa: BLE001 - a template error is the request's (or the model's) template
        raise InputError(f"the chat template failed: {type(e).__name__}: {e}", param="chat_template") from None
    if continue_final_message:
        final = messages[-1].text.strip()
        at = text.rfind(final) if final else len(text.rstrip())
        if at < 0:
            raise InputError("continue_final_message: the rendered chat does not contain the final message", param="messages")
        text = text[: at + len(final)]
    return text


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], add_special_tokens: bool, **render) -> list[int]:
    text = render_chat(tokenizer, messages, **render)
    # a model's own template writes its special tokens itself (as transformers' apply_chat_template);
    # the play-style default has none, so the tokenizer's are added
    default = not (render.get("chat_template") or tokenizer.chat_template)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens or default)


def completion_prompts(tokenizer, body: CompletionRequest, vocab_size: int, max_model_len: int) -> list[Prompt]:
    """Each prompt of a completions request (a string, token ids, or a list of either), tokenized and truncated."""
    raw = body.prompt
    if isinstance(raw, str) or all(isinstance(x, int) for x in raw):
        raw = [raw]
    out = []
    for p in raw:
        if isinstance(p, str):
            ids = tokenizer.encode(p, add_special_tokens=body.add_special_tokens)
        else:
            ids = list(p)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InputError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param="prompt")
        kept = truncate(ids, body, max_model_len)
        whole = isinstance(p, str) and len(kept) == len(ids)
        out.append(Prompt(kept, p if whole else tokenizer.decode(kept, skip_special_tokens=False)))
    return out


def truncate(ids: list[int], body: _Request, max_model_len: int) -> list[int]:
    """``truncate_prompt_tokens`` k: keep the last k tokens (``truncation_side: right``: the first k);
    -1: the model's context."""
    k = body.truncate_prompt_tokens
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if len(ids) <= k:
        return ids
    return ids[:k] if body.truncation_side == "right" else ids[len(ids) - k :]


def check_length(ids: list[int], max_tokens: int | None, max_model_len: int) -> int:
    """The request's max_tokens (default: the rest of the context); an InputError when it cannot fit."""
    if not ids:
        raise InputError("the prompt is empty: give at least one token", param="prompt")
    if max_tokens is None:
        max_tokens = max(1, max_model_len - len(ids))  # a prompt that fills the context leaves room for none: error below
    if len(ids) + max_tokens > max_model_len:
        raise InputError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {len(ids) + max_tokens} "
            f"tokens ({len(ids)} in the prompt, {max_tokens} in the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens" if len(ids) < max_model_len else "prompt", code="context_length_exceeded",
        )
    return max_tokens


def sampling_params(body: _Request, max_tokens: int, choice: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    """The engine's parameters for choice ``choice`` of a request (choice i samples with seed + i).
    Nulls take OpenAI's defaults; logit_bias values are clamped to [-100, 100], as vLLM does. A
    combination the fields' own ranges allow but the engine refuses (min_tokens > max_tokens) is an
    InputError."""

    def given(value, default):
        return default if value is None else value

    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=given(body.temperature, 1.0), top_p=given(body.top_p, 1.0),
            top_k=max(0, given(body.top_k, 0)), min_p=given(body.min_p, 0.0),
            seed=None if body.seed is None else body.seed + choice,
            stop=tuple(body.stop or ()), stop_token_ids=tuple(body.stop_token_ids or ()),
            include_stop_str_in_output=body.include_stop_str_in_output, ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens, repetition_penalty=given(body.repetition_penalty, 1.0),
            presence_penalty=given(body.presence_penalty, 0.0), frequency_penalty=given(body.frequency_penalty, 0.0),
            logit_bias=tuple(sorted((int(k), min(100.0, max(-100.0, v))) for k, v in (body.logit_bias or {}).items())),
            skip_special_tokens=body.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
    except ValueError as e:
        raise InputError(str(e)) from None
