"""The step agreement over a real TCPStore: every member decides the same plan, the FFN ranks a replacement
and a new placement are used from are agreed, a member marked dead leaves in a new epoch, and its restart
is voted back in at an agreed step."""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
import torch.distributed as dist

from afd.attention.steps import DEAD_KEY, VOTE_FORMAT, StepPlane, decode_vote, encode_vote
from afd.connectors.wire import ProtocolError
from afd.config import PipelineConfig
from afd.microbatch import CostModel

PIPELINE = PipelineConfig(mode="async", num_microbatches=2)


def store():
    return dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))


def vote_all(planes, votes, ready=None, placements=None, pipeline=PIPELINE, learned=None):
    """Each plane votes its spans on a thread (a vote waits for the others'); their plans, in plane order."""
    out = [None] * len(planes)

    def one(i):
        out[i] = planes[i].agree(votes[i], pipeline, 4, CostModel(), -1 if ready is None else ready[i],
                                 0 if placements is None else placements[i], None if learned is None else learned[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(planes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_members_agree_on_the_ffn_ranks_and_the_placement_every_vote_has():
    master = store()
    planes = [StepPlane(r, range(3), "127.0.0.1", master.port, timeout=60) for r in range(3)]
    for p in planes:
        p.join_wave(0)
    plans = vote_all(planes, [((0, 4),), (), ((0, 2),)], ready=[0b11, 0b11, 0b01], placements=[1, 1, 0])
    assert len({(p.contributors, p.num_microbatches, p.ffn_ready, p.placement) for p in plans}) == 1
    assert plans[0].contributors == (0, 2) and plans[0].ffn_ready == 0b01 and plans[0].placement == 0
    plans = vote_all(planes, [((4, 1),), (), ()], ready=[0b11] * 3, placements=[1] * 3)
    assert plans[0].ffn_ready == 0b11 and plans[0].placement == 1  # every vote has them now


def test_members_plan_with_the_first_learned_cost_model_voted():
    """Each member learns its own costs (afd/microbatch/learn.py); the votes carry them and every member plans the step
    with the same one, the first member's that has one, so that m and each contributor's cut agree."""
    master = store()
    planes = [StepPlane(r, range(3), "127.0.0.1", master.port, timeout=60) for r in range(3)]
    for p in planes:
        p.join_wave(0)
    auto = PipelineConfig(mode="async", num_microbatches=4, adaptive=True)
    mine = [CostModel(2e-6, 1e-10, 1e-6, 1e-4, 9e-4, 5e-5, ffn_curve=((8, 9e-4), (2048, 3.2e-3))),
            CostModel(2e-7, 1e-10, 1e-6, 1e-4, 9e-4, 5e-5, ffn_curve=((8, 3e-3), (2048, 3.2e-3)))]
    votes = [((0, 1024),), (), ((0, 1024),)]
    for learned, m in [([None, mine[0], mine[1]], 2), ([None, None, mine[1]], 1), ([mine[1], mine[0], None], 1)]:
        plans = vote_all(planes, votes, pipeline=auto, learned=learned)
        assert len(set(plans)) == 1, plans  # the same plan (cost model included) on every member
        voted = next(c for c in learned if c is not None)
        assert plans[0].learned and plans[0].cost == voted and plans[0].num_microbatches == m, plans[0]
    plans = vote_all(planes, votes, pipeline=auto, learned=[None] * 3)
    assert len(set(plans)) == 1 and not plans[0].learned and plans[0].cost == CostModel()


def test_a_vote_of_another_format_is_refused_naming_its_sender():
    """Members must read each other's votes; one from another build (the format before the local layers' costs: five
    fields, or a later one) is refused with the sender named, not misread or failed on with a TypeError."""
    learned = CostModel(2e-6, 1e-10, 1e-6, 1e-4, 9e-4, 5e-5, ffn_curve=((8, 9e-4),), local_token=3e-4, local_call=2e-3)
    vote = encode_vote(((0, 4),), 0b11, 1, ((2, 1),), learned)
    assert decode_vote(vote, 1) == (((0, 4),), 0b11, 1, ((2, 1),), learned)
    older = json.dumps([2, 1, [[0, 4]], [], None]).encode()  # format 1: ffn_ready first (here 2, like a format number)
    with pytest.raises(ProtocolError, match="attention rank 3 votes in step-vote format 1, this rank reads 2"):
        decode_vote(older, 3)
    for extra in ([], [None]):  # a later format, of this layout or a longer one
        later = json.dumps([VOTE_FORMAT + 1, *json.loads(vote)[1:], *extra]).encode()
        with pytest.raises(ProtocolError, match=f"attention rank 0 votes in step-vote format {VOTE_FORMAT + 1}"):
            decode_vote(later, 0)


def test_a_member_marked_dead_leaves_in_a_new_epoch_and_the_others_go_on():
    master = store()
    planes = [StepPlane(r, range(3), "127.0.0.1", master.port, timeout=60) for r in range(3)]
    for p in planes:
        p.join_wave(0)
    vote_all(planes, [((0, 3),), ((0, 3),), ((0, 3),)])
    survivors = planes[:2]  # rank 2 dies before its next vote
    got = {}

    def go(i):
        got[i] = survivors[i].agree(((3, 1),), PIPELINE, 4, CostModel())

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    threads[0].join(0.6)
    assert threads[0].is_alive()  # waiting for rank 2's vote
    master.set(DEAD_KEY, json.dumps({2: 0}))  # the launcher saw it (incarnation 0) die
    for t in threads:
        t.join(10)
    assert got[0].contributors == got[1].contributors == (0, 1)
    assert [p.members for p in survivors] == [(0, 1), (0, 1)] and [p.epoch for p in survivors] == [1, 1]
    assert got[0].epoch == 1
    plans = vote_all(survivors, [((4, 1),), ()])  # later steps: the two alone
    assert plans[0].contributors == (0,) and plans[0].epoch == 1


def _vote_on_threads(planes, votes, delays=None):
    """Like vote_all, but plane i starts voting after delays[i] s; the threads, still running or not."""
    out = [None] * len(planes)

    def one(i):
        time.sleep((delays or [0] * len(planes))[i])
        out[i] = planes[i].agree(votes[i], PIPELINE, 4, CostModel())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(planes))]
    for t in threads:
        t.start()
    return out, threads


def test_a_restart_is_voted_back_in_at_an_agreed_step_and_its_predecessors_dead_mark_does_not_drop_it():
    master = store()
    planes = [StepPlane(r, range(3), "127.0.0.1", master.port, timeout=60) for r in range(3)]
    for p in planes:
        p.join_wave(0)
    vote_all(planes, [((0, 3),)] * 3)
    master.set(DEAD_KEY, json.dumps({2: 0}))  # rank 2 died
    survivors = planes[:2]
    vote_all(survivors, [((3, 1),), ((3, 1),)])
    assert [p.members for p in survivors] == [(0, 1)] * 2 and survivors[0].epoch == 1

    restart = StepPlane(2, (), "127.0.0.1", master.port, timeout=60, incarnation=1)
    joined = threading.Thread(target=restart.join, args=(20,))
    joined.start()
    survivors[0].admit(2, 1)  # the launcher's news reached one member only: nobody takes it in yet
    assert survivors[0].wants_wave and not survivors[1].wants_wave
    plans = vote_all(survivors, [((4, 1),), ()])
    assert plans[0].joiners == plans[1].joiners == () and [p.members for p in survivors] == [(0, 1)] * 2
    survivors[1].admit(2, 1)
    plans = vote_all(survivors, [((5, 1),), ()])  # every vote names it: the last step without it
    assert plans[0].joiners == plans[1].joiners == ((2, 1),) and plans[0].epoch == 1
    joined.join(10)
    assert not joined.is_alive()
    assert restart.members == (0, 1, 2) and restart.epoch == 2 and restart.step == survivors[0].step and restart.in_wave
    assert [p.members for p in survivors] == [(0, 1, 2)] * 2 and [p.epoch for p in survivors] == [2, 2]
    assert not any(p.wants_wave for p in survivors)

    members = [*survivors, restart]
    out, threads = _vote_on_threads(members, [((6, 1),), (), ((0, 2),)], delays=[0, 0, 0.7])  # the restart votes late:
    for t in threads:                                                                       # the dead mark of incarnation 0
        t.join(10)                                                                          # must not drop it
    assert out[0] == out[1] == out[2] and out[0].contributors == (0, 2) and out[0].epoch == 2

    master.set(DEAD_KEY, json.dumps({2: 1}))  # the restart dies too: the others go on without it
    plans = vote_all(survivors, [((7, 1),), ()])
    assert [p.members for p in survivors] == [(0, 1)] * 2 and plans[0].epoch == 3


def test_a_joiner_that_dies_before_it_is_voted_in_is_dropped_and_a_waiting_wave_ends_at_the_join():
    master = store()
    planes = [StepPlane(r, range(3), "127.0.0.1", master.port, timeout=60) for r in range(3)]
    for p in planes:
        p.join_wave(0)
    vote_all(planes, [((0, 3),)] * 3)
    master.set(DEAD_KEY, json.dumps({2: 0}))
    survivors = planes[:2]
    vote_all(survivors, [(), ()])  # rank 2 leaves; a step with no work ends the wave
    assert not any(p.in_wave for p in survivors) and [p.waves_done for p in survivors] == [1, 1]

    for p in survivors:  # its first restart is admitted, then dies before any vote names it
        p.admit(2, 1)
    master.set(DEAD_KEY, json.dumps({2: 1}))
    for p in survivors:
        assert p.wants_wave and p.join_wave(1)  # a waiting member starts a wave for a joiner (the serving loop asks)
    plans = vote_all(survivors, [(), ()])
    assert plans[0].joiners == () and not any(p.wants_wave for p in survivors)  # dropped, not asked for forever

    restart = StepPlane(2, (), "127.0.0.1", master.port, timeout=60, incarnation=2)  # the second restart
    for p in survivors:
        p.admit(2, 2)
        assert p.join_wave(2)
    plans = vote_all(survivors, [(), ()])  # no work anywhere: this step ends the wave and takes it in
    assert plans[0].is_empty and plans[0].joiners == ((2, 2),)
    restart.join(10)
    assert restart.members == (0, 1, 2) and not restart.in_wave and restart.waves_done == 3 == survivors[0].waves_done
    for p in [*survivors, restart]:  # the next wave: all three
        assert p.join_wave(3)
    plans = vote_all([*survivors, restart], [(), (), ((0, 1),)])
    assert plans[0] == plans[2] and plans[0].contributors == (2,) and plans[0].epoch == 2  # 0, without 2: 1, with it: 2
