"""The wire protocol between attention and FFN ranks.

Every message is one frame: a fixed header, a tensor table, then the tensors'
bytes in table order. The header carries everything a receiver needs to pair
a message without trusting arrival order, and to check it before touching the
payload:

    magic 'AFD1' | version | kind | ops | src role | src index | dst index
    | layer | micro-batch | step | membership epoch | contributors | FFN members
    | placement version | compute time | token count | tensor count | payload bytes

Pairing key: (source rank, step, layer, micro-batch). A receiver checks
every field (:meth:`Header.expect`) and raises :class:`ProtocolError` naming
both ranks on any mismatch instead of mispairing tensors.

Work is aggregated: the attention ranks agree on each step (afd/attention/steps.py),
and a work header carries the agreement's membership epoch and the bitmask of
the attention ranks that contribute to (step, micro-batch). An FFN rank
computes (step, layer, micro-batch) once, when it holds a part -- possibly an
empty one -- from every contributor.

A work header also carries the FFN ranks the sender dispatched to (``ffn_members``, a bitmask): the
copy a row uses depends on which copies are alive (afd/distributed/placement.py), and a result is
accepted only for the dispatch it answers. Work re-dispatched after an FFN rank failed carries
``Op.RETRY``: it is computed alone (its contributors are its sender only), never merged with a union.
The placement version names the expert placement the sender chose copies under (a rebalance installs
a new one at an agreed step; until every sender uses it, an FFN rank holds both).

A RESULT carries the time the FFN rank spent computing the union it answers (``busy_us``): the
attention ranks' ``auto`` planner learns the FFN side's cost from it (afd/microbatch/learn.py).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

import torch

MAGIC = b"AFD1"
PROTOCOL_VERSION = 5  # 2: membership epoch and contributors in every header; 3: FFN members, Op.RETRY; 4: TOKEN_IDS, HIDDEN_SCALES;
# 5: a RESULT's compute time (busy_us)
MAX_ATTENTION_RANKS = 64  # the contributors bitmask is 64 bits

_FIXED = struct.Struct("<4sHBBBHHiHQHQQHIIBQ")  # see module docstring, in order
_TENSOR = struct.Struct("<BBB")  # name, dtype, ndim; then ndim x uint32 dims
_DIM = struct.Struct("<I")


class ProtocolError(RuntimeError):
    """A message that does not match what the receiver expects; names both ranks."""


class Kind(enum.IntEnum):
    HELLO = 0
    WORK = 1
    RESULT = 2
    HEARTBEAT = 3
    SHUTDOWN = 4
    ERROR = 5


class Op(enum.IntFlag):
    """What the FFN side computes for a work item."""

    NONE = 0
    ROUTED = 1  # routed experts over the given expert ids and weights
    SHARED = 2  # shared experts over every row
    DENSE = 4  # the dense MLP of a dense layer
    ROUTE = 8  # run the router on the FFN side (gate placement "ffn")
    RETRY = 16  # re-dispatched after an FFN rank failed: computed alone, once


class Role(enum.IntEnum):
    ATTENTION = 0
    FFN = 1


class TensorName(enum.IntEnum):
    HIDDEN = 0  # [n, H] ffn_input rows
    EXPERT_IDS = 1  # [n, k] int32 logical expert ids, -1 = not for this rank
    WEIGHTS = 2  # [n, k] float32 combine weights
    OUTPUT = 3  # [n, H] partial FFN output rows
    TEXT = 4  # [n] uint8: an error message
    SHARED_ROWS = 5  # [n] uint8: 1 where the receiving FFN rank computes the row's shared experts
    TOKEN_IDS = 6  # [n] int32: the rows' tokens, for a hash-routed layer whose gate runs on the FFN side (DeepSeek-V4)
    HIDDEN_SCALES = 7  # [n, 1] float32: each HIDDEN row's scale when the dispatch quantises (--dispatch-dtype int8 / fp8)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8, torch.float8_e4m3fn, torch.int8]
_DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
# enum lookups by value, cached: constructing an IntEnum/IntFlag per field costs microseconds per message
_KINDS = {int(k): k for k in Kind}
_ROLES = {int(r): r for r in Role}
_NAMES = {int(n): n for n in TensorName}
_OPS: dict[int, Op] = {}


def _op(value: int) -> Op:
    op = _OPS.get(value)
    if op is None:
        op = _OPS[value] = Op(value)
    return op


def rank_name(role: Role, index: int) -> str:
    return f"{'attention' if role == Role.ATTENTION else 'ffn'} rank {index}"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: TensorName
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Header:
    kind: Kind
    src_role: Role
    src_index: int
    dst_index: int
    layer: int = -1
    microbatch: int = 0
    seq: int = 0
    num_tokens: int = 0
    ops: Op = Op.NONE
    tensors: tuple[TensorSpec, ...] = ()
    version: int = PROTOCOL_VERSION
    epoch: int = 0  # the membership epoch the step was agreed under
    members: int = 0  # bit a: attention rank a contributes to (step, micro-batch)
    ffn_members: int = 0  # bit f: the sender dispatched this (step, layer, micro-batch) to FFN rank f (work and its result)
    placement: int = 0  # the expert placement version the copies were chosen under
    busy_us: int = 0  # a RESULT: microseconds the FFN rank computed the union it answers (saturates at 2**32 - 1)

    @property
    def source(self) -> str:
        return rank_name(self.src_role, self.src_index)

    @property
    def payload_bytes(self) -> int:
        return _layout(self.tensors)[0]

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.src_index, self.seq, self.layer, self.microbatch)

    def pack(self) -> bytes:
        parts = [
            _FIXED.pack(
                MAGIC, self.version, self.kind, self.ops, self.src_role, self.src_index, self.dst_index,
                self.layer, self.microbatch, self.seq, self.epoch, self.members, self.ffn_members, self.placement, self.busy_us,
                self.num_tokens, len(self.tensors),
                self.payload_bytes,
            )
        ]
        parts.extend(_table_entry(t.name, t.dtype, t.shape) for t in self.tensors)
        return b"".join(parts)

    @classmethod
    def unpack(cls, buf: bytes | memoryview, receiver: str) -> tuple["Header", int]:
        """Parse a header; returns it and its length in bytes. Raises ProtocolError on garbage."""
        if len(buf) < _FIXED.size:
            raise ProtocolError(f"{receiver}: truncated header ({len(buf)} bytes)")
        (magic, version, kind, ops, role, src, dst, layer, mb, seq, epoch, members, ffn_members, placement, busy_us, ntok,
         ntensors, payload) = _FIXED.unpack_from(buf, 0)
        if magic != MAGIC:
            raise ProtocolError(f"{receiver}: bad magic {bytes(magic)!r} (expected {MAGIC!r}): corrupted or foreign message")
        if kind not in _KINDS or role not in _ROLES:
            raise ProtocolError(f"{receiver}: unknown message kind {kind} or role {role}")
        kind, role = _KINDS[kind], _ROLES[role]
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"{receiver}: protocol version {version} from {rank_name(role, src)}, this side speaks {PROTOCOL_VERSION}")
        table = _TABLES.get((ntensors, bytes(buf[_FIXED.size :])))
        if table is None:
            table = _parse_table(buf, ntensors, receiver, rank_name(role, src))
        specs, off = table
        try:
            ops = _op(ops)
        except ValueError:
            raise ProtocolError(f"{receiver}: unknown ops {ops} from {rank_name(role, src)}") from None
        header = cls(kind, role, src, dst, layer, mb, seq, ntok, ops, specs, version, epoch, members, ffn_members, placement, busy_us)
        if _layout(specs)[0] != payload:
            raise ProtocolError(
                f"{receiver}: header from {header.source} declares {payload} payload bytes but its tensor table sums to {header.payload_bytes}"
            )
        return header, off

    def expect(self, receiver: str, **fields) -> None:
        """Fail loudly unless every given field has the expected value."""
        wrong = [f"{k}={getattr(self, k)!r} (expected {v!r})" for k, v in fields.items() if getattr(self, k) != v]
        if wrong:
            raise ProtocolError(f"{receiver}: message from {self.source} does not pair: {', '.join(wrong)}")


# Parsed tensor tables, by (tensor count, the header's bytes after its fixed part): a link carries the same few
# tables over and over (the shapes of a step's parts), and parsing one costs microseconds per message.
_TABLES: dict[tuple[int, bytes], tuple[tuple[TensorSpec, ...], int]] = {}
# id(specs) -> (specs, payload bytes, [(name, dtype, shape, offset, bytes)]): where each tensor lies in a payload
_LAYOUTS: dict[int, tuple] = {}
_RESULT_TABLES: dict[tuple[int, int, torch.dtype], bytes] = {}  # (rows, hidden, dtype) -> an answer's packed table
_CACHE_LIMIT = 4096  # entries; emptied when full (shapes of a run are few, a test's may be many)


def _table_entry(name: TensorName, dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """One tensor's entry of a packed tensor table: name, dtype, ndim, then each dim."""
    return _TENSOR.pack(name, _DTYPE_CODE[dtype], len(shape)) + b"".join(_DIM.pack(d) for d in shape)


