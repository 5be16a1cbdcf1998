"""Transports behind one interface: a rank's :class:`Mailbox`.

A mailbox sends a message to one peer on the other side and receives the next
message from any peer. Every receive has a timeout; a peer whose end of the
link closes (its process died) raises :class:`PeerDiedError` naming it.
Transports copy bytes exactly: a message arrives as the same header bytes and
payload bytes that were sent.

Devices: a mailbox delivers every received tensor on its rank's ``device`` and
accepts tensors on any device to send. Payload bytes travel from the
transport's ``wire_device``: host memory for ``loopback`` and ``shm`` (a CUDA
rank's payload is staged through the host, one copy each way), the rank's own
accelerator for ``torch`` over NCCL/HCCL (no staging).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from afd.connectors.wire import Header, Kind, Message, ProtocolError, Role, decode_payload, encode, flat_bytes, rank_name, tensor_bytes

log = logging.getLogger(__name__)


class PeerDiedError(RuntimeError):
    """The other end of a link is gone (process exited, link closed). ``peer``: its index, where known."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class ConnectorTimeout(TimeoutError):
    """A wait on a link ran past its timeout."""


class PeerSilentError(PeerDiedError):
    """A peer sent nothing, not even a heartbeat, for longer than the link timeout (hung or cut off)."""


@dataclass
class LinkStats:
    messages_sent: int = 0
    messages_received: int = 0
    heartbeats_sent: int = 0
    heartbeats_received: int = 0
    bytes_sent: int = 0  # header + payload
    bytes_received: int = 0
    payload_bytes_sent: dict[int, int] = field(default_factory=dict)  # per peer


