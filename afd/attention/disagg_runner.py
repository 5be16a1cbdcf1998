"""The attention rank's model runner: attention, KV cache and router here; the FFN half over the connector.

It implements the engine's runner protocol (afd/engine/model_runner.py), as the monolithic
``ModelRunner`` does, so the engine's step loop does not know whether it runs split or not.

One step:

1. the step is agreed with the other attention ranks (afd/attention/steps.py): the
   contributors and the micro-batch count m, the same on every rank;
2. the planner cuts this rank's batch into m micro-batches (one in ``sync`` mode;
   empty ones at the end when it has fewer pieces to give);
3. every micro-batch's token ids, chunks and :class:`AttentionMetadata` are
   built before any of them runs -- each owns its metadata, nothing is shared;
4. the runner executes the ping-pong schedule: ATTENTION (micro-batch, layer),
   DISPATCH (send the FFN input -- an empty part for an empty micro-batch -- or
   run a locally placed FFN half), COMBINE (the shared experts kept on this side, computed before
   the wait so that they overlap the FFN side's routed experts; receive; add both to the residual),
   in exactly the order the schedule yields.

A step of the wave with no work here is :meth:`DisaggregatedRunner.idle`: a vote,
no model pass and no message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from afd.attention.steps import SOLO_EPOCH, StepPlan, StepPlane, local_plan, own_plan
from afd.config import CacheConfig, PipelineConfig
from afd.connectors.dispatch import AttentionEndpoint, DispatchHandle
from afd.distributed.topology import Topology
from afd.kvcache import AttentionMetadata, PagedKVCache, SeqChunk, build_attention_metadata, last_token_rows
from afd.models.base import MoEModel, Observer
from afd.microbatch import Action, CostModel, MicrobatchPlan, ping_pong
from afd.microbatch.learn import CostLearner
from afd.types import AttentionOutput, Routing


@dataclass(slots=True)
class _Microbatch:
    """The state of one micro-batch through the layers (owned by it alone)."""

    index: int
    token_ids: torch.Tensor | None  # [t] int64; None: an empty micro-batch (this rank has fewer pieces than agreed)
    meta: AttentionMetadata | None
    hidden: torch.Tensor | None = None  # [t, H] layer input
    residual: torch.Tensor | None = None
    ffn_input: torch.Tensor | None = None
    mix: tuple | None = None  # DeepSeek-V4's stream mixing (AttentionOutput.mix)
    routing: Routing | None = None
    handle: DispatchHandle | None = None
    local_out: torch.Tensor | None = None  # FFN half computed on this rank
    captured: dict = field(default_factory=dict)
    work_s: float = 0.0  # this rank's work on it over the layers (attention, dispatch, merge): what the planner learns
    local_s: float = 0.0  # of which its local layers' FFN half (the dense MLPs computed here)
    ffn_s: float = 0.0  # the FFN side's compute of its union over the layers (RESULT headers)
    ffn_layers: int = 0
    wire_s: float = float("inf")  # its fastest round trip less the FFN compute, over the layers

    @property
    def is_empty(self) -> bool:
        return self.token_ids is None


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One executed schedule step on this rank (perf_counter seconds)."""

    start: float
    end: float
    action: str
    microbatch: int
    layer: int
    seq: int
    in_flight: int
    note: str = ""


