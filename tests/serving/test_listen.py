"""The server's listening socket: every accepted connection has Nagle's algorithm off (TCP_NODELAY).
asyncio sets it only when the socket names its protocol; with ``socket.create_server`` (protocol 0) a
stream's first chunk waited ~40 ms for the client's delayed ACK of the headers before it left."""

from __future__ import annotations

import asyncio
import socket

from afd.serving.server import listen


def _nodelay_of_accepted(sock: socket.socket) -> int:
    async def main() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer) -> None:
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
            return value

    return asyncio.run(main())


def test_accepted_connections_send_small_writes_at_once():
    assert _nodelay_of_accepted(listen("127.0.0.1", 0)) != 0


def test_the_check_can_fail():
    """Canary: the socket afd used before (socket.create_server) leaves Nagle on."""
    assert _nodelay_of_accepted(socket.create_server(("127.0.0.1", 0))) == 0
