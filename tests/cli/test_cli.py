"""The command line, run as a user would (real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from afd.config import SamplingParams
from afd.engine.llm_engine import LLMEngine


def afd(*args, check=True):
    env = {**os.environ, "AFD_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "afd.cli.main", *args], capture_output=True, text=True, check=check, env=env, timeout=300)


def test_generate_json_equals_the_engine(checkpoints):
    path, _ = checkpoints["qwen3-norm-topk"]
    out = afd("generate", str(path), "--prompt", "To be", "--prompt", "Now is the", "--max-tokens", "8", "--dtype", "float32", "--json", "--ignore-eos")
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    engine = LLMEngine.from_pretrained(path, dtype="float32")
    ref = engine.generate(["To be", "Now is the"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [r["prompt"] for r in rows] == ["To be", "Now is the"]
    assert [r["token_ids"] for r in rows] == [r.token_ids for r in ref]
    assert [r["text"] for r in rows] == [engine.tokenizer.decode(r.token_ids) for r in ref]


def test_generate_errors_are_one_line_and_nonzero(tmp_path):
    res = afd("generate", str(tmp_path / "missing"), "--prompt", "x", check=False)
    assert res.returncode == 2
    assert "afd: error:" in res.stderr and "does not exist" in res.stderr and "Traceback" not in res.stderr


def test_bench_generate_reports_a_table_and_json(checkpoints, tmp_path):
    path, _ = checkpoints["ds-noqlora-greedy"]
    out_json = tmp_path / "bench.json"
    res = afd("bench", "generate", str(path), "--runs", "2", "--warmup", "0", "--num-seqs", "2", "--prompt-len", "8", "--new-tokens", "4", "--json", str(out_json))
    assert "summary:" in res.stdout and "prefill" in res.stdout and "decode" in res.stdout
    data = json.loads(out_json.read_text())
    assert data["workload"] == {"num_seqs": 2, "prompt_len": 8, "new_tokens": 4}
    assert data["prefill_tok_s"] > 0 and data["decode_tok_s"] > 0
