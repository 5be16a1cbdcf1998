"""One HTTP request's engine requests (n choices x prompts) merged into one stream, and the two ways
it leaves the server: collected into one body, or as server-sent events."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from afd.config import SamplingParams
from afd.engine.request import TokenDelta
from afd.runtime.clients import ReplicaFailed
from afd.serving.frontend import Frontend, RequestRejected, ServiceUnavailable

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered with an OpenAI-style body; the message is made valid UTF-8 (a client's
    invalid text in it must not break the answer)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        message, param = _utf8(message), None if param is None else _utf8(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def to_api_error(e: BaseException) -> APIError:
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


class Fanout:
    """Several engine requests (n choices, several prompts) merged into one stream of (choice, delta);
    choice i is the i-th of ``subs``."""

    def __init__(self, frontend: Frontend, subs: list[tuple[list[int], SamplingParams]]) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.left = len(subs)
        self.tasks = [asyncio.create_task(self._pump(i, ids, p, frontend)) for i, (ids, p) in enumerate(subs)]

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
                    raise to_api_error(item)
                if item.finish_reason is not None:
                    self.left -= 1
                yield index, item
        finally:
            self.cancel()

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def collect(request: Request, fan: Fanout) -> list[list[TokenDelta]]:
    """Every choice's deltas; a client that disconnects first aborts the requests (frees their blocks)."""
    out: list[list[TokenDelta]] = [[] for _ in fan.tasks]

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


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def stream(fan: Fanout, make_chunk: Callable[[int, TokenDelta], dict], final_chunk: Callable[[], dict | None],
                 on_error: Callable[[APIError], None]) -> Response:
    """Server-sent events: one chunk per delta, then ``final_chunk()`` (the usage, if asked) and [DONE].
    The first event is awaited before the response starts, so a request the engine rejects still
    gets an HTTP error status; later failures arrive as an ``error`` event."""
    it = fan.__aiter__()
    try:
        first = await it.__anext__()
    except BaseException:
        fan.cancel()
        raise

    async def events() -> AsyncIterator[str]:
        try:
            item = first
            while True:
                yield sse(make_chunk(*item))
                try:
                    item = await it.__anext__()
                except StopAsyncIteration:
                    break
            if (last := final_chunk()) is not None:
                yield sse(last)
            yield "data: [DONE]\n\n"
        except APIError as e:
            on_error(e)
            yield sse(e.body())
        finally:
            fan.cancel()  # client gone (cancelled) or done: abort what still runs

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
