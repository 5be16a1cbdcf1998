"""``afd bench serve``: a bounded load generator against ``afd serve`` on 127.0.0.1.

For each configuration (default: monolithic, then 1 attention + 1 FFN rank in
async mode over shm) it starts ``afd serve`` on a free port, sends the same
seeded workload -- a closed loop at ``--concurrency``, or Poisson arrivals at
``--request-rate`` -- of token-id prompts with lengths drawn from
``--prompt-len`` and outputs of exactly ``--output-len`` tokens (EOS ignored),
streams every response, and reports throughput with TTFT and inter-token
latency percentiles. Ratios are against the first configuration, in one run.
``--url`` measures a server that is already running instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from afd.cli.common import cpu_features, instruction_sets, print_table, resolve_model

AGGREGATION_FLAGS = "--transport shm --mode async --num-microbatches 2 --split token"
#: what the FFN ranks report in /metrics, summed over them (mean GEMM rows and parts per batch: averaged)
FFN_METRICS = {"gemm_rows": "afd_ffn_mean_gemm_rows", "parts_per_batch": "afd_ffn_items_per_batch", "ffn_cpu_s": "afd_ffn_cpu_seconds_total",
               "ffn_process_cpu_s": "afd_ffn_process_cpu_seconds_total",
               "ffn_batches": "afd_ffn_batches_total", "ffn_rows": "afd_ffn_rows_total", "straggler_s": "afd_ffn_straggler_wait_seconds_total",
               "tokens": "afd_generation_tokens_total"}
DEFAULT_CONFIGS = ["monolithic=", "1A1F-async=--attention-ranks 1 --ffn-ranks 1 --transport shm --mode async --num-microbatches 2 --split token"]


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("serve", help="load-test afd serve over HTTP: throughput, TTFT, inter-token latency")
    p.add_argument("model", nargs="?", help="model directory (default: $AFD_MODEL or the built-in model)")
    p.add_argument("--synthetic-layers", type=int,
                   help="serve a random DeepSeek-V2-Lite-shaped checkpoint of this many layers (written to a temp dir, with the "
                        "built-in tokenizer) instead of MODEL")
    p.add_argument("--config", action="append", metavar="NAME=ARGS",
                   help="a server configuration: a name and `afd serve` flags, e.g. '1A2F=--attention-ranks 1 --ffn-ranks 2'; "
                        "repeatable (default: monolithic and 1A1F async over shm)")
    p.add_argument("--attention-ranks", help="FFN aggregation: a comma list of attention-rank counts (e.g. 1,2,4); one "
                                             "configuration each, async over shm against --ffn-ranks FFN ranks, instead of --config")
    p.add_argument("--ffn-ranks", type=int, default=1, help="with --attention-ranks (default 1)")
    p.add_argument("--url", help="measure this running server (e.g. http://127.0.0.1:8000) instead of starting one")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (closed loop; default 8)")
    p.add_argument("--request-rate", type=float, help="open loop: Poisson arrivals per second (still capped by --concurrency)")
    p.add_argument("--prompt-len", default="32:128", help="prompt tokens, uniform in MIN:MAX (default 32:128)")
    p.add_argument("--output-len", default="16:64", help="output tokens, uniform in MIN:MAX (default 16:64)")
    p.add_argument("--runs", type=int, default=3, help="measured runs per configuration; the table shows medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", help="write the results as JSON to this file")
    p.set_defaults(func=run)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise ValueError(f"bad length range {text!r}: use MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi


def workload(args, vocab: int, run: int = 0) -> list[tuple[list[int], int]]:
    """The requests of one run (each run its own prompts: a repeated run must not be served from the prefix cache)."""
    rng = random.Random(args.seed + 1000 * run)
    (plo, phi), (olo, ohi) = _range(args.prompt_len), _range(args.output_len)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(plo, phi))], rng.randint(olo, ohi)) for _ in range(args.num_requests)]


# ----------------------------------------------------------------------------- load


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk.get("choices"):
                    stamps.append(time.perf_counter())  # one chunk per generated token
    if len(stamps) != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {len(stamps)}")
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "e2e": stamps[-1] - t0, "tokens": len(stamps)}


async def _load(url: str, model: str, work, concurrency: int, rate: float | None, seed: int) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed + 1)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def limited(prompt, n, delay):
            await asyncio.sleep(delay)
            async with sem:
                return await _one(client, url, model, prompt, n)

        await asyncio.gather(*(limited(p[::-1], n, 0.0) for p, n in work[:2]))  # warm-up (prompts not in the run)
        delays, t = [], 0.0
        for _ in work:
            delays.append(t)
            if rate:
                t += rng.expovariate(rate)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p, n, d) for (p, n), d in zip(work, delays)))
        wall = time.perf_counter() - start
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {
        "wall_s": wall, "requests_per_s": len(results) / wall, "output_tokens_per_s": tokens / wall,
        **_percentiles("ttft_ms", [r["ttft"] * 1e3 for r in results]),
        **_percentiles("itl_ms", [x * 1e3 for x in itl]),
        **_percentiles("e2e_s", [r["e2e"] for r in results]),
    }


def ffn_metrics(url: str, settle_s: float = 15.0) -> dict:
    """The FFN ranks' counters from the server's /metrics (empty for a monolithic server), read once they have
    settled: every FFN rank reported itself idle and their rows add up to the rows the attention ranks sent
    them. A rank reports its counters at most once a second while busy, so a read right after the load ended
    saw up to a second's work missing (CPU and rows alike, against all of the engine's tokens). ``settled`` is
    False if they had not settled within ``settle_s``."""
    import httpx

    deadline = time.monotonic() + settle_s
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        values: dict[str, list[float]] = {}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if not line.startswith("#") and name in (*FFN_METRICS.values(), "afd_ffn_idle", "afd_connector_rows_sent_total"):
                values.setdefault(name, []).append(float(line.rsplit(" ", 1)[1]))
        if FFN_METRICS["gemm_rows"] not in values:
            return {}
        settled = (all(v == 1.0 for v in values.get("afd_ffn_idle", [0.0]))
                   and sum(values.get(FFN_METRICS["ffn_rows"], [])) == sum(values.get("afd_connector_rows_sent_total", [])))
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    averaged = ("gemm_rows", "parts_per_batch")
    return {**{k: (statistics.mean if k in averaged else sum)(values.get(m, [0.0])) for k, m in FFN_METRICS.items()}, "settled": settled}


def ffn_delta(after: dict, before: dict) -> dict:
    """The FFN counters of the work between two :func:`ffn_metrics` reads (the means, ``gemm_rows`` and
    ``parts_per_batch``, stay as of ``after``): a rank's process CPU counts from its start, its load included."""
    if not after:
        return {}
    means = ("gemm_rows", "parts_per_batch", "settled")
    return {k: v if k in means else v - before.get(k, 0.0) for k, v in after.items()}


