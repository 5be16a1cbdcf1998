"""The command line, run as a user would (real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from afd.config import EngineArgs, SamplingParams
from afd.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.procs


def afd(*args, check=True):
    env = {**os.environ, "AFD_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "afd.cli.main", *args], capture_output=True, text=True, check=check, env=env, timeout=300)


def test_generate_json_equals_the_engine(checkpoints):
    path, _ = checkpoints["qwen3-norm-topk"]
    out = afd("generate", str(path), "--prompt", "To be", "--prompt", "Now is the", "--max-tokens", "8", "--dtype", "float32", "--json", "--ignore-eos")
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    engine = LLMEngine.from_pretrained(path, EngineArgs(dtype="float32"))
    ref = engine.generate(["To be", "Now is the"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [r["prompt"] for r in rows] == ["To be", "Now is the"]
    assert [r["token_ids"] for r in rows] == [r.token_ids for r in ref]
    assert [r["text"] for r in rows] == [engine.tokenizer.decode(r.token_ids) for r in ref]


def test_monolithic_generate_steps_in_an_engine_core_process():
    """Counted: the engine that steps is another process (the engine core, as afd serve's), not a thread of the
    command, and it is gone when the command returns."""
    import re

    proc = subprocess.Popen([sys.executable, "-m", "afd.cli.main", "-v", "generate", "--prompt", "ROMEO:", "--max-tokens", "4",
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "AFD_NUM_THREADS": "1"})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert out.startswith("ROMEO:")
    pids = [int(p) for p in re.findall(r"engine core pid (\d+)", err)]
    assert len(pids) == 1 and pids[0] != proc.pid, err
    assert not os.path.exists(f"/proc/{pids[0]}")  # stopped with the command (its parent), not left behind


def test_generate_errors_are_one_line_and_nonzero(tmp_path):
    res = afd("generate", str(tmp_path / "missing"), "--prompt", "x", check=False)
    assert res.returncode == 2
    assert "afd: error:" in res.stderr and "does not exist" in res.stderr and "Traceback" not in res.stderr


def test_bench_generate_reports_a_table_and_json(checkpoints, tmp_path):
    path, _ = checkpoints["ds-noqlora-greedy"]
    out_json = tmp_path / "bench.json"
    res = afd("bench", "generate", str(path), "--runs", "2", "--warmup", "0", "--num-seqs", "2", "--prompt-len", "8", "--new-tokens", "4", "--json", str(out_json))
    assert "summary:" in res.stdout and "prefill" in res.stdout and "decode" in res.stdout
    data = json.loads(out_json.read_text())
    assert data["workload"] == {"num_seqs": 2, "prompt_len": 8, "new_tokens": 4}
    assert data["prefill_tok_s"] > 0 and data["decode_tok_s"] > 0


def test_trace_records_both_roles_per_layer_and_microbatch(tmp_path):
    trace = tmp_path / "t.json"
    afd("generate", "--prompt", "ROMEO:", "--prompt", "To be, or not", "--max-tokens", "2", "--attention-ranks", "1", "--ffn-ranks", "2",
        "--mode", "async", "--num-microbatches", "2", "--split", "token", "--trace", str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert sorted(names.values()) == ["attention rank 0", "ffn rank 0", "ffn rank 1"]
    spans = [e for e in events if e["ph"] == "X"]
    attn = {(e["cat"], e["args"]["layer"], e["args"]["microbatch"]) for e in spans if names[e["pid"]] == "attention rank 0"}
    from afd.cli.common import BUILTIN_MODEL
    from afd.models import load_model_config

    cfg = load_model_config(BUILTIN_MODEL)
    for layer in range(cfg.num_layers):
        sent = "dispatch" if cfg.is_moe_layer(layer) else "local_ffn"  # a dense layer's MLP runs here: nothing is sent
        for mb in (0, 1):
            assert {("attention", layer, mb), (sent, layer, mb), ("combine", layer, mb)} <= attn
    ffn_layers = {e["args"]["layer"] for e in spans if names[e["pid"]].startswith("ffn")}
    assert ffn_layers == set(cfg.moe.layers)
    png = tmp_path / "t.png"
    afd("trace", "plot", str(trace), "-o", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_capture_diff_finds_no_divergence_across_modes_and_names_an_injected_one(tmp_path):
    from safetensors.torch import load_file, save_file

    common = ["--prompt", "ROMEO:", "--prompt", "To be, or not", "--max-tokens", "4", "--dtype", "float32", "--ignore-eos"]
    afd("generate", *common, "--capture", str(tmp_path / "mono"))
    afd("generate", *common, "--attention-ranks", "2", "--ffn-ranks", "1", "--mode", "async", "--num-microbatches", "2",
        "--split", "token", "--capture", str(tmp_path / "split"))
    res = afd("capture", "diff", str(tmp_path / "mono"), str(tmp_path / "split"))
    assert "no divergence" in res.stdout
    # canary: one row of one boundary changed -> named exactly
    files = sorted((tmp_path / "split").glob("*.safetensors"))
    (tmp_path / "bad").mkdir()
    for f in files:
        t = load_file(str(f))
        if "req1.L2.attn_output" in t:
            pos = t["req1.positions"].tolist().index(3)
            t["req1.L2.attn_output"][pos, 5] += 1.0
        save_file(t, str(tmp_path / "bad" / f.name))
    res = afd("capture", "diff", str(tmp_path / "mono"), str(tmp_path / "bad"), check=False)
    assert res.returncode == 1
    assert "layer 2, boundary attn_output, request 1, position 3" in res.stdout, res.stdout


def test_bench_serve_measures_every_config_and_leaves_nothing(tmp_path):
    out_json = tmp_path / "serve.json"
    res = afd("bench", "serve", "--num-requests", "4", "--runs", "1", "--concurrency", "2", "--prompt-len", "8:16",
              "--output-len", "4:6", "--json", str(out_json))
    assert "TTFT p50" in res.stdout and "1A1F-async" in res.stdout
    data = json.loads(out_json.read_text())
    assert list(data["results"]) == ["monolithic", "1A1F-async"]
    for r in data["results"].values():  # every request streamed exactly its tokens (the bench checks), timings ordered
        m = r["median"]
        assert m["output_tokens_per_s"] > 0 and 0 < m["ttft_ms_p50"] <= m["ttft_ms_p99"] and 0 < m["itl_ms_p50"] <= m["itl_ms_p99"]
    bad = afd("bench", "serve", "--config", "nameonly", check=False)
    assert bad.returncode == 2 and "NAME=FLAGS" in bad.stderr


def test_bench_mixed_measures_every_scenario_on_a_model_of_a_short_context(tmp_path):
    """The built-in model's context is 1,024 tokens: the decoding streams ask for no more than it holds (they asked for
    4,032 and the server refused every one), and every scenario yields its figure and the server's RSS."""
    from afd.cli.common import BUILTIN_MODEL

    out_json = tmp_path / "mixed.json"
    afd("bench", "mixed", str(BUILTIN_MODEL), "--serve-flags", "--dtype float32", "--prompts", "900", "--decodes", "4",
        "--window", "1", "--json", str(out_json))
    data = json.loads(out_json.read_text())
    assert list(data) == ["TTFT 900-token prompt alone", "TTFT 900-token prompt beside 4 decoding", "decode, 4 running"], data
    assert data["TTFT 900-token prompt alone"]["ttft_s"] > 0 and data["TTFT 900-token prompt beside 4 decoding"]["ttft_s"] > 0
    assert data["decode, 4 running"]["tokens_per_s"] > 0
    assert all(r["peak_rss_mib"] > 0 for r in data.values())


