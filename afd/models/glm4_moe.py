"""GLM-4.5/4.6 MoE: grouped-query attention with partial rotary (the first ``partial_rotary_factor`` of
each head rotates), q/k/v bias and optional q/k RMSNorm; sigmoid routing with a selection bias
(noaux_tc, normalise then scale), a shared expert and first dense layers -- all read from the config."""

from __future__ import annotations

from torch import nn

from afd.models.qwen3_moe import GQAttention, Qwen3MoeModel


class Glm4MoeModel(Qwen3MoeModel):
    """Qwen3-MoE's GQA cache layout; GLM's o_proj has no bias even when attention_bias is set."""

    def make_attention(self, layer: int) -> nn.Module:
        return GQAttention(self.config, layer, o_bias=False)
