"""Request bodies of the OpenAI-compatible API, with vLLM's extensions.

Every field of OpenAI's and vLLM's completions and chat request schemas is known here:

* a field afd implements is typed and validated (a wrong type or range is a 400 naming it);
* a field afd does not implement is declared with :func:`unimplemented`: it is accepted at its no-op
  values (null, the default, ``[]``, ``best_of == n``) and any other value is a 400 naming it;
* any other field is ignored, and the server logs one warning per field name (vLLM does the same),
  so a client that sends something new never fails.

The JSON schema of these models is the server's ``/openapi.json``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from afd.config import MAX_LOGPROBS

MAX_N = 16
MAX_STOP = 4  # as OpenAI and vLLM
MAX_PROMPTS = 1024  # prompts in one completions request (vLLM's default)
_INT64 = 2**63


def _json(value: Any) -> str:
    return json.dumps(value)


def unimplemented(*accepted: Any, any_value: bool = False, why: str, also: str = "") -> Any:
    """A known field afd does not implement: ``accepted`` are its no-op values (the first is the
    default); with ``any_value`` every value is a no-op for afd (a hint, or a setting that has no
    effect without a feature afd refuses). ``why`` names the feature, in the 400 and the schema;
    ``also`` describes a no-op value that depends on other fields (a model's ``_is_no_op`` checks it)."""
    ok = "any value" if any_value else " or ".join([*map(_json, accepted), *([also] if also else [])])
    return Field(default=accepted[0] if accepted else None, description=f"{why}; accepted: {ok}",
                 json_schema_extra={"x-afd-accepted": "any" if any_value else list(accepted)})


def _accepted(field) -> list | str | None:
    extra = field.json_schema_extra
    return extra.get("x-afd-accepted") if isinstance(extra, dict) else None


class _Body(BaseModel):
    """Unknown fields are kept aside (``model_extra``), never an error; the server logs them once."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        """JSON can carry lone surrogates (``"\\udcff"``), which no tokenizer or UTF-8 encoder takes: a 400 here."""
        if (where := _lone_surrogate(data, "")) is not None:
            raise PydanticCustomError("afd_invalid", "{field}: invalid Unicode (a lone surrogate); send UTF-8 text",
                                      {"field": where or "body"})
        return data

    @model_validator(mode="after")
    def _only_no_op_values(self):
        fields = type(self).model_fields
        for name in self.model_fields_set & fields.keys():
            accepted = _accepted(fields[name])
            if accepted is None or accepted == "any":
                continue
            value = getattr(self, name)
            if value in accepted or self._is_no_op(name, value):
                continue
            why, ok = fields[name].description.split("; accepted: ")
            raise PydanticCustomError("afd_unimplemented", "{field} is not supported by afd ({why}); it accepts only {ok}",
                                      {"field": name, "why": why, "ok": ok})
        return self

    def _is_no_op(self, name: str, value: Any) -> bool:
        return False

    def unknown_fields(self, prefix: str = "") -> list[str]:
        """Dotted names of every field nobody defines, here and in nested bodies."""
        out = [prefix + k for k in (self.model_extra or {})]
        for name in self.model_fields_set & type(self).model_fields.keys():
            value = getattr(self, name)
            for i, item in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(item, _Body):
                    out += item.unknown_fields(f"{prefix}{name}{'[]' if isinstance(value, list) else ''}.")
        return sorted(set(out))


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The dotted path of the first string (or key) in ``value`` that is not valid Unicode, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for k, v in value.items():
            key = str(k).encode("utf-8", "backslashreplace").decode("utf-8")  # the path is shown: keep it printable
            sub = f"{path}.{key}" if path else key
            if (hit := _lone_surrogate(k, sub)) is not None or (hit := _lone_surrogate(v, sub)) is not None:
                return hit
    elif isinstance(value, list):
        for v in value:
            if (hit := _lone_surrogate(v, path)) is not None:
                return hit
    return None


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class _Request(_Body):
    """What completions and chat share: the model, sampling, stopping, streaming."""

    model: str | None = None  # null: the served model
    max_tokens: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    user: str | None = None  # an end-user id: recorded nowhere
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extensions
    top_k: int | None = Field(default=None, ge=-1)  # 0 or -1: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the last (or first) k prompt tokens; -1: the context
    truncation_side: Literal["left", "right"] | None = None
    return_tokens_as_token_ids: bool | None = False  # logprob tokens as "token_id:N"
    request_id: str | None = None  # the response's id
    # known, not implemented
    use_beam_search: Any = unimplemented(False, None, why="beam search")
    length_penalty: Any = unimplemented(1.0, None, why="beam search's length penalty")
    watermarking: Any = unimplemented(None, False, why="watermarking")
    spaces_between_special_tokens: Any = unimplemented(True, None, why="the tokenizers library joins special tokens as it decodes")
    allowed_token_ids: Any = unimplemented(None, why="allowed token ids")
    bad_words: Any = unimplemented([], None, why="bad words")
    logprob_token_ids: Any = unimplemented(None, [], why="logprobs of chosen token ids")
    response_format: Any = unimplemented(None, {"type": "text"}, why="structured output")
    structured_outputs: Any = unimplemented(None, why="structured output")
    guided_json: Any = unimplemented(None, why="structured output")
    guided_regex: Any = unimplemented(None, why="structured output")
    guided_choice: Any = unimplemented(None, why="structured output")
    guided_grammar: Any = unimplemented(None, why="structured output")
    guided_decoding_backend: Any = unimplemented(None, why="structured output")
    guided_whitespace_pattern: Any = unimplemented(None, why="structured output")
    logits_processors: Any = unimplemented(None, [], why="custom logits processors")
    priority: Any = unimplemented(0, None, why="priority scheduling")
    return_token_ids: Any = unimplemented(False, None, why="token ids in the response")
    return_token_offsets: Any = unimplemented(False, None, why="token offsets in the response")
    routed_experts_prompt_start: Any = unimplemented(0, None, why="routed experts in the response")
    mm_payload: Any = unimplemented(None, why="multimodal input")
    return_mm_kwargs: Any = unimplemented(False, None, why="multimodal input")
    mm_processor_kwargs: Any = unimplemented(None, {}, why="multimodal input")
    media_io_kwargs: Any = unimplemented(None, {}, why="multimodal input")
    kv_transfer_params: Any = unimplemented(None, {}, why="KV transfer")
    ec_transfer_params: Any = unimplemented(None, {}, why="encoder-cache transfer")
    vllm_xargs: Any = unimplemented(None, {}, why="vLLM plugin arguments")
    repetition_detection: Any = unimplemented(None, why="repetition detection")
    thinking_token_budget: Any = unimplemented(None, why="a thinking budget (no reasoning parser)")
    stream_interval: Any = unimplemented(None, 1, why="batched stream chunks")
    service_tier: Any = unimplemented(None, "auto", "default", why="service tiers")
    store: Any = unimplemented(None, False, why="stored completions")
    metadata: Any = unimplemented(None, any_value=True, why="metadata, kept only with store")
    cache_salt: Any = unimplemented(None, any_value=True, why="no prefix cache is shared, so nothing needs salting")
    session_id: Any = unimplemented(None, any_value=True, why="a routing hint")
    prompt_cache_key: Any = unimplemented(None, any_value=True, why="a routing hint")
    safety_identifier: Any = unimplemented(None, any_value=True, why="an end-user id")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is not None and any(not k.isdigit() for k in v):
            raise ValueError("keys must be token ids (strings of digits)")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("afd_invalid", "stream_options is only allowed with stream: true", {"field": "stream_options"})
        if self.prompt_logprobs is not None and self.stream:
            raise PydanticCustomError("afd_invalid", "prompt_logprobs are not available with stream: true (as in vLLM)",
                                      {"field": "prompt_logprobs"})
        return self


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0: only with echo (the prompt's logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    add_special_tokens: bool = True
    suffix: Any = unimplemented(None, "", why="insertion (suffix)")
    best_of: Any = unimplemented(None, why="best-of sampling", also="the value of n")
    prompt_embeds: Any = unimplemented(None, why="prompt embeddings")

    def _is_no_op(self, name: str, value: Any) -> bool:
        return name == "best_of" and value == self.n

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be an empty list")
            if not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
            if any(isinstance(p, list) and not p for p in v):
                raise ValueError("a token-id prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("afd_invalid", "max_tokens 0 generates nothing: it is only allowed with echo: true",
                                      {"field": "max_tokens"})
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """A message as the chat template sees it: every field given is passed to the template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: Any = unimplemented(None, [], why="tool calls")
    function_call: Any = unimplemented(None, why="function calls")
    audio: Any = unimplemented(None, why="audio")

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list):
            for part in v:
                if isinstance(part, dict) and part.get("type") != "text":
                    raise ValueError(f"afd serves text only: a content part of type {part.get('type')!r} cannot be given")
        return v

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as a chat template reads it: role, content as text, and every other field given."""
        fields = {k: getattr(self, k) for k in self.model_fields_set if k not in ("role", "content")}
        return {"role": self.role, "content": self.text, **fields, **(self.model_extra or {})}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: Any = unimplemented(False, None, why="echoing the last message")
    tools: Any = unimplemented(None, [], why="tool calling")
    tool_choice: Any = unimplemented(None, "none", "auto", why="tool calling")
    parallel_tool_calls: Any = unimplemented(None, any_value=True, why="tool calling (no tools: nothing to parallelise)")
    functions: Any = unimplemented(None, [], why="function calling")
    function_call: Any = unimplemented(None, "none", "auto", why="function calling")
    reasoning_effort: Any = unimplemented(None, why="reasoning effort")
    include_reasoning: Any = unimplemented(True, any_value=True, why="no reasoning parser: the text is returned as generated")
    documents: Any = unimplemented(None, [], why="documents for retrieval")
    modalities: Any = unimplemented(None, ["text"], why="output modalities other than text")
    audio: Any = unimplemented(None, why="audio output")
    prediction: Any = unimplemented(None, why="predicted outputs")
    web_search_options: Any = unimplemented(None, why="web search")
    verbosity: Any = unimplemented(None, why="verbosity")
    return_prompt_text: Any = unimplemented(False, None, why="the rendered prompt in the response")

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("afd_invalid", "top_logprobs needs logprobs: true", {"field": "top_logprobs"})
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise PydanticCustomError("afd_invalid", "continue_final_message and add_generation_prompt cannot both be true",
                                      {"field": "continue_final_message"})
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise PydanticCustomError("afd_invalid", "continue_final_message needs an assistant message last",
                                      {"field": "continue_final_message"})
        return self


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = unimplemented(None, [], why="tool calling")
    mm_processor_kwargs: Any = unimplemented(None, {}, why="multimodal input")
    media_io_kwargs: Any = unimplemented(None, {}, why="multimodal input")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


#: ``POST /tokenize`` takes either body, as vLLM's does: a chat one when it has ``messages``
TokenizeRequest = Annotated[
    Union[Annotated[TokenizeCompletionRequest, Tag("<text>")], Annotated[TokenizeChatRequest, Tag("<chat>")]],
    Discriminator(lambda v: "<chat>" if isinstance(v, dict) and "messages" in v else "<text>"),
]
UNION_TAGS = ("<text>", "<chat>")  # in an error's location, not fields
