"""Redundant expert copies through the real endpoint and FFN worker loop (ranks as threads, loopback links):
whatever copies compute a row, and after an FFN rank is lost mid-flight, every (token, expert) slot is
computed exactly once and the combined output equals the monolithic FFN."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from afd.connectors.dispatch import AttentionEndpoint
from afd.connectors.transport import LoopbackHub, LoopbackMailbox, PeerDiedError
from afd.connectors.wire import Role
from afd.distributed.placement import ExpertPlacement
from afd.distributed.topology import Topology, parse_devices, validate_topology
from afd.ffn.worker import FFNWorker
from afd.models import WeightSelection, load_model
from afd.testing.parity import compare_values

CASE = "ds-qlora-grouped-yarn"  # 8 routed experts, top-2, shared experts
F = 3
PLACEMENT = ExpertPlacement.contiguous(8, F, redundant=8)  # every expert on two of the three ranks
PLACEMENT_2 = ExpertPlacement.contiguous(8, 2, redundant=8)  # every expert on both of two ranks


@pytest.fixture(scope="module")
def model(checkpoints):
    return load_model(checkpoints[CASE][0], dtype="float32")[0]


@pytest.fixture(scope="module")
def ffn_models(checkpoints):
    return [load_model(checkpoints[CASE][0], dtype="float32",
                       selection=WeightSelection.experts_only(PLACEMENT.experts_of(r), shared_experts=True, routers=True))[0]
            for r in range(F)]


class Ranks:
    """One attention endpoint and F FFN worker loops on threads; ``dead`` ranks never read their links."""

    def __init__(self, ffn_models, dead=(), **topo) -> None:
        topology = Topology(parse_devices("cpu"), parse_devices(",".join(["cpu"] * F)), transport="loopback", placement=PLACEMENT, **topo)
        validate_topology(topology, 8)
        self.hub = LoopbackHub()
        self.endpoint = AttentionEndpoint(LoopbackMailbox(self.hub, Role.ATTENTION, 0, F), topology, PLACEMENT, timeout=10, failover=True)
        self.workers = [FFNWorker(ffn_models[r], LoopbackMailbox(self.hub, Role.FFN, r, 1), 1, poll_interval=0.05, placement=PLACEMENT)
                        for r in range(F)]
        self.threads = [threading.Thread(target=w.serve, daemon=True) for r, w in enumerate(self.workers) if r not in dead]

    def __enter__(self):
        self.before = self.slots()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.endpoint.shutdown()
        for t in self.threads:
            t.join(5)
        self.hub.close()

    def slots(self) -> int:
        """(token, expert) slots computed so far, over every FFN rank's experts."""
        return sum(sum(w.model.expert_token_counts().values()) for w in self.workers)

    def computed(self) -> int:
        return self.slots() - self.before


def lose(endpoint, rank):
    endpoint._lose(PeerDiedError(f"ffn rank {rank} is gone (test)", peer=rank))


@pytest.mark.parametrize("gate, shared_on", [("attention", "attention"), ("attention", "ffn"), ("ffn", "attention"), ("ffn", "ffn")])
@pytest.mark.parametrize("lost", [(), (0,), (1,), (2,)])
def test_every_slot_is_computed_once_by_one_live_copy(model, ffn_models, gate, shared_on, lost):
    """The copy choice, on both sides of the link (the gate on FFN routes there and keeps its own slots)."""
    layer = model.config.moe.layers[-1]
    k = model.config.moe.top_k
    with Ranks(ffn_models, dead=lost, gate=gate, shared_experts_on=shared_on) as ranks:
        for r in lost:  # lost before anything is in flight: nothing to re-dispatch
            lose(ranks.endpoint, r)
        for seed, n in ((0, 1), (1, 17), (2, 40)):
            torch.manual_seed(seed)
            x = torch.randn(n, model.config.hidden_size)
            routing = model.router(layer, x)
            before = ranks.computed()
            handle = ranks.endpoint.dispatch(layer, seed + 1, x, routing if gate == "attention" else None, is_moe=True)
            assert not set(handle.rows) & set(lost)
            y = ranks.endpoint.combine(handle, model.config.hidden_size, x.dtype)
            if shared_on == "attention":
                y = y + model.shared_experts(layer, x)
            assert ranks.computed() - before == n * k  # each (token, expert) slot once: no copy computed it twice
            report = compare_values("combine", model.ffn(layer, x), y)
            assert report.ok, str(report)
    assert ranks.endpoint.num_retried == 0


