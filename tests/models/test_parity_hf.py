"""afd's models equal Hugging Face transformers on the same checkpoint (rules of parity.md)."""

from __future__ import annotations

import pytest
import torch

from afd.config import EngineConfig, SamplingParams
from afd.engine.llm_engine import LLMEngine
from afd.models import load_model
from afd.testing.parity import (
    compare_bf16,
    compare_greedy,
    compare_topk,
    compare_values,
    top2_gap,
)
from tests import support

CASES = [*support.DEEPSEEK_CASES, *support.QWEN_CASES, *support.DEEPSEEK_V3_CASES, *support.GLM_CASES, *support.DSA_CASES,
         *support.MINIMAX_CASES, *support.GPT_OSS_CASES, *support.HYBRID_CASES, *support.V4_CASES]
PROMPTS = [[0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99], [0, 200, 13, 7, 2], [0, 5, 6, 7, 8, 9, 10, 11, 12]]


def prefill(model, prompts, block_size=4):
    """All prompts in one flat afd batch; returns the capture and the last-token logits."""
    runner, blocks = support.runner_and_blocks(model, block_size, 128, len(prompts))
    chunks = [support.new_chunk(blocks, s, p) for s, p in enumerate(prompts)]
    cap = support.Capture()
    logits = runner.execute([t for p in prompts for t in p], chunks, observer=cap)
    return cap, logits


def parity_reports(model, hf_model, prompts):
    """Every per-layer, routing and logits check for a batch of prompts."""
    cap, last_logits = prefill(model, prompts)
    reports, offset = [], 0
    for s, ids in enumerate(prompts):
        layers, router, logits = support.hf_reference(hf_model, ids)
        rows = slice(offset, offset + len(ids))
        for i, ref in layers.items():
            reports.append(compare_values(f"seq{s} layer{i} output", ref, cap[(i, "ffn_output")][rows]))
            if i in router:
                mlp = support.hf_layers(hf_model)[i].mlp
                bias = getattr(getattr(mlp, "gate", None), "e_score_correction_bias", getattr(mlp, "e_score_correction_bias", None))
                scores = support.selection_scores(router[i][0], hf_model.config, bias)
                reports.append(compare_topk(f"seq{s} layer{i} experts", router[i][1], cap[(i, "topk_ids")][rows], scores))
        final = model.lm_head(cap[(model.config.num_layers, "final_hidden")][rows]).float()
        reports.append(compare_values(f"seq{s} logits (all positions)", logits, final))
        reports.append(compare_values(f"seq{s} last logits", logits[-1], last_logits[s]))
        offset += len(ids)
    return reports


@pytest.mark.parametrize("case", CASES)
def test_prefill_per_layer_parity(checkpoints, case):
    path, hf = checkpoints[case]
    model, _ = load_model(path, dtype="float32")
    reports = parity_reports(model, hf, PROMPTS)
    failed = [str(r) for r in reports if not r.ok]
    assert not failed, "\n".join(failed)
    routing = [r for r in reports if hasattr(r, "near_ties")]
    assert routing, "no MoE layer was compared"
    assert sum(len(r.near_ties) for r in routing) <= 2, "too many near-ties: weights are not decisive"


@pytest.mark.parametrize("case", ["ds-qlora-grouped-yarn", "qwen3-norm-topk"])
def test_canary_swapped_experts_fail_parity(checkpoints, case):
    """A deliberately broken model (two experts' weights swapped in one layer) must fail the same check."""
    path, hf = checkpoints[case]
    model, _ = load_model(path, dtype="float32")
    layer = model.config.moe.layers[0]
    experts = model.model.layers[layer].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj[[0, 1]] = experts.gate_up_proj[[1, 0]].clone()
    failed = [r for r in parity_reports(model, hf, PROMPTS) if not r.ok]
    assert failed, "swapping two experts went unnoticed: the parity check cannot fail"


@pytest.mark.parametrize("case", ["ds-qlora-grouped-yarn"])
def test_canary_router_rows_fail_topk(checkpoints, case):
    path, hf = checkpoints[case]
    model, _ = load_model(path, dtype="float32")
    layer = model.config.moe.layers[-1]
    gate = model.model.layers[layer].mlp.gate
    with torch.no_grad():
        gate.weight[[2, 5]] = gate.weight[[5, 2]].clone()
    failed = [r for r in parity_reports(model, hf, PROMPTS) if not r.ok and hasattr(r, "near_ties")]
    assert failed, "a mis-routed gate went unnoticed by the expert-id check"


