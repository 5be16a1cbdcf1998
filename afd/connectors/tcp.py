"""``tcp`` transport: one TCP connection per (attention rank, FFN rank) link, headers and payloads on it.

The transport for ranks on several hosts that must survive a rank's loss (the
``torch`` transport moves payloads faster on accelerators, but a collective
library's groups cannot lose or gain a member).

* Rendezvous: a ``TCPStore`` hosted by node 0's launcher. FFN rank ``f`` of
  generation ``g`` (``g`` > 0: its ``g``-th replacement) listens on a port of
  its own host and publishes ``host:port`` under ``afd/tcp/f<f>.g<g>``; every
  attention rank connects and says who it is (its index, the generation it
  expects). The address is this host's on the route to the master, so the
  same code runs on one host (127.0.0.1) and across hosts.
* A frame is ``[header length u32][payload length u64][header][payload]``,
  sent with one scatter-gather ``sendmsg`` where the kernel takes it all; the
  receiver ``select``s over its sockets and reads a whole frame into a fresh
  tensor (decoded in place, no further copy).
* A peer that dies closes its socket: end-of-file at once (the death bound is
  the kernel's, not a timeout). A hung peer stops sending, heartbeats
  included: the link timeout finds it (afd/connectors/transport.py).
* A replacement FFN rank listens under its new generation's key; attention
  ranks :meth:`reconnect` to it, the FFN side accepts them as they come.
"""

from __future__ import annotations

import datetime
import logging
import select
import socket
import struct
import time

import torch

from afd.connectors.wire import Header, ProtocolError, Role, tensor_bytes
from afd.connectors.transport import ConnectorTimeout, Mailbox, PeerDiedError, PeerSilentError

FRAME = struct.Struct("<IQ")  # header length, payload length
HELLO = struct.Struct("<II")  # the connecting attention rank's index, the FFN generation it expects
STALL_S = 60.0  # a frame whose rest does not arrive within this long, once begun, is a stalled link

log = logging.getLogger(__name__)


def local_address(master_addr: str) -> str:
    """The address of this host as seen on the route to the master (works across hosts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_addr, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def address_key(ffn_index: int, generation: int = 0) -> str:
    return f"afd/tcp/f{ffn_index}.g{generation}"


def read_exact(sock: socket.socket, n: int, me: str, peer: str, into: memoryview | None = None, stall: float = STALL_S) -> bytes | None:
    """Read exactly ``n`` bytes (into ``into`` when given). End-of-file or a reset: PeerDiedError."""
    chunks, got = [], 0
    deadline = time.monotonic() + stall
    while got < n:
        try:
            if into is not None:
                k = sock.recv_into(into[got:], n - got)
                chunk = b"" if k == 0 else None
            else:
                chunk = sock.recv(n - got)
                k = len(chunk)
        except (socket.timeout, BlockingIOError):
            k, chunk = 0, None
        except (ConnectionError, OSError):
            k, chunk = 0, b""  # reset by the peer: gone
        if chunk == b"":
            raise PeerDiedError(f"{me}: {peer} is gone (its end of the link closed)")
        if k:
            if into is None:
                chunks.append(chunk)
            got += k
        elif time.monotonic() > deadline:
            raise ConnectorTimeout(f"{me}: a frame from {peer} stalled ({got} of {n} bytes in {stall:.0f} s)")
    return None if into is not None else b"".join(chunks)


def close_gracefully(sock: socket.socket) -> None:
    """Half-close, then read what the peer still sends until its FIN: closing a socket with unread data
    makes the kernel send RST, and an RST can destroy our own last frames (the SHUTDOWN) in the peer's
    receive queue before it reads them."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(2.0)
        while sock.recv(65536):
            pass
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _sendmsg_all(sock: socket.socket, parts: list) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


