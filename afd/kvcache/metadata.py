"""Per-step attention metadata, built once per (micro-)batch before any layer runs.

Immutable and owned by the batch it describes: two micro-batches never share
metadata, RoPE tables or scratch buffers, so building the metadata of every
micro-batch up front and running them in any order gives the same result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

#: tokens per decode page (rounded up to whole KV blocks); see afd/models/paged_attention.py
PAGE_TOKENS = 128


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a batch: ``length`` new tokens after ``start`` cached ones. ``window_table``:
    its blocks in the sliding-window pool (None entries: released, behind every window), which the sliding
    layers read and write instead of ``block_table``; None where one pool serves every layer. ``state_slot``: the
    sequence's slot in the state cache of a model with linear-attention layers (afd/kvcache/state.py); None: it
    has none."""

    block_table: Sequence[int]
    start: int
    length: int
    window_table: Sequence[int | None] | None = None
    state_slot: int | None = None

    @property
    def end(self) -> int:
        return self.start + self.length


def last_token_rows(chunks: Sequence[SeqChunk]) -> list[int]:
    """Flat index of each chunk's last token in a batch of the chunks' tokens, concatenated in order."""
    rows, end = [], 0
    for c in chunks:
        end += c.length
        rows.append(end - 1)
    return rows


@dataclass(frozen=True, slots=True)
class DecodePages:
    """The step's one-token chunks and their contexts, cut into pages of cache slots.

    rows       [D] int64   flat row (in the step's batch) of each decode token
    page_row   [P] int64   which decode token (0..D-1) each page serves
    page_slots [P, N] int64  cache slot of each page position (0 past the context: masked)
    page_valid [P, N] bool   the position is part of the context
    page_blocks [P, N / block_size] int64  the KV block of each run of ``block_size`` page positions (a page
                           is whole blocks: its keys are gathered a block at a time, not a slot at a time)
    block_tables [D, W] int64  each decode token's KV blocks (0 past its table), for kernels that read the
                           cache in place (afd/kernels)
    context_lens [D] int64   each decode token's context length, its own position included
    window     0: the pages cover each whole context; W > 0: only its last W positions (a sliding layer's),
               from the block holding the first of them (``page_valid`` masks the rest). Kernels that read
               ``block_tables`` from position 0 cannot serve these pages.
    """

    rows: torch.Tensor
    page_row: torch.Tensor
    page_slots: torch.Tensor
    page_valid: torch.Tensor
    page_blocks: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    block_size: int
    window: int = 0

    @property
    def num_tokens(self) -> int:
        return self.rows.shape[0]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One sequence's chunk of more than one new token: rows ``[row, row + length)`` of the step's batch,
    after ``start`` cached tokens; ``slots`` [start + length] are the cache slots of positions 0..end-1;
    ``window_slots``, with a window pool, the window pool's slots of positions window_start..end-1."""

    row: int
    start: int
    length: int
    slots: torch.Tensor
    window_slots: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class StateSlots:
    """The state slot of each sequence of a step, for the linear-attention layers (afd/models/gated_deltanet.py).

    decode_slots  [D] int64  the slot of each decode token (``decode.rows`` order); None: no decode tokens
    decode_fresh  [D] bool   the token is its sequence's position 0: the slot's old contents are not read
    prefill_slots  the slot of each of ``prefills`` (a chunk starting at position 0 starts fresh too)
    """

    decode_slots: torch.Tensor | None
    decode_fresh: torch.Tensor | None
    prefill_slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CompressedSeq:
    """One sequence of a step, for DeepSeek-V4's compressed attention (afd/models/deepseek_v4.py), which runs per
    sequence: its rows ``[row, row + length)`` of the batch after ``start`` cached tokens; ``window_slots``: the
    window pool's slots of positions ``window_start``..end-1; ``entry_rows``: per compress rate r, the rows of its
    compressed entries 0..end//r - 1 (:func:`entry_rows`)."""

    row: int
    start: int
    length: int
    window_start: int
    window_slots: torch.Tensor
    entry_rows: dict[int, torch.Tensor]

    @property
    def end(self) -> int:
        return self.start + self.length


