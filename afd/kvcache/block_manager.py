"""Block manager: which fixed-size KV blocks each sequence owns, and which full blocks are cached
for reuse by later sequences with the same prefix (automatic prefix caching). Pure Python, no tensors.

Prefix caching, as vLLM does it: a *full* block is named by a hash of its tokens chained to the
hash of the block before it, so equal names mean equal prefixes (the tokens are also compared on
a hit). Blocks are refcounted: a block shared by several sequences returns to the pool only when
the last one lets go, and then it stays cached (evictable, least recently used first) until a
new allocation needs it. A sequence only ever writes KV at positions past its cached prefix, so a
shared block is never written.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

from afd.kvcache.metadata import SeqChunk


def block_name(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The name of a full block: its tokens chained to the name of the block before it (None: the first)."""
    return hash((parent, tokens))


def prefix_names(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Names of the full blocks a prefix-cache lookup of ``token_ids`` may cover (the last token excluded)."""
    names, parent = [], None
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_name(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        names.append(parent)
    return names


class OutOfBlocksError(RuntimeError):
    """Not enough free KV blocks for a request; nothing was allocated."""


class BlockManager:
    """Hands out blocks of ``block_size`` token slots from a pool of ``num_blocks``.

    A sequence's block table lists its blocks in order: token ``j`` of the
    sequence lives in slot ``table[j // block_size] * block_size + j % block_size``.
    Growing a table is all-or-nothing: on failure nothing changes. With
    ``enable_caching``, :meth:`lookup` finds a cached prefix, :meth:`attach` starts a
    sequence on it, and :meth:`commit` names a sequence's blocks as they fill.

    A table may have holes (None): blocks no query will read again, given back by
    :meth:`release_before` (a sliding-window pool: :class:`afd.kvcache.WindowedBlocks`).

    With ``num_state_slots`` (a model with linear-attention layers), every sequence also holds one state slot
    from the sequence's first blocks to :meth:`free`: a sequence is admitted only when a slot is free too, and
    a preempted one gives its slot back (its state is rebuilt from position 0 when it is recomputed).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, num_state_slots: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.num_state_slots = num_state_slots
        self._free_slots: deque[int] = deque(range(num_state_slots))
        self._slot_of: dict[int, int] = {}  # sequence -> its state slot
        self._free: deque[int] = deque(range(num_blocks))  # hold nothing reusable
        self._tables: dict[int, list[int]] = {}
        self._refs = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._block_of: dict[int, int] = {}  # hash -> the cached block
        self._key_of: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}  # block -> (hash, parent hash, tokens)
        self._chains: dict[int, list[int]] = {}  # sequence -> hashes of its full blocks so far

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-used ones and cached ones no sequence holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks that ``ensure(seq_id, num_tokens)`` would take from the pool."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_ensure(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_new_blocks(seq_id, num_tokens) <= self.num_free_blocks

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def can_admit(self, num_tokens: int, prefix: Sequence[int] = (), skip: int = 0) -> bool:
        """Whether a new sequence starting on the cached ``prefix`` blocks (after ``skip`` holes) can hold
        ``num_tokens`` (and, with state slots, get one)."""
        if self.num_state_slots and not self._free_slots:
            return False
        reclaimed = sum(1 for b in prefix if b in self._evictable)  # attaching takes them out of the pool
        return self.blocks_for(num_tokens) - skip - len(prefix) <= self.num_free_blocks - reclaimed

    # ------------------------------------------------------------------ allocation
    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the least recently used cached block
            block, _ = self._evictable.popitem(last=False)
            h = self._key_of.pop(block)[0]
            del self._block_of[h]
        self._refs[block] = 1
        return block

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens in total; return the table."""
        need = self.num_new_blocks(seq_id, num_tokens)
        if need > self.num_free_blocks:
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {need} more KV blocks for {num_tokens} tokens, "
                f"{self.num_free_blocks} of {self.num_blocks} free; raise the KV cache size or lower the batch"
            )
        table = self._tables.get(seq_id)
        if table is None:
            table = self._open(seq_id, [])
        table.extend(self._take() for _ in range(need))
        return table

    def _open(self, seq_id: int, table: list) -> list:
        """A new sequence's table, and its state slot when the model keeps state."""
        if self.num_state_slots:
            if not self._free_slots:
                raise OutOfBlocksError(f"sequence {seq_id} needs a state slot; all {self.num_state_slots} are held")
            self._slot_of[seq_id] = self._free_slots.popleft()
        self._tables[seq_id] = table
        return table

    def state_slot(self, seq_id: int) -> int | None:
        """The sequence's state slot (None: the model keeps no state)."""
        return self._slot_of.get(seq_id)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def table(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} holds no KV blocks") from None

    def window_table(self, seq_id: int) -> list[int | None] | None:
        """The sequence's sliding-window table: one pool serves every layer here (None)."""
        return None

    def chunk(self, seq_id: int, start: int, length: int) -> SeqChunk:
        """The step's share of ``seq_id``: ``length`` tokens after ``start``, on its tables."""
        return SeqChunk(self.table(seq_id), start, length, self.window_table(seq_id), self.state_slot(seq_id))

    def advance(self, seq_id: int, start: int) -> None:
        """``seq_id``'s next step computes from ``start``: what no query will read again may go. Here every
        position stays visible (full attention); a sliding-window pool releases the blocks behind the window."""

    def release_before(self, seq_id: int, position: int) -> int:
        """Give back ``seq_id``'s blocks that hold only positions before ``position`` (holes stay in the table,
        so positions keep their blocks); a named one stays cached. Returns how many were released."""
        table = self._tables.get(seq_id, [])
        released = 0
        for i in range(min(max(0, position) // self.block_size, len(table))):
            if table[i] is not None:
                self._drop(table[i])
                table[i] = None
                released += 1
        return released

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def free(self, seq_id: int) -> None:
        """Let go of all of ``seq_id``'s blocks. A block returns to the pool when no sequence holds it;
        a cached one stays reusable until evicted. Freeing an unknown sequence is an error."""
        try:
            table = self._tables.pop(seq_id)
        except KeyError:
            raise KeyError(f"sequence {seq_id} holds no KV blocks (double free?)") from None
        self._chains.pop(seq_id, None)
        if seq_id in self._slot_of:
            self._free_slots.append(self._slot_of.pop(seq_id))
        for block in reversed(table):  # a chain's tail is evicted before its head
            if block is not None:
                self._drop(block)

    def slot(self, seq_id: int, position: int) -> int:
        table = self.table(seq_id)
        block, offset = divmod(position, self.block_size)
        if block >= len(table) or table[block] is None:
            raise IndexError(f"position {position} of sequence {seq_id} is beyond its {len(table)} blocks or released")
        return table[block] * self.block_size + offset

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks of the longest prefix of ``token_ids`` held in full blocks, leaving at
        least the last token to compute (its logits are needed)."""
        bs, blocks, parent = self.block_size, [], None
        for i in range((len(token_ids) - 1) // bs if self.enable_caching else 0):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_name(parent, tokens)
            block = self._block_of.get(h)
            if block is None or self._key_of[block][1:] != (parent, tokens):
                break
            blocks.append(block)
            parent = h
        return blocks

    def cached(self, names: Sequence[int]) -> list[int] | None:
        """The cached blocks of these block names, or None if one is not cached here."""
        blocks = [self._block_of.get(h) for h in names]
        return None if None in blocks else blocks

    def attach(self, seq_id: int, prefix: Sequence[int], skip: int = 0, names: Sequence[int] | None = None) -> None:
        """Start the new sequence ``seq_id`` on the cached ``prefix`` blocks (from :meth:`lookup`); with
        ``skip``, they follow that many holes (a window's blocks of a longer prefix, whose ``names`` are given)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds KV blocks")
        if not prefix:
            return
        self._open(seq_id, [None] * skip + list(prefix))
        for block in prefix:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        self._chains[seq_id] = list(names) if names is not None else [self._key_of[b][0] for b in prefix]

    def needs_commit(self, seq_id: int, num_computed: int) -> bool:
        """Whether ``commit`` has a newly full block to name (cheap: the step loop asks every step)."""
        return self.enable_caching and num_computed // self.block_size > len(self._chains.get(seq_id, ()))

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Name ``seq_id``'s blocks that are full now (its first ``num_computed`` of ``token_ids`` are in
        the cache), so that later sequences can reuse them."""
        if not self.enable_caching:
            return
        chain = self._chains.setdefault(seq_id, [])
        table, bs = self._tables[seq_id], self.block_size
        for i in range(len(chain), num_computed // bs):
            parent = chain[-1] if chain else None
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_name(parent, tokens)
            block = table[i]
            if block is not None and h not in self._block_of and block not in self._key_of:
                self._block_of[h] = block
                self._key_of[block] = (h, parent, tokens)
            chain.append(h)

    def check(self) -> None:
        """Invariants (tests): refcounts match the tables; a block is in exactly one of held, free, evictable."""
        held: dict[int, int] = {}
        for table in self._tables.values():
            for b in table:
                if b is not None:
                    held[b] = held.get(b, 0) + 1
        assert all(self._refs[b] == n for b, n in held.items()), "refcount differs from the tables holding the block"
        assert all(self._refs[b] == 0 for b in range(self.num_blocks) if b not in held)
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not (free & evictable) and not (free & held.keys()) and not (evictable & held.keys())
        assert len(free) + len(evictable) + len(held) == self.num_blocks, "a block is lost"
        assert evictable <= self._key_of.keys() and not (free & self._key_of.keys())
        assert all(self._block_of[k[0]] == b for b, k in self._key_of.items())
        slots = list(self._slot_of.values())
        assert self._slot_of.keys() <= self._tables.keys(), "a freed sequence still holds a state slot"
        assert len(set(slots)) == len(slots) and not set(slots) & set(self._free_slots), "a state slot is held twice"
        assert len(slots) + len(self._free_slots) == self.num_state_slots, "a state slot is lost"
        assert not self.num_state_slots or len(slots) == len(self._tables), "a sequence holds no state slot"
