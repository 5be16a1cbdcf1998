"""A recording HTTP proxy: forwards every request to a server unchanged (streams included) and keeps
each request's method, path and JSON body. Used to record what the field's clients send."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


class RecordingProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.requests: list[dict] = []
        self._client = httpx.AsyncClient(timeout=600)
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST"])])
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        try:
            recorded = json.loads(body) if body else None
        except ValueError:
            recorded = body.decode(errors="replace")
        self.requests.append({"method": request.method, "path": request.url.path, "body": recorded})
        upstream = self._client.build_request(request.method, self.upstream + request.url.path, content=body,
                                              headers={"content-type": request.headers.get("content-type", "application/json")})
        resp = await self._client.send(upstream, stream=True)
        kind = resp.headers.get("content-type", "")
        if "text/event-stream" in kind:
            return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, media_type=kind, background=None)
        data = await resp.aread()
        await resp.aclose()
        return Response(data, status_code=resp.status_code, media_type=kind)

    def __enter__(self) -> "RecordingProxy":
        self._thread.start()
        while not self._server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()
