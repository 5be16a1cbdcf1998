"""Arguments and helpers shared by the commands."""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from afd import env
from afd.config import DEFAULT_FP8_MODE, DEFAULT_MXFP4_MODE, FP8_MODES, MXFP4_MODES, STATE_DTYPES, EngineArgs, Timeouts
from afd.distributed.topology import DISPATCH_DTYPES
from afd.runtime.procs import keep_freed_memory

BUILTIN_MODEL = Path(__file__).resolve().parent.parent / "assets" / "models" / "tiny-shakespeare-moe"


def resolve_model(arg: str | None) -> Path:
    """MODEL argument, else $AFD_MODEL, else the built-in model."""
    if arg:
        return Path(arg)
    return env.default_model() or BUILTIN_MODEL


def parse_size(text: str) -> int:
    """'512M', '2G', '1048576' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use bytes or a K/M/G suffix, e.g. 512M") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="compute dtype (auto: the checkpoint's)")
    p.add_argument("--kv-cache-memory", type=parse_size, default="256M", help="KV cache budget, e.g. 256M, 2G (default 256M)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens per step, longer prompts are chunked (default: the most whose worst-case step fits --max-step-memory)")
    p.add_argument("--max-step-memory", type=parse_size,
                   help="bytes a step's temporaries may take beyond weights and KV cache, e.g. 1G (default: as much as the KV "
                        "cache, between a 512- and an 8192-token step)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's, capped to what the KV cache holds)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompt prefixes seen before (default: on; the cache lives in, and is "
                        "sized by, --kv-cache-memory)")
    p.add_argument("--fp8-weights", choices=FP8_MODES, default=DEFAULT_FP8_MODE,
                   help="fp8 block-scaled checkpoints: dequantize once at load into --dtype (default: faster), or keep fp8 in "
                        "memory (about half the memory) and dequantize per GEMM")
    p.add_argument("--mxfp4-weights", choices=MXFP4_MODES, default=DEFAULT_MXFP4_MODE,
                   help="MXFP4 experts (gpt-oss): dequantize once at load into --dtype (default: faster), or keep the 4-bit "
                        "blocks in memory (about a quarter of bf16) and decode each expert inside the expert loop")
    p.add_argument("--state-dtype", choices=STATE_DTYPES, default="float32",
                   help="hybrid models (Qwen3-Next, Qwen3.5): the linear-attention layers' recurrent state in float32 "
                        "(default, as transformers keeps it) or in the model's --dtype (half the state memory in bf16)")
    p.add_argument("--device", default="cpu",
                   help="monolithic runs: cpu (default), cuda:N or npu:N (disaggregated runs: --attention-devices / --ffn-devices)")
    p.add_argument("--ready-timeout", type=float, default=Timeouts.ready, metavar="S",
                   help="the engine (every rank of a disaggregated run) must load and report READY within S seconds (default 300)")


def device_arg(text: str) -> str:
    """``--device`` of a monolithic run -> a torch device string, once this host is known to have it."""
    from afd.distributed.devices import check_present
    from afd.distributed.topology import parse_device

    device = parse_device(text)
    if device.cores:
        raise ValueError("--device takes cpu, cuda:N or npu:N; pin a monolithic run's cores with taskset")
    check_present([device])
    return device.torch_device


def monolithic_engine(args: argparse.Namespace, model_dir: Path):
    """The engine of a monolithic run in this process, from the engine flags (``afd generate --capture``)."""
    from afd.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_pretrained(model_dir, engine_args(args), device=device_arg(args.device))
    print(f"afd: {engine.limits.describe()}", file=sys.stderr, flush=True)
    return engine


def engine_core_client(args: argparse.Namespace, model_dir: Path):
    """A monolithic engine in its engine-core process (``afd serve``, ``afd generate``): its client, READY."""
    from afd.runtime.clients import engine_core_client as start

    client = start(model_dir, engine_args(args), device_arg(args.device), timeouts_from_args(args), env.num_threads(), env.fault_plan())
    print(f"afd: {client.core.ready.limits}", file=sys.stderr, flush=True)
    return client


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine flags, as one :class:`EngineArgs` (a launcher resolves what is left unset)."""
    return EngineArgs(args.dtype, args.kv_cache_memory, args.block_size, args.max_num_seqs, args.max_num_batched_tokens,
                      args.max_step_memory, args.max_model_len, args.enable_prefix_caching, args.fp8_weights, args.mxfp4_weights,
                      args.state_dtype)


