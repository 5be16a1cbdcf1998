"""``afd bench pipeline``: the async pipeline against sync on the same topology, and against monolithic.

Each mode gets its own launch (so the FFN rank's counters at exit belong to
it); inside a launch the workload runs ``--runs`` times after a warm-up.
Reported per mode: median step time, attention busy % and bubble % (from the
attention rank's runtime trace), FFN busy % and mean rows per expert GEMM
(from the FFN rank), in-flight depth; then the speed-ups.

``--interleave``: every split mode on one launch, in rounds (each round runs
each mode once), so a slow phase of a noisy machine hits every mode alike;
only times are reported then.

``--attention-ranks 1,2,4``: FFN aggregation instead. For each A, one launch of A
attention ranks against the FFN ranks (unpinned), the async pipeline on the same
total load (``--per-rank-load``: the load times A): rows per expert GEMM, parts
per FFN batch, FFN CPU seconds per generated token (the computing thread's, and the rank's whole process over
the timed runs), the straggler wait, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from afd import env
from afd.cli.common import cpu_features, instruction_sets, print_table
from afd.cli.pipeline_trace import fill_drain, overlap_ideals, run_window, schedule_bound, split_costs
from afd.config import EngineArgs, PipelineConfig, SamplingParams
from afd.distributed.topology import DISPATCH_DTYPES
from afd.microbatch import CostModel
from afd.runtime.forkserver import RunForkServer
from afd.runtime.messages import GetTrace, SetTrace
from afd.serving.offline import generate


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("pipeline", help="async vs sync vs monolithic on one topology")
    p.add_argument("model", nargs="?", help="model directory (default: a synthetic DeepSeek-V2-Lite-shaped checkpoint written to a temp dir)")
    p.add_argument("--synthetic", choices=["deepseek-v2-lite", "deepseek-v4-flash"], default="deepseek-v2-lite",
                   help="the synthetic model's shapes (without a model directory)")
    p.add_argument("--synthetic-layers", type=int, default=4, help="layers of the synthetic model (V2-Lite: the first dense)")
    p.add_argument("--attention-devices", default="cpu:0")
    p.add_argument("--ffn-devices", default="cpu:1")
    p.add_argument("--transport", default="shm", choices=["shm", "torch"])
    p.add_argument("--dispatch-dtype", choices=DISPATCH_DTYPES, default="model",
                   help="what each dispatch sends of the FFN input rows (afd/connectors/dispatch_dtype.py)")
    p.add_argument("--dense-on", choices=["attention", "ffn"], default="attention",
                   help="where the dense layers' MLPs run (V2-Lite's first layer): on the FFN side, they overlap too")
    p.add_argument("--num-seqs", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--split", choices=["request", "token"], default="token")
    p.add_argument("--min-microbatch-tokens", type=int, default=16, help="for the extra 'async, small steps whole' row")
    p.add_argument("--cost-model", help="costs for the 'async auto' rows (JSON of afd bench costs; default: fitted here first): "
                                        "the 'fitted' row plans with them only, the 'learned' row until it has learned the run's own")
    p.add_argument("--transfer-us", type=float, default=100.0, help="one-way message cost the auto row assumes when fitting here (default 100)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--interleave", action="store_true", help="run the split modes on one launch, round by round (times only)")
    p.add_argument("--attention-ranks", help="FFN aggregation: a comma list of attention-rank counts (e.g. 1,2,4), each against "
                                             "--ffn-ranks FFN ranks, async, at the same total load")
    p.add_argument("--ffn-ranks", type=int, default=1, help="with --attention-ranks: FFN ranks (default 1)")
    p.add_argument("--per-rank-load", action="store_true", help="with --attention-ranks: --num-seqs per attention rank, not in all")
    p.add_argument("--json", dest="json_out")
    p.set_defaults(func=run)


def _workload(vocab: int, args) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_seqs)]


def _cluster(model_dir: Path, args, forks, pipeline: PipelineConfig | None = None, attention_ranks: int | None = None):
    """The benchmark's cluster (not started; 1A1F on the given devices, or A unpinned attention ranks)
    and the workload's sampling parameters."""
    from afd.distributed.topology import Topology, parse_devices
    from afd.runtime.cluster import Cluster

    if attention_ranks is None:
        topo = Topology(parse_devices(args.attention_devices), parse_devices(args.ffn_devices), transport=args.transport,
                        dispatch_dtype=args.dispatch_dtype, dense_on=args.dense_on)
    else:
        topo = Topology(parse_devices(",".join(["cpu"] * attention_ranks)), parse_devices(",".join(["cpu"] * args.ffn_ranks)),
                        transport=args.transport, dispatch_dtype=args.dispatch_dtype, dense_on=args.dense_on)
    # every run repeats the same prompts (the comparison needs the same work): no prefix cache to serve them
    engine = EngineArgs(dtype="auto", kv_cache_memory=1 << 30, max_num_batched_tokens=max(4096, args.num_seqs * args.prompt_len),
                        enable_prefix_caching=False)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    return Cluster(model_dir, topo, engine, pipeline=pipeline or PipelineConfig(), faults=env.fault_plan(), forks=forks), params