class TcpMailbox(Mailbox):
    def __init__(
        self,
        role: Role,
        index: int,
        num_attention: int,
        num_ffn: int,
        master_addr: str,
        master_port: int,
        timeout: float,
        io_log: bool = False,
        device: str = "cpu",
        generation: int = 0,
        generations: dict[int, int] | None = None,
    ) -> None:
        """``generation``: an FFN rank's generation (0 at start; its replacements count up). ``generations``:
        an attention rank's view, FFN rank -> the generation it connects to (default 0)."""
        import torch.distributed as dist

        num_peers = num_ffn if role == Role.ATTENTION else num_attention
        super().__init__(role, index, num_peers, io_log, device)
        self.generation = generation
        self._timeout = timeout
        self.store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=datetime.timedelta(seconds=timeout),
                                   wait_for_workers=False)
        self.socks: dict[int, socket.socket] = {}
        self._sock_peer: dict[int, int] = {}  # fileno -> peer
        self._server: socket.socket | None = None
        self._generations = dict(generations or {})
        if role == Role.FFN:
            self._server = socket.create_server(("0.0.0.0", 0))
            self.store.set(address_key(index, generation), f"{local_address(master_addr)}:{self._server.getsockname()[1]}")

    def connect(self, timeout: float) -> None:
        """An attention rank connects to every FFN rank; an FFN rank at the run's start waits for every
        attention rank to connect (a replacement takes them as they come, in :meth:`_recv`)."""
        if self.role == Role.ATTENTION:
            for f in range(self.num_peers):
                self._connect(f, self._generations.get(f, 0))
            return
        if self.generation:
            return
        deadline = time.monotonic() + timeout
        while len(self.socks) < self.num_peers:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._server], [], [], left)[0]:
                raise ConnectorTimeout(f"{self.name}: {self.num_peers - len(self.socks)} attention ranks did not connect within "
                                       f"{timeout:.0f} s")
            self._accept()

    # ------------------------------------------------------------------ links
    def _accept(self) -> None:
        conn, addr = self._server.accept()
        conn.settimeout(self._timeout)
        try:
            peer, generation = HELLO.unpack(read_exact(conn, HELLO.size, self.name, "a connecting rank", stall=5.0))
        except (PeerDiedError, ConnectorTimeout) as e:  # a port scan, or a rank that died connecting: not a peer's loss
            log.warning("%s: a connection from %s closed before saying who it is (%s)", self.name, addr, e)
            conn.close()
            return
        if generation != self.generation or not 0 <= peer < self.num_peers:
            # a stray connection (another run's rank, an old incarnation) must not take down a serving rank
            log.warning("%s (generation %d): refused a connection from %s as attention rank %d expecting generation %d",
                        self.name, self.generation, addr, peer, generation)
            conn.close()
            return
        self._add(peer, conn)

    def _connect(self, peer: int, generation: int) -> None:
        host, port = self.store.get(address_key(peer, generation)).decode().rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=self._timeout)
        sock.sendall(HELLO.pack(self.index, generation))
        self._add(peer, sock)

    def _add(self, peer: int, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        old = self.socks.pop(peer, None)
        if old is not None:
            self._sock_peer.pop(old.fileno(), None)
            old.close()
        self.socks[peer] = sock
        self._sock_peer[sock.fileno()] = peer
        self._rejoin(peer)  # a restarted attention rank (on the FFN side) is listened to again

    def reconnect(self, peer: int, generation: int, timeout: float) -> None:
        """Drop the link to ``peer`` and connect to its generation-``generation`` replacement."""
        with self._send_lock:  # the heartbeat thread sends too
            self._connect(peer, generation)

    def readmit(self, peer: int, incarnation: int, timeout: float) -> None:
        """A restarted attention rank connects by itself (accepted as it comes, in :meth:`_recv`)."""

    # ------------------------------------------------------------------ send
    def _send(self, peer: int, header: bytes, payload: list[torch.Tensor]) -> None:
        sock = self.socks.get(peer)
        if sock is None:
            raise PeerDiedError(f"{self.name}: no link to {self.peer_name(peer)} (not connected yet)", peer=peer)
        parts = [FRAME.pack(len(header), sum(p.numel() for p in payload)), header, *(tensor_bytes(p) for p in payload)]
        try:
            _sendmsg_all(sock, parts)
        except socket.timeout:
            raise PeerSilentError(f"{self.name}: {self.peer_name(peer)} read nothing for {self._timeout:.0f} s (its socket is full)",
                                  peer=peer) from None
        except OSError:
            raise PeerDiedError(f"{self.name}: {self.peer_name(peer)} is gone (its end of the link closed)", peer=peer) from None

    def _has_room(self, peer: int) -> bool:
        sock = self.socks.get(peer)
        return sock is not None and bool(select.select([], [sock], [], 0)[1])

    # ------------------------------------------------------------------ receive
    def _recv(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            waiting = list(self._sock_peer) + ([self._server] if self._server is not None else [])
            ready, _, _ = select.select(waiting, [], [], max(0.0, deadline - time.monotonic()))
            for fd in ready:
                if fd is self._server:
                    self._accept()
                    continue
                peer = self._sock_peer.get(fd)
                if peer is None:
                    continue
                return self._read_frame(peer)
            if time.monotonic() >= deadline:
                return None

    def _read_frame(self, peer: int):
        sock, who = self.socks[peer], self.peer_name(peer)
        stall = self.link_timeout or STALL_S
        try:
            hlen, plen = FRAME.unpack(read_exact(sock, FRAME.size, self.name, who, stall=stall))
            header_bytes = read_exact(sock, hlen, self.name, who, stall=stall)
            header, _ = Header.unpack(header_bytes, f"{self.name} (link from {who})")
            if plen != header.payload_bytes:
                raise ProtocolError(f"{self.name}: {plen} payload bytes from {who}, {header.payload_bytes} announced "
                                    f"(layer {header.layer}, seq {header.seq})")
            buf = torch.empty(plen, dtype=torch.uint8)  # exactly the announced size
            if plen:
                read_exact(sock, plen, self.name, who, into=memoryview(buf.numpy()), stall=stall)
        except PeerDiedError as e:
            raise PeerDiedError(str(e), peer=peer) from None
        return peer, header_bytes, buf  # a fresh tensor: decoded in place

    def _forget(self, peer: int) -> None:
        sock = self.socks.get(peer)
        if sock is not None:
            self._sock_peer.pop(sock.fileno(), None)

    def close(self) -> None:
        self.stop_heartbeats()
        for sock in self.socks.values():
            close_gracefully(sock)
        self.socks.clear()
        self._sock_peer.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