def timeouts_from_args(args: argparse.Namespace) -> Timeouts:
    """Every wait of the run, from the flags, once."""
    return Timeouts(hang=args.hang_timeout, ready=args.ready_timeout)


def setup_process(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    threads = env.num_threads()
    if threads:
        torch.set_num_threads(threads)
    keep_freed_memory()  # a command that runs a model here (generate, bench, loopback ranks) steps like a rank


def add_topology_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregation (no flags: monolithic)")
    g.add_argument("--attention-devices", help="attention ranks' devices, e.g. cpu,cpu or cpu:0,cpu:1")
    g.add_argument("--ffn-devices", help="FFN ranks' devices, e.g. cpu or cpu:1")
    g.add_argument("--attention-ranks", type=int, help="shorthand: N attention ranks on CPU")
    g.add_argument("--ffn-ranks", type=int, help="shorthand: N FFN ranks on CPU")
    g.add_argument("--transport", choices=["loopback", "shm", "tcp", "torch"], default="shm",
                   help="loopback: ranks as threads of one process; shm: processes on this host (default); tcp: a socket per "
                        "link, on one host or several, survives rank losses; torch: torch.distributed (NCCL when every rank "
                        "is on CUDA, HCCL on NPUs, else gloo)")
    g.add_argument("--gate", choices=["attention", "ffn"], default="attention", help="where the router runs (default attention: per-expert M2N routing)")
    g.add_argument("--mode", choices=["sync", "async"], default="async",
                   help="async (default): micro-batches ping-ponged so attention overlaps transfer and FFN work; sync: dispatch, then wait, per layer")
    g.add_argument("--num-microbatches", type=_microbatches, default=2,
                   help="micro-batches per step in async mode: 1..8 (default 2), or auto[:M]: per step, the m <= M (default 4) "
                        "that the cost model's simulation of the schedule says is fastest (the costs: learned from the run's own "
                        "steps once it has seen enough, --cost-model or built-in coefficients until then)")
    g.add_argument("--split", choices=["request", "token"], default="token", help="cut micro-batches between requests, or anywhere (default)")
    g.add_argument("--min-microbatch-tokens", type=int, default=1,
                   help="a step with fewer than M x N tokens runs fewer micro-batches (e.g. 16 keeps small decode steps whole; default 1)")
    g.add_argument("--cost-model", help="JSON of planner costs fitted by `afd bench costs` (default: built-in coefficients)")
    g.add_argument("--fixed-costs", action="store_true",
                   help="with --num-microbatches auto: plan with --cost-model (or the built-in coefficients) only, never learn costs from the run")
    g.add_argument("--dense-on", choices=["attention", "ffn"], default="attention", help="where dense-layer MLPs run")
    g.add_argument("--shared-experts-on", choices=["attention", "ffn"], default="attention", help="where shared experts run")
    g.add_argument("--dispatch-dtype", choices=DISPATCH_DTYPES, default="model",
                   help="what the dispatch sends of each token's FFN input: the compute dtype (default), bf16, or fp8 / int8 with "
                        "an fp32 scale per token (a W8A8 FFN rank's int8 GEMMs read int8 as it arrives); the combine stays in "
                        "the compute dtype")
    g.add_argument("--placement", help="explicit expert placement, e.g. 0-3:0,4-7:1 (default: contiguous blocks); "
                                        "an expert listed on several ranks has a copy on each, e.g. 0-7:0,0-7:1")
    g.add_argument("--redundant-experts", type=int, default=0, metavar="N",
                   help="N expert copies beyond the logical experts, on other FFN ranks (N >= the routed experts: every "
                        "expert on two ranks); an FFN rank's loss is then survived (shm transport). Default 0: fail-stop")
    g.add_argument("--hang-timeout", type=float, default=10.0, metavar="S",
                   help="a rank that sends nothing, not even a heartbeat, for S seconds is hung (default 10); "
                        "a death is seen at once")
    m = p.add_argument_group("multi-node (one invocation per node, same flags, --transport tcp or torch)")
    m.add_argument("--nnodes", type=int, default=1,
                   help="nodes of the run (default 1); by default node 0 runs the attention ranks and the front end, "
                        "the FFN ranks go round-robin over nodes 1..N-1")
    m.add_argument("--node-rank", type=int, default=0, help="this invocation's node")
    m.add_argument("--attention-nodes", metavar="LIST", help="each attention rank's node, e.g. 0,0 (every attention rank runs on node 0)")
    m.add_argument("--ffn-nodes", metavar="LIST", help="each FFN rank's node, e.g. 1,2,1 (default: round-robin over nodes 1..N-1)")
    m.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (the rendezvous)")
    m.add_argument("--master-port", type=int, default=0, help="the rendezvous port (required with --nnodes 2 or more)")


def _microbatches(text: str):
    """'2' -> 2; 'auto' -> ('auto', 4); 'auto:8' -> ('auto', 8)."""
    if text == "auto" or text.startswith("auto:"):
        most = text.partition(":")[2]
        try:
            return ("auto", int(most) if most else 4)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad --num-microbatches {text!r}: use 1..8, auto or auto:M") from None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --num-microbatches {text!r}: use 1..8, auto or auto:M") from None


