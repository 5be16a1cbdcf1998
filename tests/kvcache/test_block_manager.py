from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afd.kvcache import BlockManager, OutOfBlocksError


def test_ensure_grows_table_and_maps_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    table = bm.ensure(7, 5)
    assert len(table) == 2 and bm.num_free_blocks == 6
    assert bm.ensure(7, 8) == table  # still fits in two blocks
    assert len(bm.ensure(7, 9)) == 3
    t = bm.table(7)
    assert bm.slot(7, 0) == t[0] * 4 and bm.slot(7, 5) == t[1] * 4 + 1 and bm.slot(7, 8) == t[2] * 4
    with pytest.raises(IndexError):
        bm.slot(7, 12)


def test_out_of_blocks_is_atomic_and_says_what_to_do():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.ensure(0, 4)
    with pytest.raises(OutOfBlocksError, match="needs 2 more KV blocks.*1 of 3 free"):
        bm.ensure(1, 3)
    assert bm.num_free_blocks == 1 and 1 not in bm._tables


def test_double_free_is_an_error():
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.ensure(0, 1)
    bm.free(0)
    with pytest.raises(KeyError, match="double free"):
        bm.free(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(1, 40)), max_size=60))
def test_blocks_are_never_shared_and_always_conserved(ops):
    bm = BlockManager(num_blocks=16, block_size=4)
    sizes: dict[int, int] = {}
    for op, seq, n in ops:
        if op == "grow":
            target = sizes.get(seq, 0) + n
            if bm.can_ensure(seq, target):
                bm.ensure(seq, target)
                sizes[seq] = target
            else:
                with pytest.raises(OutOfBlocksError):
                    bm.ensure(seq, target)
        elif seq in sizes:
            bm.free(seq)
            del sizes[seq]
        owned = [b for s in sizes for b in bm.table(s)]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + bm.num_free_blocks == 16, "blocks leaked"
        for s, size in sizes.items():
            assert len(bm.table(s)) == bm.blocks_for(size)