def _parse_table(buf: bytes | memoryview, ntensors: int, receiver: str, sender: str) -> tuple[tuple[TensorSpec, ...], int]:
    """A header's tensor table: its specs and the header's length; cached in _TABLES."""
    off = _FIXED.size
    specs = []
    for _ in range(ntensors):
        if len(buf) < off + _TENSOR.size:
            raise ProtocolError(f"{receiver}: truncated tensor table from {sender}")
        name, dcode, ndim = _TENSOR.unpack_from(buf, off)
        off += _TENSOR.size
        if dcode >= len(DTYPES) or name not in _NAMES:
            raise ProtocolError(f"{receiver}: bad tensor entry (name {name}, dtype {dcode}) from {sender}")
        if len(buf) < off + 4 * ndim:
            raise ProtocolError(f"{receiver}: truncated tensor table from {sender}")
        shape = struct.unpack_from(f"<{ndim}I", buf, off)
        off += 4 * ndim
        specs.append(TensorSpec(_NAMES[name], DTYPES[dcode], shape))
    table = tuple(specs), off
    if len(_TABLES) >= _CACHE_LIMIT:
        _TABLES.clear()
    _TABLES[(ntensors, bytes(buf[_FIXED.size :]))] = table
    return table


def _layout(specs: tuple[TensorSpec, ...]) -> tuple:
    """(payload bytes, [(name, dtype, shape, offset, bytes)]) of a tensor table, cached by the tuple's identity
    (a cached table's tuple is shared by every message that carries it)."""
    entry = _LAYOUTS.get(id(specs))
    if entry is not None and entry[0] is specs:
        return entry[1], entry[2]
    places, off = [], 0
    for t in specs:
        places.append((t.name, t.dtype, t.shape, off, t.num_bytes))
        off += places[-1][4]
    if len(_LAYOUTS) >= _CACHE_LIMIT:
        _LAYOUTS.clear()
    _LAYOUTS[id(specs)] = (specs, off, places)  # holds specs: its id is not reused while cached
    return off, places


