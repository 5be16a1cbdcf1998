"""W8A8 int8 checkpoints (compressed-tensors ``int-quantized``, issue 29) against an independent reference written
here: afd's fp32 model with each quantised linear replaced by the scheme computed in torch from the checkpoint's
int8 tensors: the input rounded to int8 per token, the integer product exact in float64, the accumulator times
both scales. Per layer the allowed error is 1% of what the quantisation itself changes there (the same model
over the decoded weights, unrounded); the canaries' errors are above it.

Why the product is exact rather than a float32 GEMM of the decoded weights: the reference and afd then round
each token to int8 from the same values. A float32 GEMM differs from afd's int32 accumulation by a last bit,
which is enough to move an input that lies within a float32 ulp of a rounding tie (one run had elements
7.6e-6 steps from one) to the other int8 value: one step of one element, ~15 % of the whole quantisation error
at that layer, by chance of the values, whatever afd computes right or wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from afd.models import WeightSelection, load_model
from afd.models.int8 import Int8Scheme, int8_linear, int8_scheme, quantize_per_token
from afd.models.layers import GroupedExperts
from tests import support

CASE = "ds-noqlora-greedy"  # MLA (kv_b_proj dequantised at load), dense layers, shared experts, one safetensors file
PROMPTS = [[0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99], [0, 200, 13, 7, 2]]


@pytest.fixture(scope="module")
def w8a8(checkpoints, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    src, _ = checkpoints[CASE]
    root = tmp_path_factory.mktemp("w8a8")
    decoded = support.write_w8a8_checkpoint(src, root / "w8a8")
    shutil.copytree(src, root / "decoded")
    tensors = load_file(src / "model.safetensors")
    save_file({**tensors, **decoded}, root / "decoded" / "model.safetensors", metadata={"format": "pt"})
    return root


def reference(decoded_dir, fake: bool = True):
    """The scheme in pure torch: the decoded weights' model; with ``fake`` every quantised linear computed from the
    int8 checkpoint beside it as :func:`exact_int8` (MLA's kv_b_proj is not quantised: afd, as vLLM, dequantises it at
    load for the absorbed decode)."""
    from safetensors.torch import load_file

    model = load_model(decoded_dir, dtype="float32")[0]
    if not fake:
        return model
    int8 = load_file(decoded_dir.parent / "w8a8" / "model.safetensors")
    scheme = Int8Scheme(("Linear",), support.W8A8_IGNORE)

    def held(name):  # (int8 weight, scales [N]) of a quantised linear
        return int8[f"{name}.weight"], int8[f"{name}.weight_scale"].float().reshape(-1)

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and scheme.quantises(name) and not name.endswith("kv_b_proj"):
            m.forward = (lambda qw, ws, b: lambda x: exact_int8(x, qw, ws, b))(*held(name), m.bias)
        elif isinstance(m, GroupedExperts):
            ids = m.expert_ids  # local expert e is ids[e]
            gate_up = [tuple(torch.cat(t) for t in zip(held(f"{name}.{e}.gate_proj"), held(f"{name}.{e}.up_proj"))) for e in ids]
            down = [held(f"{name}.{e}.down_proj") for e in ids]
            m.forward = m.reference
            m._project = (lambda gate_up, down: lambda e, which, x, bias, weights, quantized=None:
                          exact_int8(x, *(gate_up if which == 0 else down)[e], bias))(gate_up, down)
    return model


def exact_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 as the scheme defines it: x rounded per token to int8 with scale max|x| / 127 (a zero row: scale 1), the
    integer product exact (float64 holds these sums), then the accumulator times both scales, plus the bias."""
    s = x.abs().amax(-1, keepdim=True).float() / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(x.float() / s).clamp(-127, 127)
    acc = (q.double() @ qweight.double().t()).float()
    y = acc * s * scales
    return (y if bias is None else y + bias.float()).to(x.dtype)


def outputs(model):
    runner, blocks = support.runner_and_blocks(model, 4, 64, 2)
    cap = support.Capture()
    logits = runner.execute([t for p in PROMPTS for t in p], [support.new_chunk(blocks, i, p) for i, p in enumerate(PROMPTS)], observer=cap)
    return [cap[(i, "ffn_output")] for i in range(model.config.num_layers)], logits


def failures(model, root) -> list[str]:
    got, logits = outputs(model)
    want, ref_logits = outputs(reference(root / "decoded"))
    plain, plain_logits = outputs(reference(root / "decoded", fake=False))
    out = []
    for i, (g, w, p) in enumerate([*zip(got, want, plain), (logits, ref_logits, plain_logits)]):
        quant_err = (w - p).abs().max().item()
        assert quant_err > 1e-3, f"boundary {i}: the reference's rounding changed nothing: the test cannot tell"
        err = (g - w).abs().max().item()
        if err > 0.01 * quant_err:
            out.append(f"boundary {i}: |afd - reference| {err:.3g} > 1% of the quantisation's own change {quant_err:.3g}")
    return out


def test_w8a8_equals_the_reference_per_layer(w8a8):
    model, report = load_model(w8a8 / "w8a8", dtype="float32")
    attn, layer = model.model.layers[0].self_attn, model.model.layers[model.config.moe.layers[0]]
    assert type(attn.q_proj).__name__ == "Int8Linear" and attn.q_proj.qweight.dtype == torch.int8
    assert type(attn.kv_b_proj).__name__ == "Linear", "MLA's kv_b_proj is dequantised at load"
    assert layer.mlp.experts.int8 and layer.mlp.experts.gate_up_proj.dtype == torch.int8
    assert type(model.lm_head).__name__ == "Linear" and layer.mlp.gate.weight.dtype == torch.float32, "ignored: unquantised"
    assert not failures(model, w8a8)


