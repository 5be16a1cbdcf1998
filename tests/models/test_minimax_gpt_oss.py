"""MiniMax-M2 and gpt-oss beyond the shared parity suite (tests/models/test_parity_hf.py runs both there):
the canaries issue 26 names, each a deliberately broken model that the same parity check must reject,
role-aware reads of gpt-oss's stacked experts, windowed decode pages, and what afd refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import afd.models.layers as layers
from afd.config import CacheConfig
from afd.engine.model_runner import ModelRunner
from afd.kvcache import BlockManager, SeqChunk, build_attention_metadata
from afd.models import WeightSelection, load_model
from afd.models.hf_config import UnsupportedArchitectureError, load_model_config
from afd.testing.parity import compare_values
from tests import support
from tests.models.test_parity_hf import PROMPTS, parity_reports

GPT_OSS = "gptoss-window6"
MINIMAX = "minimax-m2-rotary8"


def failures(model, hf):
    return [r for r in parity_reports(model, hf, PROMPTS) if not r.ok]


@pytest.fixture
def gpt_oss(checkpoints):
    path, hf = checkpoints[GPT_OSS]
    model, _ = load_model(path, dtype="float32")
    assert not failures(model, hf), "the unbroken model must pass before a canary means anything"
    return model, hf


def test_the_prompts_are_longer_than_the_window(checkpoints):
    """A model that ignored the window would see the same keys: the prompts must reach past it."""
    config = load_model_config(checkpoints[GPT_OSS][0])
    assert config.sliding_layers == (0, 2) and config.sliding_window == 6
    assert max(len(p) for p in PROMPTS) > 2 * config.sliding_window
    assert load_model_config(checkpoints["gptoss-window3"][0]).sliding_layers == (1, 2)


def test_canary_sinks_dropped_fails(gpt_oss):
    model, hf = gpt_oss
    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(float("-inf"))  # a sink of probability 0: as if it were not there
    assert failures(model, hf), "dropping the sinks went unnoticed"


@pytest.mark.parametrize("delta", [1, -1])
def test_canary_window_off_by_one_fails(gpt_oss, delta):
    model, hf = gpt_oss
    for i in model.config.sliding_layers:
        model.model.layers[i].self_attn.window += delta
    assert failures(model, hf), f"a window of W{delta:+d} went unnoticed"


def test_canary_gate_up_read_as_halves_fails(gpt_oss):
    """The checkpoint interleaves gate and up columns; reading its halves as gate and up must fail."""
    model, hf = gpt_oss
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "gate_up_proj_bias"):
            p = getattr(experts, name)
            inter = p.shape[1] // 2
            interleaved = torch.stack((p.data[:, :inter], p.data[:, inter:]), dim=2).flatten(1, 2)  # back to the file's order
            p.data.copy_(interleaved)  # now read as halves: rows [0, I) are "gate"
    assert failures(model, hf), "reading gate/up as halves went unnoticed"


def test_canary_plus_one_on_up_dropped_fails(gpt_oss, monkeypatch):
    model, hf = gpt_oss

    def without_plus_one(gate, up, limit, alpha, offset):
        gate = gate.clamp(max=limit)
        return up.clamp(-limit, limit) * gate * torch.sigmoid(gate * alpha)

    monkeypatch.setattr(layers, "clamped_swiglu", without_plus_one)
    for layer in model.model.layers:  # the Python loop (the C++ one is compared with it in tests/kernels)
        monkeypatch.setattr(layer.mlp.experts, "forward", layer.mlp.experts.reference)
    assert failures(model, hf), "dropping the + 1 on up went unnoticed"


def test_canary_expert_bias_after_the_combine_weight_fails(gpt_oss, monkeypatch):
    """Each expert's down bias is added before its routing weight scales it; adding it after must fail."""
    model, hf = gpt_oss
    for layer in model.model.layers:
        experts = layer.mlp.experts
        right = experts.reference

        def biased_after(x, ids, weights, quantized=None, experts=experts, right=right):
            out = right(x, ids, weights)
            local = experts._local_ids(ids)
            bias = experts.down_proj_bias[local.clamp(min=0)] * (local >= 0)[..., None]  # [T, k, H]
            return out + (bias * (1 - weights[..., None])).sum(1)  # moves each bias from weighted to unweighted

        monkeypatch.setattr(experts, "forward", biased_after)
    assert failures(model, hf), "the expert bias after the combine weight went unnoticed"