def test_devices_this_host_lacks_are_refused_before_anything_starts():
    no_cuda = {"CUDA_VISIBLE_DEVICES": ""}  # a CUDA host too looks like one without, for this test
    for argv, words in [
        (("--device", "cuda:0"), "cuda:0 asked for, but this host has no CUDA device"),
        (("--attention-devices", "cuda:0", "--ffn-devices", "cpu", "--transport", "shm"), "cuda:0 asked for"),
        (("--device", "cuda:0", "--attention-ranks", "1", "--ffn-ranks", "1"), "--device is for monolithic runs"),
        (("--device", "cpu:0-1"), "--device takes cpu, cuda:N or npu:N"),
    ]:
        res = subprocess.run([sys.executable, "-m", "afd.cli.main", "generate", "--prompt", "x", *argv], capture_output=True,
                             text=True, env={**os.environ, **no_cuda}, timeout=300)
        assert res.returncode == 2, (argv, res.stderr)
        assert words in res.stderr and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, (argv, res.stderr)


@pytest.mark.cuda
def test_monolithic_on_cuda_equals_cpu():
    """``afd generate --device cuda:0`` (fp32) greedy-decodes the built-in model as the CPU reference does."""
    from afd.cli.common import BUILTIN_MODEL
    from afd.engine.tokenizer import Tokenizer
    from afd.models import load_model
    from afd.testing.parity import compare_greedy
    from tests.support import greedy_with_gaps

    out = afd("generate", "--device", "cuda:0", "--dtype", "float32", "--prompt", "ROMEO:", "--max-tokens", "24",
              "--temperature", "0", "--ignore-eos", "--json")
    got = json.loads(out.stdout)["token_ids"]
    model = load_model(BUILTIN_MODEL, dtype="float32")[0]
    ref, gaps = greedy_with_gaps(model, Tokenizer(BUILTIN_MODEL).encode("ROMEO:"), 24)
    report = compare_greedy(ref, got, gaps, min_compared=8)
    assert report.ok, str(report)


