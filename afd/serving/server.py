"""``afd serve``: an OpenAI-compatible HTTP server over the front end (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
server-sent-event streaming), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``.
A replica failure fails in-flight requests at once (5xx, or an error event on a
stream), turns ``/health`` unhealthy and makes the server exit non-zero. SIGTERM
stops accepting, lets in-flight requests finish until the shutdown deadline,
aborts the rest and stops every rank.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from afd.config import SamplingParams
from afd.engine.request import TokenDelta
from afd.serving.frontend import Frontend, ReplicaFailed, RequestRejected, ServiceUnavailable
from afd.serving.metrics import Metrics
from afd.serving.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

log = logging.getLogger(__name__)

#: used when the tokenizer config has no ``chat_template``: each message as a speaker's turn of a
#: play, then the assistant's cue (documented in docs/user-guide.md)
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)


def listening_line(model: str, url: str) -> str:
    """What the server prints once it listens (launchers, the load generator and tests read it back)."""
    return f"afd serve: {model} on {url} (pid {os.getpid()})"


def parse_listening_line(line: str) -> tuple[str, str] | None:
    """(model, url) from :func:`listening_line`'s output, else None."""
    m = re.match(r"afd serve: (.+) on (http://\S+) \(pid \d+\)$", line.strip())
    return (m.group(1), m.group(2)) if m else None


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ServerState:
    frontend: Frontend
    metrics: Metrics
    tokenizer: Any
    model_name: str
    max_model_len: int
    started: float = 0.0


# ----------------------------------------------------------------------------- helpers


@lru_cache(maxsize=4)
def _compiled(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(template)


def _chat_prompt(state: ServerState, messages: list[ChatMessage]) -> list[int]:
    tok = state.tokenizer
    text = _compiled(tok.chat_template or DEFAULT_CHAT_TEMPLATE).render(
        messages=[{"role": m.role, "content": m.text, **({"name": m.name} if m.name else {})} for m in messages],
        add_generation_prompt=True, bos_token=tok.bos_token or "", eos_token=tok.eos_token or "",
    )
    # a model's own template writes its special tokens itself (as transformers' apply_chat_template)
    return tok.encode(text, add_special_tokens=tok.chat_template is None)


def _sampling(body, max_tokens: int, index: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k),
        seed=None if body.seed is None else body.seed + index, stop=tuple(body.stop or ()), ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


def _check_length(state: ServerState, ids: list[int], max_tokens: int | None) -> int:
    """The request's max_tokens (default: the rest of the context); 400 when it cannot fit."""
    if not ids:
        raise APIError(400, "the prompt is empty: give at least one token", param="prompt")
    limit = state.max_model_len
    if max_tokens is None:
        max_tokens = max(1, limit - len(ids))  # a prompt that fills the context leaves room for none: 400 below
    if len(ids) + max_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested {len(ids) + max_tokens} "
            f"tokens ({len(ids)} in the prompt, {max_tokens} in the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens" if len(ids) < limit else "prompt", code="context_length_exceeded",
        )
    return max_tokens


