"""DeepSeek-V4 as released (issue 28): the release's tensor names, fp8 attention and shared-expert weights with ue8m0
block scales (``X.scale``), FP4 routed experts (MXFP4 bit for bit: e2m1 pairs a byte, an e8m0 scale per 32), the MTP
layer skipped. A tiny checkpoint written in that format loads equal to the model it decodes to, with the weights
dequantised at load and kept packed."""

from __future__ import annotations

import json

import pytest
import torch

from afd.models import load_model
from afd.testing.parity import compare_values
from tests import support

SEQ = [0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99, 61, 221, 103, 50, 299, 190, 17, 65]


@pytest.fixture(scope="module")
def release(checkpoints, tmp_path_factory):
    path = support.write_v4_release(checkpoints["v4-csa-hca"][0], tmp_path_factory.mktemp("v4") / "release")
    return path, path.with_name(path.name + "-dequantised")


def outputs(model):
    runner, blocks = support.runner_and_blocks(model, 4, 64, 1)
    cap = support.Capture()
    logits = runner.execute(SEQ, [support.new_chunk(blocks, 0, SEQ)], observer=cap)
    return {i: cap[(i, "ffn_output")] for i in range(model.config.num_layers)}, logits


@pytest.mark.parametrize("mode", ["dequantize", "keep"])
def test_the_release_loads_equal_to_the_model_it_decodes_to(release, mode):
    path, decoded = release
    model, report = load_model(path, dtype="float32", fp8=mode, mxfp4=mode)
    reference, _ = load_model(decoded, dtype="float32")
    assert report.fp8 == mode and report.mxfp4 == mode and report.skipped_mtp == 2
    got, logits = outputs(model)
    want, ref_logits = outputs(reference)
    failures = [str(r) for r in (compare_values(f"layer {i}", want[i], got[i]) for i in want) if not r.ok]
    report_logits = compare_values("logits", ref_logits, logits)
    assert not failures and report_logits.ok, "\n".join(failures + [str(report_logits)])
    experts = model.model.layers[1].mlp.experts
    if mode == "keep":  # held packed: 4.25 bits a value, decoded per expert in the loop
        assert experts.mxfp4 and experts.gate_up_proj.dtype == torch.uint8
        assert type(model.model.layers[1].self_attn.q_a_proj).__name__ == "Fp8Linear"
    else:
        assert experts.gate_up_proj.dtype == torch.float32


def test_canary_a_scale_read_as_a_plain_number_fails(release, monkeypatch):
    """ue8m0 scales are exponents: bytes read as if they were the scale (not 2^(b - 127)) must not load equal."""
    from afd.models import mxfp4

    path, decoded = release
    plain = mxfp4.as_mxfp4
    monkeypatch.setattr("afd.models.loader.as_mxfp4", lambda packed, scales: (plain(packed, scales)[0], plain(packed, scales)[1] - 1))
    model, _ = load_model(path, dtype="float32")
    got, _ = outputs(model)
    want, _ = outputs(load_model(decoded, dtype="float32")[0])
    assert any(not compare_values(f"layer {i}", want[i], got[i]).ok for i in want)


@pytest.mark.parametrize("change, match", [
    (dict(expert_dtype="int4"), "expert_dtype 'int4' is not supported"),
    (dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "e5m2", "weight_block_size": [16, 16]}),
     "scale_fmt 'e5m2' is not supported"),
])
def test_unknown_expert_dtype_or_scale_format_is_refused_with_the_reason(release, tmp_path, change, match):
    import shutil

    path, _ = release
    shutil.copytree(path, tmp_path / "ckpt")
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path / "ckpt", dtype="float32")