class Mailbox(ABC):
    """One rank's end of all its links: (role, index) talks to every rank of the other side."""

    def __init__(self, role: Role, index: int, num_peers: int, io_log: bool = False, device: str | torch.device = "cpu") -> None:
        self.role = role
        self.device = torch.device(device)  # received tensors are delivered here (the rank's compute device)
        self.wire_device = torch.device("cpu")  # payload bytes leave from and arrive in this device's memory
        self.index = index
        self.num_peers = num_peers
        self.name = rank_name(role, index)
        self.peer_role = Role.FFN if role == Role.ATTENTION else Role.ATTENTION
        self.stats = LinkStats()
        self.io_log = io_log
        self._send_lock = threading.Lock()  # the heartbeat thread sends too
        self._last_sent: dict[int, float] = {}
        self._last_seen: dict[int, float] = {}  # watched peer -> monotonic time of its last message
        self._greeted: set[int] = set()  # peers this end said HELLO to: they watch it from then, so it beats to them
        self._silent_ok: set[int] = set()  # peers that said SHUTDOWN
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()
        self.link_timeout: float | None = None
        self.skipped: set[int] = set()  # an FFN rank: attention peers that died before it linked (a restart links anew)

    # ------------------------------------------------------------------ liveness
    def start_heartbeats(self, interval: float, link_timeout: float, only_to=None) -> None:
        """Send a HEARTBEAT on every link in service that carried nothing for ``interval`` s, and treat a peer
        in service that is silent for ``link_timeout`` s as hung. A link is in service from the peer's HELLO
        (:meth:`watch`): before that the peer is still starting (linking to other ranks, loading), and the
        start-up timeout is what bounds it, not the hang timeout. Beats go to a peer from this end's own HELLO
        to it (the peer watches from then), whether or not its answer has been read: a rank that said HELLO to
        a replacement and then waits on something else must not look hung to it. ``interval`` 0 disables heartbeats (silence
        is still detected). ``only_to(peer)``: beat to a peer only while it is true. An FFN rank beats only
        to the attention ranks it owes results: those wait on their links and read them, while an idle
        attention rank reads nothing, and beats to it would fill its receive ring and block the sender."""
        if interval and interval >= link_timeout:
            raise ValueError(f"heartbeat interval {interval} s must be below the link timeout {link_timeout} s")
        self.link_timeout = link_timeout
        if interval:
            self._heartbeat = threading.Thread(target=self._beat, args=(interval, only_to), name=f"{self.name} heartbeat", daemon=True)
            self._heartbeat.start()

    def watch(self, peer: int) -> None:
        """The link to ``peer`` is in service (its HELLO arrived): beat to it and watch it for silence."""
        self._silent_ok.discard(peer)
        self._last_seen[peer] = time.monotonic()

    def expect(self, peer: int) -> None:
        """This end now waits on ``peer`` (it sent it work): the peer's silence counts from now at the latest. A
        peer that owes nothing need not beat (an FFN rank beats only to the ranks it owes), so the time this end
        spent busy elsewhere before asking is not the peer's silence."""
        if peer in self._last_seen:
            self._last_seen[peer] = max(self._last_seen[peer], time.monotonic())

    def _beat(self, interval: float, only_to) -> None:
        while not self._stop.wait(interval / 2):
            now = time.monotonic()
            for peer in sorted(self._last_seen.keys() | self._greeted):
                if peer in self._silent_ok or now - self._last_sent.get(peer, 0.0) < interval:
                    continue
                if (only_to is not None and not only_to(peer)) or not self._has_room(peer):
                    continue  # a beat never waits: a hung peer's full ring must not hold the send lock
                try:
                    self.send(peer, Message(Header(Kind.HEARTBEAT, self.role, self.index, peer)))
                    self.stats.heartbeats_sent += 1
                except Exception:  # the receiver side reports a dead peer; beats to it stop, the others go on
                    self._silent_ok.add(peer)

    def check_silence(self, peers=None) -> None:
        """Raise PeerSilentError if a peer in service (of ``peers``, default all) has been silent past the link
        timeout: nothing from it since its last message, or since this end last asked it for work (:meth:`expect`)."""
        if self.link_timeout is None:
            return
        now = time.monotonic()
        for peer, seen in list(self._last_seen.items()):
            if peers is not None and peer not in peers:
                continue
            if peer not in self._silent_ok and now - seen > self.link_timeout:
                raise PeerSilentError(
                    f"{self.name}: {self.peer_name(peer)} sent nothing for {now - seen:.1f} s "
                    f"(link timeout {self.link_timeout:.1f} s): hung, or heartbeats are off", peer=peer
                )

    def peer_name(self, peer: int) -> str:
        return rank_name(self.peer_role, peer)

    def send(self, peer: int, message: Message) -> None:
        """Send to one peer. The message's tensors may still be read after this returns (an accelerator
        transport sends asynchronously, without a copy): never modify them in place afterwards."""
        header_bytes, tensors = encode(message)
        self.send_packed(peer, header_bytes, tensors, message.header)

    def send_packed(self, peer: int, header_bytes: bytes, tensors: list[torch.Tensor], header: Header | None = None) -> None:
        """Send a header the caller packed (an FFN rank's answers, :func:`~afd.connectors.wire.result_header`) and
        its tensors, in table order; ``header``: the same header parsed, where the caller has it."""
        wire = self.wire_device
        self.send_frame(peer, header, header_bytes, [flat_bytes(t if t.device == wire else t.to(wire)) for t in tensors])

    def send_frame(self, peer: int, header: Header | None, header_bytes: bytes, payload: list[torch.Tensor]) -> None:
        """Send one encoded frame: ``payload`` is 1-d uint8 tensors (views where possible) on ``wire_device``;
        ``header``: the frame's header parsed (None: not at hand, and no HELLO)."""
        with self._send_lock:
            self._send(peer, header_bytes, payload)
            self._last_sent[peer] = time.monotonic()
            if header is not None and header.kind == Kind.HELLO:
                self._greeted.add(peer)
        n_payload = sum(p.numel() for p in payload)
        self.stats.messages_sent += 1
        self.stats.bytes_sent += len(header_bytes) + n_payload
        self.stats.payload_bytes_sent[peer] = self.stats.payload_bytes_sent.get(peer, 0) + n_payload
        if self.io_log:
            log.info("%s -> %s: %s", self.name, self.peer_name(peer), _describe(header or Header.unpack(header_bytes, self.name)[0]))

    def recv(self, timeout: float) -> Message | None:
        """The next message from any peer, or None after ``timeout`` seconds."""
        got = self._recv(timeout)
        if got is None:
            return None
        peer, raw_header, payload = got
        payload_len = len(payload)
        try:
            header, n = Header.unpack(raw_header, self.name + f" (link from {self.peer_name(peer)})")
            if header.src_role != self.peer_role or header.src_index != peer or header.dst_index != self.index:
                raise ProtocolError(
                    f"{self.name}: message on the link from {self.peer_name(peer)} claims to come from {header.source} "
                    f"to index {header.dst_index}"
                )
            message = decode_payload(header, payload, self.name, self.device)
        finally:
            if isinstance(payload, memoryview):
                payload.release()
            self._release()
        self.stats.messages_received += 1
        self.stats.bytes_received += n + payload_len
        if peer in self._last_seen:
            self._last_seen[peer] = time.monotonic()
        if header.kind == Kind.HELLO:
            self.watch(peer)
        elif header.kind == Kind.HEARTBEAT:
            self.stats.heartbeats_received += 1
        elif header.kind == Kind.SHUTDOWN:
            # the last message on its link: stop listening at once, before the caller even looks at it,
            # so the peer closing right after (EOF on its socket or FIFO) is never read as a death
            self.forget(peer)
        if self.io_log:
            log.info("%s <- %s: %s", self.name, header.source, _describe(header))
        return message

    @abstractmethod
    def _send(self, peer: int, header: bytes, payload: list[torch.Tensor]) -> None:
        """Send one frame; ``payload`` is 1-d uint8 tensors on ``wire_device``, in table order."""

    @abstractmethod
    def _recv(self, timeout: float) -> tuple[int, bytes, bytes | memoryview | torch.Tensor] | None:
        """(peer, header bytes, payload): a buffer the transport reuses after ``_release``, or a fresh uint8 tensor."""

    def _has_room(self, peer: int) -> bool:
        """Whether a send to ``peer`` would go without waiting for the peer to read (heartbeats skip it)."""
        return True

    def _release(self) -> None:
        """Give the transport's receive buffer back (after the payload was copied out)."""

    def connect(self, timeout: float) -> None:
        """Finish opening the links (the second half of starting, after the constructor's own): wait at most
        ``timeout`` s for the peers. A transport whose constructor linked everything does nothing here."""

    def reconnect(self, peer: int, generation: int, timeout: float) -> None:
        """Open new links to a peer's replacement (generation ``generation``); the transport must support it."""
        raise NotImplementedError(f"{type(self).__name__}: links cannot be reopened (a replacement rank needs the shm or tcp transport)")

    def readmit(self, peer: int, incarnation: int, timeout: float) -> None:
        """An FFN rank: take back attention rank ``peer`` after its restart (``incarnation``), on new links."""
        raise NotImplementedError(f"{type(self).__name__}: links cannot be reopened (a restarted rank needs the shm or tcp transport)")

    def _rejoin(self, peer: int) -> None:
        """After :meth:`reconnect`: the peer is listened to again; it is watched for silence from its HELLO."""
        self._silent_ok.discard(peer)
        self._last_seen.pop(peer, None)
        self._last_sent.pop(peer, None)
        self._greeted.discard(peer)

    def forget(self, peer: int) -> None:
        """Stop listening to a peer that said SHUTDOWN: its link closing later is not a death."""
        self._silent_ok.add(peer)
        self._forget(peer)

    def _forget(self, peer: int) -> None:
        """Transport part of :meth:`forget`."""

    def stop_heartbeats(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=2)

    def close(self) -> None:
        self.stop_heartbeats()