@dataclass(slots=True)
class Message:
    header: Header
    tensors: dict[TensorName, torch.Tensor] = field(default_factory=dict)

    def get(self, name: TensorName) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ProtocolError(f"message from {self.header.source} has no {name.name} tensor") from None


def make_message(header: Header, tensors: dict[TensorName, torch.Tensor]) -> Message:
    """Fill the header's tensor table from the tensors (any device; made contiguous when sent)."""
    if not tensors:
        return Message(header, {})
    h = header
    specs = tuple(TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items())
    # positional construction: dataclasses.replace introspects the fields on every call (~10 us)
    return Message(Header(h.kind, h.src_role, h.src_index, h.dst_index, h.layer, h.microbatch, h.seq, h.num_tokens, h.ops, specs,
                          h.version, h.epoch, h.members, h.ffn_members, h.placement, h.busy_us), dict(tensors))


def result_header(work: Header, ffn_rank: int, output: torch.Tensor, busy_s: float = 0.0) -> bytes:
    """The packed header of the RESULT that answers ``work`` with ``output`` [n, H], computed in ``busy_s``
    (``Header.pack`` of what :func:`afd.connectors.work.result_message` builds, without building it: an FFN
    rank answers every part, right after computing, when little of this code is still in the caches)."""
    n, hidden = output.shape
    table = _RESULT_TABLES.get((n, hidden, output.dtype))
    if table is None:
        if len(_RESULT_TABLES) >= _CACHE_LIMIT:
            _RESULT_TABLES.clear()
        table = _RESULT_TABLES[(n, hidden, output.dtype)] = _table_entry(TensorName.OUTPUT, output.dtype, (n, hidden))
    return _FIXED.pack(MAGIC, PROTOCOL_VERSION, Kind.RESULT, work.ops, Role.FFN, ffn_rank, work.src_index, work.layer, work.microbatch,
                       work.seq, work.epoch, work.members, work.ffn_members, work.placement, busy_us(busy_s), n, 1,
                       n * hidden * output.dtype.itemsize) + table


