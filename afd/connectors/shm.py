"""Same-host transport: shared-memory rings, woken through FIFOs.

Per direction of every (attention rank, FFN rank) link:

* a ring file (``<dir>/<src>-<dst>.ring``, mmapped): a control block with the
  producer's and the consumer's message counters, then ``num_slots`` slots;
  a frame is ``[header length][payload length][header][payload]``;
* a ``.data`` FIFO: the producer writes one byte per published frame; the
  consumer blocks in ``select`` on it, so an idle rank sleeps instead of
  spinning (5 spinning ranks on 2 cores turn microseconds into time slices);
* a ``.space`` FIFO: the consumer writes one byte per freed slot; a producer
  facing a full ring waits on it.

A FIFO reports end-of-file once its writer is gone, so a receiver learns that
its peer died from the same ``select`` it sleeps in. The launcher creates all
files before any rank starts (:func:`create_links`) and removes the directory.
One copy in (payload -> slot), one copy out (slot -> tensors).
"""

from __future__ import annotations

import errno
import mmap
import os
import select
import struct
import time
from pathlib import Path
from typing import Sequence

from afd.connectors.wire import Role, tensor_bytes
from afd.connectors.transport import ConnectorTimeout, Mailbox, PeerDiedError

_CTRL = 64  # write count (u64) at 0, read count (u64) at 8
_COUNT = struct.Struct("<Q")
_FRAME = struct.Struct("<QQ")


class _PeerDead(Exception):
    """An attention peer was marked dead while this FFN rank waited for its end of a link."""


def _tag(role: Role, index: int, incarnation: int = 0) -> str:
    return f"{'a' if role == Role.ATTENTION else 'f'}{index}" + (f"r{incarnation}" if incarnation else "")


def _prefix(run_dir: Path, src: tuple, dst: tuple, generation: int = 0) -> Path:
    """``src``, ``dst``: (role, index) or (role, index, incarnation), incarnation r > 0 for the r-th restart
    of an attention rank. Generation g > 0: the links of the g-th replacement of the pair's FFN rank. New
    files either way, never reused."""
    return Path(run_dir) / (f"{_tag(*src)}-{_tag(*dst)}" + (f".g{generation}" if generation else ""))


def _make_link(p: Path, num_slots: int, slot_bytes: int) -> None:
    """One direction of a link: its ring file and its two FIFOs."""
    with open(f"{p}.ring", "wb") as fh:
        fh.truncate(_CTRL + num_slots * slot_bytes)
    os.mkfifo(f"{p}.data")
    os.mkfifo(f"{p}.space")


