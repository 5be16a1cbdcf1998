"""Expert placement with redundant copies: construction, the copy choice, load balancing, the flags' checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from afd.distributed.placement import ExpertPlacement, mask_ranks
from afd.distributed.topology import (
    Topology,
    TopologyError,
    parse_devices,
    validate_topology,
)


def topo(ffn="cpu,cpu", **kw):
    return Topology(parse_devices("cpu"), parse_devices(ffn), **kw)


def test_an_expert_listed_on_several_ranks_has_a_copy_on_each():
    p = ExpertPlacement.parse("0-7:0,0-3:1,4-7:2", 8)
    assert p.copies[0] == (0, 1) and p.copies[7] == (0, 2)
    assert p.experts_of(0) == tuple(range(8)) and p.experts_of(1) == (0, 1, 2, 3)
    assert p.redundant == 8 and p.num_slots == 16 and p.single_copy() == ()
    assert p.orphans([1, 2]) == () and p.orphans([0, 1]) == () and p.orphans([1]) == (4, 5, 6, 7)


@given(st.integers(1, 32), st.integers(2, 8), st.integers(0, 64))
def test_redundant_copies_land_on_other_ranks_and_balance_the_slots(num_experts, num_ranks, redundant):
    assume(num_ranks <= num_experts and redundant <= num_experts * (num_ranks - 1))
    p = ExpertPlacement.contiguous(num_experts, num_ranks, redundant)
    assert p.num_slots == num_experts + redundant
    assert all(len(set(c)) == len(c) for c in p.copies)  # never two copies on one rank
    slots = [len(p.experts_of(r)) for r in range(num_ranks)]
    assert max(slots) - min(slots) <= 1, slots
    if redundant >= num_experts:
        assert p.single_copy() == ()  # every expert on at least two ranks


@settings(max_examples=200)
@given(st.data())
def test_the_copy_choice_is_a_live_copy_and_spreads_rows_evenly(data):
    """Every selected slot goes to exactly one rank, a live copy of its expert, whatever the live set; the
    rows of one expert split over its live copies within one row of each other."""
    num_experts = data.draw(st.integers(2, 16))
    num_ranks = data.draw(st.integers(2, min(6, num_experts)))
    redundant = data.draw(st.integers(0, num_experts * (num_ranks - 1)))
    p = ExpertPlacement.contiguous(num_experts, num_ranks, redundant)
    alive = data.draw(st.sets(st.integers(0, num_ranks - 1), min_size=1))
    if p.orphans(alive):
        with pytest.raises(TopologyError, match="no surviving copy"):
            p.copy_table(alive)
        return
    table = p.copy_table(alive)
    assert mask_ranks(table.alive) == tuple(sorted(alive))
    rows = data.draw(st.integers(1, 64))
    ids = torch.tensor(data.draw(st.lists(st.integers(0, num_experts - 1), min_size=rows * 2, max_size=rows * 2))).view(rows, 2)
    keys = torch.arange(rows) + data.draw(st.integers(0, 63))
    owner = table.owner(ids, keys)
    for (e, r) in zip(ids.flatten().tolist(), owner.flatten().tolist()):
        assert r in alive and r in p.copies[e]
    assert torch.equal(owner, table.owner(ids, keys))  # a pure function: the FFN side computes the same
    e = 0  # one expert over consecutive keys: counts per live copy differ by at most one
    live = [r for r in p.copies[e] if r in alive]
    same = table.owner(torch.zeros(rows, 1, dtype=torch.long), keys).flatten().tolist()
    counts = [same.count(r) for r in live]
    assert max(counts) - min(counts) <= 1


def test_a_placement_from_skewed_load_lowers_the_max_over_mean_rank_load():
    load = [1000, 800, 50, 40, 30, 20, 10, 10]  # two hot experts, both on rank 0 in contiguous blocks
    before = ExpertPlacement.contiguous(8, 2, 2)
    after = ExpertPlacement.from_load(load, 2, 2)

    def imbalance(p):
        ranks = p.rank_load(load, 2)
        return max(ranks) / (sum(ranks) / len(ranks))

    assert after.num_slots == 10 and all(after.experts_of(r) for r in range(2))
    assert imbalance(after) < imbalance(before) and imbalance(after) < 1.1, (imbalance(before), imbalance(after))
    assert len(after.copies[0]) == 2 and len(after.copies[1]) == 2  # the extra copies go to the hot experts


@pytest.mark.parametrize(
    "topology, message",
    [
        (topo("cpu", redundant_experts=8), "needs at least 2 FFN ranks"),
        (topo(redundant_experts=8, placement=ExpertPlacement.parse("0-7:0,0-7:1", 8)), "not both"),
        (topo(redundant_experts=9), "at most 8"),
        (topo(redundant_experts=-1), "0 or more"),
    ],
)
def test_bad_redundancy_is_refused_before_anything_starts(topology, message):
    with pytest.raises(TopologyError, match=message):
        validate_topology(topology, num_experts=8)


def test_the_redundant_flag_gives_each_rank_its_slots():
    p = validate_topology(topo("cpu,cpu,cpu", redundant_experts=8), num_experts=8)
    assert p.redundant == 8 and p.single_copy() == ()
    assert sum(len(p.experts_of(r)) for r in range(3)) == 16
