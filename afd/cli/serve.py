"""``afd serve``: an OpenAI-compatible server, monolithic (no topology flags) or disaggregated (async by default)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from afd.cli.common import add_engine_args, add_topology_args, cluster_from_args, engine_core_client, resolve_model, topology_from_args

log = logging.getLogger("afd.serve")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions)", description=__doc__)
    p.add_argument("model", nargs="?", help="local Hugging Face model directory (default: $AFD_MODEL or the built-in model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (the bound address is printed)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the model directory's name)")
    p.add_argument("--rebalance-every", type=float, default=0.0, metavar="S",
                   help="check the measured FFN load every S seconds and rebalance the expert placement when its max/mean "
                        "is above --rebalance-threshold (default 0: only on POST /rebalance)")
    p.add_argument("--rebalance-threshold", type=float, default=1.25, metavar="X",
                   help="the FFN load max/mean above which --rebalance-every moves the placement (default 1.25)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may still finish before they are aborted (default 30)")
    add_engine_args(p)
    add_topology_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from afd.engine.tokenizer import Tokenizer
    from afd.models import load_model_config
    from afd.serving.frontend import Frontend
    from afd.serving.metrics import Metrics
    from afd.serving.server import ServerState, listen, run_server

    model_dir = resolve_model(args.model)
    config = load_model_config(model_dir)
    tokenizer = Tokenizer(model_dir)  # the server tokenizes; a model without tokenizer.json cannot be served
    topology = topology_from_args(args, config.moe.num_experts)
    if args.rebalance_every < 0 or args.rebalance_threshold < 1.0:
        raise ValueError(f"--rebalance-every {args.rebalance_every} / --rebalance-threshold {args.rebalance_threshold}: give "
                         "seconds >= 0 and a max/mean >= 1")
    if args.rebalance_every and topology is None:
        raise ValueError("--rebalance-every moves expert copies between FFN ranks: a monolithic server has none")
    if args.nnodes > 1 and args.node_rank > 0:
        return _serve_ffn_node(args, model_dir, topology)
    # bind before loading anything or starting a rank: a busy port fails at once, leaving nothing behind
    with listen(args.host, args.port) as sock:
        client = _client(args, model_dir, topology)
        try:
            metrics = Metrics()
            frontend = Frontend(client, metrics, tokenizer=tokenizer)
            metrics.bind(frontend)
            state = ServerState(frontend, metrics, tokenizer, args.served_model_name or model_dir.name, client.max_model_len,
                                rebalance_every=args.rebalance_every, rebalance_threshold=args.rebalance_threshold)
        except BaseException:
            client.close(timeout=10)
            raise
        return run_server(state, sock, args.shutdown_timeout)  # stops the replicas (and ranks) before it returns


def _client(args: argparse.Namespace, model_dir, topology):
    from afd.runtime.clients import ClusterClient

    if topology is None:  # the engine in a process of its own; this one serves HTTP and works out text
        client = engine_core_client(args, model_dir)
        log.info("monolithic: %s, engine core pid %d", model_dir, client.core.pid)
        return client
    cluster = _cluster(args, model_dir, topology)
    cluster.start()
    return ClusterClient(cluster, cluster.pipeline)


def _cluster(args: argparse.Namespace, model_dir, topology):
    cluster = cluster_from_args(args, model_dir, topology)
    log.info("disaggregated: %s, %s, %s", model_dir, topology, cluster.pipeline)
    print(f"afd serve: starting {topology.num_attention_ranks} attention + {topology.num_ffn_ranks} FFN ranks ...", file=sys.stderr, flush=True)
    print(f"afd: {cluster.describe_limits()}", file=sys.stderr, flush=True)
    print(f"afd: {cluster.describe_redundancy()}", file=sys.stderr, flush=True)
    return cluster


def _serve_ffn_node(args: argparse.Namespace, model_dir, topology) -> int:
    """The FFN node of a multi-node run: no HTTP here; its FFN ranks serve node 0's attention ranks. SIGTERM
    stops them (and is what ends the node early); a normal end comes from node 0's attention ranks."""
    if topology is None:
        raise ValueError("a multi-node run needs topology flags (and --transport tcp or torch)")
    cluster = _cluster(args, model_dir, topology)

    def on_sigterm(_signum, _frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        cluster.start()
        print(f"afd serve: node {args.node_rank}: FFN ranks serving node 0's attention ranks", flush=True)
        cluster.wait()
    finally:
        cluster.shutdown()
        signal.signal(signal.SIGTERM, previous)
    print(f"afd serve: node {args.node_rank}: the run ended", flush=True)
    return 0
