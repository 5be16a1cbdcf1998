"""``afd serve`` as a real process, driven by the official ``openai`` client: monolithic and 2A1F async
over shm give ``afd generate``'s greedy text, streaming or not; 32 concurrent streams match one-by-one
runs; a KV budget too small for the load preempts and still completes every request correctly."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import openai
import pytest

from afd.cli.common import BUILTIN_MODEL
from afd.config import EngineArgs, SamplingParams
from afd.engine.llm_engine import LLMEngine
from afd.kvcache import PagedKVCache
from afd.serving.inputs import DEFAULT_CHAT_TEMPLATE
from tests.serving.server_proc import MODEL_NAME, Server
from tests.support import wait_for

pytestmark = pytest.mark.procs

PROMPTS = ["ROMEO:", "KING.\nWhat say you", "To be"]
CHAT = [{"role": "system", "content": "A scene in Verona."}, {"role": "user", "content": "Who art thou?"}]
DISAGG = ["--attention-ranks", "2", "--ffn-ranks", "1", "--transport", "shm", "--mode", "async", "--num-microbatches", "2", "--split", "token"]


def chat_text(messages) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(DEFAULT_CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


@pytest.fixture(scope="module")
def generate_reference():
    """`afd generate`'s greedy output for the completion prompts and the rendered chat prompt."""
    prompts = [*PROMPTS, chat_text(CHAT)]
    cmd = [sys.executable, "-m", "afd.cli.main", "generate", str(BUILTIN_MODEL), "--dtype", "float32", "--max-tokens", "24",
           "--json", "--no-progress"] + [a for p in prompts for a in ("--prompt", p)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=True).stdout
    return [json.loads(line)["text"] for line in out.splitlines()]


@pytest.fixture(scope="module")
def reference_engine():
    return LLMEngine.from_pretrained(BUILTIN_MODEL, EngineArgs(dtype="float32", kv_cache_memory=64 << 20))