def _percentiles(name: str, xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {f"{name}_p50": statistics.median(xs), f"{name}_p90": pick(0.90), f"{name}_p99": pick(0.99)}


# ----------------------------------------------------------------------------- servers


def synthetic_checkpoint(layers: int, root: Path, **overrides) -> Path:
    """A random DeepSeek-V2-Lite-shaped checkpoint of ``layers`` layers (``overrides``: config.json fields)
    with the built-in tokenizer, under ``root``: what a served synthetic model is, for benches and tests."""
    from afd.cli.common import BUILTIN_MODEL
    from afd.engine.tokenizer import Tokenizer
    from afd.models.synthetic import deepseek_v2_lite_shaped, write_random_checkpoint

    raw = deepseek_v2_lite_shaped(num_layers=layers, vocab_size=Tokenizer(BUILTIN_MODEL).vocab_size)
    raw.update(overrides)
    out = root / f"deepseek-v2-lite-shaped-{layers}l"
    write_random_checkpoint(raw, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN_MODEL / name, out / name)
    return out


def run(args: argparse.Namespace) -> int:
    from afd.engine.tokenizer import Tokenizer
    from afd.serving.spawn import ServerProcess

    configs = []
    if args.attention_ranks:
        args.config = [f"{a}A{args.ffn_ranks}F=--attention-ranks {a} --ffn-ranks {args.ffn_ranks} {AGGREGATION_FLAGS}"
                       for a in args.attention_ranks.split(",")]
    for c in args.config or DEFAULT_CONFIGS:
        name, sep, flags = c.partition("=")
        if not sep or not name:
            raise ValueError(f"bad --config {c!r}: use NAME=FLAGS (FLAGS may be empty for monolithic)")
        configs.append((name, shlex.split(flags)))
    tmp = Path(tempfile.mkdtemp(prefix="afd-bench-serve-"))
    try:
        model_dir = synthetic_checkpoint(args.synthetic_layers, tmp) if args.synthetic_layers else resolve_model(args.model)
        vocab = Tokenizer(model_dir).vocab_size
        rows, results = [], {}
        for name, flags in ([("url", [])] if args.url else configs):
            server = None if args.url else ServerProcess(model_dir, *flags)
            try:
                url, model = (args.url, None) if server is None else (server.url, server.model)
                if model is None:
                    import httpx

                    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
                before = ffn_metrics(url)
                runs = [asyncio.run(_load(url, model, workload(args, vocab, i), args.concurrency, args.request_rate, args.seed))
                        for i in range(args.runs)]
                ffn = ffn_delta(ffn_metrics(url), before)
            finally:
                if server is not None:
                    server.stop()
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            results[name] = {"flags": flags, "runs": runs, "median": med, **({"ffn": ffn} if ffn else {})}
            print(f"{name}: {med['output_tokens_per_s']:.1f} output tok/s (median of {args.runs})", file=sys.stderr)
        first = next(iter(results.values()))["median"]
        rows = [("config", "req/s", "out tok/s", "vs first", "TTFT p50", "p90", "p99 ms", "ITL p50", "p90", "p99 ms", "e2e p50 s")]
        for name, r in results.items():
            m = r["median"]
            rows.append((name, f"{m['requests_per_s']:.2f}", f"{m['output_tokens_per_s']:.1f}",
                         f"{m['output_tokens_per_s'] / first['output_tokens_per_s']:.2f}x",
                         *(f"{m[f'ttft_ms_{q}']:.0f}" for q in ("p50", "p90", "p99")),
                         *(f"{m[f'itl_ms_{q}']:.1f}" for q in ("p50", "p90", "p99")), f"{m['e2e_s_p50']:.2f}"))
        print(f"model {model_dir.name}; {args.num_requests} requests, prompt {args.prompt_len}, output {args.output_len} tokens, "
              + (f"{args.request_rate} req/s (Poisson), " if args.request_rate else "") + f"concurrency {args.concurrency}; "
              f"medians of {args.runs} runs; machine: {instruction_sets(cpu_features())}")
        print_table(rows)
        ffn_rows = [("config", "GEMM rows", "parts/batch", "FFN CPU ms/token", "straggler ms/batch")]
        for name, r in results.items():
            if "ffn" in r:
                f = r["ffn"]
                ffn_rows.append((name, f"{f['gemm_rows']:.1f}", f"{f['parts_per_batch']:.2f}", f"{1e3 * f['ffn_cpu_s'] / max(1, f['tokens']):.2f}",
                                 f"{1e3 * f['straggler_s'] / max(1, f['ffn_batches']):.2f}"))
        if len(ffn_rows) > 1:
            print("FFN ranks, over every run of the configuration, from /metrics once settled:")
            print_table(ffn_rows)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "func"},
                                                         "instruction_sets": instruction_sets(cpu_features()), "results": results}, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0