@pytest.mark.parametrize("gate", ["attention", "ffn"])
def test_work_in_flight_on_a_lost_rank_is_redispatched_and_stale_results_are_dropped(model, ffn_models, gate):
    """Rank 1 never answers; the others answer the first attempt; the loss re-dispatches the whole unit to
    ranks 0 and 2 as a retry, whose results alone are summed."""
    layer = model.config.moe.layers[0]
    with Ranks(ffn_models, dead=(1,), gate=gate) as ranks:
        torch.manual_seed(3)
        x = torch.randn(29, model.config.hidden_size)
        routing = model.router(layer, x)
        handles = [ranks.endpoint.dispatch(layer, 1, x, routing if gate == "attention" else None, is_moe=True, microbatch=mb)
                   for mb in range(2)]
        assert all(1 in h.rows for h in handles)
        deadline = threading.Event()
        while sum(w.items_served for w in ranks.workers) < 4 and not deadline.wait(0.01):  # ranks 0 and 2 answered both
            pass
        lose(ranks.endpoint, 1)
        assert [h.retries for h in handles] == [1, 1] and ranks.endpoint.num_retried == 2
        for h in handles:
            y = ranks.endpoint.combine(h, model.config.hidden_size, x.dtype) + model.shared_experts(layer, x)
            report = compare_values("combine after failover", model.ffn(layer, x), y)
            assert report.ok, str(report)
            assert set(h.rows) <= {0, 2}
        assert ranks.endpoint.stale_results == 4  # the first attempt's answers from ranks 0 and 2, both micro-batches
        assert sum(w.unions.retries for w in ranks.workers) == 4


def test_without_a_surviving_copy_the_loss_names_the_experts(model, ffn_models):
    with Ranks(ffn_models, dead=(0, 1)) as ranks:
        lose(ranks.endpoint, 1)
        with pytest.raises(PeerDiedError, match=r"experts \[.*\] have no surviving copy"):
            lose(ranks.endpoint, 0)


def test_without_failover_a_lost_rank_fails_as_before(model, ffn_models):
    with Ranks(ffn_models) as ranks:
        ranks.endpoint.failover = False
        with pytest.raises(PeerDiedError, match="test"):
            lose(ranks.endpoint, 1)


def test_a_restarted_attention_rank_counts_in_unions_only_from_the_epoch_it_rejoined(ffn_models):
    """Attention rank 2 dies while a union of epoch 0 names it; its restart is taken back in epoch 2. The old
    union is whole without it even after the restart's HELLO (a survivor's part may come late: a long
    prefill), and a union of epoch 2 waits for the restart's part."""
    from afd.connectors.wire import Header, Kind, Op
    from afd.connectors.work import WorkItem

    hub = LoopbackHub()
    worker = FFNWorker(ffn_models[0], LoopbackMailbox(hub, Role.FFN, 0, 3), 3, placement=PLACEMENT)
    worker.attention_restart = True
    layer = worker.model.config.moe.layers[0]
    hidden = worker.model.config.hidden_size

    def part(src: int, epoch: int, seq: int, members: int) -> WorkItem:
        h = Header(Kind.WORK, Role.ATTENTION, src, 0, layer=layer, seq=seq, ops=Op.ROUTED, epoch=epoch, members=members, ffn_members=1)
        return WorkItem(h, torch.zeros(0, hidden), None, None)

    try:
        add = lambda item: worker.unions.add(item, worker.versions)  # noqa: E731
        assert add(part(0, 0, 7, 0b111)) is None
        assert worker._attention_lost(2, {0, 1, 2}) == []  # rank 1's part is still to come
        worker._readmit(2, 2)  # its restart said HELLO for epoch 2
        assert add(part(1, 0, 7, 0b111)) is not None  # the old union: whole without rank 2
        assert add(part(0, 2, 9, 0b101)) is None  # epoch 2: the restart contributes
        assert add(part(2, 2, 9, 0b101)) is not None
        assert worker.unions.excused(1) == 0b100 and worker.unions.excused(2) == 0
    finally:
        hub.close()