def test_bench_pipeline_and_connector_report_consistent_figures(tmp_path):
    """Both benchmarks run end to end on small settings; their JSON holds figures that fit together."""
    from afd.cli.common import BUILTIN_MODEL

    out = tmp_path / "pipeline.json"
    res = afd("bench", "pipeline", str(BUILTIN_MODEL), "--runs", "1", "--num-seqs", "2", "--prompt-len", "16", "--new-tokens", "2",
              "--json", str(out))
    assert "summary:" in res.stdout and "vs sync" in res.stdout
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"sync", "async m=2", "async m=2, min 16 tok", "async auto (m<=2), fitted", "async auto (m<=2), learned",
                            "monolithic (2 threads)"}
    for name, r in results.items():
        assert r["step_s"] > 0, name
        if "attention_busy" in r:
            assert 0 < r["attention_busy"] <= 1 and 0 <= r["bubble"] <= 1 and abs(r["attention_busy"] + r["bubble"] - 1) < 0.02, (name, r)
            assert 0 < r["ffn_busy"] <= 1 and r["mean_gemm_rows"] >= 1, (name, r)
    assert results["sync"]["mean_in_flight"] <= 1.0  # sync never has two dispatches out
    for auto in ("fitted", "learned"):
        assert sum(results[f"async auto (m<=2), {auto}"]["steps_by_chosen_m"].values()) == 2  # one prefill step + one decode step

    afd("bench", "pipeline", str(BUILTIN_MODEL), "--runs", "2", "--num-seqs", "2", "--prompt-len", "16", "--new-tokens", "2",
        "--interleave", "--json", str(out))  # every split mode on one launch, round by round
    results = json.loads(out.read_text())["results"]
    split = {name: r for name, r in results.items() if name != "monolithic (2 threads)"}
    assert len(split) == 5 and all(len(r["runs_s"]) == 2 and r["step_s"] == pytest.approx(sum(r["runs_s"]) / 2) for r in split.values())
    # the overlap's ideal from each round's traced sync run: 1 / max(b, 1 - b) lies in [1, 2]
    ideals = results["sync"]["ideal_by_round"]
    assert len(ideals) == 2 and all(1 <= i <= 2 for i in ideals) and results["sync"]["ideal_speedup"] == pytest.approx(sum(ideals) / 2)
    # each side's work lies within its run: no overlap gains more than the run's length over the larger side's, >= 1
    assert len(results["sync"]["reach_by_round"]) == 2 and all(r >= 1 for r in results["sync"]["reach_by_round"])
    # the m=2 schedule on the sync run's own work, split at no cost, is never slower than the run
    assert len(results["sync"]["schedule_bound_by_round"]) == 2 and all(b >= 1 for b in results["sync"]["schedule_bound_by_round"])
    for name, r in split.items():  # every split run traced too: each side's work against the sync run's of its round
        if name != "sync":
            assert len(r["split_by_round"]) == 2 and all(c["attention"] > 0 and c["ffn"] > 0 and 0 < c["bound"] < 4
                                                         and 0 < c["reach"] for c in r["split_by_round"]), (name, r["split_by_round"])

    out = tmp_path / "connector.json"
    afd("bench", "connector", "--tokens", "1,64", "--iters", "5", "--hidden", "256", "--json", str(out))
    one_way = json.loads(out.read_text())["one_way_s"]
    assert {"memcpy", "loopback", "shm", "tcp", "torch", "raw gloo"} <= set(one_way)
    assert all(len(v) == 2 and all(0 < t < 1 for t in v) for v in one_way.values()), one_way


