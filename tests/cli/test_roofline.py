"""``afd bench roofline``'s counts against independent ones: the prefill FLOPs it derives from the model's modules
against torch's FLOP counter over the same prefill (the matrix products of the linear layers, counted as they run),
and the bytes a decode step reads against the model's parameters."""

from __future__ import annotations

import pytest
from torch.utils.flop_counter import FlopCounterMode

from afd.cli.bench_roofline import Counts
from afd.models import load_model
from tests import support


@pytest.mark.parametrize("case", ["ds-noqlora-greedy", "qwen3-norm-topk"])
def test_prefill_flops_equal_torch_s_count_of_the_linear_products(checkpoints, case, monkeypatch):
    from afd.models import deepseek_v2, layers

    monkeypatch.setattr(layers, "native_ops", lambda: None)  # every product an ATen matmul the counter sees
    # MLA's prefill decompresses the context through kv_b_proj (an mm); its absorbed form spends the same FLOPs on
    # W_UK/W_UV as einsums (bmm), which the counter files with attention's own products
    monkeypatch.setattr(deepseek_v2.MLAttention, "_absorbed_is_cheaper", lambda self, q, length: False)
    model = load_model(checkpoints[case][0], dtype="float32")[0]
    prompts = [[3, 17, 44, 9, 120, 31, 5, 77, 8], [2, 200, 13, 7, 2, 9]]
    runner, blocks = support.runner_and_blocks(model, 4, 64, 2)
    with FlopCounterMode(display=False) as counter:
        runner.execute([t for p in prompts for t in p], [support.new_chunk(blocks, i, p) for i, p in enumerate(prompts)])
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    linear = by_op.get("aten.mm", 0) + by_op.get("aten.addmm", 0)
    assert linear > 0, by_op
    assert Counts(model).prefill_flops(sum(map(len, prompts)), len(prompts)) == linear, by_op


def test_the_bytes_every_step_reads_plus_every_expert_are_the_model_less_its_embedding(checkpoints):
    model = load_model(checkpoints["ds-noqlora-greedy"][0], dtype="float32")[0]
    counts = Counts(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    experts = sum(size * len(m.expert_ids) for size, m in zip(counts.expert_bytes, counts.experts))
    assert counts.always_bytes + experts == pytest.approx(total - embed.numel() * embed.element_size())
    # a snapshot diff counts the experts that took rows, no more
    before = counts.snapshot()
    counts.experts[0].tokens_routed[1] += 3
    assert counts.touched_bytes(before, counts.snapshot()) == counts.expert_bytes[0]
