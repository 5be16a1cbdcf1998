"""MiniMax-M2: grouped-query attention whose q/k RMSNorm spans the whole projection (one weight of
heads x head_dim, not one per head) and partial rotary (``rotary_dim``); every layer MoE, sigmoid scores
with a selection bias (``e_score_correction_bias``), normalised top-k weights, no shared expert.

Its checkpoints keep Mixtral's names: ``block_sparse_moe.{gate, e_score_correction_bias}`` and experts
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down)."""

from __future__ import annotations

from afd.models.qwen3_moe import Qwen3MoeModel


class MiniMaxM2Model(Qwen3MoeModel):
    checkpoint_renames = ((".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"),
                          (".mlp.", ".block_sparse_moe."))
    expert_tensors = ("w1", "w3", "w2")