def create_links(run_dir: Path, num_attention: int, num_ffn: int, num_slots: int, slot_bytes: int,
                 ffn_ranks: Sequence[int] | None = None, generation: int = 0) -> None:
    """Create the ring files and FIFOs of a run (before any rank starts), or of the links of ``ffn_ranks``'
    replacement generation ``generation`` (before the replacement starts)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for a in range(num_attention):
        for f in range(num_ffn) if ffn_ranks is None else ffn_ranks:
            for src, dst in (((Role.ATTENTION, a), (Role.FFN, f)), ((Role.FFN, f), (Role.ATTENTION, a))):
                _make_link(_prefix(run_dir, src, dst, generation), num_slots, slot_bytes)


def mark_attention_dead(run_dir: Path, index: int, incarnation: int) -> None:
    """The launcher: attention rank ``index``'s ``incarnation`` is dead. An FFN rank still opening its links
    (a replacement starting) stops waiting for that rank's end and leaves it to the restart's links."""
    (Path(run_dir) / f"dead-{_tag(Role.ATTENTION, index, incarnation)}").touch()


def create_attention_links(run_dir: Path, index: int, incarnation: int, ffn_generations: Sequence[int], num_slots: int,
                           slot_bytes: int) -> None:
    """The links of attention rank ``index``'s ``incarnation``-th restart to every FFN rank (each at its
    current generation), before the restarted rank starts."""
    for f, generation in enumerate(ffn_generations):
        for src, dst in (((Role.ATTENTION, index, incarnation), (Role.FFN, f)), ((Role.FFN, f), (Role.ATTENTION, index, incarnation))):
            _make_link(_prefix(Path(run_dir), src, dst, generation), num_slots, slot_bytes)


class _Ring:
    def __init__(self, path: str, num_slots: int, slot_bytes: int) -> None:
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, _CTRL + num_slots * slot_bytes)
        finally:
            os.close(fd)

    def count(self, offset: int) -> int:
        return _COUNT.unpack_from(self.mm, offset)[0]

    def set_count(self, offset: int, value: int) -> None:
        _COUNT.pack_into(self.mm, offset, value)

    def slot(self, n: int) -> int:
        return _CTRL + (n % self.num_slots) * self.slot_bytes


class ShmMailbox(Mailbox):
    def __init__(
        self,
        run_dir: Path,
        role: Role,
        index: int,
        num_peers: int,
        num_slots: int,
        slot_bytes: int,
        io_log: bool = False,
        device: str = "cpu",
        generations: dict[int, int] | None = None,
        incarnation: int = 0,
    ) -> None:
        """``generations``: peer -> the generation of its links (default 0: the run's first links).
        ``incarnation``: an attention rank's restart count (its links are new files)."""
        super().__init__(role, index, num_peers, io_log, device)
        self._run_dir, self._num_slots, self._slot_bytes = Path(run_dir), num_slots, slot_bytes
        gen = self._gen = dict(generations or {})
        self._incarnation = incarnation
        self._peer_incarnation: dict[int, int] = {}  # an FFN rank's view: attention peer -> its incarnation
        self._out: dict[int, _Ring] = {}
        self._in: dict[int, _Ring] = {}
        self._data_r: dict[int, int] = {}  # peer -> fd (incoming notifications)
        self._space_r: dict[int, int] = {}  # peer -> fd (slots freed by the peer)
        self._data_w: dict[int, int] = {}
        self._space_w: dict[int, int] = {}
        self._connected: set[int] = set()  # peers whose writer we have seen
        self._pending: int | None = None  # peer whose slot is held until release
        for p in range(num_peers):  # every reader end first (:meth:`connect` opens the writers, which need the peer's readers)
            self._open_readers(p, gen.get(p, 0))
        self._fd_peer: dict[int, int] = {}

    def connect(self, timeout: float) -> None:
        """Open the writer ends: each waits for the peer to open its reader end (at most ``timeout`` s). A
        replacement FFN rank opens its readers, says it is loaded, and only then waits here, so that the
        attention ranks that link to it never wait on it."""
        deadline = time.monotonic() + timeout
        for p in range(self.num_peers):
            try:
                self._open_writers(p, self._gen.get(p, 0), deadline)
            except _PeerDead:
                self.skipped.add(p)
                self._silent_ok.add(p)  # not watched until its restart's links open (readmit)
                for fds in (self._data_w, self._space_w):
                    fd = fds.pop(p, None)
                    if fd is not None:
                        os.close(fd)
        self._fd_peer = {fd: p for p, fd in self._data_r.items() if p not in self.skipped}

    def _paths(self, p: int, generation: int) -> tuple[Path, Path]:
        me, peer = (self.role, self.index, self._incarnation), (self.peer_role, p, self._peer_incarnation.get(p, 0))
        return _prefix(self._run_dir, me, peer, generation), _prefix(self._run_dir, peer, me, generation)

    def _open_readers(self, p: int, generation: int) -> None:
        out, inc = self._paths(p, generation)
        self._out[p] = _Ring(f"{out}.ring", self._num_slots, self._slot_bytes)
        self._in[p] = _Ring(f"{inc}.ring", self._num_slots, self._slot_bytes)
        self._data_r[p] = os.open(f"{inc}.data", os.O_RDONLY | os.O_NONBLOCK)
        self._space_r[p] = os.open(f"{out}.space", os.O_RDONLY | os.O_NONBLOCK)

    def _open_writers(self, p: int, generation: int, deadline: float) -> None:
        out, inc = self._paths(p, generation)
        self._data_w[p] = self._open_writer(f"{out}.data", p, deadline)
        self._space_w[p] = self._open_writer(f"{inc}.space", p, deadline)

    def reconnect(self, peer: int, generation: int, timeout: float) -> None:
        """Drop the links to ``peer`` and open its generation-``generation`` links (a replacement rank)."""
        with self._send_lock:  # the heartbeat thread sends too
            self._gen[peer] = generation
            self._reconnect(peer, generation, timeout)

    def readmit(self, peer: int, incarnation: int, timeout: float) -> None:
        """An FFN rank: open the links of attention rank ``peer``'s restart ``incarnation``."""
        with self._send_lock:
            self._peer_incarnation[peer] = incarnation
            self._reconnect(peer, self._gen.get(peer, 0), timeout)

    def _reconnect(self, peer: int, generation: int, timeout: float) -> None:
        self._fd_peer.pop(self._data_r.get(peer, -1), None)
        for fds in (self._data_r, self._space_r, self._data_w, self._space_w):
            fd = fds.pop(peer, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._connected.discard(peer)
        self._open_readers(peer, generation)
        self._open_writers(peer, generation, time.monotonic() + timeout)
        self._fd_peer[self._data_r[peer]] = peer
        self._rejoin(peer)

    def _open_writer(self, path: str, peer: int, deadline: float) -> int:
        dead = None
        if self.role == Role.FFN:  # an attention peer the launcher marked dead never opens its end
            dead = self._run_dir / f"dead-{_tag(Role.ATTENTION, peer, self._peer_incarnation.get(peer, 0))}"
        while True:
            try:
                return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
            if dead is not None and dead.exists():
                raise _PeerDead(peer)
            if time.monotonic() > deadline:
                raise ConnectorTimeout(f"{self.name}: {self.peer_name(peer)} did not open its end of the shm link in time")
            time.sleep(0.002)

    # ------------------------------------------------------------------ send
    def _send(self, peer: int, header: bytes, payload: list) -> None:
        payload = [tensor_bytes(p) for p in payload]  # host tensors -> their bytes, no copy
        ring = self._out[peer]
        size = _FRAME.size + len(header) + sum(len(p) for p in payload)
        if size > ring.slot_bytes:
            raise ValueError(
                f"{self.name}: a {size}-byte message to {self.peer_name(peer)} exceeds the shm slot of {ring.slot_bytes} bytes; "
                "lower --max-num-batched-tokens or raise the slot size"
            )
        written = ring.count(0)
        while written - ring.count(8) >= ring.num_slots:
            self._wait_space(peer)
        off = ring.slot(written)
        _FRAME.pack_into(ring.mm, off, len(header), size - _FRAME.size - len(header))
        off += _FRAME.size
        ring.mm[off : off + len(header)] = header
        off += len(header)
        for part in payload:
            ring.mm[off : off + len(part)] = part
            off += len(part)
        ring.set_count(0, written + 1)
        self._drain(self._space_r[peer], peer)
        try:
            os.write(self._data_w[peer], b"\x01")
        except BrokenPipeError:
            raise PeerDiedError(f"{self.name}: {self.peer_name(peer)} is gone (its end of the link closed)", peer=peer) from None

    def _has_room(self, peer: int) -> bool:
        ring = self._out.get(peer)
        return ring is not None and peer in self._data_w and ring.count(0) - ring.count(8) < ring.num_slots

    def _wait_space(self, peer: int, timeout: float = 60.0) -> None:
        r, _, _ = select.select([self._space_r[peer]], [], [], timeout)
        if not r:
            raise ConnectorTimeout(f"{self.name}: {self.peer_name(peer)} consumed nothing for {timeout:.0f} s (ring full)")
        if self._drain(self._space_r[peer], peer) == 0 and peer in self._connected:
            raise PeerDiedError(f"{self.name}: {self.peer_name(peer)} is gone (its end of the link closed)", peer=peer)

    @staticmethod
    def _drain(fd: int, peer: int) -> int:
        n = 0
        while True:
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                return max(n, 1)  # nothing (more) now, but the writer is there
            if not chunk:
                return n  # EOF
            n += len(chunk)

    # ------------------------------------------------------------------ receive
    def _recv(self, timeout: float):
        deadline = time.monotonic() + timeout
        looked = False
        while True:
            left = deadline - time.monotonic()
            if left < 0 and looked:  # always look once: recv(0.0) returns a message already waiting
                return None
            left, looked = max(left, 0.0), True
            if not self._fd_peer:
                time.sleep(left)
                return None
            ready, _, _ = select.select(list(self._fd_peer), [], [], left)
            for fd in ready:
                peer = self._fd_peer[fd]
                try:
                    byte = os.read(fd, 1)
                except BlockingIOError:
                    continue
                if not byte:
                    if peer in self._connected:
                        raise PeerDiedError(f"{self.name}: {self.peer_name(peer)} is gone (its end of the link closed)", peer=peer)
                    time.sleep(0.001)  # its writer has not opened yet
                    continue
                self._connected.add(peer)
                ring = self._in[peer]
                off = ring.slot(ring.count(8))
                hlen, plen = _FRAME.unpack_from(ring.mm, off)
                if _FRAME.size + hlen + plen > ring.slot_bytes:
                    raise PeerDiedError(f"{self.name}: corrupt frame from {self.peer_name(peer)} ({hlen}+{plen} bytes)", peer=peer)
                off += _FRAME.size
                header = bytes(ring.mm[off : off + hlen])
                payload = memoryview(ring.mm)[off + hlen : off + hlen + plen]
                self._pending = peer
                return peer, header, payload

    def _release(self) -> None:
        peer, self._pending = self._pending, None
        if peer is None:
            return
        ring = self._in[peer]
        ring.set_count(8, ring.count(8) + 1)
        try:
            os.write(self._space_w[peer], b"\x01")
        except BlockingIOError:
            pass  # the producer drains this FIFO on every send; a full pipe only means it has not looked yet
        except BrokenPipeError:
            pass  # the producer is gone; its death is reported on the data FIFO

    def _forget(self, peer: int) -> None:
        self._fd_peer.pop(self._data_r.get(peer, -1), None)

    def close(self) -> None:
        self.stop_heartbeats()
        for fds in (self._data_r, self._space_r, self._data_w, self._space_w):
            for fd in fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            fds.clear()
