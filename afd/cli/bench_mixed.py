"""``afd bench mixed``: long prompts beside decoding sequences, the load continuous batching is for.

Against one ``afd serve`` (started here on a free port, or ``--url``/``--pid`` of a running one):

* TTFT of each ``--prompts`` length, alone, and beside each ``--decodes`` count of streaming sequences
  already decoding (the long prompt arrives while they decode);
* decode tokens/s with each ``--decodes`` count of sequences running (tokens streamed over a window);
* the server's peak RSS (with its children) in each, sampled every 50 ms.

Without MODEL it serves a random DeepSeek-V2-Lite-shaped checkpoint (``--synthetic-layers``, the
built-in tokenizer) written to a temporary directory. The server started here gets ``--max-num-seqs``
one above the most decoding sequences (so the long prompt is admitted beside them); a server given by
``--url`` needs as much.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

from afd.cli.common import print_table


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("mixed", help="TTFT of long prompts alone and beside decoding sequences, decode tok/s, peak RSS")
    p.add_argument("model", nargs="?", help="model directory (default: a synthetic DeepSeek-V2-Lite-shaped checkpoint)")
    p.add_argument("--synthetic-layers", type=int, default=4)
    p.add_argument("--serve-flags", default="--dtype bfloat16 --kv-cache-memory 2G", help="flags of the afd serve started here")
    p.add_argument("--url", help="measure this running server instead of starting one")
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for its RSS")
    p.add_argument("--prompts", default="1024,4096", help="long prompt lengths (default 1024,4096; '' for none: decode only)")
    p.add_argument("--decodes", default="32,64", help="decoding sequence counts (default 32,64)")
    p.add_argument("--window", type=float, default=10.0, help="seconds of decode measured (default 10)")
    p.add_argument("--json", dest="json_out")
    p.set_defaults(func=run)


class _RSS:
    """Peak RSS (MiB) of a process and its children, sampled every 50 ms while it runs."""

    def __init__(self, pid: int | None) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _tree_rss(self.pid))

    def __enter__(self) -> "_RSS":
        if self.pid:
            self.peak = _tree_rss(self.pid)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


def _tree_rss(pid: int) -> float:
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += next(int(x.split()[1]) for x in open(f"/proc/{p}/status") if x.startswith("VmRSS:")) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total


async def _model(client) -> None:
    """The served model's name (sent in every request, as servers that require the field expect) and its context
    length, where the server says it (``max_model_len``, as afd and vLLM do), onto ``client``."""
    r = await client.get("/v1/models")
    r.raise_for_status()
    model = r.json()["data"][0]
    client.model, client.max_model_len = model["id"], model.get("max_model_len")


async def _stream(client, prompt: list[int], max_tokens: int, first: list, tokens: list | None = None) -> None:
    body = {"model": client.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                if not first:
                    first.append(time.perf_counter() - t0)
                if tokens is not None:
                    tokens.append(time.perf_counter())


def _prompt(n: int, vocab: int, salt: int) -> list[int]:
    return [(17 * i + 101 * salt) % (vocab - 3) + 3 for i in range(n)]


DECODE_TOKENS = 4000  # each decoding stream's max_tokens: longer than any scenario, within an 8k context (or the model's)
DECODE_PROMPT = 32  # each decoding stream's prompt tokens


class _Decodes:
    """``n`` streams decoding until cancelled; entered once every stream has its first token. A stream
    that fails (the server died) fails the scenario; every stream is cancelled and reaped on exit."""

    def __init__(self, client, vocab: int, n: int, stamps: list | None = None) -> None:
        self.firsts = [[] for _ in range(n)]
        limit = DECODE_TOKENS if client.max_model_len is None else min(DECODE_TOKENS, client.max_model_len - DECODE_PROMPT)
        self.tasks = [asyncio.create_task(_stream(client, _prompt(DECODE_PROMPT, vocab, i), limit, self.firsts[i], stamps)) for i in range(n)]

    async def __aenter__(self) -> "_Decodes":
        while not all(self.firsts):
            for t in self.tasks:
                if t.done() and t.exception() is not None:
                    await self.__aexit__()
                    raise t.exception()
            await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _ttft(url: str, vocab: int, length: int, beside: int) -> float:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        await _model(client)
        first: list = []
        async with _Decodes(client, vocab, beside):
            # a prompt of its own per scenario: the prefix cache must not serve one scenario's prompt to the next
            await _stream(client, _prompt(length, vocab, 1000 + 7 * beside + length), 1, first)
    return first[0]


async def _decode_rate(url: str, vocab: int, running: int, window: float) -> float:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        await _model(client)
        stamps: list = []
        async with _Decodes(client, vocab, running, stamps):
            t0 = time.perf_counter()
            await asyncio.sleep(window)
            n = sum(1 for s in stamps if s >= t0)
            elapsed = time.perf_counter() - t0
    return n / elapsed


def _counts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _alive(pid: int | None) -> bool:
    """The server process exists and is not a zombie (killed, not yet reaped)."""
    if pid is None:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def run(args: argparse.Namespace) -> int:
    from afd.cli.bench_serve import synthetic_checkpoint
    from afd.engine.tokenizer import Tokenizer
    from afd.serving.spawn import ServerProcess

    tmp = tempfile.TemporaryDirectory(prefix="afd-bench-mixed-")
    server = None
    try:
        if args.url:
            url, pid = args.url, args.pid
            vocab = 2000
        else:
            model_dir = Path(args.model) if args.model else synthetic_checkpoint(args.synthetic_layers, Path(tmp.name))
            vocab = Tokenizer(model_dir).vocab_size
            flags = shlex.split(args.serve_flags)
            if "--max-num-seqs" not in flags:  # room for the decoding sequences and the long prompt beside them
                flags += ["--max-num-seqs", str(max(_counts(args.decodes), default=0) + 1)]
            server = ServerProcess(model_dir, *flags, env={"AFD_NUM_THREADS": "1"})
            url, pid = server.url, server.proc.pid
        prompts, decodes = _counts(args.prompts), _counts(args.decodes)
        results: dict[str, dict] = {}
        scenarios = [(f"TTFT {length}-token prompt" + (f" beside {beside} decoding" if beside else " alone"), "ttft_s",
                      lambda length=length, beside=beside: _ttft(url, vocab, length, beside))
                     for beside in [0, *decodes] for length in prompts]
        scenarios += [(f"decode, {running} running", "tokens_per_s", lambda running=running: _decode_rate(url, vocab, running, args.window))
                      for running in decodes]
        for name, key, measure in scenarios:
            with _RSS(pid) as rss:
                try:
                    value = asyncio.run(measure())
                except Exception as e:  # noqa: BLE001 - a server that dies (e.g. killed for memory) is the result
                    alive = _alive(pid)
                    results[name] = {"error": f"{type(e).__name__}: {e}"[:200], "server_alive": alive, "peak_rss_mib": rss.peak}
                    print(f"{name}: FAILED ({results[name]['error']}); server {'up' if alive else 'gone'}", file=sys.stderr, flush=True)
                    if not alive:
                        break
                    continue
            results[name] = {key: value, "peak_rss_mib": rss.peak}
            print(f"{name}: {value:.2f}, peak RSS {rss.peak:.0f} MiB", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
        tmp.cleanup()
    rows = [("scenario", "TTFT s", "tok/s", "peak RSS MiB")]
    for name, r in results.items():
        rows.append((name, f"{r['ttft_s']:.2f}" if "ttft_s" in r else ("FAILED" if "error" in r else ""),
                     f"{r['tokens_per_s']:.1f}" if "tokens_per_s" in r else "", f"{r['peak_rss_mib']:.0f}"))
    print_table(rows)
    print("summary: " + ", ".join(f"{k} " + (f"{v['ttft_s']:.2f} s" if "ttft_s" in v else f"{v['tokens_per_s']:.1f} tok/s" if "tokens_per_s" in v
                                             else "FAILED") for k, v in results.items()))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0