def busy_us(seconds: float) -> int:
    """A compute time as a header's ``busy_us``."""
    return min(max(0, round(seconds * 1e6)), 0xFFFFFFFF)



def encode(message: Message) -> tuple[bytes, list[torch.Tensor]]:
    """-> (header bytes, tensors to put on the wire after it, in table order)."""
    return message.header.pack(), [message.tensors[s.name].contiguous() for s in message.header.tensors]


def decode_payload(header: Header, payload: bytes | memoryview | torch.Tensor, receiver: str,
                   device: torch.device | None = None) -> Message:
    """Split a contiguous payload into the header's tensors, on ``device`` (default: where the payload is).

    ``payload`` is a transport's reusable buffer (bytes / memoryview: copied out once, straight to
    ``device``) or a fresh uint8 tensor the transport hands over (viewed in place, moved if needed).
    """
    size = payload.numel() if isinstance(payload, torch.Tensor) else len(payload)
    total, places = _layout(header.tensors)
    if size != total:
        raise ProtocolError(
            f"{receiver}: truncated payload from {header.source}: {size} of {total} bytes "
            f"(layer {header.layer}, seq {header.seq})"
        )
    if not places:
        return Message(header, {})
    if isinstance(payload, torch.Tensor):
        buf = payload if device is None or payload.device == device else payload.to(device)
    elif size == 0:
        buf = torch.empty(0, dtype=torch.uint8, device=device)
    else:
        if isinstance(payload, bytes):  # read-only: torch.frombuffer wants a writable buffer
            payload = bytearray(payload)
        host = torch.frombuffer(payload, dtype=torch.uint8)
        buf = host.clone() if device is None or device.type == "cpu" else host.to(device)  # the one copy out
    tensors = {}
    for name, dtype, shape, off, n in places:
        raw = buf[off : off + n]
        if off % dtype.itemsize:  # a dtype view needs an aligned offset
            raw = raw.clone()
        tensors[name] = raw.view(dtype).view(shape)
    return Message(header, tensors)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a 1-d uint8 tensor on its own device (a view when it is contiguous)."""
    if t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous():  # already (a transport's payload, sent on)
        return t
    return t.contiguous().reshape(-1).view(torch.uint8)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor as a memoryview (no copy when it is contiguous)."""
    t = flat_bytes(t)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.numpy())  # 1-d uint8: already format "B", one byte an item