def rows_per_block(rate: int, block_size: int) -> int:
    """Rows a block of ``block_size`` tokens holds of a tensor with one row per ``rate`` tokens (a compressed entry
    per window): block_size / rate, or 1 when a window spans blocks. One must divide the other."""
    if block_size % rate and rate % block_size:
        raise ValueError(f"a compress rate of {rate} tokens and blocks of {block_size} tokens: one must divide the other")
    return max(1, block_size // rate)


def entry_rows(table: Sequence[int], rate: int, block_size: int, count: int) -> torch.Tensor:
    """[count] rows of entries 0..count-1 of rate ``rate`` in a sequence's full-pool blocks. Entry e is kept in the
    block of its window's *last* token, (e + 1) rate - 1: it is written in the step that fills that block, and the
    block's name (prefix cache) covers every token the entry depends on."""
    last = (torch.arange(count, dtype=torch.long) + 1) * rate - 1
    blocks = torch.tensor(list(table[: -(-(count * rate) // block_size)]), dtype=torch.long)[last // block_size] if count else last
    per_block = rows_per_block(rate, block_size)
    return blocks * per_block + (last % block_size) // rate if per_block > 1 else blocks


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where a flat batch of T tokens from S sequences reads and writes KV, with nothing padded:

    positions     [T] int64  absolute position of each token
    slot_mapping  [T] int64  cache slot each token's KV is written to
    last_token    [S] int64  flat index of each sequence's last token in this batch
    decode        the one-token chunks, their contexts cut into pages (None: there are none)
    prefills      the chunks of more than one token, each with its context's slots
    windowed      (W, the decode pages of the last W positions of each context) for each sliding window
                  the model has (gpt-oss): a sliding layer's decode reads O(W) positions, not O(context)
    layer_state   what one layer of this batch's forward leaves for a later one (GLM-5's shared top-k:
                  afd/models/sparse_attention.py), owned by the batch like the rest
    window_slot_mapping  [T] with a sliding-window pool: the slot each token's KV takes in the sliding layers'
                  cache (their own pool and tables); None: those layers use ``slot_mapping``
    state         the state slots of a hybrid model's sequences
    compressed    every sequence of the step, for DeepSeek-V4's compressed attention (built with ``rates``)
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    last_token: torch.Tensor
    decode: DecodePages | None
    prefills: tuple[PrefillChunk, ...]
    windowed: tuple[tuple[int, DecodePages], ...] = ()
    layer_state: dict[str, Any] = field(default_factory=dict, compare=False)
    window_slot_mapping: torch.Tensor | None = None
    state: StateSlots | None = None
    compressed: tuple[CompressedSeq, ...] = ()

    def slots_for(self, window: int) -> torch.Tensor:
        """Where a layer of this window writes the step's KV."""
        return self.window_slot_mapping if window and self.window_slot_mapping is not None else self.slot_mapping

    def decode_pages(self, window: int = 0) -> DecodePages | None:
        """The decode pages a layer of this attention window reads (0: the whole context)."""
        if not window or self.decode is None:
            return self.decode
        for w, pages in self.windowed:
            if w == window:
                return pages
        raise ValueError(f"no decode pages for window {window}: build the metadata with windows=({window},)")

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.last_token.shape[0]


def build_attention_metadata(chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str = "cpu",
                             page_tokens: int = PAGE_TOKENS, windows: Sequence[int] = (), rates: Sequence[int] = ()) -> AttentionMetadata:
    if not chunks:
        raise ValueError("a batch needs at least one sequence chunk")
    for c in chunks:
        if c.length < 1 or c.start < 0:
            raise ValueError(f"bad chunk {c}: length must be >= 1 and start >= 0")
        if len(c.block_table) * block_size < c.end:
            raise ValueError(f"chunk {c} needs {c.end} slots but its block table holds {len(c.block_table) * block_size}")
    positions, rows = [], []
    for c in chunks:
        rows.append(len(positions))
        positions.extend(range(c.start, c.end))
    positions_t = torch.tensor(positions, dtype=torch.long)
    slot_mapping = _slot_mapping([c.block_table for c in chunks], chunks, block_size)
    lengths = torch.tensor([c.length for c in chunks])
    pooled = any(c.window_table is not None for c in chunks)  # the sliding layers have a pool of their own
    if pooled and (len(set(windows)) != 1 or not all(c.window_table is not None for c in chunks)):
        raise ValueError(f"a window pool serves one window, and every chunk of the step needs its window table (windows {windows})")
    window = windows[0] if pooled else 0
    window_mapping = _slot_mapping([c.window_table for c in chunks], chunks, block_size).to(device) if pooled else None
    prefills = tuple(PrefillChunk(rows[s], c.start, c.length, _slots(c.block_table, block_size, 0, c.end).to(device),
                                  _slots(c.window_table, block_size, max(0, c.start - window + 1), c.end).to(device) if pooled else None)
                     for s, c in enumerate(chunks) if c.length > 1)
    decoding = [s for s, c in enumerate(chunks) if c.length == 1]
    decode_chunks, decode_rows = [chunks[s] for s in decoding], [rows[s] for s in decoding]
    decode = _decode_pages(decode_chunks, decode_rows, block_size, page_tokens, device) if decoding else None
    # with a window pool, the windowed pages read the window tables (their released blocks lie before every window)
    window_chunks = [SeqChunk([0 if b is None else b for b in c.window_table], c.start, c.length) for c in decode_chunks] if pooled else decode_chunks
    windowed = tuple((w, _decode_pages(window_chunks, decode_rows, block_size, page_tokens, device, w))
                     for w in sorted(set(windows)) if decoding)
    compressed = ()
    if rates:  # DeepSeek-V4: every layer reads its window from the window pool
        if not pooled:
            raise ValueError("compressed attention keeps its window in a window pool: every chunk needs its window table")
        compressed = tuple(CompressedSeq(rows[s], c.start, c.length, max(0, c.start - window + 1),
                                         _slots(c.window_table, block_size, max(0, c.start - window + 1), c.end).to(device),
                                         {r: entry_rows(c.block_table, r, block_size, c.end // r).to(device) for r in rates})
                           for s, c in enumerate(chunks))
    return AttentionMetadata(
        compressed=compressed,
        state=_state_slots(chunks, device),
        positions=positions_t.to(device),
        slot_mapping=slot_mapping.to(device),
        last_token=(torch.cumsum(lengths, 0) - 1).to(device),
        decode=decode,
        prefills=prefills,
        windowed=windowed,
        window_slot_mapping=window_mapping,
    )


def _state_slots(chunks: Sequence[SeqChunk], device) -> StateSlots | None:
    held = [c.state_slot is not None for c in chunks]
    if not any(held):
        return None
    if not all(held):
        raise ValueError("a model with state slots needs the slot of every chunk of the step")
    decoding = [c for c in chunks if c.length == 1]
    slots = torch.tensor([c.state_slot for c in decoding], dtype=torch.long, device=device) if decoding else None
    fresh = torch.tensor([c.start == 0 for c in decoding], dtype=torch.bool, device=device) if decoding else None
    return StateSlots(slots, fresh, tuple(c.state_slot for c in chunks if c.length > 1))


def _slot_mapping(tables: Sequence[Sequence[int | None]], chunks: Sequence[SeqChunk], block_size: int) -> torch.Tensor:
    """[T] the slot of each new token of the chunks, in these tables."""
    return torch.tensor([t[p // block_size] * block_size + p % block_size  # plain ints: no tensor per chunk
                         for c, t in zip(chunks, tables) for p in range(c.start, c.end)], dtype=torch.long)


def _slots(table: Sequence[int | None], block_size: int, begin: int, end: int) -> torch.Tensor:
    """[end - begin] cache slots of positions begin..end-1 of one sequence, in its table (whose blocks before
    ``begin``'s may be released: None)."""
    p = torch.arange(begin, end)
    blocks = torch.tensor([0 if b is None else b for b in table[: -(-end // block_size)]], dtype=torch.long)
    return blocks[p // block_size] * block_size + p % block_size


def _decode_pages(chunks: Sequence[SeqChunk], rows: Sequence[int], block_size: int, page_tokens: int, device,
                  window: int = 0) -> DecodePages:
    """Each decode token's context (positions 0..start; with a window, its last ``window`` positions) in pages
    of whole blocks; only the last page of a context is partial. Vectorized over pages: O(pages) Python, not
    O(context tokens)."""
    first = [max(0, c.end - window) if window else 0 for c in chunks]  # each context's first visible position
    longest = max(c.end - f // block_size * block_size for c, f in zip(chunks, first))  # no page longer than needed
    per_page = block_size * max(1, min(-(-page_tokens // block_size), -(-longest // block_size)))
    page_row, page_start, ends = [], [], []
    width = max(len(c.block_table) for c in chunks)
    tables = torch.tensor([[*c.block_table, *[0] * (width - len(c.block_table))] for c in chunks], dtype=torch.long)
    for d, c in enumerate(chunks):
        for a in range(first[d] // block_size * block_size, c.end, per_page):
            page_row.append(d)
            page_start.append(a)
        ends.append(c.end)
    row_t, ends_t = torch.tensor(page_row, dtype=torch.long), torch.tensor(ends, dtype=torch.long)
    pos = torch.tensor(page_start, dtype=torch.long)[:, None] + torch.arange(per_page)[None, :]  # [P, N]
    valid = (pos < ends_t[row_t][:, None]) & (pos >= torch.tensor(first, dtype=torch.long)[row_t][:, None])
    # a page's runs start at whole blocks of the table (the positions before a window's first stay in its
    # first block); positions past a context's end read its table's padding, masked
    block = tables[row_t[:, None], (pos // block_size).clamp(max=width - 1)]
    slots = (block * block_size + pos % block_size).masked_fill(~valid, 0)
    return DecodePages(torch.tensor(rows, dtype=torch.long, device=device), row_t.to(device), slots.to(device), valid.to(device),
                       block[:, ::block_size].contiguous().to(device), tables.to(device), ends_t.to(device), block_size, window)
