"""The built-in model (afd/assets/models/tiny-shakespeare-moe): trained, balanced, equal to transformers."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from afd.cli.common import BUILTIN_MODEL
from afd.config import CacheConfig, EngineConfig, SamplingParams
from afd.engine.llm_engine import LLMEngine
from afd.engine.model_runner import ModelRunner
from afd.engine.tokenizer import Tokenizer
from afd.kvcache import BlockManager, SeqChunk
from afd.models import load_model
from afd.testing.parity import compare_greedy, top2_gap
from tests.support import Capture, monolithic_capture

EXCERPT = (Path(__file__).parent / "data" / "heldout_excerpt.txt").read_text().split("\n", 3)[3]
REPORT = json.loads((BUILTIN_MODEL / "training_report.json").read_text())
WINDOW = 256


@pytest.fixture(scope="module")
def model():
    return load_model(BUILTIN_MODEL, dtype="float32")[0]


@pytest.fixture(scope="module")
def heldout(model):
    """afd's own pass over the held-out excerpt: NLL per window and routed expert ids per MoE layer."""
    ids = Tokenizer(BUILTIN_MODEL).encode(EXCERPT)
    nll, count = 0.0, 0
    routed: dict[int, list[torch.Tensor]] = {}
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start : start + WINDOW + 1]
        runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=32))
        chunk = SeqChunk(BlockManager(32, 16).ensure(0, len(window) - 1), 0, len(window) - 1)
        cap = Capture()
        runner.execute(window[:-1], [chunk], observer=cap)
        logits = model.lm_head(cap[(model.config.num_layers, "final_hidden")]).float()
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]), reduction="sum").item()
        count += len(window) - 1
        for layer in model.config.moe.layers:
            routed.setdefault(layer, []).append(cap[(layer, "topk_ids")].flatten())
    return math.exp(nll / count), {layer: torch.cat(v) for layer, v in routed.items()}, count


def test_checkpoint_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in BUILTIN_MODEL.iterdir()}
    for need in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert need in files
    assert sum(files.values()) <= 20 * 2**20


def test_model_card_perplexity_is_well_below_bigram():
    assert REPORT["held_out_perplexity"] < 0.75 * REPORT["bigram_perplexity"], REPORT
    card = (BUILTIN_MODEL / "README.md").read_text()
    assert f"{REPORT['held_out_perplexity']:.2f}" in card and f"{REPORT['bigram_perplexity']:.2f}" in card


def test_afd_heldout_perplexity_beats_the_bigram_baseline(heldout):
    ppl, _, count = heldout
    assert count > 4000
    assert ppl < 0.75 * REPORT["bigram_perplexity"], f"afd perplexity {ppl:.1f} on held-out text"
    assert ppl < 1.5 * REPORT["held_out_perplexity"], f"afd perplexity {ppl:.1f} far from the card's"


def test_no_expert_starves_on_heldout_text(heldout, model):
    _, routed, _ = heldout
    num_experts = model.config.moe.num_experts
    for layer, ids in routed.items():
        share = torch.bincount(ids, minlength=num_experts).float() / ids.numel()
        assert share.min() >= 0.25 / num_experts, f"layer {layer}: expert shares {share.tolist()}"


def test_tokenizer_matches_autotokenizer():
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(BUILTIN_MODEL)
    ours = Tokenizer(BUILTIN_MODEL)
    samples = ["ROMEO:", "To be, or not to be,\nthat is the question.", "  spaces  and\ttabs", "Ünïcödé — ‘quotes’", EXCERPT[:500], ""]
    for text in samples:
        assert ours.encode(text) == ref(text)["input_ids"], repr(text)
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), repr(text)
    assert ours.bos_token_id == ref.bos_token_id and ours.eos_token_id == ref.eos_token_id


def test_greedy_64_tokens_match_transformers(model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL, dtype=torch.float32).eval()
    tok = Tokenizer(BUILTIN_MODEL)
    prompts = ["KING.\nWhat say you, my lord?\n\n", EXCERPT[1000:1400], "Enter a Messenger.\n\n"]
    engine = LLMEngine(model, tok, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)))
    outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    compared = 0
    for prompt, out in zip(prompts, outs):
        seq, gaps = tok.encode(prompt), []
        n = len(seq)
        with torch.no_grad():
            for _ in range(64):
                logits = hf(torch.tensor([seq]), use_cache=False).logits[0, -1]
                gaps.append(top2_gap(logits))
                seq.append(int(logits.argmax()))
        report = compare_greedy(seq[n:], out.token_ids, gaps, min_compared=0)  # the total below counts
        assert report.ok, f"{prompt[:30]!r}: {report}"
        compared += report.num_compared
    assert compared >= 96, f"only {compared} of 192 greedy steps compared"


@pytest.mark.procs
def test_readme_demo_reads_like_a_play():
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n\t\$\(BIN\)/afd (.+)$", makefile, re.M).group(1)
    args = re.findall(r'"[^"]*"|\S+', demo)
    args = [a.strip('"') for a in args]
    out = subprocess.run(
        [sys.executable, "-m", "afd.cli.main", *args], capture_output=True, text=True, check=True, timeout=300,
        env={**os.environ, "AFD_NUM_THREADS": "2"},
    ).stdout
    lines = [l for l in out.splitlines() if l.strip()]
    assert len(lines) >= 8, out
    speakers = [l for l in lines if re.fullmatch(r"\s*[A-Z][A-Za-z]+(\s[A-Z][A-Za-z]+)?\.", l)]
    assert len(speakers) >= 2, f"no speaker names in:\n{out}"
    vocabulary = set(re.findall(r"[a-z']+", EXCERPT.lower())) | set(re.findall(r"[a-z']+", (BUILTIN_MODEL / "README.md").read_text().lower()))
    words = re.findall(r"[a-z']+", out.lower())
    known = sum(w in vocabulary for w in words) / max(1, len(words))
    assert len(words) >= 60 and known >= 0.6, f"{known:.0%} known words in:\n{out}"


def test_rotary_cos_sin_are_computed_once_a_batch_and_read_by_every_layer(model, monkeypatch):
    """Every layer of a batch rotates by the same positions: the cos/sin are computed once a batch (kept in its
    layer_state), and the logits are those of computing them in every layer."""
    from afd.models.layers import RotaryEmbedding

    prompts = [[5, 9, 13, 17, 21, 25, 29], [7, 11, 3]]
    calls = []
    real = RotaryEmbedding.cos_sin
    monkeypatch.setattr(RotaryEmbedding, "cos_sin", lambda self, positions: calls.append(len(positions)) or real(self, positions))
    _, once = monolithic_capture(model, prompts)
    assert model.config.num_layers > 1 and calls == [10]
    monkeypatch.setattr(RotaryEmbedding, "cos_sin_of", lambda self, meta: real(self, meta.positions))
    _, every_layer = monolithic_capture(model, prompts)
    assert torch.equal(once, every_layer)