def test_a_replacement_is_linked_without_waiting_and_enters_at_the_agreed_step(ffn_models, tmp_path):
    """An attention rank that never noticed FFN rank 1's loss (idle since) gets its replacement's FfnJoin: it
    drops the lost rank first (so the replacement enters every sender's set at the same agreed step), opens
    the new links and says HELLO, and returns at once, before the replacement has even opened its writers;
    the HELLO is read between steps, and the rank is used only once a step's agreement names it."""
    from afd.connectors.shm import ShmMailbox, create_links

    create_links(tmp_path, 1, 2, num_slots=4, slot_bytes=64 << 10)
    create_links(tmp_path, 1, 2, num_slots=4, slot_bytes=64 << 10, ffn_ranks=[1], generation=1)
    topology = Topology(parse_devices("cpu"), parse_devices("cpu,cpu"), transport="shm", placement=PLACEMENT_2, redundant_experts=8)
    boxes = {}

    def ffn(rank: int, generation: int) -> None:
        box = ShmMailbox(tmp_path, Role.FFN, rank, 1, 4, 64 << 10, generations={0: generation} if generation else None)
        box.connect(30)
        boxes[(rank, generation)] = box

    old = [threading.Thread(target=ffn, args=(r, 0)) for r in range(2)]
    for t in old:
        t.start()
    attn = ShmMailbox(tmp_path, Role.ATTENTION, 0, 2, 4, 64 << 10)
    attn.connect(30)
    for t in old:
        t.join()
    endpoint = AttentionEndpoint(attn, topology, PLACEMENT_2, timeout=10, failover=True, link_timeout=5)
    linked = []
    endpoint.on_link = lambda rank, generation, error: linked.append((rank, generation, error))
    boxes[(1, 0)].close()  # FFN rank 1 dies while this attention rank is idle: it notices nothing
    replacement = ShmMailbox(tmp_path, Role.FFN, 1, 1, 4, 64 << 10, generations={0: 1})  # its readers: "loaded"
    endpoint.join(1, 1)  # returns without waiting for the replacement
    assert endpoint.members.alive == [0] and len(endpoint.losses) == 1 and linked == []
    replacement.connect(30)
    worker = FFNWorker(ffn_models[1], replacement, 1, poll_interval=0.05, placement=PLACEMENT_2)
    serving = threading.Thread(target=worker.serve, daemon=True)
    serving.start()  # answers the HELLO
    deadline = time.monotonic() + 10
    while not linked and time.monotonic() < deadline:
        endpoint.poll_links()  # between steps
        time.sleep(0.01)
    assert linked == [(1, 1, None)] and endpoint.ready_mask == 0b11
    assert endpoint.members.alive == [0], "used before a step's agreement names it"
    endpoint.admit(endpoint.ready_mask)  # the agreed step
    assert endpoint.members.alive == [0, 1]
    endpoint.shutdown()
    serving.join(10)
    for box in (attn, boxes[(0, 0)], replacement):
        box.close()