@pytest.mark.parametrize("case", CASES)
def test_cached_decode_equals_full_forward(checkpoints, case):
    """Each decode step over the paged cache equals transformers' no-cache forward of the whole sequence."""
    path, hf = checkpoints[case]
    model, _ = load_model(path, dtype="float32")
    runner, blocks = support.runner_and_blocks(model, 4, 64, 2)
    seqs = [list(PROMPTS[0]), list(PROMPTS[1])]
    logits = runner.execute([t for s in seqs for t in s], [support.new_chunk(blocks, i, s) for i, s in enumerate(seqs)])
    for step in range(12):
        for i, s in enumerate(seqs):
            if case in support.HYBRID_CASES:
                report = support.fp64_logits_report(hf, s, logits[i], f"step {step} seq {i}")
            else:
                report = compare_values(f"step {step} seq {i}", support.hf_reference(hf, s)[2][-1], logits[i])
            assert report.ok, str(report)
            s.append(int(logits[i].argmax()))
        for i, s in enumerate(seqs):
            blocks.ensure(i, len(s))
        logits = runner.execute([s[-1] for s in seqs], [blocks.chunk(i, len(s) - 1, 1) for i, s in enumerate(seqs)])


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuation_matches_transformers(checkpoints, case):
    path, hf = checkpoints[case]
    model, _ = load_model(path, dtype="float32")
    engine = LLMEngine(model, None, EngineConfig(cache=support.cache_config(model, 4, 128)))
    steps = 24
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    compared = 0
    for prompt, out in zip(PROMPTS, outs):
        seq, gaps = list(prompt), []
        with torch.no_grad():
            for _ in range(steps):
                logits = hf(torch.tensor([seq]), use_cache=False).logits[0, -1]
                gaps.append(top2_gap(logits))
                seq.append(int(logits.argmax()))
        report = compare_greedy(seq[len(prompt) :], out.token_ids, gaps, min_compared=0)  # a prompt may tie at once: the total counts
        assert report.ok, str(report)
        compared += report.num_compared
    assert compared >= steps, f"only {compared} greedy steps compared: too many near-ties"


@pytest.mark.parametrize("case", ["ds-qlora-grouped-yarn", "qwen3-no-norm-topk", "minimax-m2-rotary8", "gptoss-window6", "qwen35-moe",
                                  "qwen3-next", "v4-csa-hca"])
def test_bf16_error_within_twice_transformers_bf16(checkpoints, case):
    """bf16 rule: afd-bf16's mean error against fp32 is at most 2x transformers-bf16's own."""
    from transformers import AutoModelForCausalLM

    path, hf = checkpoints[case]
    model16, _ = load_model(path, dtype="bfloat16")
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ref32, ref16, got16 = [], [], []
    for ids in PROMPTS:
        ref32.append(support.hf_reference(hf, ids)[2])
        ref16.append(support.hf_reference(hf16, ids)[2])
        cap, _ = prefill(model16, [ids])
        got16.append(model16.lm_head(cap[(model16.config.num_layers, "final_hidden")]).float())
    report = compare_bf16(torch.cat(ref32), torch.cat(ref16), torch.cat(got16))
    assert report.ok, f"afd bf16 mean error {report.err_split:.3g} > 2 x transformers bf16's {report.err_reference:.3g}"
    # canary: the same check rejects a bf16 model with two experts swapped
    experts = model16.model.layers[model16.config.moe.layers[0]].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj[[0, 1]] = experts.gate_up_proj[[1, 0]].clone()
    broken = []
    for ids in PROMPTS:
        cap, _ = prefill(model16, [ids])
        broken.append(model16.lm_head(cap[(model16.config.num_layers, "final_hidden")]).float())
    assert not compare_bf16(torch.cat(ref32), torch.cat(ref16), torch.cat(broken)).ok


def _v3_failures(model, hf):
    return [r for r in parity_reports(model, hf, PROMPTS) if not r.ok]


def test_canary_v3_bias_ignored_in_selection_fails(checkpoints):
    """noaux_tc chooses experts on score + e_score_correction_bias: a router that drops the bias picks other experts."""
    path, hf = checkpoints["dsv3-grouped-yarn"]
    model, _ = load_model(path, dtype="float32")
    assert not _v3_failures(model, hf)
    for i in model.config.moe.layers:
        model.model.layers[i].mlp.gate.e_score_correction_bias.data.zero_()
    failed = _v3_failures(model, hf)
    assert any(hasattr(r, "near_ties") for r in failed), "ignoring the selection bias went unnoticed by the expert-id check"


def test_canary_v3_bias_in_weights_fails(checkpoints):
    """The bias only selects: weights come from the unbiased sigmoid scores. Weighting by biased scores must fail."""
    from afd.types import Routing

    path, hf = checkpoints["dsv3-grouped-yarn"]
    model, _ = load_model(path, dtype="float32")
    for i in model.config.moe.layers:
        gate = model.model.layers[i].mlp.gate
        plain = gate.forward

        def biased(x, token_ids=None, gate=gate, plain=plain):
            r = plain(x, token_ids)
            w = r.topk_weights + gate.e_score_correction_bias[r.topk_ids]
            w = w / w.sum(-1, keepdim=True) * gate.moe.routed_scaling_factor
            return Routing(topk_ids=r.topk_ids, topk_weights=w)

        gate.forward = biased
    failed = _v3_failures(model, hf)
    first = model.config.moe.layers[0]
    assert any(r.name.endswith(f"layer{first} output") for r in failed), "bias in the weights went unnoticed"
    assert not any(r.name.endswith(f"layer{first} experts") for r in failed), "the first MoE layer's selection must not move"


def test_v3_checkpoint_mtp_layer_is_skipped(checkpoints, caplog):
    path, _ = checkpoints["dsv3-grouped-yarn"]
    with caplog.at_level("INFO", logger="afd.models.loader"):
        _, report = load_model(path, dtype="float32")
    assert report.skipped_mtp >= 10 and not any(t.startswith("model.layers.4.") for t in report.tensors)
    assert "multi-token-prediction" in caplog.text
