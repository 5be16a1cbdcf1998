"""Qwen3-Next and Qwen3.5-MoE: hybrid layers. Most are Gated DeltaNet linear attention
(afd/models/gated_deltanet.py), whose per-sequence memory is a state slot; the others (``layer_types``) are
gated full attention over the paged KV cache (:class:`~afd.models.qwen3_moe.GQAttention` with the output gate,
q/k norm and partial rotary). The MoE is softmax top-k plus a sigmoid-gated shared expert.

Every RMSNorm but the linear layers' gated one is zero-centred: the checkpoint stores w and the norm scales
by 1 + w; afd holds 1 + w (added in fp32 at load), so its norms and kernels are the plain ones. Qwen3.5's
release is multimodal: its language model's tensors live under ``model.language_model.``
(``ModelConfig.checkpoint_prefix``), and the vision tower and the ``mtp.*`` layers are not read.
"""

from __future__ import annotations

from torch import nn

from afd.models.base import MoEModel
from afd.models.gated_deltanet import GatedDeltaNet
from afd.models.qwen3_moe import GQAttention

#: parameter names ending so are zero-centred RMSNorm weights (the gated norm of the linear layers is not)
_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight")


class Qwen3NextModel(MoEModel):
    checkpoint_renames = ((".mlp.shared_experts.", ".mlp.shared_expert."),)

    def make_attention(self, layer: int) -> nn.Module:
        return GatedDeltaNet(self.config) if self.config.is_linear_layer(layer) else GQAttention(self.config, layer)

    def kv_layout(self) -> tuple[tuple[int, ...], ...]:
        c = self.config
        return ((c.num_kv_heads, c.head_dim), (c.num_kv_heads, c.head_dim))

    def state_layout(self) -> tuple[tuple[int, ...], ...]:
        lin = self.config.linear
        return ((lin.conv_dim, lin.conv_kernel - 1), (lin.num_value_heads, lin.key_head_dim, lin.value_head_dim))

    def checkpoint_name(self, name: str) -> str:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and parts[3] == "self_attn" and self.config.is_linear_layer(int(parts[2])):
            name = ".".join((*parts[:3], "linear_attn", *parts[4:]))
        return super().checkpoint_name(name)

    def load_convert(self, name: str) -> str | None:
        return "plus_one" if name.endswith(_ZERO_CENTRED) else None
