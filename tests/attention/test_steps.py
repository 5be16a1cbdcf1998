"""The step agreement over a real TCPStore: every member decides the same plan, the FFN ranks a replacement
and a new placement are used from are agreed, and a member marked dead leaves in a new epoch."""

from __future__ import annotations

import datetime
import json
import threading

import torch.distributed as dist

from afd.attention.steps import DEAD_KEY, StepPlane
from afd.config import PipelineConfig
from afd.pipeline import CostModel

PIPELINE = PipelineConfig(mode="async", num_microbatches=2)


def store():
    return dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))


def vote_all(planes, votes, ready=None, placements=None):
    """Each plane votes its spans on a thread (a vote waits for the others'); their plans, in plane order."""
    out = [None] * len(planes)

    def one(i):
        out[i] = planes[i].agree(votes[i], PIPELINE, 4, CostModel(), -1 if ready is None else ready[i],
                                 0 if placements is None else placements[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(planes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_members_agree_on_the_ffn_ranks_and_the_placement_every_vote_has():
    master = store()
    planes = [StepPlane(r, range(3), "127.0.0.1", master.port) for r in range(3)]
    for p in planes:
        p.join_wave(0)
    plans = vote_all(planes, [((0, 4),), (), ((0, 2),)], ready=[0b11, 0b11, 0b01], placements=[1, 1, 0])
    assert len({(p.contributors, p.num_microbatches, p.ffn_ready, p.placement) for p in plans}) == 1
    assert plans[0].contributors == (0, 2) and plans[0].ffn_ready == 0b01 and plans[0].placement == 0
    plans = vote_all(planes, [((4, 1),), (), ()], ready=[0b11] * 3, placements=[1] * 3)
    assert plans[0].ffn_ready == 0b11 and plans[0].placement == 1  # every vote has them now


def test_a_member_marked_dead_leaves_in_a_new_epoch_and_the_others_go_on():
    master = store()
    planes = [StepPlane(r, range(3), "127.0.0.1", master.port) for r in range(3)]
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
    master.set(DEAD_KEY, json.dumps([2]))  # the launcher saw it die
    for t in threads:
        t.join(10)
    assert got[0].contributors == got[1].contributors == (0, 1)
    assert [p.members for p in survivors] == [(0, 1), (0, 1)] and [p.epoch for p in survivors] == [1, 1]
    assert got[0].epoch == 1
    plans = vote_all(survivors, [((4, 1),), ()])  # later steps: the two alone
    assert plans[0].contributors == (0,) and plans[0].epoch == 1