def _describe(h: Header) -> str:
    tensors = ", ".join(f"{t.name.name}{list(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for t in h.tensors)
    return f"{h.kind.name} ops={int(h.ops)} layer={h.layer} mb={h.microbatch} seq={h.seq} tokens={h.num_tokens} [{tensors}]"


# ----------------------------------------------------------------------------- loopback


class LoopbackHub:
    """In-process links for ranks that are threads of one process (tests, debugging)."""

    def __init__(self) -> None:
        self._inboxes: dict[tuple[Role, int], queue.Queue] = {}
        self._lock = threading.Lock()
        self.closed = threading.Event()

    def inbox(self, role: Role, index: int) -> queue.Queue:
        with self._lock:
            return self._inboxes.setdefault((role, index), queue.Queue())

    def close(self) -> None:
        """Wake every receiver: links are gone (a rank failed or the run ends)."""
        self.closed.set()
        with self._lock:
            for q in self._inboxes.values():
                q.put(None)


class LoopbackMailbox(Mailbox):
    def __init__(self, hub: LoopbackHub, role: Role, index: int, num_peers: int, io_log: bool = False,
                 device: str | torch.device = "cpu") -> None:
        super().__init__(role, index, num_peers, io_log, device)
        self.hub = hub
        self._inbox = hub.inbox(role, index)

    def _send(self, peer: int, header: bytes, payload: list[torch.Tensor]) -> None:
        if self.hub.closed.is_set():
            raise PeerDiedError(f"{self.name}: links are closed, cannot send to {self.peer_name(peer)}", peer=peer)
        data = bytearray(b"".join(tensor_bytes(p) for p in payload))  # a copy, as a real transport makes
        self.hub.inbox(self.peer_role, peer).put((self.index, bytes(header), data))

    def _recv(self, timeout: float):
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is None:
            self._inbox.put(None)  # keep waking later receivers
            raise PeerDiedError(f"{self.name}: links closed while waiting (a rank of this run failed)")
        return item
