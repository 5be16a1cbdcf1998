"""Agreed steps: the attention ranks of a membership epoch step together, so that an FFN rank can
compute each (step, layer, micro-batch) once over the union of every contributor's rows.

**A step.** Before step s every member publishes a vote -- the (start, length) spans of the chunks its
scheduler chose for the step, nothing when it has no work -- and reads every member's vote. From the
same votes every member computes the same :class:`StepPlan` (:func:`decide`): the contributors (the
members that voted work) and the micro-batch count m. Which ranks take part therefore depends only on
their schedulers, never on message timing. Each contributor cuts its own batch into m micro-batches
(fewer tokens than m: the missing ones are empty) and, for every (layer, micro-batch), sends every FFN
rank a part, empty where it has no rows for it; the work header carries the epoch and the contributor
bitmask, so the FFN rank knows when a union is whole.

**A rank with no work** runs no model pass and sends nothing to the FFN ranks: it only votes, one
small exchange per step, while others work.

**Waves.** While any member has work, all members vote every step (a wave). A step with no
contributor ends the wave; every member sees that same decision, so all stop at the same step and
wait for commands. Work arriving while the ranks wait starts the next wave, numbered by the waves
done: the rank that got it asks for wave w (``NeedWave``), the cluster's owner thread tells every rank
to join (``StartWave``) once per w, and a rank ignores a start for a wave it has finished. A batch command
(``afd generate``) is sent to every rank at once, and each joins the wave itself.

**FFN ranks join at an agreed step.** A vote also carries the FFN ranks the voter has links to
(``ffn_ready``, a bitmask). A rank that replaces a lost FFN rank is used from the first step whose
every vote names it (:attr:`StepPlan.ffn_ready`, the AND of the votes), so every contributor sends
it parts from the same step on and its unions complete. A lost FFN rank needs no agreement: each
attention rank stops sending to it on its own (afd/connectors/dispatch.py), and the unions on the
survivors do not depend on who else is alive. A new expert placement (a rebalance) is used the same
way: from the first step whose every vote has it installed (:attr:`StepPlan.placement`, the lowest).

**Costs.** With ``--num-microbatches auto`` a vote also carries the voter's learned cost model
(afd/microbatch/learn.py), once it has one; every member plans the step with the model of the first
member (in member order) that voted one, else its configured model (the same on every rank), and the
plan says which (:attr:`StepPlan.cost`): m, and each contributor's cut of its own batch, are computed
from the same numbers on every rank. A vote starts with its format (:data:`VOTE_FORMAT`): a member that
reads another format (a rank of another build) fails naming the sender, instead of misreading it (builds
from before the format, which read no such field, fail on its length, naming no one).

**The epoch** is the membership the steps are agreed under: epoch 0 is every attention rank of the
launch. A later change of membership is a new epoch with its own members, not a change to the step
protocol. **A lost member**: the launcher writes the dead attention ranks to the store
(``afd/steps/dead``, with the incarnation lost). A member waiting for a vote that does not come looks
there; a dead member whose vote for this step is absent *after* the mark was written never votes again
(it wrote before it died, and the mark after), so every survivor decides the same: the step goes on in
epoch e + 1 without it.
A vote it wrote before dying is read by everyone, and it counts as an idle voter's or a contributor's
(the FFN ranks complete unions without a dead contributor's parts).

**A restarted member rejoins** at an agreed step too. The launcher writes dead members with their
incarnation (``afd/steps/dead``: index -> the newest incarnation lost), so a restart of index r, one
incarnation up, is not taken for the dead one. Once the restart has its weights and links it asks to join;
the launcher tells every member (``Admit``), and each member votes the joiner from then on (a member that
waits for commands starts a wave for it, as it would for work). The first step whose every vote names the
joiner (:attr:`StepPlan.joiners`) is the last of the old membership: from the next step on, every member
steps in epoch e + 1 with the joiner added, and each one writes the joiner its welcome (the epoch, the next
step, the members and their incarnations, the wave state) at ``afd/steps/welcome/a<r>.i<incarnation>``. The
joiner reads it, says HELLO to every FFN rank with that epoch (an FFN rank counts it among a union's
contributors only in unions of that epoch or later), and votes the next step; the members wait for that
vote as for any other. A joiner that dies first is dropped by the dead mark, like a member.

The votes travel through a ``torch.distributed.TCPStore`` the launcher hosts: per step, one ``set``
and one ``multi_get`` per rank (and a ``delete`` of the step before last).
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, replace
from typing import Sequence

from afd.config import PipelineConfig
from afd.connectors.wire import ProtocolError
from afd.microbatch import CostModel, MicrobatchPlan, choose_microbatches, plan_microbatches
from afd.microbatch.learn import pack_costs, unpack_costs

Spans = tuple[tuple[int, int], ...]  # (start position, new tokens) per chunk, in batch order


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the members agreed for one step."""

    epoch: int
    step: int
    contributors: tuple[int, ...]  # attention ranks with work, ascending
    num_microbatches: int
    requested: int = 0  # the m asked for (configured, or chosen by auto) before the cap to what contributors can form
    votes: tuple[Spans, ...] = ()  # per member, in member order (the inputs of the decision)
    estimates: tuple[tuple[int, float], ...] = ()  # auto: the simulated step time of each m tried
    ffn_ready: int = -1  # FFN ranks every member has links to (the AND of the votes); -1: no restriction
    placement: int = -1  # the expert placement version every member has installed (the lowest voted); -1: unchanged
    joiners: tuple[tuple[int, int], ...] = ()  # (attention rank, incarnation) every vote admits: members from the next step
    cost: CostModel | None = None  # the model the step was planned with (every contributor cuts its batch with it)
    learned: bool = False  # ``cost`` is a member's learned model (afd/microbatch/learn.py), not the configured one
    union_tokens: tuple[int, ...] = ()  # per micro-batch, the tokens of every contributor's piece together

    @property
    def mask(self) -> int:
        """The contributors as a bitmask (bit a: attention rank a), as work headers carry it."""
        return sum(1 << r for r in self.contributors)

    @property
    def is_empty(self) -> bool:
        return not self.contributors


