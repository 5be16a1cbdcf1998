"""gpt-oss: grouped-query attention with q/k/v/o biases, a learned sink logit per head, and layers that
alternate a sliding window with full attention (``layer_types``); YaRN rotary (halves, ``truncate:
false``). Its MoE has a biased router (top-k of the logits, softmax over the chosen) and biased experts
with gpt-oss's clamped SwiGLU (:func:`afd.models.layers.clamped_swiglu`).

Its checkpoints stack each layer's experts in one tensor, transposed against afd's layout, with gate and
up interleaved: ``mlp.experts.gate_up_proj [E, H, 2I]`` (even columns gate, odd up), ``gate_up_proj_bias
[E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``; the router is ``mlp.router``. The loader
reads only the held experts' rows and de-interleaves them once (afd/models/loader.py)."""

from __future__ import annotations

from afd.models.qwen3_moe import Qwen3MoeModel


class GptOssModel(Qwen3MoeModel):
    checkpoint_renames = ((".mlp.gate.", ".mlp.router."),)
    stacked_experts = True
