"""``torch`` transport: torch.distributed point-to-point for payloads, a TCP control channel for headers.

* Backend (:func:`afd.distributed.topology.backend_for`): NCCL when every rank is
  on CUDA, HCCL when every rank is on an Ascend NPU; payloads then move
  device to device. Otherwise gloo, with payloads staged through host memory.
* Rendezvous: a ``TCPStore`` hosted by the launcher (or node 0's launcher in a
  multi-node run); each rank joins the world group with global rank ``a``
  (attention) or ``A + f`` (FFN), and **two** two-rank groups per (attention
  rank, FFN rank) link, one per direction. NCCL runs a communicator's sends and
  receives in order on one stream, and a send waits for its matching receive:
  with work and results on one communicator, an attention rank's send of
  micro-batch k+1 queued before its receive of result k, and the FFN rank's
  send of result k queued before its receive of work k+1, wait on each other
  for ever. One communicator per direction cannot form that cycle.
* Headers travel on one TCP connection per link: the FFN rank listens and
  publishes ``host:port`` in the store, the attention rank connects. The
  receiver polls the sockets with ``select``, so it never posts a receive it
  cannot bound: a gloo ``recv`` that times out closes the link for good, and
  NCCL cannot receive from "any source" nor without knowing sizes. The control
  frame says how many payload bytes follow; only then is the payload received,
  on the link's own group, into a buffer of exactly that size.
* A peer that dies closes its socket: the receiver sees end-of-file at once.
"""

from __future__ import annotations

import datetime
import select
import socket
import struct
import time

import torch
import torch.distributed as dist

from afd.connectors.wire import Header, ProtocolError, Role
from afd.connectors.tcp import FRAME, close_gracefully, local_address, read_exact
from afd.connectors.transport import ConnectorTimeout, Mailbox, PeerDiedError

OP_TIMEOUT_S = 600.0  # NCCL/HCCL: the process group's per-operation limit (at least the connect timeout)
CLOSE_GRACE_S = 5.0  # how long close() lets sends in flight finish


def global_rank(role: Role, index: int, num_attention: int) -> int:
    return index if role == Role.ATTENTION else num_attention + index