def decide(epoch: int, step: int, members: Sequence[int], votes: Sequence[Spans], pipeline: PipelineConfig,
           num_layers: int, cost: CostModel, ffn_ready: Sequence[int] = (), placements: Sequence[int] = (),
           joins: Sequence[Sequence[tuple[int, int]]] = (), learned: Sequence[CostModel | None] = (),
           local_layers: int = 0) -> StepPlan:
    """The step's plan from every member's vote: a pure function, so every member computes the same.

    m: 1 in sync mode; with ``auto``, the fastest m for the contributors' batches, each cut by itself
    (:func:`choose_microbatches`), under the first learned model voted (else ``cost``); else the configured m. It is
    then capped to the most pieces any contributor can form (tokens, or requests for the ``request``
    split), so that no micro-batch is empty on every rank. Joiners: those every vote admits (none that is a
    member already)."""
    ready = -1
    for mask in ffn_ready:
        ready &= mask
    version = min(placements, default=-1)
    admitted = set.intersection(*(set(j) for j in joins)) if joins else set()
    joiners = tuple(sorted(j for j in admitted if j[0] not in members))
    contributors = tuple(r for r, v in zip(members, votes) if v)
    if not contributors:
        return StepPlan(epoch, step, (), 0, 0, tuple(votes), ffn_ready=ready, placement=version, joiners=joiners)
    if pipeline.mode == "sync":
        return StepPlan(epoch, step, contributors, 1, 1, tuple(votes), ffn_ready=ready, placement=version, joiners=joiners,
                        union_tokens=(sum(n for v in votes for _, n in v),))
    voted = next((c for c in learned if c is not None), None) if pipeline.adaptive else None
    cost = voted or cost
    estimates: tuple = ()
    if pipeline.adaptive:
        m, estimates = choose_microbatches([v for v in votes if v], pipeline.num_microbatches, num_layers, pipeline.split, cost,
                                           pipeline.credits, local_layers=local_layers)
    else:
        m = pipeline.effective_microbatches
    plans = [own_plan(v, m, pipeline, cost) for v in votes if v]
    agreed = max(p.num_microbatches for p in plans)
    union_tokens = tuple(sum(sum(sp.length for sp in p.pieces[k]) for p in plans if k < p.num_microbatches) for k in range(agreed))
    return StepPlan(epoch, step, contributors, agreed, m, tuple(votes), estimates, ready, version, joiners, cost, voted is not None,
                    union_tokens)


def own_plan(spans: Spans, m: int, pipeline: PipelineConfig, cost: CostModel) -> MicrobatchPlan:
    """One contributor's cut of its own batch into at most m micro-batches (same on every rank). An
    ``auto`` m was chosen knowing the sizes; a fixed one yields to ``min_microbatch_tokens``."""
    min_tokens = 1 if pipeline.adaptive else pipeline.min_microbatch_tokens
    return plan_microbatches(spans, m, pipeline.split, cost, min_tokens)


#: a vote's layout, its first field (1: no such field; 2: the learned costs carry the local layers' MLP). Members of a
#: run (one host or several) must read each other's votes: another format is refused with both named.
VOTE_FORMAT = 2


