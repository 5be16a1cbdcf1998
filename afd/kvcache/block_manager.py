"""Block manager: which fixed-size KV blocks each sequence owns. Pure Python, no tensors."""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """Not enough free KV blocks for a request; nothing was allocated."""


class BlockManager:
    """Hands out blocks of ``block_size`` token slots from a pool of ``num_blocks``.

    A sequence's block table lists its blocks in order: token ``j`` of the
    sequence lives in slot ``table[j // block_size] * block_size + j % block_size``.
    Growing a table is all-or-nothing: on failure nothing changes.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks that ``ensure(seq_id, num_tokens)`` would take from the pool."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_ensure(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_new_blocks(seq_id, num_tokens) <= len(self._free)

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens in total; return the table."""
        need = self.num_new_blocks(seq_id, num_tokens)
        if need > len(self._free):
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {need} more KV blocks for {num_tokens} tokens, "
                f"{len(self._free)} of {self.num_blocks} free; raise the KV cache size or lower the batch"
            )
        table = self._tables.setdefault(seq_id, [])
        table.extend(self._free.popleft() for _ in range(need))
        return table

    def table(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} holds no KV blocks") from None

    def free(self, seq_id: int) -> None:
        """Return all of ``seq_id``'s blocks to the pool. Freeing an unknown sequence is an error."""
        try:
            table = self._tables.pop(seq_id)
        except KeyError:
            raise KeyError(f"sequence {seq_id} holds no KV blocks (double free?)") from None
        self._free.extend(table)

    def slot(self, seq_id: int, position: int) -> int:
        table = self.table(seq_id)
        block, offset = divmod(position, self.block_size)
        if block >= len(table):
            raise IndexError(f"position {position} of sequence {seq_id} is beyond its {len(table)} blocks")
        return table[block] * self.block_size + offset
