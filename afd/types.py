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

    residual   [T, H]  x + attention(norm(x)): the FFN output is added to this
    ffn_input  [T, H]  post_attention_layernorm(residual): what the router and experts read
    """

    residual: torch.Tensor
    ffn_input: torch.Tensor