def test_greedy_agrees_under_the_near_tie_rule(w8a8):
    from afd.testing.parity import compare_greedy

    ours = load_model(w8a8 / "w8a8", dtype="float32")[0]
    ref = reference(w8a8 / "decoded")
    for prompt in PROMPTS:
        got, _ = support.greedy_with_gaps(ours, prompt, 16)
        want, gaps = support.greedy_with_gaps(ref, prompt, 16)
        report = compare_greedy(want, got, gaps, min_compared=8)
        assert report.ok, str(report)


def test_an_ffn_rank_reads_only_its_experts_int8_bytes(w8a8):
    """Role-aware: experts 0-3 only; the bytes read are their int8 weights and scales, nothing else."""
    from safetensors import safe_open

    _, report = load_model(w8a8 / "w8a8", dtype="float32", selection=WeightSelection.experts_only({0, 1, 2, 3}, shared_experts=False,
                                                                                                     routers=False, dense_mlp=False))
    with safe_open(w8a8 / "w8a8" / "model.safetensors", "pt") as f:
        want = sum(f.get_slice(n).get_shape()[0] * (f.get_slice(n).get_shape()[1] if len(f.get_slice(n).get_shape()) > 1 else 1)
                   * (1 if n.endswith(".weight") else 4)
                   for n in f.keys() if any(f".mlp.experts.{e}." in n for e in range(4)))
    assert report.bytes_read == want


def torch_twins(monkeypatch) -> None:
    """The native int8 ops off (afd/kernels): the canaries break the torch twins, which these tests then read. The
    native ops' own canaries are in tests/kernels/test_int8.py, against these twins."""
    from afd.models import int8, layers

    monkeypatch.setattr(int8, "native_ops", lambda: None)
    monkeypatch.setattr(layers, "native_ops", lambda: None)


def test_canary_scales_along_the_input_columns_fail(w8a8, monkeypatch):
    from afd.models import int8

    torch_twins(monkeypatch)

    plain = int8.int8_matmul

    def columns(q, s, qweight, weight_scale, dtype, bias=None, row_bias=None):
        k = qweight.shape[1]
        wrong = weight_scale.repeat(-(-k // weight_scale.numel()))[:k]  # one scale per input column
        return ((q.float() * s) @ (qweight.float() * wrong).t()).to(dtype) if q.shape[0] else plain(q, s, qweight, weight_scale, dtype, bias)

    monkeypatch.setattr(int8, "int8_matmul", columns)
    assert failures(load_model(w8a8 / "w8a8", dtype="float32")[0], w8a8)


def test_canary_one_activation_scale_per_tensor_fails(w8a8, monkeypatch):
    from afd.models import int8

    torch_twins(monkeypatch)

    def per_tensor(x):
        s = (x.abs().amax() / 127).clamp(min=1e-12).float().expand(x.shape[0], 1)
        return torch.round(x.float() / s).clamp(-127, 127).to(torch.int8), s

    monkeypatch.setattr(int8, "quantize_per_token", per_tensor)
    assert failures(load_model(w8a8 / "w8a8", dtype="float32")[0], w8a8)


def test_canary_a_module_on_the_ignore_list_quantised_is_refused(w8a8, monkeypatch):
    """The loader reading the ignore list wrong would take the unquantised LM head for int8: it refuses instead."""
    from afd.models.loader import CheckpointError

    monkeypatch.setattr(Int8Scheme, "quantises", lambda self, module: True)
    with pytest.raises(CheckpointError, match="lm_head.weight is a W8A8 target: it must be int8"):
        load_model(w8a8 / "w8a8", dtype="float32")


def test_zero_rows_and_empty_parts_quantise_without_nan():
    torch.manual_seed(0)
    w = torch.randint(-127, 128, (6, 32), dtype=torch.int8)
    scale = torch.rand(6) + 0.1
    x = torch.randn(3, 32)
    x[1] = 0
    q, s = quantize_per_token(x)
    assert not torch.isnan(s).any() and (q[1] == 0).all()
    y = int8_linear(x, w, scale)
    assert torch.isfinite(y).all() and (y[1] == 0).all()
    assert int8_linear(torch.zeros(0, 32), w, scale).shape == (0, 6)
    # canary: amax / 127 unguarded gives a zero row a 0/0 NaN
    assert torch.isnan(x[1:2] / (x[1:2].abs().amax(-1, keepdim=True) / 127)).all()


@pytest.mark.parametrize("change, match", [
    ({"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}}, "int4"),
    ({"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}, "group scales are not read"),
    ({"weights": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}}, "asymmetric weights"),
    ({"input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}}, "static scales"),
    ({"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}, "float8"),
])
def test_other_schemes_are_refused_with_the_reason(w8a8, tmp_path, change, match):
    raw = json.loads((w8a8 / "w8a8" / "config.json").read_text())
    group = raw["quantization_config"]["config_groups"]["group_0"]
    group.update(change)
    with pytest.raises(ValueError, match=match):
        int8_scheme(raw)