class _Fanout:
    """Several engine requests (n choices, several prompts) merged into one stream of (choice, delta)."""

    def __init__(self, state: ServerState, subs: list[tuple[list[int], SamplingParams]]) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.left = len(subs)
        self.tasks = [asyncio.create_task(self._pump(i, ids, p, state.frontend)) for i, (ids, p) in enumerate(subs)]

    async def _pump(self, index: int, ids: list[int], params: SamplingParams, frontend: Frontend) -> None:
        try:
            async for delta in frontend.generate(ids, params):
                self.queue.put_nowait((index, delta))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self.queue.put_nowait((index, e))

    async def __aiter__(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        try:
            while self.left:
                index, item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise _to_api_error(item)
                if item.finish_reason is not None:
                    self.left -= 1
                yield index, item
        finally:
            self.cancel()

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()


def _to_api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestRejected):
        return APIError(400, str(e))
    if isinstance(e, ServiceUnavailable):
        return APIError(503, str(e), "service_unavailable")
    if isinstance(e, ReplicaFailed):
        return APIError(500, f"the engine failed while serving this request: {e}", "server_error")
    log.exception("unexpected error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ----------------------------------------------------------------------------- app


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="afd", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = state.metrics

    @lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        return state.tokenizer.decode([token_id], skip_special_tokens=False)

    def fail(e: APIError) -> JSONResponse:
        metrics.http_errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return fail(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return fail(APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"))
        if first.get("type") == "extra_forbidden":
            return fail(APIError(400, f"unknown field {'.'.join(loc)!r}", param=".".join(loc)))
        if first.get("type") == "model_attributes_type" or not loc:
            return fail(APIError(400, "the request body must be a JSON object"))
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return fail(APIError(400, f"{'.'.join(loc)}: {msg}", param=".".join(loc)))

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):
        return fail(_to_api_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return fail(APIError(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error"))

    def check_model(name: str) -> None:
        if name != state.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{state.model_name}'",
                           param="model", code="model_not_found")

    def check_serving() -> None:
        fe = state.frontend
        if fe.failure is not None:
            raise APIError(503, f"the engine has failed: {fe.failure}", "service_unavailable")
        if fe.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable")

    # ------------------------------------------------------------------ info
    @app.get("/health")
    async def health():
        fe = state.frontend
        if fe.failure is not None:
            return JSONResponse({"status": "unhealthy", "reason": fe.failure}, status_code=503)
        if fe.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "in_flight": fe.num_in_flight, "ranks": fe.replicas.rank_info()}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started),
                                            "owned_by": "afd", "max_model_len": state.max_model_len}]}

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        check_serving()
        raw = body.prompt
        if isinstance(raw, str):
            prompts = [raw]
        elif all(isinstance(x, int) for x in raw):
            prompts = [raw]
        else:
            prompts = list(raw)
        ids_list = []
        for p in prompts:
            ids = state.tokenizer.encode(p) if isinstance(p, str) else list(p)
            bad = [t for t in ids if not 0 <= t < state.tokenizer.vocab_size]
            if bad:
                raise APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {state.tokenizer.vocab_size})", param="prompt")
            ids_list.append(ids)
        subs = []
        for ids in ids_list:
            max_tokens = _check_length(state, ids, body.max_tokens)
            subs += [(ids, _sampling(body, max_tokens, i, body.logprobs)) for i in range(body.n)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}

        def logprobs_of(deltas: list[TokenDelta], offset: int) -> dict | None:
            if body.logprobs is None:
                return None
            out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for d in deltas:
                out["tokens"].append(token_text(d.token_id))
                out["token_logprobs"].append(d.logprob)
                out["top_logprobs"].append({token_text(t): lp for t, lp in d.top_logprobs} if body.logprobs else None)
                out["text_offset"].append(offset)
                offset += len(d.text)
            return out

        usage = {"prompt_tokens": sum(len(ids) for ids in ids_list), "completion_tokens": 0}
        fan = _Fanout(state, subs)
        if body.stream:
            return await _stream(head, fan, state, usage, body.stream_options, lambda index, d, offset: {
                **head, "choices": [{"index": index, "text": d.text, "logprobs": logprobs_of([d], offset), "finish_reason": d.finish_reason}]})
        per_choice = await _collect(request, fan, len(subs))
        choices = []
        for index, deltas in enumerate(per_choice):
            choices.append({"index": index, "text": "".join(d.text for d in deltas), "logprobs": logprobs_of(deltas, 0),
                            "finish_reason": deltas[-1].finish_reason})
            usage["completion_tokens"] += len(deltas)
        return {**head, "choices": choices, "usage": _usage(usage)}

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        check_serving()
        ids = _chat_prompt(state, body.messages)
        max_tokens = _check_length(state, ids, body.max_completion_tokens or body.max_tokens)
        n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        subs = [(ids, _sampling(body, max_tokens, i, n_logprobs)) for i in range(body.n)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "created": int(time.time()), "model": state.model_name}

        def entry(t: int, lp: float) -> dict:
            text = token_text(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        def logprobs_of(deltas: list[TokenDelta]) -> dict | None:
            if not body.logprobs:
                return None
            return {"content": [{**entry(d.token_id, d.logprob), "top_logprobs": [entry(t, lp) for t, lp in d.top_logprobs]} for d in deltas]}

        usage = {"prompt_tokens": len(ids), "completion_tokens": 0}
        fan = _Fanout(state, subs)
        if body.stream:
            started: set[int] = set()

            def chunk(index: int, d: TokenDelta, _offset: int) -> dict:
                delta = {"content": d.text}
                if index not in started:  # the first chunk of each choice names the role
                    started.add(index)
                    delta = {"role": "assistant", **delta}
                return {**head, "object": "chat.completion.chunk",
                        "choices": [{"index": index, "delta": delta, "logprobs": logprobs_of([d]), "finish_reason": d.finish_reason}]}

            return await _stream({**head, "object": "chat.completion.chunk"}, fan, state, usage, body.stream_options, chunk)
        per_choice = await _collect(request, fan, len(subs))
        choices = []
        for index, deltas in enumerate(per_choice):
            choices.append({"index": index, "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                            "logprobs": logprobs_of(deltas), "finish_reason": deltas[-1].finish_reason})
            usage["completion_tokens"] += len(deltas)
        return {**head, "object": "chat.completion", "choices": choices, "usage": _usage(usage)}

    return app


def _usage(u: dict) -> dict:
    return {**u, "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


async def _collect(request: Request, fan: _Fanout, num: int) -> list[list[TokenDelta]]:
    """Every choice's deltas; a client that disconnects first aborts the requests (frees their blocks)."""
    out: list[list[TokenDelta]] = [[] for _ in range(num)]

    async def gather() -> None:
        async for index, d in fan:
            out[index].append(d)

    work = asyncio.create_task(gather())
    gone = asyncio.create_task(_until_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            fan.cancel()
    if work.cancelled():
        raise APIError(499, "client disconnected")
    work.result()  # re-raises an APIError
    return out


async def _stream(head: dict, fan: _Fanout, state: ServerState, usage: dict, options, make_chunk) -> Response:
    """Server-sent events. The first event is awaited before the response starts, so a request the
    engine rejects still gets an HTTP error status; later failures arrive as an ``error`` event."""
    it = fan.__aiter__()
    try:
        first = await it.__anext__()
    except BaseException:
        fan.cancel()
        raise

    async def events() -> AsyncIterator[str]:
        offsets: dict[int, int] = {}
        try:
            item = first
            while True:
                index, d = item
                usage["completion_tokens"] += 1
                yield _sse(make_chunk(index, d, offsets.get(index, 0)))
                offsets[index] = offsets.get(index, 0) + len(d.text)
                try:
                    item = await it.__anext__()
                except StopAsyncIteration:
                    break
            if options is not None and options.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(usage)})
            yield "data: [DONE]\n\n"
        except APIError as e:
            state.metrics.http_errors.labels(str(e.status)).inc()
            yield _sse(e.body())
        finally:
            fan.cancel()  # client gone (cancelled) or done: abort what still runs

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ----------------------------------------------------------------------------- running


def run_server(state: ServerState, sock: socket.socket, shutdown_timeout: float) -> int:
    """Serve on the bound ``sock`` until SIGTERM/SIGINT (exit 0) or a replica failure (exit 1). Prints
    the address once it listens; stops the front end (and every replica and rank) before returning."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            """SIGTERM/SIGINT: uvicorn stops accepting and waits for in-flight requests; just before its
            deadline, whatever still runs is ended with a clear 503 error (not a cut connection)."""
            first = not self.should_exit
            super().handle_exit(sig, frame)
            fe = state.frontend
            if first and fe.loop is not None:
                fe.draining = True
                fe.loop.call_soon_threadsafe(fe.loop.call_later, max(0.0, shutdown_timeout - 0.5), fe.abort_all,
                                             f"the server is shutting down (in-flight requests get {shutdown_timeout:g} s)")

    app = create_app(state)
    host, bound = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=max(1, int(shutdown_timeout)),
                            timeout_keep_alive=5, lifespan="off")
    server = _Server(config)

    def on_signal(signum, _frame) -> None:
        """uvicorn re-raises the signal it caught when it is done: here that means nothing more to do."""

    def on_failure(_reason: str) -> None:
        # in-flight requests already got their error; give their responses a moment to go out
        loop = state.frontend.loop
        loop.call_soon_threadsafe(loop.call_later, 0.5, setattr, server, "should_exit", True)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    state.frontend.on_failure = on_failure
    state.started = time.time()

    async def main() -> None:
        state.frontend.start(asyncio.get_running_loop())
        print(listening_line(state.model_name, f"http://{host}:{bound}"), flush=True)
        await server.serve(sockets=[sock])

    try:
        asyncio.run(main())
    finally:
        state.frontend.draining = True
        state.frontend.close(timeout=max(5.0, shutdown_timeout))
        for s, h in previous.items():
            signal.signal(s, h)
    if state.frontend.failure is not None:
        print(f"afd serve: exiting after a failure: {state.frontend.failure}", flush=True)
        return 1
    return 0
