"""``afd serve``: an OpenAI-compatible server, monolithic (no topology flags) or disaggregated (async by default)."""

from __future__ import annotations

import argparse
import logging
import sys

from afd.cli.common import add_engine_args, add_topology_args, pipeline_from_args, resolve_model, topology_from_args

log = logging.getLogger("afd.serve")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions)", description=__doc__)
    p.add_argument("model", nargs="?", help="local Hugging Face model directory (default: $AFD_MODEL or the built-in model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (the bound address is printed)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the model directory's name)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may still finish before they are aborted (default 30)")
    add_engine_args(p)
    add_topology_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from afd.engine.tokenizer import Tokenizer
    from afd.models import load_model_config
    from afd.serving.frontend import ClusterReplicas, Frontend, LocalReplicas
    from afd.serving.metrics import Metrics
    from afd.serving.server import ServerState, run_server

    model_dir = resolve_model(args.model)
    config = load_model_config(model_dir)
    tokenizer = Tokenizer(model_dir)  # the server tokenizes; a model without tokenizer.json cannot be served
    topology = topology_from_args(args, config.moe.num_experts)
    if topology is None:
        from afd.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_pretrained(model_dir, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
                                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
        log.info("monolithic: %s, %s", model_dir, engine.config.cache)
        replicas = LocalReplicas(engine)
    else:
        from afd import env
        from afd.engine.launcher import Cluster
        from afd.engine.ranks import EngineArgs

        engine_args = EngineArgs(args.dtype, args.kv_cache_memory, args.block_size, args.max_num_seqs, args.max_num_batched_tokens)
        cluster = Cluster(model_dir, topology, engine_args, io_log=env.io_log(), pipeline=pipeline_from_args(args), nnodes=args.nnodes,
                          node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port)
        log.info("disaggregated: %s, %s, %s", model_dir, topology, pipeline_from_args(args))
        print(f"afd serve: starting {topology.num_attention_ranks} attention + {topology.num_ffn_ranks} FFN ranks ...", file=sys.stderr, flush=True)
        cluster.start()
        if not cluster.attention_ranks():  # the FFN node of a multi-node run: no HTTP here, serve node 0's ranks
            print(f"afd serve: node {args.node_rank}: FFN ranks serving node 0's attention ranks", flush=True)
            try:
                cluster.wait_until_done()
            finally:
                cluster.shutdown()
            print(f"afd serve: node {args.node_rank}: the run ended", flush=True)
            return 0
        replicas = ClusterReplicas(cluster, pipeline_from_args(args))
    metrics = Metrics()
    frontend = Frontend(replicas, metrics)
    metrics.bind(frontend)
    state = ServerState(frontend, metrics, tokenizer, args.served_model_name or model_dir.name, config.max_position_embeddings)
    return run_server(state, args.host, args.port, args.shutdown_timeout)
