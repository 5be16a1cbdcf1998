"""fp8 block-scaled checkpoints (DeepSeek-V3's release format): afd on the fp8 checkpoint equals
transformers on the same weights dequantised to fp32, in both modes (dequantise at load, keep fp8).

The test quantises and dequantises with its own code. Blocks are 12 x 24, so the routed experts'
[32, 64] and [64, 32] weights span at least 2 x 2 blocks with a partial last block on both axes.
Canaries: a loader that applies the scales transposed, or per row instead of per block, fails.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from afd.config import EngineArgs, PipelineConfig
from afd.distributed.topology import Topology, parse_devices
from afd.models import WeightSelection, load_model, quant
from afd.models.quant import Fp8Linear
from afd.runtime.messages import Capture
from tests import support

BLOCK = (12, 24)
FP8_MAX = 448.0  # float8_e4m3fn
CASE = "dsv3-grouped-yarn"
PROMPTS = [[0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99], [0, 200, 13, 7, 2]]


def quantizable(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek-V3's release stores in fp8: the linear weights of attention, MLPs and experts."""
    return (t.dim() == 2 and name.endswith(".weight") and (".self_attn." in name or ".mlp." in name)
            and "norm" not in name and not name.endswith("mlp.gate.weight"))


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 12 x 24 block: scale = amax / 448, q = w / scale in e4m3. Returns (q, scale_inv)."""
    rows, cols = w.shape
    nr, nc = -(-rows // BLOCK[0]), -(-cols // BLOCK[1])
    scale = torch.empty(nr, nc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]].float()
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The test's own dequantisation, element by element over blocks."""
    out = q.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] *= scale[i, j]
    return out


@pytest.fixture(scope="module")
def fp8_case(checkpoints, tmp_path_factory):
    """(fp8 checkpoint dir, transformers on its dequantised weights, names of the quantised tensors)."""
    src, hf = checkpoints[CASE]
    out = tmp_path_factory.mktemp("fp8") / CASE
    shutil.copytree(src, out)
    path = out / "model.safetensors"
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    stored, real, quantised = {}, {}, []
    for name, t in tensors.items():
        if quantizable(name, t):
            q, s = quantize(t)
            stored[name], stored[name + "_scale_inv"] = q, s
            real[name] = dequantize(q, s)
            quantised.append(name)
        else:
            stored[name] = t
    save_file(stored, path, metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(BLOCK)}
    (out / "config.json").write_text(json.dumps(raw))
    ref = copy.deepcopy(hf)
    state = ref.state_dict()
    # transformers holds the experts stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    for name, w in real.items():
        if ".mlp.experts." in name:
            prefix, e, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
            inter = hf.config.moe_intermediate_size
            if proj == "down_proj":
                state[f"{prefix}.down_proj"][e] = w
            else:
                rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                state[f"{prefix}.gate_up_proj"][e, rows] = w
        else:
            state[name] = w
    ref.load_state_dict(state)
    return out, ref.eval(), quantised


def _failures(model, ref):
    from tests.models.test_parity_hf import parity_reports

    return [str(r) for r in parity_reports(model, ref, PROMPTS) if not r.ok]


def test_the_test_tensors_span_partial_blocks(fp8_case):
    path, _, quantised = fp8_case
    expert = next(n for n in quantised if ".mlp.experts.0.gate_proj" in n)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        w, s = f.get_slice(expert).get_shape(), f.get_slice(expert + "_scale_inv").get_shape()
    assert s[0] >= 2 and s[1] >= 2 and w[0] % BLOCK[0] and w[1] % BLOCK[1]


@pytest.mark.parametrize("mode", ["dequantize", "keep"])
def test_fp8_checkpoint_equals_transformers_on_dequantised_weights(fp8_case, mode):
    path, ref, quantised = fp8_case
    model, report = load_model(path, dtype="float32", fp8=mode)
    assert report.fp8 == mode
    failures = _failures(model, ref)
    assert not failures, "\n".join(failures)
    experts = model.model.layers[model.config.moe.layers[0]].mlp.experts
    fp8_linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if mode == "keep":  # held as fp8 in memory, dequantised per GEMM
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.down_proj.dtype == torch.float8_e4m3fn
        assert len(fp8_linears) == sum(1 for n in quantised if ".mlp.experts." not in n)
    else:
        assert experts.gate_up_proj.dtype == torch.float32 and not fp8_linears


