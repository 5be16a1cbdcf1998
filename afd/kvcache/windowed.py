"""Two block pools, as vLLM's hybrid KV manager keeps them: the full-attention layers' and the sliding-window
layers' (gpt-oss). Each sequence has a table in each. The full layers keep every position; a sliding
layer's query at position i reads only i-W+1..i, so before a step computes a sequence from ``start``, its
window blocks that hold only positions before ``start - W + 1`` go back to the pool
(:meth:`WindowedBlocks.advance`). A sequence's window memory is bounded by its window (plus the chunk it
computes), whatever its length.

:class:`WindowedBlocks` has the interface the scheduler uses of a :class:`BlockManager`; counts, limits and
``max_model_len`` are the full pool's (the window pool is sized for every sequence at once:
:func:`afd.engine.budget.window_pool_blocks`).

**The prefix cache rule for the sliding layers.** Window blocks are named like full ones (the same chain of
token hashes) as they fill, and a window block released behind the window stays cached until evicted. A
prefix of k full blocks is a hit only when the window pool still holds, by name, the blocks of its last W
positions (those the next token's window reaches); the longest such k <= the full pool's hit is taken.
So the full layers' hit is used whenever the sliding layers can resume from it, and never otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from afd.kvcache.block_manager import BlockManager, OutOfBlocksError, prefix_names
from afd.kvcache.metadata import SeqChunk


@dataclass(frozen=True)
class Prefix:
    """A prefix-cache hit in both pools: the full pool's ``blocks`` (their ``names``), and the window pool's
    blocks of the positions the next token's window reaches, after ``skip`` blocks it does not."""

    blocks: tuple[int, ...] = ()
    names: tuple[int, ...] = ()
    skip: int = 0
    window: tuple[int, ...] = ()

    def __len__(self) -> int:  # the scheduler counts a hit in full blocks
        return len(self.blocks)


class WindowedBlocks:
    """A full pool and a sliding-window pool of the same block size; see the module docstring."""

    def __init__(self, full: BlockManager, window: BlockManager, size: int) -> None:
        if full.block_size != window.block_size or full.enable_caching != window.enable_caching:
            raise ValueError("the two pools need one block size and one caching setting")
        if size < 1:
            raise ValueError(f"a sliding window of {size} tokens")
        self.full, self.window, self.size = full, window, size

    # ------------------------------------------------------------------ the full pool's counts
    @property
    def block_size(self) -> int:
        return self.full.block_size

    @property
    def enable_caching(self) -> bool:
        return self.full.enable_caching

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.full.num_used_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return self.full.blocks_for(num_tokens)

    def _first_visible(self, position: int) -> int:
        """The first position a query at ``position`` reads in the sliding layers."""
        return max(0, position - self.size + 1)

    # ------------------------------------------------------------------ sequences
    def holds(self, seq_id: int) -> bool:
        return self.full.holds(seq_id)

    def table(self, seq_id: int) -> list[int]:
        return self.full.table(seq_id)

    def window_table(self, seq_id: int) -> list[int | None]:
        return self.window.table(seq_id)

    def chunk(self, seq_id: int, start: int, length: int) -> SeqChunk:
        return SeqChunk(self.full.table(seq_id), start, length, self.window.table(seq_id), self.full.state_slot(seq_id))

    def advance(self, seq_id: int, start: int) -> None:
        if self.window.holds(seq_id):
            self.window.release_before(seq_id, self._first_visible(start))

    def can_ensure(self, seq_id: int, num_tokens: int) -> bool:
        return self.full.can_ensure(seq_id, num_tokens) and self.window.can_ensure(seq_id, num_tokens)

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        if not self.window.can_ensure(seq_id, num_tokens):  # all or nothing, in both pools
            raise OutOfBlocksError(f"sequence {seq_id} needs {self.window.num_new_blocks(seq_id, num_tokens)} more sliding-window "
                                   f"blocks, {self.window.num_free_blocks} of {self.window.num_blocks} free")
        table = self.full.ensure(seq_id, num_tokens)
        self.window.ensure(seq_id, num_tokens)
        return table

    def free(self, seq_id: int) -> None:
        self.full.free(seq_id)
        if self.window.holds(seq_id):
            self.window.free(seq_id)

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, token_ids: Sequence[int]) -> Prefix:
        """The longest prefix the full pool holds whose window the window pool holds too (the module's rule)."""
        blocks = self.full.lookup(token_ids)
        names = prefix_names(token_ids, self.block_size)[: len(blocks)]
        for k in range(len(blocks), 0, -1):
            skip = self._first_visible(k * self.block_size) // self.block_size
            window = self.window.cached(names[skip:k])
            if window is not None:
                return Prefix(tuple(blocks[:k]), tuple(names[:k]), skip, tuple(window))
        return Prefix()

    def can_admit(self, num_tokens: int, prefix: Prefix = Prefix()) -> bool:
        return (self.full.can_admit(num_tokens, prefix.blocks)
                and self.window.can_admit(num_tokens, prefix.window, prefix.skip))

    def attach(self, seq_id: int, prefix: Prefix) -> None:
        self.full.attach(seq_id, prefix.blocks)
        self.window.attach(seq_id, prefix.window, prefix.skip, prefix.names)

    def needs_commit(self, seq_id: int, num_computed: int) -> bool:
        return self.full.needs_commit(seq_id, num_computed)

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        self.full.commit(seq_id, token_ids, num_computed)
        self.window.commit(seq_id, token_ids, num_computed)

    def check(self) -> None:
        self.full.check()
        self.window.check()


def make_blocks(num_blocks: int, block_size: int, enable_caching: bool, num_window_blocks: int = 0,
                window: int = 0, num_state_slots: int = 0) -> BlockManager | WindowedBlocks:
    """One pool, or the full and window pools of a model whose sliding layers have a pool of their own; the
    full pool hands out the state slots of a model with linear-attention layers."""
    full = BlockManager(num_blocks, block_size, enable_caching, num_state_slots)
    if not num_window_blocks:
        return full
    return WindowedBlocks(full, BlockManager(num_window_blocks, block_size, enable_caching), window)