def test_canary_minimax_qk_norm_per_head_fails(checkpoints):
    """MiniMax-M2 normalises the whole q (and k) projection; normalising per head must fail."""
    path, hf = checkpoints[MINIMAX]
    model, _ = load_model(path, dtype="float32")
    assert not failures(model, hf)
    for layer in model.model.layers:
        attn = layer.self_attn
        for norm, heads in ((attn.q_norm, attn.num_heads), (attn.k_norm, attn.num_kv_heads)):
            def per_head(x, norm=norm, heads=heads):
                h = x.view(x.shape[0], heads, -1).float()
                h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
                return norm.weight * h.reshape(x.shape).to(x.dtype)

            norm.forward = per_head
    assert failures(model, hf), "q/k norm per head went unnoticed"


def test_gpt_oss_ffn_rank_reads_only_its_experts_rows(checkpoints):
    """The checkpoint stacks every expert in one tensor; an FFN rank reads its experts' rows and no more."""
    path, _ = checkpoints[GPT_OSS]
    config = load_model_config(path)
    held = {1, 6}
    _, report = load_model(path, dtype="float32", selection=WeightSelection.experts_only(held))
    e, h, i, layers_ = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size, config.num_layers
    per_expert = 4 * (h * 2 * i + 2 * i + i * h + h)  # fp32 gate_up, its bias, down, its bias
    assert report.bytes_read == layers_ * len(held) * per_expert
    full, _ = load_model(path, dtype="float32")
    part, _ = load_model(path, dtype="float32", selection=WeightSelection.experts_only(held))
    for layer in range(layers_):
        a, b = full.model.layers[layer].mlp.experts, part.model.layers[layer].mlp.experts
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            assert torch.equal(getattr(a, name)[[1, 6]], getattr(b, name)), name
    assert e == 8