def _run_split(model_dir: Path, args, pipeline: PipelineConfig, prompts, forks) -> dict:
    times, busy, inflight, chosen, edges, learned = [], [], [], {}, [], 0
    cluster, params = _cluster(model_dir, args, forks, pipeline)
    with cluster:
        t0 = time.perf_counter()
        generate(cluster, prompts, params, pipeline)  # warm-up
        warmup = time.perf_counter() - t0
        for _ in range(args.runs):
            cluster.request(0, SetTrace(True))
            t0 = time.perf_counter()
            generate(cluster, prompts, params, pipeline)
            wall = time.perf_counter() - t0
            events, _ = cluster.request(0, GetTrace())
            times.append(wall)
            start, end, attn = run_window(events)
            busy.append(attn / (end - start))
            inflight.append(statistics.mean(e.in_flight for e in events if e.action == "dispatch"))
            edges.append(fill_drain(events))
            for e in events:
                if e.action == "plan":  # adaptive: "chose m=2 (...)"
                    m = int(e.note.split("m=", 1)[1].split()[0])
                    chosen[m] = chosen.get(m, 0) + 1
                    learned += "learned costs" in e.note
        ffn_rank = next(r for r in cluster.ranks if r.spec.role.name == "FFN")
    stats = ffn_rank.final_stats or {}
    total = sum(times) + warmup  # the FFN counters include the warm-up (timed, not guessed: a slow first run)
    return {
        "step_s": statistics.median(times),
        "attention_busy": statistics.median(busy),
        "bubble": 1 - statistics.median(busy),
        "ffn_busy": stats.get("busy_cpu_s", 0.0) / total,  # CPU time of its computing thread
        "ffn_busy_wall": stats.get("busy_s", 0.0) / total,
        "mean_in_flight": statistics.median(inflight),
        "mean_gemm_rows": stats.get("mean_gemm_rows", 0.0),
        "items_per_ffn_batch": stats.get("items_per_batch", 0.0),
        "fill_drain": statistics.median(edges),
        **({"steps_by_chosen_m": dict(sorted(chosen.items()))} if chosen else {}),
        **({"steps_planned_with_learned_costs": learned} if pipeline.adaptive else {}),
    }