def test_an_attention_rank_that_said_hello_and_reads_nothing_is_not_hung_to_the_replacement(ffn_models, tmp_path):
    """The replacement watches an attention rank for silence from that rank's HELLO, so the rank beats to it
    from then, not from reading the answer: an attention rank that says HELLO and then waits on something
    else (its launcher's next command) for three link timeouts is still alive to the replacement (it once
    was reported hung and killed, one fault-test round in twenty)."""
    from afd.connectors.shm import ShmMailbox, create_links

    create_links(tmp_path, 1, 2, num_slots=4, slot_bytes=64 << 10)
    create_links(tmp_path, 1, 2, num_slots=4, slot_bytes=64 << 10, ffn_ranks=[1], generation=1)
    topology = Topology(parse_devices("cpu"), parse_devices("cpu,cpu"), transport="shm", placement=PLACEMENT_2, redundant_experts=8)
    first = [ShmMailbox(tmp_path, Role.FFN, r, 1, 4, 64 << 10) for r in range(2)]
    opening = [threading.Thread(target=box.connect, args=(30,)) for box in first]
    for t in opening:
        t.start()
    attn = ShmMailbox(tmp_path, Role.ATTENTION, 0, 2, 4, 64 << 10)
    attn.connect(30)
    for t in opening:
        t.join()
    link_timeout = 0.5
    attn.start_heartbeats(0.1, link_timeout)
    endpoint = AttentionEndpoint(attn, topology, PLACEMENT_2, timeout=10, failover=True, link_timeout=5)
    first[1].close()
    replacement = ShmMailbox(tmp_path, Role.FFN, 1, 1, 4, 64 << 10, generations={0: 1})
    endpoint.join(1, 1)
    replacement.connect(30)
    replacement.start_heartbeats(0.1, link_timeout)
    worker = FFNWorker(ffn_models[1], replacement, 1, poll_interval=0.05, placement=PLACEMENT_2)
    silent = []
    worker.on_attention_silent = lambda rank, reason: silent.append(reason)
    serving = threading.Thread(target=worker.serve, daemon=True)
    serving.start()  # reads the HELLO (from then it watches attention rank 0) and answers it
    time.sleep(3 * link_timeout)  # this attention rank reads nothing meanwhile
    assert silent == [], silent
    assert replacement.stats.heartbeats_received >= 5
    endpoint.poll_links()
    assert endpoint.ready_mask == 0b11  # the answer was waiting to be read
    endpoint.shutdown()
    serving.join(10)
    assert not serving.is_alive() and silent == []
    for box in (attn, first[0], replacement):
        box.close()


def test_an_ffn_rank_s_silence_counts_from_the_work_sent_to_it(model, ffn_models):
    """An FFN rank beats only to the attention ranks it owes results (an idle attention rank reads nothing), so
    an attention rank busy elsewhere for longer than the link timeout hears nothing meanwhile: its next dispatch
    starts the FFN ranks' silence anew. Before, `afd bench pipeline --num-seqs 4 --prompt-len 2048` failed as
    "ffn rank 0 sent nothing for 10.0 s" whenever the answer (and its first heartbeat) outlasted one 0.5 s poll."""
    from afd.connectors.transport import PeerSilentError

    layer = model.config.moe.layers[0]
    with Ranks(ffn_models) as ranks:
        mailbox = ranks.endpoint.mailbox
        mailbox.link_timeout = 0.4
        for r in range(F):
            mailbox.watch(r)  # in service (as from its HELLO)
        time.sleep(1.0)  # busy elsewhere; nothing is owed, nothing arrives
        with pytest.raises(PeerSilentError, match="sent nothing"):  # the clock runs: the check can fail
            mailbox.check_silence()
        torch.manual_seed(5)
        x = torch.randn(9, model.config.hidden_size)
        handle = ranks.endpoint.dispatch(layer, 1, x, model.router(layer, x), is_moe=True)
        mailbox.check_silence()  # asked just now: not silent
        y = ranks.endpoint.combine(handle, model.config.hidden_size, x.dtype) + model.shared_experts(layer, x)
        report = compare_values("combine", model.ffn(layer, x), y)
        assert report.ok, str(report)
