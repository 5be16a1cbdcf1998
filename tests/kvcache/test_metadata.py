from __future__ import annotations

import pytest
import torch

from afd.kvcache import SeqChunk, build_attention_metadata


def test_metadata_matches_a_direct_reference():
    bs = 4
    chunks = [SeqChunk([5, 2, 9], start=3, length=6), SeqChunk([1], start=0, length=2), SeqChunk([7, 0], start=7, length=1)]
    meta = build_attention_metadata(chunks, bs)
    positions, slots, seqs = [], [], []
    for s, c in enumerate(chunks):
        for p in range(c.start, c.end):
            positions.append(p)
            slots.append(c.block_table[p // bs] * bs + p % bs)
            seqs.append(s)
    assert meta.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == slots
    assert meta.token_seq.tolist() == seqs
    assert meta.last_token.tolist() == [5, 7, 8]
    for s, c in enumerate(chunks):
        for i in range(meta.max_query_len):
            for j in range(meta.gather_slots.shape[1]):
                expect = (j <= c.start + i) if i < c.length else (j == 0)
                assert bool(meta.mask[s, 0, i, j]) == expect, (s, i, j)
            if i < c.length:
                for j in range(c.start + i + 1):
                    assert meta.gather_slots[s, j] == c.block_table[j // bs] * bs + j % bs


def test_pad_unpad_round_trip():
    meta = build_attention_metadata([SeqChunk([0, 1], 0, 5), SeqChunk([2], 1, 2)], 4)
    x = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)
    assert torch.equal(meta.unpad(meta.pad(x)), x)


@pytest.mark.parametrize(
    "chunks, message",
    [([], "at least one"), ([SeqChunk([0], 0, 0)], "length must be"), ([SeqChunk([0], 2, 3)], "needs 5 slots")],
)
def test_bad_chunks_are_rejected(chunks, message):
    with pytest.raises(ValueError, match=message):
        build_attention_metadata(chunks, 4)
