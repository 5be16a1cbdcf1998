"""``afd bench connector``: one-way latency and bandwidth of each transport for [T, hidden] payloads.

A message of one [T, H] tensor goes to a peer (a thread for loopback, a
process otherwise) that sends it straight back; one-way time = round trip / 2,
median over the iterations. Baselines in the same run: an in-process memcpy of
the same tensor, and raw ``torch.distributed`` gloo send/recv ping-pong
(no header, no control channel).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import threading
import time
import uuid

import torch

from afd import env
from afd.cli.common import print_table
from afd.connectors.dispatch_dtype import DISPATCH_DTYPES, QuantizedRows, encode
from afd.connectors.factory import LinkSpec, make_mailbox
from afd.connectors.transport import LoopbackHub
from afd.connectors.wire import Header, Kind, Role, TensorName, make_message
from afd.runtime.forkserver import RunForkServer

SIZES = (1, 16, 128, 1024, 4096)


def add_parser(bsub: argparse._SubParsersAction) -> None:
    c = bsub.add_parser("connector", help="one-way latency and bandwidth of each transport")
    c.add_argument("--hidden", type=int, default=2048)
    c.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    c.add_argument("--tokens", default=",".join(map(str, SIZES)), help="payload rows T, comma-separated")
    c.add_argument("--iters", type=int, default=200, help="round trips per size (fewer for large sizes)")
    c.add_argument("--transports", default="loopback,shm,tcp,torch")
    c.add_argument("--dispatch-dtype", choices=DISPATCH_DTYPES, default="model",
                   help="send the rows as a dispatch of this kind sends them (int8 / fp8: one byte a value plus an fp32 "
                        "scale a row, afd/connectors/dispatch_dtype.py); model: in --dtype")
    c.add_argument("--json", dest="json_out")
    c.set_defaults(func=run)


def _iters(base: int, nbytes: int) -> int:
    return max(10, min(base, int(base * (1 << 20) / max(nbytes, 1))))


def _message(tensors: dict, seq: int, role: Role) -> object:
    kind = Kind.WORK if role == Role.ATTENTION else Kind.RESULT
    rows = tensors[TensorName.HIDDEN].shape[0]
    return make_message(Header(kind, role, 0, 0, layer=0, seq=seq, num_tokens=rows), tensors)


def _payload(rows: torch.Tensor, kind: str) -> dict:
    """What a dispatch of ``kind`` sends of these rows: the values, and with int8 / fp8 their per-row scales."""
    sent = encode(rows, kind)
    if isinstance(sent, QuantizedRows):
        return {TensorName.HIDDEN: sent.values, TensorName.HIDDEN_SCALES: sent.scales}
    return {TensorName.HIDDEN: sent}


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _echo(spec: LinkSpec, total: int, hub=None) -> None:
    torch.set_num_threads(1)
    box = make_mailbox(spec, Role.FFN, 0, 1, hub)
    box.connect(60.0)
    for _ in range(total):
        msg = box.recv(60)
        box.send(0, _message(msg.tensors, msg.header.seq, Role.FFN))
    box.close()


def _measure_transport(transport: str, payloads: list[dict], base_iters: int, forks) -> list[float]:
    counts = [_iters(base_iters, _nbytes(p)) + 5 for p in payloads]
    with tempfile.TemporaryDirectory(prefix="afd-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        biggest = max(_nbytes(p) for p in payloads) + 4096
        spec = LinkSpec(transport, d, num_slots=4, slot_bytes=biggest)
        hub, peer, store = None, None, None
        if transport == "shm":
            from afd.connectors.shm import create_links

            create_links(d, 1, 1, spec.num_slots, spec.slot_bytes)
        if transport in ("torch", "tcp"):
            import torch.distributed as dist

            store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
            spec = LinkSpec(transport, d, master_port=store.port, num_attention=1, num_ffn=1)
        if transport == "loopback":
            hub = LoopbackHub()
            peer = threading.Thread(target=_echo, args=(spec, sum(counts), hub), daemon=True)
        else:
            peer = forks.process(_echo, (spec, sum(counts)), "afd-bench-echo")
        peer.start()
        box = make_mailbox(spec, Role.ATTENTION, 0, 1, hub)
        box.connect(60.0)
        results, seq = [], 0
        try:
            for p, n in zip(payloads, counts):
                times = []
                for i in range(n):
                    seq += 1
                    t0 = time.perf_counter()
                    box.send(0, _message(p, seq, Role.ATTENTION))
                    box.recv(60)
                    if i >= 5:
                        times.append((time.perf_counter() - t0) / 2)
                results.append(statistics.median(times))
        finally:
            box.close()
            peer.join(30)
    return results


def _gloo_peer(port: int, shapes: list, counts: list, dtype) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=1, world_size=2)
    for shape, n in zip(shapes, counts):
        buf = torch.empty(shape, dtype=dtype)
        for _ in range(n):
            dist.recv(buf, src=0)
            dist.send(buf, dst=0)
    dist.destroy_process_group()


def _measure_gloo(payloads: list[dict], base_iters: int, forks) -> list[float]:
    import torch.distributed as dist

    payloads = [p[TensorName.HIDDEN] for p in payloads]  # raw gloo: the values alone
    counts = [_iters(base_iters, p.numel() * p.element_size()) + 5 for p in payloads]
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    peer = forks.process(_gloo_peer, (store.port, [tuple(p.shape) for p in payloads], counts, payloads[0].dtype), "afd-bench-gloo")
    peer.start()
    dist.init_process_group("gloo", store=store, rank=0, world_size=2)
    results = []
    try:
        for p, n in zip(payloads, counts):
            buf, times = torch.empty_like(p), []
            for i in range(n):
                t0 = time.perf_counter()
                dist.send(p, dst=1)
                dist.recv(buf, src=1)
                if i >= 5:
                    times.append((time.perf_counter() - t0) / 2)
            results.append(statistics.median(times))
    finally:
        dist.destroy_process_group()
        peer.join(30)
    return results


def _measure_memcpy(payloads: list[dict], base_iters: int) -> list[float]:
    out = []
    for p in (p[TensorName.HIDDEN] for p in payloads):
        dst, times = torch.empty_like(p), []
        for _ in range(_iters(base_iters, p.numel() * p.element_size())):
            t0 = time.perf_counter()
            dst.copy_(p)
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    tokens = [int(t) for t in args.tokens.split(",")]
    payloads = [_payload(torch.randn(t, args.hidden).to(dtype), args.dispatch_dtype) for t in tokens]
    columns = {"memcpy": _measure_memcpy(payloads, args.iters)}
    forks = RunForkServer(env.run_id() or f"bench-{uuid.uuid4().hex[:8]}")  # peers forked from it: torch imported once
    try:
        for transport in [t for t in args.transports.split(",") if t]:
            columns[transport] = _measure_transport(transport, payloads, args.iters, forks)
        columns["raw gloo"] = _measure_gloo(payloads, args.iters, forks)
    finally:
        forks.stop()
    names = list(columns)
    header = ["T", "bytes"] + [f"{n} us" for n in names] + [f"{n} GB/s" for n in names if n != "memcpy"]
    rows = []
    for i, (t, p) in enumerate(zip(tokens, payloads)):
        nbytes = _nbytes(p)
        lat = [f"{1e6 * columns[n][i]:.1f}" for n in names]
        bw = [f"{nbytes / columns[n][i] / 1e9:.2f}" for n in names if n != "memcpy"]
        rows.append([str(t), str(nbytes), *lat, *bw])
    print_table([header, *rows])
    mid = tokens.index(128) if 128 in tokens else len(tokens) // 2
    if "shm" in columns:
        print(
            f"summary: [T, {args.hidden}] {args.dtype}, dispatch {args.dispatch_dtype}, one-way median: at T={tokens[mid]} shm {1e6 * columns['shm'][mid]:.0f} us "
            f"vs raw gloo {1e6 * columns['raw gloo'][mid]:.0f} us ({columns['raw gloo'][mid] / columns['shm'][mid]:.1f}x), "
            f"memcpy {1e6 * columns['memcpy'][mid]:.0f} us"
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"hidden": args.hidden, "dtype": args.dtype, "dispatch_dtype": args.dispatch_dtype, "tokens": tokens, "one_way_s": columns}, f, indent=2)
    return 0
