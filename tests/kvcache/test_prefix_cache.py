"""The prefix cache in the block manager: hits, refcounts, eviction, and a property test that
preemption and aborts never free a shared block early and that every block returns to the pool."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from afd.kvcache import BlockManager


def fill(bm: BlockManager, seq: int, tokens: list[int]) -> list[int]:
    """Admit ``seq`` on its cached prefix, allocate the rest, 'compute' it, name its full blocks."""
    prefix = bm.lookup(tokens)
    bm.attach(seq, prefix)
    table = bm.ensure(seq, len(tokens))
    bm.commit(seq, tokens, len(tokens))
    return table


def test_a_shared_prefix_reuses_full_blocks_and_leaves_the_last_token():
    bm = BlockManager(16, 4, enable_caching=True)
    a = fill(bm, 0, list(range(10)))  # blocks 0-3, 4-7 full; 8-9 partial
    assert bm.lookup(list(range(10))) == a[:2]  # the partial block is never shared
    assert bm.lookup(list(range(8))) == a[:1]  # all 8 cached, but the last token must be computed
    assert bm.lookup([0, 1, 2, 3, 9, 9, 9, 9, 9]) == a[:1]  # diverges in the second block
    assert bm.lookup([5, 1, 2, 3, 4, 5, 6, 7, 8]) == []  # same second block, different first: the chain differs
    b = fill(bm, 1, list(range(9)))
    assert b[:2] == a[:2] and b[2] not in a
    bm.check()


def test_a_freed_prefix_stays_cached_until_evicted_lru():
    bm = BlockManager(4, 2, enable_caching=True)
    t = fill(bm, 0, [1, 2, 3, 4, 5])  # 3 blocks, 2 full
    bm.free(0)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    assert bm.lookup([1, 2, 3, 4, 9]) == t[:2]
    bm.ensure(1, 6)  # 3 blocks: the 2 never-cached ones first, then one eviction: the chain's tail, not its head
    assert bm.lookup([1, 2, 3, 4, 9]) == t[:1]
    bm.ensure(1, 8)
    assert bm.lookup([1, 2, 3, 4, 9]) == []
    bm.check()


def test_without_caching_nothing_is_found():
    bm = BlockManager(8, 2)
    fill(bm, 0, [1, 2, 3, 4, 5])
    bm.free(0)
    assert bm.lookup([1, 2, 3, 4, 5]) == [] and bm.num_cached_blocks == 0
    bm.check()


def test_admission_counts_cached_blocks_it_takes_out_of_the_pool():
    bm = BlockManager(3, 2, enable_caching=True)
    fill(bm, 0, [1, 2, 3, 4, 5])  # all 3 blocks
    bm.free(0)  # 2 cached (evictable) + 1 free
    prefix = bm.lookup([1, 2, 3, 4, 7, 8])
    assert len(prefix) == 2
    assert bm.can_admit(6, prefix)  # 2 cached + 1 new
    assert not bm.can_admit(8, prefix)  # 2 cached + 2 new > 1 left once the prefix is taken back


OPS = st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "preempt"]), st.integers(0, 5), st.integers(1, 9)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_refcounts_never_free_a_shared_block_early_and_every_block_returns(ops):
    """Random admissions (prompts from a 3-token alphabet, so that prefixes repeat), growth by decode,
    frees and preemptions (free + later re-admission). The invariants hold after every operation; a
    block held by a live sequence is never handed to another; at the end every block is back."""
    bm = BlockManager(24, 2, enable_caching=True)
    live: dict[int, list[int]] = {}  # seq -> its tokens (all computed)
    for op, seq, n in ops:
        if op == "add" and seq not in live:
            tokens = [(seq * 7 + i * (n % 3)) % 3 for i in range(n)]
            prefix = bm.lookup(tokens)
            if not bm.can_admit(len(tokens), prefix):
                continue
            bm.attach(seq, prefix)
            bm.ensure(seq, len(tokens))
            bm.commit(seq, tokens, len(tokens))
            live[seq] = tokens
        elif op == "grow" and seq in live:
            if not bm.can_ensure(seq, len(live[seq]) + 1):
                continue
            live[seq].append(n % 3)
            bm.ensure(seq, len(live[seq]))
            bm.commit(seq, live[seq], len(live[seq]))
        elif op in ("free", "preempt") and seq in live:
            bm.free(seq)
            tokens = live.pop(seq)
            if op == "preempt":  # recomputed later from its tokens, maybe from the cache
                prefix = bm.lookup(tokens)
                if bm.can_admit(len(tokens), prefix):
                    bm.attach(seq, prefix)
                    bm.ensure(seq, len(tokens))
                    bm.commit(seq, tokens, len(tokens))
                    live[seq] = tokens
        bm.check()
        owners: dict[int, set[int]] = {}
        for s, tokens in live.items():  # a sequence's full blocks hold exactly its tokens' names
            table = bm.table(s)
            assert len(table) == bm.blocks_for(len(tokens))
            for b in table:
                owners.setdefault(b, set()).add(s)
        for b, seqs in owners.items():  # a block shared by several sequences holds a prefix common to all
            if len(seqs) > 1:
                pos = [bm.table(s).index(b) for s in seqs]
                assert len(set(pos)) == 1
                i = pos[0]
                contents = {tuple(live[s][i * 2:(i + 1) * 2]) for s in seqs}
                prefixes = {tuple(live[s][: (i + 1) * 2]) for s in seqs}
                assert len(contents) == 1 and len(prefixes) == 1
    for s in list(live):
        bm.free(s)
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
