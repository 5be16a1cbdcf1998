"""A quantised dispatch (``--dispatch-dtype``, issue 29): the split with int8 / fp8 / bf16 rows on the wire equals,
layer by layer, the monolithic model whose FFN half reads the same rows rounded as the test rounds them here (so the
only error the split adds is the rounding itself); bytes counted from the transport; an FFN rank with W8A8 experts reads the int8
rows as they arrive (no dequantise-requantise)."""

from __future__ import annotations

import pytest
import torch

from afd.config import EngineArgs, PipelineConfig
from afd.distributed.topology import Topology, parse_devices
from afd.models import WeightSelection, load_model
from afd.runtime.messages import Capture
from afd.testing.parity import compare_values
from tests import support

CASE = "ds-noqlora-greedy"
PROMPTS = [[0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99], [0, 200, 13, 7, 2], [0, 5, 6, 7, 8, 9, 10, 11, 12]]
ENGINE = EngineArgs(dtype="float32", kv_cache_memory=16 << 20, block_size=4)
FP8_MAX = 448.0


def rounded(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The rows as the wire carries them, back in float: per-row scales, symmetric (written here, not imported)."""
    if kind == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    top = 127.0 if kind == "int8" else FP8_MAX
    s = x.abs().amax(-1, keepdim=True) / top
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(x / s).clamp(-127, 127) if kind == "int8" else (x / s).to(torch.float8_e4m3fn).float()
    return (q * s).to(x.dtype)


def reference(path, kind: str, gate: str):
    """The monolithic model whose routed experts (and, with the gate on FFN, the router) read the rounded rows."""
    model = load_model(path, dtype="float32")[0]
    experts, router = model.experts, model.router
    model.experts = lambda layer, x, routing, quantized=None: experts(layer, rounded(x, kind), routing)
    if gate == "ffn":
        model.router = lambda layer, x, token_ids=None: router(layer, rounded(x, kind), token_ids)
    return model


@pytest.mark.parametrize("kind", ["int8", "fp8", "bf16"])
@pytest.mark.parametrize("gate", ["attention", "ffn"])
def test_split_with_a_quantised_dispatch_equals_the_rounded_reference(checkpoints, kind, gate):
    path, _ = checkpoints[CASE]
    model = reference(path, kind, gate)
    ref_values, ref_logits = support.monolithic_capture(model, PROMPTS)
    plain_values, _ = support.monolithic_capture(load_model(path, dtype="float32")[0], PROMPTS)
    t = Topology(parse_devices("cpu,cpu"), parse_devices("cpu,cpu,cpu"), transport="loopback", gate=gate, dispatch_dtype=kind)
    with support.cluster(path, t, ENGINE, pipeline=PipelineConfig("async", 2, "token")) as cluster:
        values, logits = cluster.request(0, Capture(PROMPTS))
    failures = []
    for i in range(model.config.num_layers):
        # each layer's FFN half against the reference's on the split's own attention output, so that both round the
        # same rows: a chained comparison rounds rows that differ by float noise (other batch shapes), and a value
        # within that noise of a rounding tie then moves by a whole step on one side only (one bf16 step is 2^-8 of
        # the value), by chance of the values whatever the split computes
        residual = values[(i, "attn_output")]
        want = residual + model.ffn(i, model.model.layers[i].post_attention_layernorm(residual))
        report = compare_values(f"layer {i} ffn_output", want, values[(i, "ffn_output")])
        if not report.ok:
            failures.append(str(report))
    assert not failures, "\n".join(failures)
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 0.5  # and the chain as a whole not far off
    # what the rounding costs, against the unquantised model: reported, and nonzero (the rows were rounded)
    last = model.config.num_layers - 1
    moved = (values[(last, "ffn_output")] - plain_values[(last, "ffn_output")]).abs().max().item()
    assert moved > 0, f"--dispatch-dtype {kind} changed nothing: the rows were not rounded"
    plain = load_model(path, dtype="float32")[0]
    agree = []
    for i in model.config.moe.layers:  # the experts the split's router chose (on the rows it read) against the unquantised model's
        norm = plain.model.layers[i].post_attention_layernorm
        x = norm(values[(i, "attn_output")])
        ids = plain.router(i, rounded(x, kind) if gate == "ffn" else x).topk_ids.sort(-1).values
        ref_ids = plain.router(i, norm(plain_values[(i, "attn_output")])).topk_ids.sort(-1).values
        agree.append(round(float((ids == ref_ids).all(-1).float().mean()), 3))
    print(f"{kind}, gate {gate}: last layer moved {moved:.3g} from the unquantised model; tokens routed as the unquantised "
          f"model routes them, per MoE layer: {agree}")


def test_int8_rows_cost_at_most_0_28_of_fp32_bytes(checkpoints):
    """Counted from the transport: the payload bytes of one dispatch (gate on FFN: only the rows travel)."""
    from tests.connectors.test_failover import F, PLACEMENT, Ranks

    path, _ = checkpoints[CASE]
    model = load_model(path, dtype="float32")[0]
    ffn = [load_model(path, dtype="float32", selection=WeightSelection.experts_only(PLACEMENT.experts_of(r), routers=True))[0]
           for r in range(F)]
    x = torch.randn(29, model.config.hidden_size)
    sent = {}
    for kind in ("model", "int8", "fp8", "bf16"):
        with Ranks(ffn, gate="ffn", dispatch_dtype=kind) as ranks:
            before = sum(ranks.endpoint.mailbox.stats.payload_bytes_sent.values())
            handle = ranks.endpoint.dispatch(model.config.moe.layers[0], 1, x, None, is_moe=True)
            ranks.endpoint.combine(handle, model.config.hidden_size, x.dtype)
            sent[kind] = sum(ranks.endpoint.mailbox.stats.payload_bytes_sent.values()) - before
    h = model.config.hidden_size
    assert sent["model"] == F * 29 * 4 * h
    assert sent["int8"] == sent["fp8"] == F * 29 * (h + 4) and sent["int8"] <= 0.28 * sent["model"]
    assert sent["bf16"] == sent["model"] // 2


def test_w8a8_experts_read_int8_rows_as_they_arrive(checkpoints, tmp_path, monkeypatch):
    """W8A8 experts on the FFN ranks, an int8 dispatch: each expert's first GEMM reads the received int8 rows and their
    scales (counted: no requantisation of the FFN input; only each expert's intermediate is quantised, as W8A8 does),
    and the combine equals the monolithic W8A8 model's routed experts, which quantise the same rows the same way.
    Counted in both expert loops: the native one (afd/kernels: one call per layer, given the int8 rows or not) and its
    torch twin (a call per GEMM: ``int8_matmul`` reads int8 rows, ``int8_linear`` quantises its input)."""
    from afd.models import layers
    from afd.testing.parity import compare_values
    from tests.connectors.test_failover import F, PLACEMENT, Ranks

    src, _ = checkpoints[CASE]
    support.write_w8a8_checkpoint(src, tmp_path / "w8a8")
    model = load_model(tmp_path / "w8a8", dtype="float32")[0]
    ffn = [load_model(tmp_path / "w8a8", dtype="float32", selection=WeightSelection.experts_only(PLACEMENT.experts_of(r)))[0]
           for r in range(F)]
    calls = {"requantised": 0, "read as sent": 0}

    def count(key: str, fn):
        return lambda *a, **k: (calls.__setitem__(key, calls[key] + 1), fn(*a, **k))[1]

    class NativeSpy:  # the native ops, their W8A8 expert loop counted by whether it was handed int8 rows
        def __init__(self, ops):
            self.ops = ops

        def __getattr__(self, name):
            return getattr(self.ops, name)

        def moe_experts_int8(self, x, q, *rest):
            return count("read as sent" if q is not None else "requantised", self.ops.moe_experts_int8)(x, q, *rest)

    native = layers.native_ops()
    layer = model.config.moe.layers[0]
    torch.manual_seed(5)
    x = torch.randn(29, model.config.hidden_size)
    routing = model.router(layer, x)
    counted = {}
    for loop in ("native", "torch"):
        if loop == "native":
            monkeypatch.setattr(layers, "native_ops", lambda: NativeSpy(native))
        else:
            monkeypatch.setattr(layers, "native_ops", lambda: None)
            monkeypatch.setattr(layers, "int8_linear", count("requantised", layers.int8_linear))
            monkeypatch.setattr(layers, "int8_matmul", count("read as sent", layers.int8_matmul))
        for kind in ("int8", "model"):
            calls.update({"requantised": 0, "read as sent": 0})
            with Ranks(ffn, dispatch_dtype=kind) as ranks:
                handle = ranks.endpoint.dispatch(layer, 1, x, routing, is_moe=True)
                y = ranks.endpoint.combine(handle, model.config.hidden_size, x.dtype)
            counted[loop, kind] = dict(calls)
            report = compare_values(f"combine ({kind} dispatch, {loop} loop)", model.experts(layer, x, routing), y)
            assert report.ok, str(report)
    # native: every call on a rank is handed the int8 rows as sent; rows sent in the compute dtype are quantised in it
    assert counted["native", "int8"]["read as sent"] == F and counted["native", "int8"]["requantised"] == 0, counted
    assert counted["native", "model"] == {"requantised": F, "read as sent": 0}, counted
    # torch twin: an expert's first GEMM reads the int8 rows as sent, its second quantises its intermediate
    invocations = counted["torch", "int8"]["read as sent"]
    assert invocations > 0 and counted["torch", "int8"]["requantised"] == invocations, counted
    # the control: rows sent in the compute dtype are quantised on arrival, before every first GEMM
    assert counted["torch", "model"] == {"requantised": 2 * invocations, "read as sent": 0}, counted