def topology_from_args(args: argparse.Namespace, num_experts: int):
    """The topology flags -> a validated Topology, or None for a monolithic run."""
    import dataclasses

    from afd.distributed.topology import ExpertPlacement, default_nodes, parse_topology_args, validate_topology

    topology = parse_topology_args(
        args.attention_devices,
        args.ffn_devices,
        args.attention_ranks,
        args.ffn_ranks,
        transport=args.transport,
        gate=args.gate,
        dense_on=args.dense_on,
        shared_experts_on=args.shared_experts_on,
        dispatch_dtype=args.dispatch_dtype,
        placement=ExpertPlacement.parse(args.placement, num_experts) if args.placement else None,
        redundant_experts=args.redundant_experts,
    )
    if topology is None and (args.nnodes > 1 or args.attention_nodes or args.ffn_nodes):
        raise ValueError("a multi-node run is disaggregated: add topology flags (e.g. --attention-ranks 1 --ffn-ranks 2 --transport tcp)")
    if topology is not None:
        attention_nodes, ffn_nodes = default_nodes(args.nnodes, topology.num_attention_ranks, topology.num_ffn_ranks,
                                                   args.attention_nodes, args.ffn_nodes)
        topology = dataclasses.replace(topology, attention_nodes=attention_nodes, ffn_nodes=ffn_nodes)
        if args.device != "cpu":
            raise ValueError("--device is for monolithic runs; a disaggregated run takes --attention-devices and --ffn-devices")
        validate_topology(topology, num_experts)
    return topology


def cluster_from_args(args: argparse.Namespace, model_dir, topology):
    """A Cluster (not started) from the engine, topology, pipeline, liveness and multi-node flags, and the
    environment (afd/env.py: the run id, threads, I/O log, injected faults)."""
    from afd.runtime.cluster import Cluster
    from afd.runtime.launcher import NodeSpec

    node = NodeSpec(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    return Cluster(model_dir, topology, engine_args(args), timeouts=timeouts_from_args(args), pipeline=pipeline_from_args(args),
                   node=node, run_id=env.run_id(), io_log=env.io_log(), faults=env.fault_plan(), threads=env.num_threads())


def pipeline_from_args(args: argparse.Namespace):
    from afd.config import PipelineConfig
    from afd.microbatch import CostModel

    cost = None
    if args.cost_model:
        import json

        cost = CostModel.from_fit(json.loads(Path(args.cost_model).read_text()))
    adaptive = isinstance(args.num_microbatches, tuple)
    m = args.num_microbatches[1] if adaptive else args.num_microbatches
    return PipelineConfig(mode=args.mode, num_microbatches=m, split=args.split, cost=cost,
                          min_microbatch_tokens=args.min_microbatch_tokens, adaptive=adaptive,
                          learn_costs=not args.fixed_costs)


def print_table(rows: list[tuple[str, ...]] | list[list[str]]) -> None:
    """Right-aligned columns; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def alternate(a, b, runs: int) -> tuple[float, float]:
    """Median seconds of a() and b(), run in turn after one warm-up call each (this machine's drift hits both alike)."""
    a(), b()
    ta, tb = [], []
    for _ in range(runs):
        for f, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def cpu_features() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith(("flags", "Features"))), []))
    except OSError:
        return set()


def instruction_sets(flags: set[str]) -> str:
    """The vector and matrix sets that decide a CPU kernel's speed, as /proc/cpuinfo names them."""
    named = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "asimd", "sve")
    return " ".join(f for f in named if f in flags) or "none of the named sets"