def one_by_one(engine: LLMEngine, prompt: str, max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of ``prompt`` run alone, with the top-2 log-prob gap of each step (near-tie rule)."""
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2))
    ids, gaps = [], []
    while engine.has_unfinished():
        for d in engine.step_deltas():
            ids.append(d.token_id)
            gaps.append(d.top_logprobs[0][1] - d.top_logprobs[1][1])
    return ids, gaps


def greedy_text_ok(tokenizer, ref_ids: list[int], gaps: list[float], got: str, tie_gap: float = 1e-3) -> bool:
    """The parity rule of research/parity.md on text: equal up to the first reference near-tie."""
    for i in range(len(ref_ids)):
        if gaps[i] < tie_gap:
            return True  # from here on the outputs may legitimately differ
        if not got.startswith(tokenizer.decode(ref_ids[: i + 1])):
            return False
    return got == tokenizer.decode(ref_ids)


@pytest.fixture(scope="module", params=["monolithic", "2A1F-async-shm"])
def server(request):
    with Server(*([] if request.param == "monolithic" else DISAGG)) as s:
        yield s


def test_openai_client_gets_generate_text(server, generate_reference):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    for prompt, want in zip(PROMPTS, generate_reference):
        got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == want, prompt
        assert got.usage.completion_tokens == 24
        stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want, prompt
    want_chat = generate_reference[-1]
    got = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0)
    assert got.choices[0].message.content == want_chat and got.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    assert chunks[-1].usage.completion_tokens == 24


def test_sampling_options(server, reference_engine):
    """n, seed, stop and logprobs behave as documented (and as the engine run in-process)."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    a = client.completions.create(model=MODEL_NAME, prompt="ROMEO:", max_tokens=16, temperature=1.0, seed=7, n=3)
    b = client.completions.create(model=MODEL_NAME, prompt="ROMEO:", max_tokens=16, temperature=1.0, seed=7, n=3)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # choice i samples with seed + i
    full = client.completions.create(model=MODEL_NAME, prompt="ROMEO:", max_tokens=24, temperature=0).choices[0].text
    stop = full.strip()[3:6]
    cut = client.completions.create(model=MODEL_NAME, prompt="ROMEO:", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(stop)]
    streamed = client.completions.create(model=MODEL_NAME, prompt="ROMEO:", max_tokens=24, temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text  # never a piece of the stop string
    lp = client.completions.create(model=MODEL_NAME, prompt="ROMEO:", max_tokens=6, temperature=0, logprobs=3).choices[0].logprobs
    ref_ids, _ = one_by_one(reference_engine, "ROMEO:", 6)
    assert lp.tokens == [reference_engine.tokenizer.decode([t], skip_special_tokens=False) for t in ref_ids]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the most likely


def test_logprobs_match_transformers(server):
    """Log-probabilities served equal an independent reference: transformers on prompt + output."""
    import torch
    from transformers import AutoModelForCausalLM

    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    got = client.completions.create(model=MODEL_NAME, prompt="KING.\nWhat say you", max_tokens=8, temperature=0, logprobs=2)
    from afd.engine.tokenizer import Tokenizer

    tok = Tokenizer(BUILTIN_MODEL)
    prompt_ids = tok.encode("KING.\nWhat say you")
    hf = AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for token_text, served in zip(got.choices[0].logprobs.tokens, got.choices[0].logprobs.token_logprobs):
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
            token = int(lp.argmax())
            assert tok.decode([token], skip_special_tokens=False) == token_text
            assert served == pytest.approx(float(lp[token]), abs=1e-4)
            ids.append(token)


def test_32_concurrent_streams_match_one_by_one(server, reference_engine):
    prompts = [f"{['ROMEO', 'JULIET', 'KING', 'HAMLET'][i % 4]}:\n{'Good morrow ' * (i % 5)}" for i in range(32)]
    lengths = [4 + (7 * i) % 21 for i in range(32)]
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)

    async def one(prompt: str, n: int) -> str:
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    texts = asyncio.run(all_of_them())
    tok = reference_engine.tokenizer
    for prompt, n, got in zip(prompts, lengths, texts):
        ref_ids, gaps = one_by_one(reference_engine, prompt, n)
        assert greedy_text_ok(tok, ref_ids, gaps, got), (prompt, got, tok.decode(ref_ids))
    assert server.metric("afd_kv_blocks_peak") > 0
    assert server.metric("afd_kv_blocks_used") == 0  # every block back in the pool
    assert server.metric("afd_requests_in_flight") == 0
    steps = [line for line in server.get("/metrics").text.splitlines() if line.startswith("afd_engine_steps_total{")]
    assert steps and all(float(line.rsplit(" ", 1)[1]) > 0 for line in steps), steps  # every replica served


def test_small_kv_budget_preempts_and_completes(reference_engine):
    """A cache of 12 blocks for 6 requests that each grow to 4-5 blocks: the scheduler must preempt
    (and recompute), and every output must still be right."""
    per_block = PagedKVCache.bytes_per_block(reference_engine.config.cache, reference_engine.model.config.num_layers,
                                             reference_engine.model.kv_layout(), reference_engine.model.model.embed_tokens.weight.dtype)
    prompts = [f"{name}:\n" for name in ("ROMEO", "JULIET", "KING", "HAMLET", "OPHELIA", "LEAR")]
    with Server("--kv-cache-memory", str(12 * per_block), "--block-size", "16") as s:
        assert s.metric("afd_kv_blocks_total") == 12
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=300)

        async def run():
            return await asyncio.gather(*(client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=60, temperature=0)
                                          for p in prompts))

        outs = asyncio.run(run())
        assert s.metric("afd_preemptions_total") > 0
        assert s.metric("afd_kv_blocks_used") == 0
        for prompt, out in zip(prompts, outs):
            ref_ids, gaps = one_by_one(reference_engine, prompt, 60)
            assert greedy_text_ok(reference_engine.tokenizer, ref_ids, gaps, out.choices[0].text), prompt