def test_bench_sampler_times_every_mix(tmp_path):
    from afd.cli.bench_sampler import MIXES

    out = tmp_path / "sampler.json"
    res = afd("bench", "sampler", "--vocab", "300", "--num-seqs", "3", "--runs", "1", "--history", "5", "--json", str(out))
    assert "summary:" in res.stdout
    data = json.loads(out.read_text())
    assert set(data) == {f"300 {m}" for m in MIXES} and all(v > 0 for v in data.values())


def test_bench_kernels_times_each_native_kernel_against_its_torch_path(tmp_path):
    out = tmp_path / "kernels.json"
    res = afd("bench", "kernels", "--decode-tokens", "2", "--context", "40", "--heads", "4", "--tokens", "3", "--runs", "2",
              "--rows", "4", "--linears", "64x32", "--mxfp4-experts", "4", "2", "64", "64", "--mxfp4-tokens", "2", "--gdn-tokens", "2", "--gdn", "4", "16", "16", "4", "--int8-rows", "2", "--int8-linears", "64x32", "--json", str(out))
    from afd.kernels import ops

    assert "summary:" in res.stdout and f"({ops().simd} register tiles)" in res.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"decode attention D=2 L=40", "experts T=3", "linear M=4 N=64 K=32", "mxfp4 T=2", "gdn decode D=2",
                         "int8 linear M=2 N=64 K=32"}
    mxfp4 = data.pop("mxfp4 T=2")
    int8 = data.pop("int8 linear M=2 N=64 K=32")
    assert all(int8[k] > 0 for k in ("int8_ms", "float32_ms", "bfloat16_ms"))
    assert all(v["native_ms"] > 0 and v["torch_ms"] > 0 for v in data.values())
    assert mxfp4["keep_ms"] > 0 and mxfp4["keep_mib"] < mxfp4["dequantized_mib"] / 3  # 4.25 bits against fp32's 32


def test_bench_hybrid_times_both_layer_kinds_against_context(tmp_path):
    out = tmp_path / "hybrid.json"
    res = afd("bench", "hybrid", "--contexts", "64", "512", "--dtype", "float32", "--runs", "2", "--json", str(out))
    assert "linear layer ms" in res.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["context"] for r in rows] == [64, 512] and rows[0]["layers"] == [30, 10]
    assert all(r["linear_ms"] > 0 and r["full_ms"] > 0 for r in rows)