def encode_vote(spans: Spans, ffn_ready: int = -1, placement: int = 0, joiners: Sequence[tuple[int, int]] = (),
                learned: CostModel | None = None) -> bytes:
    return json.dumps([VOTE_FORMAT, ffn_ready, placement, spans, joiners, pack_costs(learned)], separators=(",", ":")).encode()


def decode_vote(data: bytes, sender: int) -> tuple[Spans, int, int, tuple[tuple[int, int], ...], CostModel | None]:
    fields = json.loads(data)
    if len(fields) != 6 or fields[0] != VOTE_FORMAT:  # format 1: five fields, the first an int like ours
        theirs = 1 if len(fields) == 5 else fields[0]
        raise ProtocolError(f"attention rank {sender} votes in step-vote format {theirs}, this rank reads {VOTE_FORMAT}: "
                            "every attention rank of a run must run the same afd")
    _, ffn_ready, placement, spans, joiners, learned = fields
    return (tuple((int(a), int(b)) for a, b in spans), int(ffn_ready), int(placement),
            tuple((int(r), int(i)) for r, i in joiners), unpack_costs(learned))


class StepPlane:
    """One attention rank's side of the agreement: votes through the launcher's TCPStore."""

    def __init__(self, rank: int, members: Sequence[int], host: str, port: int, timeout: float, epoch: int = 0,
                 incarnation: int = 0) -> None:
        """A member of epoch ``epoch``; or, with ``incarnation`` > 0 and no members, a restart that joins
        (:meth:`join`) before its first step."""
        import torch.distributed as dist

        if rank not in members and not (incarnation and not members):
            raise ValueError(f"attention rank {rank} is not a member of epoch {epoch}: {list(members)}")
        self.store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        self.rank, self.members, self.epoch = rank, tuple(members), epoch
        self.incarnation = incarnation
        self.incarnations: dict[int, int] = {r: 0 for r in members}  # each member's incarnation (a dead mark names one)
        self.pending: set[tuple[int, int]] = set()  # restarts admitted (the launcher said so), not yet members
        self.timeout = timeout
        self._mine: list[str] = []  # this rank's vote keys, oldest first (each deleted two steps later)
        self.step = 1  # the next step to agree (numbered from 1)
        self.in_wave = False
        self.waves_done = 0
        self.num_votes = 0
        self.num_idle_votes = 0  # steps this rank voted without work (it ran no model pass)
        self.num_epochs_changed = 0  # members lost or joined
        self.num_joined = 0  # restarts that became members

    def _key(self, step: int, rank: int) -> str:
        return f"afd/steps/e{self.epoch}/s{step}/a{rank}"

    def _read_votes(self, s: int) -> list[bytes]:
        """Every member's vote for step s; a member marked dead whose vote is absent leaves (a new epoch)."""
        import torch.distributed as dist

        waited = 0.0
        while True:
            keys = [self._key(s, r) for r in self.members]
            try:
                self.store.wait(keys, datetime.timedelta(seconds=VOTE_POLL_S))
                return self.store.multi_get(keys)
            except (dist.DistStoreError, RuntimeError):  # not every vote yet
                waited += VOTE_POLL_S
            dead = self.dead_members()
            gone = [r for r in self.members if dead.get(r, -1) >= self.incarnations[r] and r != self.rank
                    and not self.store.check([self._key(s, r)])]
            if gone:
                self.members = tuple(r for r in self.members if r not in gone)
                for r in gone:
                    del self.incarnations[r]
                self.epoch += 1
                self.store.set(self._key(s, self.rank), self.store.get(self._mine[-1]))  # this step's vote, in the new epoch
                self._mine.append(self._key(s, self.rank))
                self.num_epochs_changed += 1
                continue
            if waited > self.timeout:
                raise TimeoutError(f"attention rank {self.rank}: no vote for step {s} from attention ranks "
                                   f"{[r for r in self.members if not self.store.check([self._key(s, r)])]} within {self.timeout:.0f} s")

    def dead_members(self) -> dict[int, int]:
        """The attention ranks the launcher marked dead: index -> the newest incarnation lost."""
        if not self.store.check([DEAD_KEY]):
            return {}
        return {int(r): int(i) for r, i in json.loads(self.store.get(DEAD_KEY)).items()}

    def admit(self, rank: int, incarnation: int) -> None:
        """The launcher says a restart of ``rank`` asks to join: vote it from the next step on."""
        if rank == self.rank:
            raise ValueError(f"attention rank {self.rank}: asked to admit itself")
        if self.incarnations.get(rank, -1) < incarnation:
            self.pending.add((rank, incarnation))

    @property
    def wants_wave(self) -> bool:
        """A joiner waits to be voted in: a rank waiting for commands starts a wave for it, as for work."""
        return bool(self.pending)

    def join(self, timeout: float) -> None:
        """A restart: wait for the members' welcome, then step with them (the next :meth:`agree` is its first vote)."""
        import torch.distributed as dist

        key = welcome_key(self.rank, self.incarnation)
        try:
            self.store.wait([key], datetime.timedelta(seconds=timeout))
        except (dist.DistStoreError, RuntimeError):
            raise TimeoutError(f"attention rank {self.rank} (incarnation {self.incarnation}): the other attention ranks did "
                               f"not take it back within {timeout:.0f} s") from None
        w = json.loads(self.store.get(key))
        self.store.delete_key(key)
        self.epoch, self.step, self.in_wave, self.waves_done = w["epoch"], w["step"], w["in_wave"], w["waves_done"]
        self.incarnations = {int(r): int(i) for r, i in w["incarnations"].items()}
        self.members = tuple(sorted(self.incarnations))

    def _take_in(self, plan: StepPlan) -> None:
        """Every vote of this step admitted ``plan.joiners``: from the next step, a new epoch with them; welcome each."""
        for rank, incarnation in plan.joiners:
            self.incarnations[rank] = incarnation
            self.pending.discard((rank, incarnation))
        self.members = tuple(sorted(self.incarnations))
        self.epoch += 1
        self.num_epochs_changed += 1
        self.num_joined += len(plan.joiners)
        welcome = json.dumps({"epoch": self.epoch, "step": self.step, "in_wave": self.in_wave, "waves_done": self.waves_done,
                              "incarnations": self.incarnations})
        for rank, incarnation in plan.joiners:  # every member writes the same: whoever survives, it is there
            self.store.set(welcome_key(rank, incarnation), welcome)

    def join_wave(self, wave: int) -> bool:
        """Join wave ``wave`` unless it is done already (a start that arrives late); True if joined."""
        if self.in_wave or wave != self.waves_done:
            return False
        self.in_wave = True
        return True

    def agree(self, spans: Spans, pipeline: PipelineConfig, num_layers: int, cost: CostModel, ffn_ready: int = -1,
              placement: int = 0, learned: CostModel | None = None, local_layers: int = 0) -> StepPlan:
        """Vote ``spans`` (empty: no work), the FFN ranks this rank has links to, the newest expert placement
        it has installed and its learned cost model (None: none yet) for the next step, and return what every
        member agreed."""
        if not self.in_wave:
            raise RuntimeError(f"attention rank {self.rank}: a step outside a wave (a bug: every member must be in it)")
        s = self.step
        key = self._key(s, self.rank)
        if self.pending:  # a joiner that died since it asked is not voted in
            dead = self.dead_members()
            self.pending = {(r, i) for r, i in self.pending if dead.get(r, -1) < i and r not in self.members}
        self.store.set(key, encode_vote(spans, ffn_ready, placement, sorted(self.pending), learned))
        self._mine.append(key)
        raw = self._read_votes(s)
        if len(self._mine) >= 3:  # every member has read step s - 2's votes before it could vote for s - 1
            self.store.delete_key(self._mine.pop(0))
        votes = [decode_vote(v, r) for v, r in zip(raw, self.members)]
        plan = decide(self.epoch, s, self.members, [v[0] for v in votes], pipeline, num_layers, cost, [v[1] for v in votes],
                      [v[2] for v in votes], [v[3] for v in votes], [v[4] for v in votes], local_layers)
        self.step += 1
        self.num_votes += 1
        self.num_idle_votes += not spans
        if plan.is_empty:
            self.in_wave = False
            self.waves_done += 1
        if plan.joiners:
            self._take_in(plan)
        return plan


def welcome_key(rank: int, incarnation: int) -> str:
    return f"afd/steps/welcome/a{rank}.i{incarnation}"


SOLO_EPOCH = 0x8000  # + rank: the epoch of a rank's solo steps (a membership of one)
DEAD_KEY = "afd/steps/dead"  # JSON {attention rank: its newest incarnation lost}, written by the launcher
VOTE_POLL_S = 0.2  # a wait for votes looks for dead members this often


def local_plan(step: int, rank: int, spans: Spans, pipeline: PipelineConfig, num_layers: int, cost: CostModel,
               epoch: int = 0, ffn_ready: int = -1, placement: int = -1, learned: CostModel | None = None,
               local_layers: int = 0) -> StepPlan:
    """The plan of a rank that agrees with nobody: the only attention rank (epoch 0), or a solo step of
    one rank of several (a capture: its own epoch, ``SOLO_EPOCH + rank``, with its own step numbers)."""
    return replace(decide(epoch, step, (rank,), (spans,), pipeline, num_layers, cost, (ffn_ready,), (placement,), (), (learned,),
                          local_layers), votes=())
