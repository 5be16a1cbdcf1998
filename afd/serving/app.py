"""The OpenAI-compatible HTTP API of ``afd serve`` (FastAPI), over the front end.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with server-sent-event
streaming), ``POST /tokenize``, ``POST /detokenize``, ``GET /v1/models``, ``GET /version``,
``GET /health``, ``GET /metrics``, ``GET /openapi.json`` (the request models' schema), and
``POST /rebalance`` (a disaggregated server: move the expert placement to the measured load).

Requests follow OpenAI's and vLLM's schemas (afd/serving/api_models.py says what is implemented,
what is accepted only at its no-op value, and that unknown fields are ignored). Every error is an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``. A replica failure fails
in-flight requests at once (5xx, or an error event on a stream), turns ``/health`` unhealthy and
makes the server exit non-zero (afd/serving/server.py runs it).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from afd import __version__
from afd.engine.request import TokenDelta
from afd.runtime.rebalance import RebalanceRefused
from afd.serving.frontend import Frontend
from afd.serving.inputs import InputError, Prompt, chat_prompt_ids, check_length, completion_prompts, sampling_params, truncate
from afd.serving.metrics import Metrics
from afd.serving.outputs import (chat_logprobs, completion_logprobs, generated, prompt_scored, token_texts,
                                 vllm_prompt_logprobs)
from afd.serving.api_models import (UNION_TAGS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                                  TokenizeRequest)
from afd.serving.streams import APIError, Fanout, collect, stream, to_api_error

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    frontend: Frontend
    metrics: Metrics
    tokenizer: Any
    model_name: str
    max_model_len: int
    started: float = 0.0
    rebalance_every: float = 0.0  # seconds between load checks (0: rebalance only on POST /rebalance)
    rebalance_threshold: float = 1.25  # a check moves the placement when the FFN load max/mean is above this


# ----------------------------------------------------------------------------- app


@dataclass
class _Choice:
    """What one choice of a response has sent so far."""

    prompt: Prompt
    offset: int = 0  # text offset of its next logprob token
    num_tokens: int = 0
    started: bool = False


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="afd", version=__version__, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    metrics = state.metrics
    tok = state.tokenizer
    warned: set[str] = set()  # unknown field names already logged

    def fail(e: APIError) -> JSONResponse:
        metrics.http_errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return fail(e)

    @app.exception_handler(InputError)
    async def _input_error(_, e: InputError):
        return fail(APIError(400, str(e), param=e.param, code=e.code))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        return fail(_validation_error(e.errors()))

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):
        return fail(to_api_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return fail(APIError(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error"))

    def check(body, path: str) -> None:
        """The served model (or none named); unknown fields logged once per name."""
        if body.model is not None and body.model != state.model_name:
            raise APIError(404, f"The model '{body.model}' does not exist; this server serves '{state.model_name}'",
                           param="model", code="model_not_found")
        for name in body.unknown_fields():
            if name not in warned:
                warned.add(name)
                log.warning("%s: ignoring the unknown request field %r (logged once per field name)", path, name)

    def admit(body, path: str) -> None:
        """The checks every generation request passes first."""
        check(body, path)
        fe = state.frontend
        if fe.failure is not None:
            raise APIError(503, f"the engine has failed: {fe.failure}", "service_unavailable")
        if fe.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable")

    def on_stream_error(e: APIError) -> None:
        metrics.http_errors.labels(str(e.status)).inc()

    # ------------------------------------------------------------------ info
    @app.get("/health")
    async def health():
        fe = state.frontend
        if fe.failure is not None:
            return JSONResponse({"status": "unhealthy", "reason": fe.failure}, status_code=503)
        if fe.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "in_flight": fe.num_in_flight,
                "ranks": [{"name": r.name, "pid": r.pid, "state": r.state} for r in fe.client.status().ranks]}

    @app.post("/rebalance")
    async def rebalance():
        """Recompute the expert placement from the measured per-expert load and move to it while serving."""
        client = state.frontend.client
        if not client.can_rebalance:
            raise APIError(400, "a monolithic server has no FFN ranks to rebalance", "invalid_request_error")
        try:
            return await asyncio.get_running_loop().run_in_executor(None, client.rebalance)
        except RebalanceRefused as e:
            raise APIError(409, str(e), "conflict")

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started),
                                            "owned_by": "afd", "root": state.model_name, "max_model_len": state.max_model_len}]}

    # ------------------------------------------------------------------ tokenizer
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check(body, "/tokenize")
        if isinstance(body, TokenizeChatRequest):
            ids = chat_prompt_ids(tok, body.messages, body.add_special_tokens, **_render_args(body))
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = [tok.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check(body, "/detokenize")
        bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {tok.vocab_size})", param="tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        admit(body, "/v1/completions")
        prompts = completion_prompts(tok, body, tok.vocab_size, state.max_model_len)
        # echo with logprobs scores the prompt with the same number of alternatives (vLLM's rule)
        n_prompt = max(body.prompt_logprobs or 0, body.logprobs or 0) if body.prompt_logprobs is not None or (
            body.echo and body.logprobs is not None) else None
        subs, choices = [], []
        for p in prompts:
            max_tokens = check_length(p.ids, body.max_tokens, state.max_model_len)
            for j in range(body.n):  # choice index = prompt index x n + j
                subs.append((p.ids, sampling_params(body, max_tokens, j, body.logprobs, n_prompt)))
                choices.append(_Choice(p))
        text_of = token_texts(tok, bool(body.return_tokens_as_token_ids))
        head = {"id": f"cmpl-{body.request_id or uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": state.model_name}

        def choice_body(index: int, deltas: list[TokenDelta]) -> dict:
            c = choices[index]
            first, c.started = not c.started, True
            text = "".join(d.text for d in deltas)
            items = generated(deltas)
            c.num_tokens += len(items)
            out = {"index": index, "text": text, "logprobs": None, "finish_reason": deltas[-1].finish_reason,
                   "stop_reason": deltas[-1].stop_reason}
            if first and body.echo:
                out["text"] = c.prompt.text + text
                if body.logprobs is not None:
                    items = prompt_scored(c.prompt.ids, deltas[0].prompt_logprobs) + items
            if body.logprobs is not None:
                out["logprobs"], c.offset = completion_logprobs(items, body.logprobs, text_of, c.offset)
            if first and body.prompt_logprobs is not None:
                out["prompt_logprobs"] = vllm_prompt_logprobs(deltas[0].prompt_logprobs, body.prompt_logprobs, text_of)
            return out

        num_prompt = sum(len(p.ids) for p in prompts)
        fan = Fanout(state.frontend, subs)
        if body.stream:
            return await stream(fan, lambda i, d: {**head, "choices": [choice_body(i, [d])], **_usage_each(body, choices[i])},
                                lambda: _usage_last(body, head, num_prompt, choices), on_stream_error)
        per_choice = await collect(request, fan)
        return {**head, "choices": [choice_body(i, ds) for i, ds in enumerate(per_choice)],
                "usage": _usage(num_prompt, sum(c.num_tokens for c in choices))}

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        admit(body, "/v1/chat/completions")
        ids = truncate(chat_prompt_ids(tok, body.messages, body.add_special_tokens, **_render_args(body)), body, state.max_model_len)
        max_tokens = check_length(ids, body.max_completion_tokens or body.max_tokens, state.max_model_len)
        n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        subs = [(ids, sampling_params(body, max_tokens, j, n_logprobs, body.prompt_logprobs)) for j in range(body.n)]
        choices = [_Choice(Prompt(ids, "")) for _ in subs]
        text_of = token_texts(tok, bool(body.return_tokens_as_token_ids))
        head = {"id": f"chatcmpl-{body.request_id or uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}

        def logprobs_of(deltas: list[TokenDelta]) -> dict | None:
            return chat_logprobs(generated(deltas), text_of) if body.logprobs else None

        def chunk(index: int, d: TokenDelta) -> dict:
            c = choices[index]
            delta = {"content": d.text}
            if not c.started:  # the first chunk of each choice names the role
                c.started = True
                delta = {"role": "assistant", **delta}
            c.num_tokens += d.token_id is not None
            return {**head, "object": "chat.completion.chunk", **_usage_each(body, c, len(ids)),
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs_of([d]), "finish_reason": d.finish_reason,
                                 "stop_reason": d.stop_reason}]}

        fan = Fanout(state.frontend, subs)
        if body.stream:
            return await stream(fan, chunk, lambda: _usage_last(body, {**head, "object": "chat.completion.chunk"}, len(ids), choices),
                                on_stream_error)
        per_choice = await collect(request, fan)
        out = {**head, "object": "chat.completion", "choices": [], "usage": None}
        for index, deltas in enumerate(per_choice):
            choices[index].num_tokens = len(generated(deltas))
            out["choices"].append({"index": index, "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                                   "logprobs": logprobs_of(deltas), "finish_reason": deltas[-1].finish_reason,
                                   "stop_reason": deltas[-1].stop_reason})
        if body.prompt_logprobs is not None:
            out["prompt_logprobs"] = vllm_prompt_logprobs(per_choice[0][0].prompt_logprobs, body.prompt_logprobs, text_of)
        out["usage"] = _usage(len(ids), sum(c.num_tokens for c in choices))
        return out

    return app


def _render_args(body) -> dict:
    return {"add_generation_prompt": body.add_generation_prompt, "continue_final_message": body.continue_final_message,
            "chat_template": body.chat_template, "chat_template_kwargs": body.chat_template_kwargs}


def _validation_error(errs: list[dict]) -> APIError:
    """pydantic's first error as one OpenAI-style 400 that names the field."""
    first = errs[0] if errs else {}
    kind, ctx = first.get("type"), first.get("ctx") or {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and x not in UNION_TAGS]
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {ctx.get('error', first.get('msg'))}")
    if kind in ("afd_unimplemented", "afd_invalid"):
        field = ".".join([*loc, ctx["field"]])
        return APIError(400, str(first.get("msg")), param=field)
    if kind == "model_attributes_type" or not loc:
        return APIError(400, "the request body must be a JSON object")
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return APIError(400, f"{'.'.join(loc)}: {msg}", param=".".join(loc))


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _usage_each(body, c: _Choice, num_prompt: int | None = None) -> dict:
    """vLLM's ``stream_options.continuous_usage_stats``: the choice's usage so far in every chunk."""
    opts = body.stream_options
    if opts is None or not opts.continuous_usage_stats:
        return {}
    return {"usage": _usage(len(c.prompt.ids) if num_prompt is None else num_prompt, c.num_tokens)}


def _usage_last(body, head: dict, num_prompt: int, choices: list[_Choice]) -> dict | None:
    """``stream_options.include_usage``: one last chunk with no choices and the whole request's usage."""
    opts = body.stream_options
    if opts is None or not opts.include_usage:
        return None
    return {**head, "choices": [], "usage": _usage(num_prompt, sum(c.num_tokens for c in choices))}