def test_windowed_decode_pages_cover_only_the_window():
    """A sliding layer's decode pages hold the last W positions, from the block that holds the first of them."""
    block = 4
    chunks = [SeqChunk(list(range(10)), 37, 1), SeqChunk(list(range(20, 23)), 2, 1)]
    meta = build_attention_metadata(chunks, block, windows=(6,))
    pages = meta.decode_pages(6)
    assert pages.window == 6 and meta.decode_pages(0) is meta.decode
    for d, c in enumerate(chunks):
        mine = pages.page_row == d
        visible = pages.page_slots[mine][pages.page_valid[mine]].tolist()
        want = [c.block_table[p // block] * block + p % block for p in range(max(0, c.end - 6), c.end)]
        assert sorted(visible) == sorted(want)
    with pytest.raises(ValueError, match="window 5"):
        meta.decode_pages(5)


def test_long_windowed_decode_equals_a_full_forward(checkpoints):
    """A sequence at 8x the window, decoded over the paged cache, equals transformers' full forward."""
    path, hf = checkpoints[GPT_OSS]
    model, _ = load_model(path, dtype="float32")
    runner = ModelRunner(model, CacheConfig(block_size=4, num_blocks=64))
    blocks = BlockManager(64, 4)
    seq = list(range(2, 2 + 40))
    logits = runner.execute(seq, [SeqChunk(blocks.ensure(0, len(seq)), 0, len(seq))])[0]
    for step in range(8):
        _, _, ref = support.hf_reference(hf, seq)
        assert compare_values(f"step {step}", ref[-1], logits).ok
        seq.append(int(logits.argmax()))
        logits = runner.execute([seq[-1]], [SeqChunk(blocks.ensure(0, len(seq)), len(seq) - 1, 1)])[0]


@pytest.fixture(scope="module")
def mxfp4_checkpoint(checkpoints, tmp_path_factory):
    """gpt-oss with MXFP4 experts (encoded here), and transformers' model on the weights its own converter
    (``integrations/mxfp4.convert_moe_packed_tensors``) decodes from that checkpoint."""
    import copy

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, hf = checkpoints[GPT_OSS]
    dst = tmp_path_factory.mktemp("mxfp4") / "gpt-oss-mxfp4"
    written = support.write_mxfp4_checkpoint(path, dst)
    dequantized = copy.deepcopy(hf)
    with torch.no_grad():
        for i, layer in enumerate(dequantized.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                name = f"model.layers.{i}.mlp.experts.{proj}"
                decoded = convert_moe_packed_tensors(written[f"{name}_blocks"], written[f"{name}_scales"], dtype=torch.float32)
                original = getattr(layer.mlp.experts, proj)
                ours = support.encode_mxfp4(original.transpose(1, 2))[2].transpose(1, 2)
                assert torch.equal(decoded, ours), f"{name}: transformers decodes another value than the test encoded"
                assert not torch.equal(decoded, original)  # the quantisation moved the weights: the comparison below means something
                original.copy_(decoded)
    return dst, dequantized


@pytest.mark.parametrize("mode", ["dequantize", "keep"])
def test_mxfp4_experts_equal_transformers_on_the_decoded_weights(mxfp4_checkpoint, mode):
    """Both modes: decoded once at load, or kept as blocks and decoded inside the expert loop (the C++ one at
    decode sizes and past them; the Python loop's reference in tests/kernels)."""
    path, hf = mxfp4_checkpoint
    model, report = load_model(path, dtype="float32", mxfp4=mode)
    assert report.mxfp4 == mode
    experts = model.model.layers[0].mlp.experts
    assert (experts.gate_up_proj.dtype == torch.uint8) == (mode == "keep") and experts.mxfp4 == (mode == "keep")
    assert not failures(model, hf)
    if mode == "keep":  # the 4-bit blocks and their scales: about an eighth of fp32's bytes
        held = sum(getattr(experts, n).numel() * getattr(experts, n).element_size()
                   for n in ("gate_up_proj", "down_proj", "gate_up_proj_scales", "down_proj_scales"))
        assert held * 7 < 4 * (experts.gate_up_proj_scales.numel() + experts.down_proj_scales.numel()) * 32


@pytest.mark.parametrize("broken", ["nibbles swapped", "scale without its bias"])
def test_canary_mxfp4_misread_fails(mxfp4_checkpoint, monkeypatch, broken):
    """The decoder misreading either field must fail the same check (a decoder of the test's own, in place
    of afd's at load; the C++ decoder is compared with afd's in tests/kernels)."""
    import afd.models.loader as loader
    from afd.models import mxfp4

    path, hf = mxfp4_checkpoint
    if broken == "nibbles swapped":
        misread = lambda blocks, scales, dtype: mxfp4.dequantize_mxfp4((blocks << 4) | (blocks >> 4), scales, dtype)  # noqa: E731
    else:
        misread = lambda blocks, scales, dtype: mxfp4.dequantize_mxfp4(blocks, scales, dtype) * 2.0**127  # noqa: E731
    monkeypatch.setattr(loader, "dequantize_mxfp4", misread)
    model, _ = load_model(path, dtype="float32")
    assert failures(model, hf), f"MXFP4 {broken} went unnoticed"


def test_mxfp4_ffn_rank_reads_only_its_experts_blocks_and_scales(mxfp4_checkpoint):
    path, _ = mxfp4_checkpoint
    config = load_model_config(path)
    held = {0, 5}
    _, report = load_model(path, dtype="float32", selection=WeightSelection.experts_only(held))
    h, i = config.hidden_size, config.moe.intermediate_size
    per_expert = (2 * i * h // 2 + 2 * i * h // 32) + (h * i // 2 + h * i // 32) + 4 * (2 * i + h)  # blocks, scales, fp32 biases
    assert report.bytes_read == config.num_layers * len(held) * per_expert


def test_other_quantisation_of_gpt_oss_is_refused(checkpoints, tmp_path):
    path, _ = checkpoints[GPT_OSS]
    dst = tmp_path / "int4"
    shutil.copytree(path, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq"}
    (dst / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedArchitectureError, match="awq"):
        load_model(dst)


def test_minimax_fp8_release_reads_as_v3s(checkpoints, tmp_path):
    """MiniMax-M2's release is fp8 block-scaled under Mixtral's names (``block_sparse_moe.experts.{e}.w1``...):
    it loads as V3's does, in both modes, and equals transformers on the dequantised weights."""
    import copy

    from safetensors import safe_open
    from safetensors.torch import save_file

    from tests.models.test_fp8 import BLOCK, dequantize, quantize

    src, hf = checkpoints[MINIMAX]
    dst = tmp_path / "minimax-fp8"
    shutil.copytree(src, dst)
    with safe_open(dst / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    stored, real = {}, {}
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith(".weight") and (".self_attn." in name or ".experts." in name) and "norm" not in name:
            q, s = quantize(t)
            stored[name], stored[name + "_scale_inv"], real[name] = q, s, dequantize(q, s)
        else:
            stored[name] = t
    save_file(stored, dst / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(BLOCK)}
    (dst / "config.json").write_text(json.dumps(raw))
    ref = copy.deepcopy(hf)
    state = ref.state_dict()
    inter = hf.config.intermediate_size
    for name, w in real.items():
        if ".experts." in name:  # Mixtral's w1 (gate), w3 (up), w2 (down) -> transformers' stacked experts
            layer, e, proj = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6]
            prefix = f"model.layers.{layer}.mlp.experts"
            if proj == "w2":
                state[f"{prefix}.down_proj"][e] = w
            else:
                state[f"{prefix}.gate_up_proj"][e, slice(0, inter) if proj == "w1" else slice(inter, 2 * inter)] = w
        else:
            state[name] = w
    ref.load_state_dict(state)
    for mode in ("dequantize", "keep"):
        model, report = load_model(dst, dtype="float32", fp8=mode)
        assert report.fp8 == mode
        assert not failures(model, ref.eval()), mode