class DisaggregatedRunner:
    """``plane``: the step agreement with the other attention ranks (None: this rank steps alone)."""

    def __init__(
        self,
        model: MoEModel,
        cache: CacheConfig,
        endpoint: AttentionEndpoint,
        topology: Topology,
        pipeline: PipelineConfig = PipelineConfig(),
        cost: CostModel = CostModel(),
        plane: StepPlane | None = None,
    ) -> None:
        self.model = model
        self.cache_config = cache
        self.device = model.model.embed_tokens.weight.device  # where the model was loaded; KV and metadata live there too
        self.kv_cache = PagedKVCache.for_model(model, cache, self.device)
        self.endpoint = endpoint
        self.topology = topology
        self.pipeline = pipeline
        self.cost = cost
        self.plane = plane
        self.seq = -1  # the step of the messages in flight: the agreed step number
        self._local_step = 1  # the next step, when stepping alone (numbered from 1)
        self.trace: list[TraceEvent] | None = None  # set to [] to record
        self.last_plan: MicrobatchPlan | None = None
        self.last_step: StepPlan | None = None
        self.num_steps = 0  # model passes
        self.num_idle_steps = 0  # agreed steps without work here: no model pass
        self.num_degraded_steps = 0  # steps whose plan could not form the micro-batches asked for
        self.on_placement = None  # called with the version when an agreed step switches the expert placement
        self.learner = CostLearner()  # the auto planner's costs, from this rank's own steps (afd/microbatch/learn.py)
        self.ffn_busy_s = 0.0  # the FFN side's compute of every union the learner was shown
        # the leading layers whose FFN half runs here (dense MLPs kept beside attention): the schedule runs each
        # micro-batch through them alone, so the FFN side's first work leaves after one micro-batch's, not all
        self.local_layers = 0
        while self.local_layers < model.config.num_layers and self._local(self.local_layers):
            self.local_layers += 1

    def _local(self, layer: int) -> bool:
        """Whether ``layer``'s FFN half runs on this rank (a dense MLP kept beside attention): nothing is sent."""
        return not self.model.config.is_moe_layer(layer) and self.topology.dense_on == "attention"

    # ------------------------------------------------------------------ agreement
    @property
    def waves(self) -> StepPlane | None:
        """The agreed steps (the engine's ``Waves``); None: this rank steps alone."""
        return self.plane

    @property
    def in_wave(self) -> bool:
        """Whether the agreed steps go on (some rank has work): this rank must keep voting."""
        return self.plane is not None and self.plane.in_wave

    def maintain(self) -> None:
        """Between steps: a replacement FFN rank's HELLO is read (and a silent one given up), never waited for."""
        self.endpoint.poll_links()

    def _cost(self) -> CostModel:
        cost = self.pipeline.cost or self.cost
        if self.pipeline.adaptive:
            moe = self.model.config.moe
            cost = replace(cost, num_experts=moe.num_experts, top_k=moe.top_k)  # the expert-read term
        return cost

    @property
    def _learning(self) -> bool:
        return self.pipeline.adaptive and self.pipeline.learn_costs and self.pipeline.mode == "async"

    def _agree(self, spans: tuple[tuple[int, int], ...], solo: bool = False) -> StepPlan:
        layers = self.model.config.num_layers
        self.endpoint.poll_links()  # the vote names the replacements linked so far
        learned = self.learner.model if self._learning else None
        if self.plane is None or solo:
            epoch = 0 if self.plane is None else SOLO_EPOCH + self.endpoint.rank
            plan = local_plan(self._local_step, self.endpoint.rank, spans, self.pipeline, layers, self._cost(), epoch,
                              self.endpoint.ready_mask, self.endpoint.ready_placement if self.plane is None else -1, learned,
                              self.local_layers)
            self._local_step += 1
        else:
            plan = self.plane.agree(spans, self.pipeline, layers, self._cost(), self.endpoint.ready_mask, self.endpoint.ready_placement,
                                    learned, self.local_layers)
        if self.plane is None or not solo:  # what every member has ready is used from this step: a replacement FFN rank,
            self.endpoint.admit(plan.ffn_ready)  # a new expert placement
            if self.endpoint.use(plan.placement) and self.on_placement is not None:
                self.on_placement(plan.placement)
        self.last_step = plan
        if self.trace is not None and plan.contributors:
            now = time.perf_counter()
            estimates = ", ".join(f"m={m}: {t:.3g}" for m, t in plan.estimates)
            self.trace.append(TraceEvent(now, now, "plan", 0, -1, plan.step, 0,
                                         f"agreed m={plan.num_microbatches} (contributors {list(plan.contributors)})"
                                         + (f" from {estimates}" if estimates else "") + (" (learned costs, s)" if plan.learned else "")))
        return plan

    def idle(self) -> StepPlan:
        """One agreed step with no work here: vote, and run nothing (no model pass, no message)."""
        if self.plane is None:
            raise RuntimeError("an idle step needs the step agreement (this rank steps alone)")
        self.num_idle_steps += 1
        return self._agree(())

    # ------------------------------------------------------------------ planning
    def _microbatches(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk], step: StepPlan) -> list[_Microbatch]:
        """This rank's share of the agreed step, cut into exactly the agreed m micro-batches (the last
        ones empty when it has fewer pieces to give)."""
        spans = [(c.start, c.length) for c in chunks]
        plan = own_plan(tuple(spans), step.requested, self.pipeline, step.cost or self._cost())  # at most the agreed m pieces
        self.last_plan = plan
        self.num_steps += 1
        degraded = plan.degraded
        if plan.num_microbatches < step.num_microbatches and not degraded:
            degraded = f"{step.num_microbatches} micro-batches agreed, {plan.num_microbatches} here: the rest are empty"
        if degraded:
            self.num_degraded_steps += 1
            if self.trace is not None:
                now = time.perf_counter()
                self.trace.append(TraceEvent(now, now, "degraded", 0, -1, step.step, 0, degraded))
        offsets, acc = [], 0
        for c in chunks:
            offsets.append(acc)
            acc += c.length
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        mbs = []
        for k, piece in enumerate(plan.pieces):
            rows, mb_chunks = [], []
            for span in piece:
                c = chunks[span.seq]
                first = offsets[span.seq] + span.start - c.start
                rows.append(ids[first : first + span.length])
                mb_chunks.append(replace(c, start=span.start, length=span.length))
            meta = build_attention_metadata(mb_chunks, self.cache_config.block_size, self.device, windows=self.model.config.windows,
                                            rates=self.model.config.compression_rates)
            mbs.append(_Microbatch(k, torch.cat(rows), meta))
        mbs += [_Microbatch(k, None, None) for k in range(len(mbs), step.num_microbatches)]
        return mbs

    # ------------------------------------------------------------------ execution
    def execute(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk], observer: Observer | None = None,
                solo: bool = False) -> torch.Tensor:
        """Logits [S, V] fp32 of each chunk's last token."""
        return self.model.head(self.run(token_ids, chunks, observer, solo)[last_token_rows(chunks)])

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk], observer: Observer | None = None,
            solo: bool = False) -> torch.Tensor:
        """One agreed step through every layer, the FFN halves over the connector. Returns the last
        layer's hidden states [T, H] of every token, in the batch's order (micro-batches are contiguous
        pieces of it; empty ones come last). ``solo``: a step of this rank alone, outside the waves (its
        own epoch), e.g. a capture for a parity check."""
        m = self.model
        step = self._agree(tuple((c.start, c.length) for c in chunks), solo)
        self.seq = step.step  # every message of the step carries the agreed step number
        mbs = self._microbatches(token_ids, chunks, step)  # all metadata first
        for mb in mbs:
            if not mb.is_empty:
                mb.hidden = m.embed(mb.token_ids)
        record = observer is not None
        credits = min(self.pipeline.effective_credits, len(mbs)) if len(mbs) > 1 else 1
        learning = self._learning
        for action in ping_pong(len(mbs), m.config.num_layers, credits, self.local_layers):
            t0 = began = waited = time.perf_counter()
            mb = mbs[action.microbatch]
            if action.action is Action.ATTENTION:
                self._attention(mb, action.layer, record)
            elif action.action is Action.DISPATCH:
                self._dispatch(mb, action.layer, step)
            else:
                began, waited = self._combine(mb, action.layer, record, learning, t0)
            if learning:
                spent = (began - t0) + (time.perf_counter() - waited)
                mb.work_s += spent
                if action.action is Action.DISPATCH and action.layer < self.local_layers:
                    mb.local_s += spent
            if self.trace is not None:
                self._traced(action, t0, began, waited, self._local(action.layer))
        if learning:
            self._learn(step, mbs)
        real = [mb for mb in mbs if not mb.is_empty]
        hidden = torch.cat([mb.hidden for mb in real]) if len(real) > 1 else real[0].hidden
        if record:
            self._emit(real, hidden, observer)
        return hidden

    def _learn(self, step: StepPlan, mbs: list[_Microbatch]) -> None:
        """This step's costs into the learner: per micro-batch, its work here and its union's on the FFN side, per layer."""
        layers, local = self.model.config.num_layers, self.local_layers
        tokens = [sum(sp.length for sp in piece) for piece in self.last_plan.pieces]
        attention = [(n, CostModel.context(piece), (mb.work_s - mb.local_s) / layers)
                     for n, mb, piece in zip(tokens, mbs, self.last_plan.pieces)]
        ffn = [(step.union_tokens[mb.index], mb.ffn_s / mb.ffn_layers) for mb in mbs if mb.ffn_layers and mb.ffn_s > 0]
        self.ffn_busy_s += sum(mb.ffn_s for mb in mbs)
        self.learner.observe(attention, ffn, [mb.wire_s / 2 for mb in mbs if mb.ffn_layers],
                             [(n, mb.local_s / local) for n, mb in zip(tokens, mbs)] if local else ())

    def _traced(self, action, t0: float, began: float, waited: float, local: bool) -> None:
        """A schedule step into the trace; a combine as this rank's work before its wait ("shared": the shared
        experts when they run on this side), its wait for the FFN output ("combine") and the work here after it
        ("merge": the residual), so that the trace tells this rank's work from its waiting. A local layer's dispatch
        sends nothing: it is traced as what it is, the FFN half computed here ("local_ffn")."""
        end = time.perf_counter()
        args = (action.microbatch, action.layer, self.seq, self.endpoint.num_in_flight)
        if action.action is Action.COMBINE:
            if began > t0:
                self.trace.append(TraceEvent(t0, began, "shared", *args))
            self.trace.append(TraceEvent(began, waited, "combine", *args))
            self.trace.append(TraceEvent(waited, end, "merge", *args))
        else:
            name = "local_ffn" if local and action.action is Action.DISPATCH else action.action.value
            self.trace.append(TraceEvent(t0, end, name, *args))

    def _attention(self, mb: _Microbatch, layer: int, record: bool) -> None:
        m, t = self.model, self.topology
        if mb.is_empty:
            return
        if record:
            mb.captured[(layer, "layer_input")] = mb.hidden
        out = m.attention(layer, mb.hidden, mb.meta, self.kv_cache.layer(layer))
        mb.residual, mb.ffn_input, mb.mix = out
        if record:
            mb.captured[(layer, "attn_output")] = out.residual
        is_moe = m.config.is_moe_layer(layer)
        mb.routing = m.router(layer, out.ffn_input, mb.token_ids) if is_moe and t.gate == "attention" else None
        if record and mb.routing is not None:
            mb.captured[(layer, "topk_ids")] = mb.routing.topk_ids

    def _dispatch(self, mb: _Microbatch, layer: int, step: StepPlan) -> None:
        m, t = self.model, self.topology
        is_moe = m.config.is_moe_layer(layer)
        if self._local(layer):
            if not mb.is_empty:
                mb.local_out = m.dense_mlp(layer, mb.ffn_input)
            return
        if mb.is_empty:  # the FFN ranks still get this contributor's (empty) part of the union
            mb.ffn_input = torch.empty(0, m.config.hidden_size, dtype=m.model.embed_tokens.weight.dtype, device=self.device)
            if is_moe and t.gate == "attention":
                k = m.config.moe.top_k
                mb.routing = Routing(torch.empty(0, k, dtype=torch.long, device=self.device), torch.empty(0, k, device=self.device))
        token_ids = None
        if t.gate == "ffn" and layer in m.config.moe.hash_layers:  # the FFN side's router reads the rows' tokens
            token_ids = torch.empty(0, dtype=torch.long, device=self.device) if mb.is_empty else mb.token_ids
        mb.handle = self.endpoint.dispatch(layer, self.seq, mb.ffn_input, mb.routing, is_moe, microbatch=mb.index,
                                           epoch=step.epoch, members=step.mask, token_ids=token_ids)

    def _combine(self, mb: _Microbatch, layer: int, record: bool, learning: bool, started: float) -> tuple[float, float]:
        """Wait for the FFN output and merge it; returns when the wait began (``started``, when nothing ran before
        it) and when it ended (perf_counter).
        The shared experts, when they run here, are computed before the wait (they need only the FFN input), so
        they overlap the FFN side's routed experts rather than follow them. ``learning``: the FFN side's compute
        and the round trip's rest are kept for the cost learner."""
        m, t = self.model, self.topology
        if mb.is_empty:
            if mb.handle is not None:
                self.endpoint.combine(mb.handle, m.config.hidden_size, m.model.embed_tokens.weight.dtype)  # no rows: nothing comes
            mb.handle = mb.ffn_input = mb.routing = None
            return started, time.perf_counter()
        shared, began = None, started
        if mb.handle is not None and m.config.is_moe_layer(layer) and t.shared_experts_on == "attention":
            shared = m.shared_experts(layer, mb.ffn_input)
            began = started if shared is None else time.perf_counter()
        if mb.handle is None:
            y, waited = mb.local_out, time.perf_counter()
        else:
            y = self.endpoint.combine(mb.handle, m.config.hidden_size, mb.hidden.dtype)
            waited = time.perf_counter()
            if learning:
                mb.ffn_s += mb.handle.ffn_busy_s
                mb.ffn_layers += 1
                # at most the round trip's rest: a result that came while the shared experts ran is taken after them
                mb.wire_s = min(mb.wire_s, waited - mb.handle.sent_at - mb.handle.ffn_busy_s)
            if shared is not None:
                y = y + shared
        mb.hidden = m.merge(layer, AttentionOutput(mb.residual, mb.ffn_input, mb.mix), y)
        mb.handle = mb.local_out = mb.routing = mb.residual = mb.ffn_input = mb.mix = None
        if record:
            mb.captured[(layer, "ffn_output")] = mb.hidden
        return began, waited

    def _emit(self, mbs: list[_Microbatch], hidden: torch.Tensor, observer: Observer) -> None:
        """Captured boundaries in the batch's token order (micro-batches are contiguous pieces of it)."""
        m = self.model
        for layer in range(m.config.num_layers):
            for boundary in ("layer_input", "attn_output", "topk_ids", "ffn_output"):
                parts = [mb.captured[(layer, boundary)] for mb in mbs if (layer, boundary) in mb.captured]
                if parts:
                    observer(layer, boundary, torch.cat(parts))
        observer(m.config.num_layers, "final_hidden", m.final_norm(hidden))
