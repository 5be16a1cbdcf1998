"""Prefix-aware routing over replicas (pure): the replica that holds a prompt's prefix wins unless it
is more than one batch busier than the least loaded one."""

from __future__ import annotations

from afd.serving.routing import PrefixRouter

P = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 (the last token is never cached)
Q = list(range(500, 540))


def test_a_prompt_follows_its_prefix():
    r = PrefixRouter(2, 16, capacity_blocks=64, slack_tokens=100)
    assert r.choose(P, [0, 0]) == 0
    assert r.choose(Q, [50, 0]) == 1  # no prefix anywhere: the least loaded
    assert r.choose(P + [1, 2], [80, 0]) == 0  # its prefix is on 0, 80 tokens busier: within one batch
    assert r.choose(Q[:33] + [7], [0, 60]) == 1  # a shared first two blocks of Q


def test_a_busy_replica_loses_its_prefix_advantage():
    r = PrefixRouter(2, 16, capacity_blocks=64, slack_tokens=100)
    r.choose(P, [0, 0])
    assert r.choose(P, [101, 0]) == 1
    assert r.choose(P, [0, 0]) == 0  # both hold it now: ties go to the less loaded, then the first


def test_the_mirror_forgets_beyond_the_replica_capacity():
    r = PrefixRouter(2, 16, capacity_blocks=2, slack_tokens=100)
    r.choose(P, [0, 0])  # 2 blocks on replica 0
    r.choose(Q, [0, 1])  # Q's 2 blocks push P's out
    assert r.choose(P, [1, 0]) == 1
