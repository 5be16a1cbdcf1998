"""Per-step attention metadata, built once per (micro-)batch before any layer runs.

Immutable and owned by the batch it describes: two micro-batches never share
metadata, RoPE tables or scratch buffers, so building the metadata of every
micro-batch up front and running them in any order gives the same result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a batch: ``length`` new tokens after ``start`` cached ones."""

    block_table: Sequence[int]
    start: int
    length: int

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
class AttentionMetadata:
    """Where a flat batch of T tokens from S sequences reads and writes KV.

    positions      [T] int64  absolute position of each token
    slot_mapping   [T] int64  cache slot each token's KV is written to
    token_seq      [T] int64  which sequence (0..S-1) each token belongs to
    token_qpos     [T] int64  index of the token within its sequence's chunk
    gather_slots   [S, L] int64  cache slot of context position j of sequence s (L = longest context)
    mask           [S, 1, Q, L] bool  query i of s may attend key j (Q = longest chunk)
    last_token     [S] int64  flat index of each sequence's last token in this batch
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    token_seq: torch.Tensor
    token_qpos: torch.Tensor
    gather_slots: torch.Tensor
    mask: torch.Tensor
    last_token: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.gather_slots.shape[0]

    @property
    def max_query_len(self) -> int:
        return self.mask.shape[2]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [S, Q, ...], zeros where a sequence's chunk is shorter than Q."""
        out = x.new_zeros(self.num_seqs, self.max_query_len, *x.shape[1:])
        out[self.token_seq, self.token_qpos] = x
        return out

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[S, Q, ...] -> [T, ...]."""
        return x[self.token_seq, self.token_qpos]


def build_attention_metadata(chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    if not chunks:
        raise ValueError("a batch needs at least one sequence chunk")
    for c in chunks:
        if c.length < 1 or c.start < 0:
            raise ValueError(f"bad chunk {c}: length must be >= 1 and start >= 0")
        if len(c.block_table) * block_size < c.end:
            raise ValueError(f"chunk {c} needs {c.end} slots but its block table holds {len(c.block_table) * block_size}")
    num_seqs = len(chunks)
    max_q = max(c.length for c in chunks)
    max_len = max(c.end for c in chunks)

    positions, token_seq, token_qpos = [], [], []
    for s, c in enumerate(chunks):
        positions.extend(range(c.start, c.end))
        token_seq.extend([s] * c.length)
        token_qpos.extend(range(c.length))
    positions_t = torch.tensor(positions, dtype=torch.long)
    token_seq_t = torch.tensor(token_seq, dtype=torch.long)

    max_blocks = -(-max_len // block_size)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long)
    for s, c in enumerate(chunks):
        n = min(len(c.block_table), max_blocks)
        tables[s, :n] = torch.tensor(list(c.block_table[:n]), dtype=torch.long)
    j = torch.arange(max_len)
    gather = tables[:, j // block_size] * block_size + j % block_size  # [S, L]
    slot_mapping = gather[token_seq_t, positions_t]

    starts = torch.tensor([c.start for c in chunks])
    lengths = torch.tensor([c.length for c in chunks])
    qpos = torch.arange(max_q)
    # causal: key j visible to query i iff j <= start + i; padded queries see key 0 only (no NaN rows)
    visible = j[None, None, :] <= (starts[:, None, None] + qpos[None, :, None])
    is_pad = qpos[None, :] >= lengths[:, None]  # [S, Q]
    mask = torch.where(is_pad[:, :, None], j[None, None, :] == 0, visible)

    ends = torch.cumsum(lengths, 0)
    return AttentionMetadata(
        positions=positions_t.to(device),
        slot_mapping=slot_mapping.to(device),
        token_seq=token_seq_t.to(device),
        token_qpos=torch.tensor(token_qpos, dtype=torch.long, device=device),
        gather_slots=gather.to(device),
        mask=mask[:, None].to(device),
        last_token=(ends - 1).to(device),
    )