def test_health_and_metrics_format(server):
    # a request of its own first: the counters below must not depend on which tests ran before (run alone, this
    # test found no expert tokens); an FFN rank reports them within a second of falling idle
    assert server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "To be", "max_tokens": 4, "temperature": 0}).status_code == 200
    h = server.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    text = server.get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    names = {f.name for f in text_string_to_metric_families(text)}
    for want in ("afd_requests", "afd_time_to_first_token_seconds", "afd_inter_token_latency_seconds", "afd_queue_depth",
                 "afd_kv_blocks_used", "afd_preemptions", "afd_busy_seconds", "afd_expert_tokens"):
        assert want in names, want
    wait_for(lambda: server.metric("afd_expert_tokens_total") > 0, 10, "the request's expert tokens in /metrics")
    if "attention rank" in json.dumps(h.json()):
        assert server.metric("afd_connector_bytes_total") > 0 and server.metric("afd_connector_round_trips_total") > 0
    r = httpx.get(server.url + "/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_seeded_sampling_does_not_depend_on_the_batch(server):
    """Per-request random streams: a seeded request samples the same text alone and among 8 others."""
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)

    async def ask(prompt, seed):
        r = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0.9, top_p=0.95, seed=seed)
        return r.choices[0].text

    async def alone_then_crowd():
        alone = await ask("ROMEO:", 123)
        crowd = await asyncio.gather(ask("ROMEO:", 123), *(ask(f"KING {i}:", i) for i in range(8)))
        return alone, crowd[0]

    alone, in_crowd = asyncio.run(alone_then_crowd())
    assert in_crowd == alone


def test_a_repeated_prompt_hits_the_prefix_cache(server):
    """The same ~100-token prompt four times, one after another: at least two land on one replica
    (there are at most two), so the later one reads its prefix from the cache; text is unchanged."""
    prompt = "ROMEO:\n" + " ".join(["But soft, what light through yonder window breaks?"] * 8)
    before = server.metric("afd_prefix_cache_hits_total")
    queries = server.metric("afd_prefix_cache_queries_total")
    texts = []
    for _ in range(4):
        r = server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert len(set(texts)) == 1, texts
    assert server.metric("afd_prefix_cache_queries_total") - queries >= 4 * 90
    assert server.metric("afd_prefix_cache_hits_total") - before >= 80, "no prefix cache hit"


def test_a_prompt_goes_where_its_prefix_is_cached(server):
    """Two replicas (2A1F): a prompt served on one replica, then that replica busy with a long stream;
    the prompt again goes back to it (its prefix is cached there) rather than to the idle one, and hits."""
    import threading

    prompt = "KING LEAR:\n" + " ".join(["Blow, winds, and crack your cheeks! rage! blow!"] * 8)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    assert server.post("/v1/completions", json=body).status_code == 200
    started, stop = threading.Event(), threading.Event()

    def long_stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={"model": MODEL_NAME, "prompt": "To be", "max_tokens": 400, "temperature": 0, "stream": True,
                                "ignore_eos": True}) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    break

    t = threading.Thread(target=long_stream, daemon=True)
    t.start()
    assert started.wait(60)
    hits = server.metric("afd_prefix_cache_hits_total")
    assert server.post("/v1/completions", json=body).status_code == 200
    got = server.metric("afd_prefix_cache_hits_total") - hits
    stop.set()
    t.join(60)
    assert got >= 64, f"the repeated prompt hit {got} cached tokens: it went to the replica without its prefix"


def test_the_ffn_counters_a_benchmark_reads_account_for_every_row(server):
    """``ffn_metrics`` (what `afd bench serve` and vllm_bench.py report) waits until the FFN ranks' counters have
    settled: read at once after a burst, they had missed up to a second of work (a rank reports at most once a
    second while busy), which made the FFN CPU per token of a short run look lower than it was."""
    from concurrent.futures import ThreadPoolExecutor

    from afd.cli.bench_serve import ffn_delta, ffn_metrics

    disaggregated = "attention rank" in json.dumps(server.get("/health").json())
    before = ffn_metrics(server.url)
    assert bool(before) == disaggregated and before.get("settled", True), before  # a baseline even before any work
    payload = {"model": MODEL_NAME, "prompt": "To be, or not to be", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        assert all(r.status_code == 200 for r in pool.map(lambda _: server.post("/v1/completions", json=payload), range(8)))
    after = ffn_metrics(server.url)
    if not disaggregated:  # no FFN rank
        assert after == {}
        return
    sent = sum(float(line.rsplit(" ", 1)[1]) for line in server.get("/metrics").text.splitlines()
               if line.startswith("afd_connector_rows_sent_total{"))
    assert after["settled"] and after["ffn_rows"] == sent, (after, sent)
    work = ffn_delta(after, before)
    assert work["ffn_rows"] > 0 and work["ffn_process_cpu_s"] >= work["ffn_cpu_s"] > 0, work