def _run_aggregation(model_dir: Path, args, prompts, forks) -> dict[str, dict]:
    """One launch per attention-rank count, async, the same total load (or the same per rank)."""
    counts = [int(x) for x in args.attention_ranks.split(",")]
    pipeline = PipelineConfig("async", args.num_microbatches, args.split)
    out = {}
    for a in counts:
        work = prompts * a if args.per_rank_load else prompts
        cluster, params = _cluster(model_dir, args, forks, pipeline, attention_ranks=a)
        with cluster:
            t0 = time.perf_counter()
            generate(cluster, work, params, pipeline)  # warm-up
            warmup = time.perf_counter() - t0
            settled = _idle_ffn_stats(cluster)  # the FFN ranks' process CPU after the load and the warm-up
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                generate(cluster, work, params, pipeline)
                times.append(time.perf_counter() - t0)
        ffn = [r.final_stats or {} for r in cluster.ranks if r.spec.role.name == "FFN"]
        generated = len(work) * args.new_tokens * (args.runs + 1)
        process_cpu = sum(f.get("process_cpu_s", 0.0) for f in ffn) - sum(s.get("process_cpu_s", 0.0) for s in settled.values())
        out[f"A={a}"] = {
            "step_s": statistics.median(times), "tokens_per_s": len(work) * args.new_tokens / statistics.median(times),
            "mean_gemm_rows": statistics.mean(f["mean_gemm_rows"] for f in ffn),
            "items_per_ffn_batch": statistics.mean(f["items_per_batch"] for f in ffn),
            "ffn_cpu_s_per_token": sum(f["busy_cpu_s"] for f in ffn) / generated,
            "ffn_wall_s_per_token": sum(f["busy_s"] for f in ffn) / generated,
            # the whole process over the timed runs (and its shutdown), from its counters once idle after the warm-up
            "ffn_process_cpu_s_per_token": process_cpu / (len(work) * args.new_tokens * args.runs) if settled else float("nan"),
            "straggler_wait_s_per_batch": sum(f["straggler_wait_s"] for f in ffn) / max(1, sum(f["batches"] for f in ffn)),
            "ffn_busy": sum(f["busy_cpu_s"] for f in ffn) / (len(ffn) * (sum(times) + warmup)),
        }
        print(f"A={a}: {out[f'A={a}']['tokens_per_s']:.1f} tok/s, {out[f'A={a}']['mean_gemm_rows']:.1f} rows per expert GEMM",
              file=sys.stderr)
    return out


