"""The attention rank's model runner: attention, KV cache and router here; the FFN half over the connector.

Same interface as the monolithic :class:`~afd.engine.runner.ModelRunner`, so
the engine's step loop does not know whether it runs split or not.
"""

from __future__ import annotations

from typing import Sequence

import torch

from afd.config import CacheConfig
from afd.connectors.endpoints import AttentionEndpoint
from afd.distributed.topology import Topology
from afd.engine.runner import ModelRunner
from afd.kvcache import SeqChunk, build_attention_metadata
from afd.models.base import MoEModel, Observer


class DisaggregatedRunner(ModelRunner):
    def __init__(self, model: MoEModel, cache: CacheConfig, endpoint: AttentionEndpoint, topology: Topology) -> None:
        super().__init__(model, cache, "cpu")
        self.endpoint = endpoint
        self.topology = topology
        self.seq = 0  # step sequence number, increasing per attention rank

    @torch.inference_mode()
    def execute(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk], observer: Observer | None = None) -> torch.Tensor:
        m, t = self.model, self.topology
        meta = build_attention_metadata(chunks, self.cache_config.block_size, self.device)
        self.seq += 1
        hidden = m.embed(torch.tensor(token_ids, dtype=torch.long))
        for i in range(m.config.num_layers):
            if observer is not None:
                observer(i, "layer_input", hidden)
            out = m.attention(i, hidden, meta, self.kv_cache.layer(i))
            if observer is not None:
                observer(i, "attn_output", out.residual)
            is_moe = m.config.is_moe_layer(i)
            if not is_moe and t.dense_on == "attention":
                y = m.dense_mlp(i, out.ffn_input)
            else:
                routing = m.router(i, out.ffn_input) if is_moe and t.gate == "attention" else None
                if routing is not None and observer is not None:
                    observer(i, "topk_ids", routing.topk_ids)
                handle = self.endpoint.dispatch(i, self.seq, out.ffn_input, routing, is_moe)
                y = self.endpoint.combine(handle, m.config.hidden_size, hidden.dtype)
                if is_moe and t.shared_experts_on == "attention":
                    shared = m.shared_experts(i, out.ffn_input)
                    if shared is not None:
                        y = y + shared
            hidden = out.residual + y
            if observer is not None:
                observer(i, "ffn_output", hidden)
        if observer is not None:
            observer(m.config.num_layers, "final_hidden", m.model.norm(hidden))
        return m.head(hidden[meta.last_token])
