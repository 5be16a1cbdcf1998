"""The attention rank's model runner: attention, KV cache and router here; the FFN half over the connector.

Same interface as the monolithic ``afd.engine.runner.ModelRunner`` (``execute``),
so the engine's step loop does not know whether it runs split or not.

One step:

1. the planner cuts the batch into micro-batches (one in ``sync`` mode);
2. every micro-batch's token ids, chunks and :class:`AttentionMetadata` are
   built before any of them runs -- each owns its metadata, nothing is shared;
3. the runner executes the ping-pong schedule: ATTENTION (micro-batch, layer),
   DISPATCH (send the FFN input, or run a locally placed FFN half), COMBINE
   (receive, add to the residual), in exactly the order the schedule yields.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from afd.config import CacheConfig, PipelineConfig
from afd.connectors.endpoints import AttentionEndpoint, DispatchHandle
from afd.distributed.topology import Topology
from afd.kvcache import AttentionMetadata, PagedKVCache, SeqChunk, build_attention_metadata, last_token_rows
from afd.models.base import MoEModel, Observer
from afd.pipeline import Action, CostModel, MicrobatchPlan, choose_plan, plan_microbatches, ping_pong
from afd.types import Routing


@dataclass(slots=True)
class _Microbatch:
    """The state of one micro-batch through the layers (owned by it alone)."""

    index: int
    token_ids: torch.Tensor  # [t] int64
    meta: AttentionMetadata
    hidden: torch.Tensor | None = None  # [t, H] layer input
    residual: torch.Tensor | None = None
    ffn_input: torch.Tensor | None = None
    routing: Routing | None = None
    handle: DispatchHandle | None = None
    local_out: torch.Tensor | None = None  # FFN half computed on this rank
    captured: dict = field(default_factory=dict)


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
    def __init__(
        self,
        model: MoEModel,
        cache: CacheConfig,
        endpoint: AttentionEndpoint,
        topology: Topology,
        pipeline: PipelineConfig = PipelineConfig(),
        cost: CostModel = CostModel(),
    ) -> None:
        self.model = model
        self.cache_config = cache
        self.device = model.model.embed_tokens.weight.device  # where the model was loaded; KV and metadata live there too
        dtype = model.model.embed_tokens.weight.dtype
        self.kv_cache = PagedKVCache(cache, model.config.num_layers, model.kv_layout(), dtype, self.device)
        self.endpoint = endpoint
        self.topology = topology
        self.pipeline = pipeline
        self.cost = cost
        self.seq = 0  # step sequence number, increasing per attention rank
        self.trace: list[TraceEvent] | None = None  # set to [] to record
        self.last_plan: MicrobatchPlan | None = None
        self.num_steps = 0
        self.num_degraded_steps = 0  # steps whose plan could not form the micro-batches asked for

    # ------------------------------------------------------------------ planning
    def _microbatches(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk]) -> list[_Microbatch]:
        cost = self.pipeline.cost or self.cost
        spans = [(c.start, c.length) for c in chunks]
        if self.pipeline.adaptive and self.pipeline.mode == "async":
            moe = self.model.config.moe
            cost = replace(cost, num_experts=moe.num_experts, top_k=moe.top_k)  # the expert-read term
            plan = choose_plan(spans, self.pipeline.num_microbatches, self.model.config.num_layers, self.pipeline.split, cost,
                               self.pipeline.credits)
            if self.trace is not None:
                now = time.perf_counter()
                estimates = ", ".join(f"m={m}: {t:.3g}" for m, t in plan.estimates)
                self.trace.append(TraceEvent(now, now, "plan", 0, -1, self.seq, 0, f"chose m={plan.num_microbatches} ({estimates})"))
        else:
            plan = plan_microbatches(spans, self.pipeline.effective_microbatches, self.pipeline.split, cost,
                                     self.pipeline.min_microbatch_tokens)
        self.last_plan = plan
        self.num_steps += 1
        if plan.degraded:
            self.num_degraded_steps += 1
            if self.trace is not None:
                now = time.perf_counter()
                self.trace.append(TraceEvent(now, now, "degraded", 0, -1, self.seq, 0, plan.degraded))
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
                mb_chunks.append(SeqChunk(c.block_table, span.start, span.length))
            meta = build_attention_metadata(mb_chunks, self.cache_config.block_size, self.device)
            mbs.append(_Microbatch(k, torch.cat(rows), meta))
        return mbs

    # ------------------------------------------------------------------ execution
    def execute(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk], observer: Observer | None = None) -> torch.Tensor:
        """Logits [S, V] fp32 of each chunk's last token."""
        return self.model.head(self.run(token_ids, chunks, observer)[last_token_rows(chunks)])

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk], observer: Observer | None = None) -> torch.Tensor:
        """One step through every layer, the FFN halves over the connector. Returns the last layer's
        hidden states [T, H] of every token, in the batch's order (micro-batches are contiguous pieces)."""
        m = self.model
        self.seq += 1
        mbs = self._microbatches(token_ids, chunks)  # all metadata first
        for mb in mbs:
            mb.hidden = m.embed(mb.token_ids)
        record = observer is not None
        credits = min(self.pipeline.effective_credits, len(mbs)) if len(mbs) > 1 else 1
        for step in ping_pong(len(mbs), m.config.num_layers, credits):
            t0 = time.perf_counter()
            mb = mbs[step.microbatch]
            if step.action is Action.ATTENTION:
                self._attention(mb, step.layer, record)
            elif step.action is Action.DISPATCH:
                self._dispatch(mb, step.layer)
            else:
                self._combine(mb, step.layer, record)
            if self.trace is not None:
                self.trace.append(TraceEvent(t0, time.perf_counter(), step.action.value, step.microbatch, step.layer, self.seq, self.endpoint.num_in_flight))
        hidden = torch.cat([mb.hidden for mb in mbs])
        if record:
            self._emit(mbs, hidden, observer)
        return hidden

    def _attention(self, mb: _Microbatch, layer: int, record: bool) -> None:
        m, t = self.model, self.topology
        if record:
            mb.captured[(layer, "layer_input")] = mb.hidden
        out = m.attention(layer, mb.hidden, mb.meta, self.kv_cache.layer(layer))
        mb.residual, mb.ffn_input = out.residual, out.ffn_input
        if record:
            mb.captured[(layer, "attn_output")] = out.residual
        is_moe = m.config.is_moe_layer(layer)
        mb.routing = m.router(layer, out.ffn_input) if is_moe and t.gate == "attention" else None
        if record and mb.routing is not None:
            mb.captured[(layer, "topk_ids")] = mb.routing.topk_ids

    def _dispatch(self, mb: _Microbatch, layer: int) -> None:
        m, t = self.model, self.topology
        is_moe = m.config.is_moe_layer(layer)
        if not is_moe and t.dense_on == "attention":
            mb.local_out = m.dense_mlp(layer, mb.ffn_input)
            return
        mb.handle = self.endpoint.dispatch(layer, self.seq, mb.ffn_input, mb.routing, is_moe, microbatch=mb.index)

    def _combine(self, mb: _Microbatch, layer: int, record: bool) -> None:
        m, t = self.model, self.topology
        if mb.handle is None:
            y = mb.local_out
        else:
            y = self.endpoint.combine(mb.handle, m.config.hidden_size, mb.hidden.dtype)
            if m.config.is_moe_layer(layer) and t.shared_experts_on == "attention":
                shared = m.shared_experts(layer, mb.ffn_input)
                if shared is not None:
                    y = y + shared
        mb.hidden = mb.residual + y
        mb.handle = mb.local_out = mb.routing = mb.residual = mb.ffn_input = None
        if record:
            mb.captured[(layer, "ffn_output")] = mb.hidden

    def _emit(self, mbs: list[_Microbatch], hidden: torch.Tensor, observer: Observer) -> None:
        """Captured boundaries in the batch's token order (micro-batches are contiguous pieces of it)."""
        m = self.model
        for layer in range(m.config.num_layers):
            for boundary in ("layer_input", "attn_output", "topk_ids", "ffn_output"):
                parts = [mb.captured[(layer, boundary)] for mb in mbs if (layer, boundary) in mb.captured]
                if parts:
                    observer(layer, boundary, torch.cat(parts))
        observer(m.config.num_layers, "final_hidden", m.model.norm(hidden))