def _idle_ffn_stats(cluster, timeout: float = 15.0) -> dict[str, dict]:
    """The FFN ranks' live counters once each reported itself idle twice with the same unions (empty if not
    within ``timeout``): a rank reports at most once a second while busy, and at once when it falls idle."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        stats = dict(cluster.status.ffn_stats)
        now = {name: s.get("batches") for name, s in stats.items()}
        if stats and all(s.get("idle") for s in stats.values()) and now == last:
            return stats
        last = now
        time.sleep(0.3)
    return {}


def _print_aggregation(results: dict[str, dict], args, label: str) -> None:
    rows = [("attention ranks", "run s", "tok/s", "GEMM rows", "parts/batch", "FFN CPU us/tok", "FFN process us/tok", "FFN wall us/tok",
             "straggler ms/batch")]
    for name, r in results.items():
        rows.append((name, f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.1f}", f"{r['mean_gemm_rows']:.1f}", f"{r['items_per_ffn_batch']:.2f}",
                     f"{1e6 * r['ffn_cpu_s_per_token']:.1f}", f"{1e6 * r['ffn_process_cpu_s_per_token']:.1f}",
                     f"{1e6 * r['ffn_wall_s_per_token']:.1f}", f"{1e3 * r['straggler_wait_s_per_batch']:.2f}"))
    print_table(rows)
    first, last = next(iter(results.values())), list(results.values())[-1]
    load = f"{args.num_seqs} seqs per attention rank" if args.per_rank_load else f"{args.num_seqs} seqs in all"
    print(f"machine: {instruction_sets(cpu_features())}")
    print(f"summary: {label}; {', '.join(results)} x {args.ffn_ranks} FFN over {args.transport}, async m={args.num_microbatches} "
          f"{args.split}; {load} x {args.prompt_len} prompt + {args.new_tokens} new, median of {args.runs}: rows per expert GEMM "
          f"{last['mean_gemm_rows'] / first['mean_gemm_rows']:.2f}x, FFN CPU per token "
          f"{last['ffn_cpu_s_per_token'] / first['ffn_cpu_s_per_token']:.2f}x (its whole process "
          f"{last['ffn_process_cpu_s_per_token'] / first['ffn_process_cpu_s_per_token']:.2f}x), {list(results)[-1]} vs {list(results)[0]}")


def _run_interleaved(model_dir: Path, args, pipelines: dict[str, PipelineConfig], prompts, forks) -> dict[str, dict]:
    """Every split mode on one launch, one run of each per round after a warm-up of each: medians of step time.
    Every run is traced. A sync run gives the overlap's ideal for its round, (T_attn + T_ffn) / max(T_attn,
    T_ffn), T_attn the attention rank's own work in its trace (pipeline_trace.BUSY) and T_ffn the FFN
    rank's busy time (its computed unions' spans) within the run; what is neither (transfers, wake-ups, the
    engine between steps) is reported as its slack. An async run gives its split's cost: each side's work
    against the sync run's of the round, and the best the split's own work allows, (T_attn + T_ffn of the sync
    run) / max(T_attn, T_ffn of the async run)."""
    times: dict[str, list[float]] = {name: [] for name in pipelines}
    windows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in pipelines}  # each run: (start, end, attention busy s)
    sync_events: list = []  # each sync run's trace
    cluster, params = _cluster(model_dir, args, forks)
    with cluster:
        for pipeline in pipelines.values():
            generate(cluster, prompts, params, pipeline)  # warm-up
        for r in range(args.runs):
            for name, pipeline in pipelines.items():
                cluster.request(0, SetTrace(True))
                t0 = time.perf_counter()
                generate(cluster, prompts, params, pipeline)
                times[name].append(time.perf_counter() - t0)
                events, _ = cluster.request(0, GetTrace())
                cluster.request(0, SetTrace(False))
                windows[name].append(run_window(events))
                if name == "sync":
                    sync_events.append(events)
            print(f"round {r}: " + ", ".join(f"{name} {t[-1]:.3f} s" for name, t in times.items()), file=sys.stderr)
        ffn_rank = next(r for r in cluster.ranks if r.spec.role.name == "FFN")
    spans = (ffn_rank.final_stats or {}).get("spans", [])
    ideals, slack, reach = overlap_ideals(windows["sync"], spans)
    results = {name: {"step_s": statistics.median(t), "runs_s": t} for name, t in times.items()}
    scheduled = [(w[1] - w[0]) / schedule_bound(ev, spans, args.num_microbatches) for w, ev in zip(windows["sync"], sync_events)]
    results["sync"].update(ideal_speedup=statistics.median(ideals), ideal_by_round=ideals, slack_by_round=slack, reach_by_round=reach,
                           schedule_bound_by_round=scheduled)
    for name in pipelines:
        if name != "sync":
            results[name]["split_by_round"] = split_costs(windows["sync"], windows[name], spans)
    return results


def _run_monolithic(model_dir: Path, args, prompts) -> dict:
    from afd.engine.llm_engine import LLMEngine

    torch.set_num_threads(2)
    engine = LLMEngine.from_pretrained(model_dir, EngineArgs(kv_cache_memory=1 << 30, max_num_batched_tokens=max(4096, args.num_seqs * args.prompt_len),
                                                             enable_prefix_caching=False))  # the same prompts every run, as the split runs
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times)}


def _auto_costs(model_dir: Path, args) -> CostModel:
    """The cost model the adaptive row plans with: --cost-model, else fitted on this model now."""
    if args.cost_model:
        c = json.loads(Path(args.cost_model).read_text())
    else:
        from afd.cli.bench_costs import fit
        from afd.models import load_model

        model, _ = load_model(model_dir)
        c = fit(model, repeats=3, threads=1)  # one thread, as the ranks run
        del model
    cost = CostModel.from_fit(c, transfer=args.transfer_us * 1e-6)
    keys = ("attn_token", "attn_context", "ffn_token", "attn_call", "ffn_call", "transfer", "ffn_expert", "local_token", "local_call")
    print("auto row costs: " + ", ".join(f"{k} {getattr(cost, k):.3g}" for k in keys)
          + (", ffn measured " + ", ".join(f"{n}: {1e3 * t:.0f} ms" for n, t in cost.ffn_curve) if cost.ffn_curve else ""), file=sys.stderr)
    return cost


def run(args: argparse.Namespace) -> int:
    import uuid

    from afd.models import load_model_config
    from afd.models.synthetic import SYNTHETIC_SHAPES, write_random_checkpoint

    # every launch of the benchmark shares one fork server (torch imported once)
    forks = RunForkServer(env.run_id() or f"bench-{uuid.uuid4().hex[:8]}")
    tmp = None
    if args.model:
        model_dir = Path(args.model)
        label = str(model_dir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="afd-bench-model-")
        model_dir = Path(tmp.name)
        label = f"synthetic {args.synthetic}-shaped, {args.synthetic_layers} layers, bf16"
        print(f"writing a {label} checkpoint to {model_dir}", file=sys.stderr)
        write_random_checkpoint(SYNTHETIC_SHAPES[args.synthetic](num_layers=args.synthetic_layers), model_dir)
    try:
        prompts = _workload(load_model_config(model_dir).vocab_size, args)
        if args.attention_ranks:
            results = _run_aggregation(model_dir, args, prompts, forks)
            _print_aggregation(results, args, label)
            _write_json(args, label, results)
            return 0
        cost = _auto_costs(model_dir, args)
        m, split = args.num_microbatches, args.split
        pipelines = {
            "sync": PipelineConfig("sync"),
            f"async m={m}": PipelineConfig("async", m, split),
            f"async m={m}, min {args.min_microbatch_tokens} tok": PipelineConfig("async", m, split, min_microbatch_tokens=args.min_microbatch_tokens),
            f"async auto (m<={m}), fitted": PipelineConfig("async", m, split, cost=cost, adaptive=True, learn_costs=False),
            f"async auto (m<={m}), learned": PipelineConfig("async", m, split, cost=cost, adaptive=True),
        }
        if args.interleave:
            results = _run_interleaved(model_dir, args, pipelines, prompts, forks)
        else:
            results = {name: _run_split(model_dir, args, pipeline, prompts, forks) for name, pipeline in pipelines.items()}
        results["monolithic (2 threads)"] = _run_monolithic(model_dir, args, prompts)
    finally:
        forks.stop()
        if tmp is not None:
            tmp.cleanup()
    header = ("mode", "run s", "attn busy", "bubble", "fill+drain", "ffn busy", "in flight", "GEMM rows", "items/batch")
    rows = [header]
    for name, r in results.items():
        if "attention_busy" in r:
            rows.append((name, f"{r['step_s']:.3f}", f"{100 * r['attention_busy']:.0f}%", f"{100 * r['bubble']:.0f}%", f"{100 * r['fill_drain']:.0f}%",
                         f"{100 * r['ffn_busy']:.0f}%", f"{r['mean_in_flight']:.2f}", f"{r['mean_gemm_rows']:.1f}", f"{r['items_per_ffn_batch']:.2f}"))
        else:
            rows.append((name, f"{r['step_s']:.3f}", "", "", "", "", "", "", ""))
    print_table(rows)
    for name, r in results.items():
        if "steps_by_chosen_m" in r:
            print(f"{name}: steps by chosen m (all runs): " + ", ".join(f"m={m}: {n}" for m, n in r["steps_by_chosen_m"].items())
                  + (f"; {r['steps_planned_with_learned_costs']} planned with learned costs" if "steps_planned_with_learned_costs" in r else ""))
    a = results[f"async m={args.num_microbatches}"]["step_s"]
    a_min = results[f"async m={args.num_microbatches}, min {args.min_microbatch_tokens} tok"]["step_s"]
    s_ = results["sync"]["step_s"]
    fitted = results[f"async auto (m<={args.num_microbatches}), fitted"]["step_s"]
    learned = results[f"async auto (m<={args.num_microbatches}), learned"]["step_s"]
    mono = results["monolithic (2 threads)"]["step_s"]
    print(f"machine: {instruction_sets(cpu_features())}")
    print(f"summary: {label}; {args.attention_devices} attention / {args.ffn_devices} FFN over {args.transport}"
          f"{', dense MLPs on the FFN side' if args.dense_on == 'ffn' else ''}; "
          f"{args.num_seqs} seqs x {args.prompt_len} prompt + {args.new_tokens} new, median of {args.runs}{' (interleaved)' if args.interleave else ''}: "
          f"async m={args.num_microbatches} {s_ / a:.2f}x vs sync ({s_ / a_min:.2f}x keeping steps under "
          f"{args.num_microbatches} x {args.min_microbatch_tokens} tokens whole; choosing m per step {s_ / fitted:.2f}x with the "
          f"fitted costs, {s_ / learned:.2f}x with the run's learned ones), "
          f"{mono / a:.2f}x vs monolithic")
    if "ideal_speedup" in results["sync"]:
        ideal = results["sync"]["ideal_speedup"]
        per_round = [s / x for s, x in zip(results["sync"]["runs_s"], results[f"async m={args.num_microbatches}"]["runs_s"])]
        print(f"overlap: async m={args.num_microbatches} / sync {s_ / a:.2f}x (rounds {', '.join(f'{x:.2f}' for x in per_round)}); "
              f"ideal from the sync runs' traces {ideal:.2f}x (rounds {', '.join(f'{x:.2f}' for x in results['sync']['ideal_by_round'])}; "
              f"their slack, neither side's work, {', '.join(f'{x:.0%}' for x in results['sync']['slack_by_round'])}); "
              f"the issue's bar 1 + 0.8 (ideal - 1) = {1 + 0.8 * (ideal - 1):.2f}x")
        reach = results["sync"]["reach_by_round"]
        if statistics.median(reach) < ideal:
            print(f"overlap: the sync runs already overlap some of their work (the shared experts beside the routed ones): against "
                  f"their own length the most any overlap could give is {statistics.median(reach):.2f}x (rounds "
                  f"{', '.join(f'{x:.2f}' for x in reach)}), not the ideal's {ideal:.2f}x")
        scheduled = results["sync"]["schedule_bound_by_round"]
        print(f"overlap: the m={args.num_microbatches} schedule run on the sync runs' own work (each layer's, split evenly; no transfer time, "
              f"no cost of splitting), simulated: at most {statistics.median(scheduled):.2f}x (rounds {', '.join(f'{x:.2f}' for x in scheduled)}): "
              f"the order the ideal leaves out (nothing leaves before micro-batch 0's local layers; each layer waits on the one before)")
        split = results[f"async m={args.num_microbatches}"]["split_by_round"]
        rounds = {key: ", ".join(f"{x[key]:.2f}x" for x in split) for key in ("attention", "ffn", "bound")}
        print(f"split: async m={args.num_microbatches}'s own work against the sync run's, per round: attention {rounds['attention']}, "
              f"FFN {rounds['ffn']}; the most its own work allows, overlapped perfectly: {rounds['bound']} "
              f"(median {(bound := statistics.median(x['bound'] for x in split)):.2f}x; against the sync run's own length "
              f"{statistics.median(x['reach'] for x in split):.2f}x)")
        if bound < 1.05:
            print(f"split: at m={args.num_microbatches} the split adds about what overlapping can hide on this machine: keep such steps "
                  f"whole (--min-microbatch-tokens, or --num-microbatches auto), or put more work on the lighter side (--dense-on)")
    _write_json(args, label, results)
    return 0


def _write_json(args: argparse.Namespace, label: str, results: dict) -> None:
    """``--json``: the results, with the model, the machine's instruction sets and the arguments."""
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": label, "instruction_sets": instruction_sets(cpu_features()), "results": results,
                                                   "args": vars(args) | {"func": None}}, indent=2, default=str))
