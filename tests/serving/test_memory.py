"""Ordinary continuous-batching load does not blow up memory: 48 sequences decode when a 1900-token prompt
arrives, on a real ``afd serve`` of a checkpoint with DeepSeek-V2-Lite's attention dimensions (2 layers,
small experts). The server's peak RSS (its HTTP process plus its engine-core process, where the steps run),
sampled while it runs, grows by less than the step budget it states at start (and far less than the 2 GiB
the issue allows); every request completes, the decodes still running when the long prompt joins; the
server is still up. Before, attention padded every sequence to the longest query and context: this step alone
needed ~15 GiB of masks and scores, and the server was OOM-killed."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

from afd.cli.bench_serve import synthetic_checkpoint
from afd.serving.spawn import ServerProcess

pytestmark = pytest.mark.procs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """V2-Lite's attention (hidden 2048, 16 heads, MLA 512/64/128), small experts and MLP, 2 layers."""
    return synthetic_checkpoint(2, tmp_path_factory.mktemp("v2-lite-attention"), intermediate_size=512, moe_intermediate_size=128,
                                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=4096)


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, started: list) -> tuple[int, float, float]:
    """(tokens streamed, time of the first, time of the last)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    n, first, last = 0, 0.0, 0.0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                n += 1
                last = time.monotonic()
                if n == 1:
                    first = last
                    started.append(time.monotonic())
    return n, first, last


DECODE_TOKENS = 96  # each decode outlasts the long prompt's prefill (checked below)


def test_a_long_prompt_joining_48_decodes_stays_within_the_step_budget(checkpoint):
    with ServerProcess(checkpoint, "--dtype", "float32", "--kv-cache-memory", "512M", env={"AFD_NUM_THREADS": "1"}) as server:
        stated = int(re.search(r"step memory (\d+) MiB", "".join(server.stderr)).group(1))
        ranks = httpx.get(server.url + "/health").json()["ranks"]
        pids = (server.proc.pid, next(r["pid"] for r in ranks if r["name"] == "engine core"))  # HTTP process, engine process
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.05):
                samples.append((time.monotonic(), sum(rss_mib(pid) for pid in pids)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        async def load() -> tuple[list[int], int, float]:
            async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
                started: list = []
                decodes = [asyncio.create_task(stream(client, [5 + i, 17, 300 + i] * 10, DECODE_TOKENS, started)) for i in range(48)]
                while len(started) < 48:  # every sequence is decoding
                    await asyncio.sleep(0.05)
                arrived = time.monotonic()
                long = asyncio.create_task(stream(client, [(7 * i) % 1800 + 3 for i in range(1900)], 4, []))
                return await asyncio.gather(*decodes), await long, arrived

        decoded, (long_count, long_first, _), arrived = asyncio.run(load())
        stop.set()
        sampler.join(5)
        assert server.proc.poll() is None, "the server died"
        assert [n for n, _, _ in decoded] == [DECODE_TOKENS] * 48 and long_count == 4  # every request completed with all its tokens
        assert long_first < min(last for _, _, last in decoded), "the decodes ended before the long prompt joined them"
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
    before = max(r for t, r in samples if t < arrived)
    after = max(r for t, r in samples)
    growth = after - before
    assert growth < stated + 128, f"peak RSS grew by {growth:.0f} MiB when the long prompt joined; the stated step budget is {stated} MiB"
    print(f"peak RSS {before:.0f} MiB before the long prompt, {after:.0f} MiB after (+{growth:.0f}); stated step budget {stated} MiB")
    assert growth < 2048
