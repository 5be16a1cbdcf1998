"""Plain data that crosses package boundaries (model halves, connector, engine)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Routing(NamedTuple):
    """The router's decision for T tokens.

    topk_ids      [T, k] int64   logical expert ids
    topk_weights  [T, k] float32 combine weights (already scaled / normalised)
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


class AttentionOutput(NamedTuple):
    """What the attention half of a layer hands to the FFN half.

    residual   [T, H]  x + attention(norm(x)): the FFN output is added to this (DeepSeek-V4: the streams
                       [T, N, H] after the attention block, mixed with the FFN output by ``mix``)
    ffn_input  [T, H]  post_attention_layernorm(residual): what the router and experts read
    mix        None, or DeepSeek-V4's (post [T, N], comb [T, N, N]): how the FFN output and the streams make the
               next layer's streams (``MoEModel.merge``)
    """

    residual: torch.Tensor
    ffn_input: torch.Tensor
    mix: tuple[torch.Tensor, torch.Tensor] | None = None