class TorchMailbox(Mailbox):
    def __init__(
        self,
        role: Role,
        index: int,
        num_attention: int,
        num_ffn: int,
        master_addr: str,
        master_port: int,
        *,
        timeout: float,
        backend: str = "gloo",
        io_log: bool = False,
        device: str = "cpu",
    ) -> None:
        num_peers = num_ffn if role == Role.ATTENTION else num_attention
        super().__init__(role, index, num_peers, io_log, device)
        self.num_attention = num_attention
        self.me = global_rank(role, index, num_attention)
        self.backend = backend
        options = {}
        if backend != "gloo":  # payloads stay on the accelerator: NCCL / HCCL move device memory
            self.wire_device = self.device
            torch.get_device_module(self.device.type).set_device(self.device)
            # connect every communicator up front (new_group splits the world one), so that no first
            # send blocks the host while NCCL sets up; p2p on two-rank groups is serialized by design
            options["device_id"] = self.device  # (the fork server's environment silences NCCL's warning that it serializes p2p)
        td = datetime.timedelta(seconds=timeout)
        self.store = dist.TCPStore(master_addr, master_port, num_attention + num_ffn, is_master=False, timeout=td)
        # on NCCL/HCCL the process group's timeout bounds every send and receive (the watchdog aborts the
        # process past it): longer than any legitimate wait; a hung peer is reported by the heartbeats
        # well before (PeerSilentError). On gloo it stays the connect timeout.
        op_timeout = td if backend == "gloo" else max(td, datetime.timedelta(seconds=OP_TIMEOUT_S))
        dist.init_process_group(backend, store=self.store, rank=self.me, world_size=num_attention + num_ffn,
                                timeout=op_timeout, **options)
        # two groups per link, one per direction (see the module docstring), created by every rank in
        # the same order (new_group is collective)
        self._out: dict[int, object] = {}  # peer -> group this rank sends payloads on
        self._in: dict[int, object] = {}  # peer -> group this rank receives payloads on
        for a in range(num_attention):
            for f in range(num_ffn):
                to_ffn = dist.new_group([a, num_attention + f])
                to_attention = dist.new_group([a, num_attention + f])
                if role == Role.ATTENTION and index == a:
                    self._out[f], self._in[f] = to_ffn, to_attention
                elif role == Role.FFN and index == f:
                    self._out[a], self._in[a] = to_attention, to_ffn
        self.socks: dict[int, socket.socket] = {}
        self._pending: list[tuple[object, torch.Tensor]] = []  # isend works not yet completed
        if role == Role.FFN:
            self._accept(master_addr, timeout)
        else:
            self._connect(timeout)
        self._sock_peer = {s.fileno(): p for p, s in self.socks.items()}

    def _peer_global(self, peer: int) -> int:
        return global_rank(self.peer_role, peer, self.num_attention)

    def _accept(self, master_addr: str, timeout: float) -> None:
        server = socket.create_server(("0.0.0.0", 0))
        host = local_address(master_addr)
        self.store.set(f"afd/ctrl/ffn{self.index}", f"{host}:{server.getsockname()[1]}")
        server.settimeout(timeout)
        while len(self.socks) < self.num_peers:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                raise ConnectorTimeout(f"{self.name}: attention ranks did not connect within {timeout:.0f} s") from None
            peer = struct.unpack("<I", read_exact(conn, 4, self.name, "a connecting rank"))[0]
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks[peer] = conn
        server.close()

    def _connect(self, timeout: float) -> None:
        for f in range(self.num_peers):
            host, port = self.store.get(f"afd/ctrl/ffn{f}").decode().rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(struct.pack("<I", self.index))
            self.socks[f] = s

    def _send(self, peer: int, header: bytes, payload: list[torch.Tensor]) -> None:
        size = sum(p.numel() for p in payload)
        try:
            self.socks[peer].sendall(FRAME.pack(len(header), size) + header)
        except OSError:
            raise PeerDiedError(f"{self.name}: {self.peer_name(peer)} is gone (control socket closed)", peer=peer) from None
        if size:
            # one message per frame: a lone tensor goes as it is (nobody writes to a sent tensor), several are
            # packed with one copy. Two blocking gloo sends facing each other never complete (gloo reads a
            # message only into a posted receive), and with micro-batches in flight both sides may send at
            # once. So one side must not block: the attention side sends asynchronously (the tensor lives in
            # _pending until the send completes) and, on gloo, the FFN side blocks -- the attention side
            # always comes back to read results, and a blocking send is ~3x faster here than an isend left
            # to progress alone. NCCL/HCCL sends never block the host: both sides keep them pending.
            tensor = payload[0] if len(payload) == 1 else torch.cat(payload)
            work = dist.isend(tensor, dst=self._peer_global(peer), group=self._out[peer], tag=self.me)
            if self.role == Role.FFN and self.backend == "gloo":
                work.wait()
            else:
                self._pending.append((work, tensor))
            # reaped here, on the thread that sends payloads: the heartbeat thread sends headers only and
            # must not query CUDA events (a thread without a current device would open a context on GPU 0)
            self._reap()

    def _reap(self) -> None:
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def _recv(self, timeout: float):
        if not self._sock_peer:
            time.sleep(max(0.0, timeout))
            return None
        ready, _, _ = select.select(list(self._sock_peer), [], [], max(0.0, timeout))
        if not ready:
            return None
        peer = self._sock_peer[ready[0]]
        sock = self.socks[peer]
        who = self.peer_name(peer)
        hlen, plen = FRAME.unpack(read_exact(sock, FRAME.size, self.name, who))
        header_bytes = read_exact(sock, hlen, self.name, who)
        header, _ = Header.unpack(header_bytes, f"{self.name} (link from {who})")
        if plen != header.payload_bytes:
            raise ProtocolError(
                f"{self.name}: truncated payload from {who}: {plen} of {header.payload_bytes} bytes announced "
                f"(layer {header.layer}, seq {header.seq})"
            )
        self._reap()
        buf = torch.empty(plen, dtype=torch.uint8, device=self.wire_device)  # exactly the announced size
        if plen:
            dist.recv(buf, src=self._peer_global(peer), group=self._in[peer], tag=self._peer_global(peer))
        return peer, header_bytes, buf  # a fresh tensor: decoded in place, no copy

    def _forget(self, peer: int) -> None:
        sock = self.socks.get(peer)
        if sock is not None:
            self._sock_peer.pop(sock.fileno(), None)

    def close(self) -> None:
        self.stop_heartbeats()
        # let sends in flight finish (gloo: each wait ends or fails; NCCL: poll, since waiting only orders
        # the stream), but not for ever: a peer that is gone never posts its receive
        deadline = time.monotonic() + CLOSE_GRACE_S
        while self._pending and time.monotonic() < deadline:
            if self.backend == "gloo":
                work, _ = self._pending.pop(0)
                try:
                    work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                except RuntimeError:
                    pass  # the peer is gone (or stopped reading); nothing left to deliver
            else:
                self._reap()
                time.sleep(0.001)
        stuck, self._pending = bool(self._pending), []
        for s in self.socks.values():
            close_gracefully(s)
        self.socks.clear()
        if dist.is_initialized():
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if stuck and self.backend != "gloo" and abort is not None:
                abort()  # a clean destroy would wait on the stuck sends until the watchdog kills us
            else:
                dist.destroy_process_group()
