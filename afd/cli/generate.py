"""``afd generate``: offline generation, monolithic (no topology flags) or disaggregated."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from afd.cli.common import (add_engine_args, add_topology_args, cluster_from_args, engine_core_client, monolithic_engine, resolve_model,
                            topology_from_args)
from afd.config import SamplingParams
from afd.serving.offline import run_offline

log = logging.getLogger("afd.generate")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts", description=__doc__)
    p.add_argument("model", nargs="?", help="local Hugging Face model directory (default: $AFD_MODEL or the built-in model)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="prompt i samples with seed S+i (same output whatever the batch)")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt: prompt, text, token_ids")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--capture", metavar="DIR", help="capture layer_input/attn_output/ffn_output/final_hidden of every token to DIR (safetensors)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace of every rank's spans to this file (disaggregated runs)")
    add_engine_args(p)
    add_topology_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    params = [
        SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=None if args.seed is None else args.seed + i,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
        for i in range(len(args.prompt))
    ]
    from afd.models import load_model_config

    topology = topology_from_args(args, load_model_config(model_dir).moe.num_experts)
    if topology is None and args.trace:
        raise ValueError("--trace records the disaggregated runtime: add topology flags (e.g. --attention-ranks 1 --ffn-ranks 1)")
    progress = not args.no_progress and sys.stderr.isatty()
    if topology is None and args.capture:  # the capture hooks are on an engine of this process: run it on a thread here
        from afd.runtime.clients import LocalClient

        engine = monolithic_engine(args, model_dir)
        log.info("monolithic: model %s (%s), dtype %s, %s", model_dir, engine.model.config.architecture, engine.config.dtype, engine.config.cache)
        outputs = run_offline(LocalClient(engine, capture=str(Path(args.capture) / "monolithic.safetensors")), engine.tokenizer,
                              args.prompt, params, progress=progress)
    elif topology is None:  # a server's front end and engine-core process: the step loop shares no GIL with the text work
        from afd.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(model_dir)
        client = engine_core_client(args, model_dir)
        try:
            log.info("monolithic: model %s, engine core pid %d", model_dir, client.core.pid)
            outputs = run_offline(client, tokenizer, args.prompt, params, progress=progress)
        finally:
            client.close(args.ready_timeout)
    else:
        outputs = _generate_disaggregated(args, model_dir, topology, params, progress)
        if outputs is None:
            return 0
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
        else:
            print(out.prompt + out.text)
            if len(outputs) > 1:
                print("-" * 60)
    return 0


def _generate_disaggregated(args: argparse.Namespace, model_dir: Path, topology, params, progress: bool):
    from afd.runtime.messages import GetTrace, SetTrace
    from afd.serving.offline import generate

    cluster = cluster_from_args(args, model_dir, topology)
    log.info("disaggregated: model %s, %s, %s", model_dir, topology, cluster.pipeline)
    print(f"afd: {cluster.describe_limits()}", file=sys.stderr, flush=True)
    print(f"afd: {cluster.describe_redundancy()}", file=sys.stderr, flush=True)
    num_attention = topology.num_attention_ranks
    with cluster:
        if args.node_rank > 0:  # an FFN-only node of a multi-node run
            cluster.wait()
            print(f"node {args.node_rank}: FFN ranks served the run and exited", file=sys.stderr)
            return None
        if args.trace:
            cluster.request_all([SetTrace(True)] * num_attention)
        outputs = generate(cluster, args.prompt, params, capture_dir=args.capture, progress=progress)
        attention_traces = ({f"attention rank {i}": events for i, (events, _) in enumerate(cluster.request_all([GetTrace()] * num_attention))}
                            if args.trace else {})
    if args.trace:
        from afd.obs.trace import chrome_trace, write_trace

        ffn_spans = {r.spec.name: (r.final_stats or {}).get("spans", []) for r in cluster.ranks if r.spec.role.name == "FFN"}
        write_trace(args.trace, chrome_trace(attention_traces, ffn_spans))
        print(f"trace written to {args.trace}", file=sys.stderr)
    return outputs
