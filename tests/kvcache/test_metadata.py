from __future__ import annotations

import pytest

from afd.kvcache import SeqChunk, build_attention_metadata


def slot(c: SeqChunk, p: int, bs: int) -> int:
    return c.block_table[p // bs] * bs + p % bs


def test_metadata_matches_a_direct_reference():
    bs = 4
    chunks = [SeqChunk([5, 2, 9], start=3, length=6), SeqChunk([1], start=0, length=2), SeqChunk([7, 0, 3], start=9, length=1),
              SeqChunk([4], start=0, length=1)]
    meta = build_attention_metadata(chunks, bs, page_tokens=8)
    positions, slots = [], []
    for c in chunks:
        for p in range(c.start, c.end):
            positions.append(p)
            slots.append(slot(c, p, bs))
    assert meta.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == slots
    assert meta.last_token.tolist() == [5, 7, 8, 9]
    # chunks of more than one token: their rows, offset and every context slot, nothing padded
    assert [(p.row, p.start, p.length) for p in meta.prefills] == [(0, 3, 6), (6, 0, 2)]
    for p, c in zip(meta.prefills, chunks[:2]):
        assert p.slots.tolist() == [slot(c, j, bs) for j in range(c.end)]
    # one-token chunks: pages of whole blocks (8 slots here), only the last one of a context partial
    d = meta.decode
    assert d.rows.tolist() == [8, 9]
    for k, c in enumerate(chunks[2:]):
        pages = [i for i in range(len(d.page_row)) if d.page_row[i] == k]
        got = [int(d.page_slots[i, j]) for i in pages for j in range(d.page_slots.shape[1]) if d.page_valid[i, j]]
        assert got == [slot(c, j, bs) for j in range(c.end)]
        assert all(bool(d.page_valid[i].all()) for i in pages[:-1])
    assert d.page_slots.shape == (3, 8)  # contexts of 10 and 1 tokens: 2 + 1 pages, padding below one page each


@pytest.mark.parametrize(
    "chunks, message",
    [([], "at least one"), ([SeqChunk([0], 0, 0)], "length must be"), ([SeqChunk([0], 2, 3)], "needs 5 slots")],
)
def test_bad_chunks_are_rejected(chunks, message):
    with pytest.raises(ValueError, match=message):
        build_attention_metadata(chunks, 4)