def test_fp8_checkpoint_differs_from_the_unquantised_one(fp8_case, checkpoints):
    """The quantisation is visible: the unquantised transformers model is *not* within tolerance of fp8 afd."""
    path, _, _ = fp8_case
    model, _ = load_model(path, dtype="float32")
    assert _failures(model, checkpoints[CASE][1])


@pytest.mark.parametrize("bug", ["transposed", "per_row"])
def test_canary_misapplied_scales_fail(fp8_case, monkeypatch, bug):
    path, ref, _ = fp8_case
    right = quant.expand_scales

    def wrong(scale_inv, rows, cols, block):
        if bug == "transposed":  # the scale grid read in the other order
            scale_inv = scale_inv.transpose(-1, -2).reshape(scale_inv.shape)
        else:  # one scale per row block, as if per output channel
            scale_inv = scale_inv[..., :1].expand(scale_inv.shape)
        return right(scale_inv, rows, cols, block)

    monkeypatch.setattr(quant, "expand_scales", wrong)
    for mode in ("dequantize", "keep"):
        model, _ = load_model(path, dtype="float32", fp8=mode)
        assert _failures(model, ref), f"{bug} scales went unnoticed ({mode})"


def test_ffn_rank_reads_only_its_experts_and_their_scales(fp8_case):
    path, _, _ = fp8_case
    held = [1, 6]
    model, report = load_model(path, dtype="float32", selection=WeightSelection.experts_only(held))
    with safe_open(path / "model.safetensors", framework="pt") as f:
        want = [n for n in f.keys() if ".mlp.experts." in n and int(n.split(".mlp.experts.")[1].split(".")[0]) in held]
        expect = sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in want)
    assert any(n.endswith("_scale_inv") for n in want)
    assert report.bytes_read == expect
    assert set(report.tensors) == {n for n in want if not n.endswith("_scale_inv")}


@pytest.mark.procs
def test_fp8_split_keep_mode_equals_monolithic(fp8_case):
    """fp8 held on the FFN ranks (keep), gate on the FFN side, async, A != F."""
    path, ref, _ = fp8_case
    model, _ = load_model(path, dtype="float32")
    ref_values, ref_logits = support.monolithic_capture(model, PROMPTS)
    t = Topology(parse_devices("cpu,cpu"), parse_devices("cpu,cpu,cpu"), transport="loopback", gate="ffn")
    engine = EngineArgs(dtype="float32", kv_cache_memory=16 << 20, block_size=4, fp8_weights="keep")
    with support.cluster(path, t, engine, pipeline=PipelineConfig("async", 2, "token")) as cluster:
        for rank in range(2):
            values, logits = cluster.request(rank, Capture(PROMPTS))
            failures = support.split_parity_failures(model, ref_values, ref_logits, values, logits, check_topk=False)
            assert not failures, "\n".join(failures)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq"}, "not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "static"),
])
def test_unsupported_quantisation_is_refused(fp8_case, tmp_path, config, message):
    path, _, _ = fp8_case
    out = tmp_path / "q"
    shutil.copytree(path, out)
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        load_model(out, dtype="float32")


def test_whole_block_dequantisation_equals_the_reference():
    """Shapes that are multiples of the block take a blocked-view path; it equals the test's own loop."""
    w = torch.randn(48, 72) * 0.1
    q, s = quantize(w)
    assert s.shape == (4, 3)
    torch.testing.assert_close(quant.dequantize(q, s, BLOCK, torch.float32), dequantize(q, s), rtol=0, atol=0)
    stacked = quant.dequantize(torch.stack([q, q]), torch.stack([s, 2 * s]), BLOCK, torch.float32)
    torch.testing.assert_close(stacked[1], 2 * dequantize(q, s), rtol=0, atol=0)