def test_bench_attention_reports_sparse_and_window_figures(tmp_path):
    out = tmp_path / "attention.json"
    res = afd("bench", "attention", "--contexts", "300", "--heads", "4", "--index", "4", "16", "64", "--dtype", "float32",
              "--window-contexts", "1024", "--window", "32", "--runs", "2", "--json", str(out))
    assert "sparse/dense" in res.stdout
    data = json.loads(out.read_text())
    (dsa,), (window,) = data["dsa"], data["windows"]
    assert dsa["context"] == 300 and dsa["dense_ms"] > 0 and dsa["sparse_ms"] > 0 and dsa["indexer_ms"] > 0
    # 1024 tokens with a window of 32 over half the layers: a little over half the one-pool bytes
    assert window["window_blocks_held"] <= -(-(32 - 1) // 16) + 1 and 0.5 < window["ratio"] < 0.55


def test_bench_pipeline_counts_aggregation_across_attention_ranks(tmp_path):
    """--attention-ranks: the same load over 1 and 2 attention ranks; the FFN batches of A=2 hold two parts
    and keep their expert GEMM rows."""
    from afd.cli.common import BUILTIN_MODEL

    out = tmp_path / "agg.json"
    res = afd("bench", "pipeline", str(BUILTIN_MODEL), "--attention-ranks", "1,2", "--runs", "1", "--num-seqs", "4", "--prompt-len", "8",
              "--new-tokens", "3", "--json", str(out))
    assert "summary:" in res.stdout and "rows per expert GEMM" in res.stdout
    r = json.loads(out.read_text())["results"]
    assert r["A=1"]["items_per_ffn_batch"] == 1.0 and r["A=2"]["items_per_ffn_batch"] > 1.5
    assert r["A=2"]["mean_gemm_rows"] >= 0.9 * r["A=1"]["mean_gemm_rows"]
    assert all(0 < v["ffn_busy"] <= 1.0 for v in r.values())  # a CPU-time share can never pass 100 %


def test_bench_roofline_measures_the_machine_and_the_model(checkpoints, tmp_path):
    path, _ = checkpoints["ds-noqlora-greedy"]
    out = tmp_path / "roofline.json"
    res = afd("bench", "roofline", str(path), "--dtype", "float32", "--batch", "1", "3", "--steps", "3", "--context", "8",
              "--prefill-tokens", "32", "--prefill-len", "16", "--runs", "1", "--bandwidth-mib", "64", "--gemm-sizes", "128",
              "--json", str(out))
    assert "summary:" in res.stdout and "of bandwidth" in res.stdout
    data = json.loads(out.read_text())
    assert data["read_bandwidth_gb_s"] > 0 and set(data["gemm_peak_gflop_s"]) == {"float32", "bfloat16", "int8"}
    assert data["native"]["float32"] and data["compute_dtype"] == "float32"
    one, three = data["decode"]
    # three sequences touch at least the experts one does, and hold three times the cache
    assert three["weight_bytes"] >= one["weight_bytes"] > 0 and three["kv_bytes"] > 2 * one["kv_bytes"]
    assert [p["tokens"] for p in data["prefill"]] == [32] and data["prefill"][0]["sequences"] == 2
    assert all(0 < x["fraction"] for x in data["decode"] + data["prefill"])
    phases = {r["phase"]: r for r in data["prefill"][0]["phases"]}  # one step by phase, the GEMM phases against their bounds
    assert {"attention projections", "routed experts", "attention core", "other"} <= set(phases)
    assert 0 < phases["routed experts"]["of_bound"] and 0 < data["prefill"][0]["gemms"]["of_peak"]
    # each decode measured against the probes taken just before its steps, reported beside it
    assert all(x["bandwidth_gb_s"] > 0 and 0.5 < x["fraction"] * x["bandwidth_gb_s"] / x["gb_s"] < 2 for x in data["decode"])
