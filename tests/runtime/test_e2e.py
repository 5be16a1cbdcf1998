"""End-to-end cases: real processes, checked against the monolithic model (parity rules), and the
built-in model's held-out perplexity equal within 1e-4 relative in fp32."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from afd.cli.common import BUILTIN_MODEL, pipeline_from_args, topology_from_args
from afd.cli.main import build_parser
from afd.config import EngineArgs, SamplingParams
from afd.engine.tokenizer import Tokenizer
from afd.models import load_model, load_model_config
from afd.runtime.messages import Capture
from afd.serving.offline import generate
from afd.testing.parity import compare_greedy
from tests import support
from tests.runtime.e2e_cases import CASES

pytestmark = pytest.mark.procs

EXCERPT = (Path(__file__).parents[1] / "data" / "heldout_excerpt.txt").read_text().split("\n", 3)[3]
WINDOW, NUM_WINDOWS = 256, 6
PARITY_PROMPTS = [[0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99], [0, 200, 13, 7, 2], [0, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def reference():
    model = load_model(BUILTIN_MODEL, dtype="float32")[0]
    ids = Tokenizer(BUILTIN_MODEL).encode(EXCERPT)
    windows = [ids[i * WINDOW : (i + 1) * WINDOW + 1] for i in range(NUM_WINDOWS)]
    values, _ = support.monolithic_capture(model, [w[:-1] for w in windows])
    return model, windows, perplexity(model, values, windows), support.monolithic_capture(model, PARITY_PROMPTS)


def perplexity(model, values, windows) -> float:
    logits = model.lm_head(values[(model.config.num_layers, "final_hidden")]).float()
    targets = torch.tensor([t for w in windows for t in w[1:]])
    return math.exp(torch.nn.functional.cross_entropy(logits, targets).item())


def params(case):
    return pytest.param(case, id=case.name, marks=[getattr(pytest.mark, kind)(devices=n) for kind, n in case.needs.items()])


@pytest.mark.parametrize("case", [params(c) for c in CASES])
def test_e2e_case(reference, case):
    model, windows, ref_ppl, (ref_values, ref_logits) = reference
    args = build_parser().parse_args(case.argv())
    topology = topology_from_args(args, load_model_config(BUILTIN_MODEL).moe.num_experts)  # validate_topology inside
    pipeline = pipeline_from_args(args)
    engine = EngineArgs(dtype="float32", kv_cache_memory=32 << 20, block_size=16, max_num_batched_tokens=2048)  # the 1536-token capture
    with support.cluster(BUILTIN_MODEL, topology, engine, pipeline=pipeline) as cluster:
        values, logits = cluster.request(0, Capture(PARITY_PROMPTS))
        failures = support.split_parity_failures(model, ref_values, ref_logits, values, logits, check_topk=topology.gate == "attention")
        assert not failures, "\n".join(failures)
        split_values, _ = cluster.request(0, Capture([w[:-1] for w in windows]))
        ppl = perplexity(model, split_values, windows)
        assert abs(ppl - ref_ppl) <= 1e-4 * ref_ppl, f"held-out perplexity {ppl:.6f} vs monolithic {ref_ppl:.6f}"
        tok = Tokenizer(BUILTIN_MODEL)
        prompts = ["ROMEO:", "KING.\nWhat say you"]
        outs = generate(cluster, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            ref, gaps = support.greedy_with_gaps(model, tok.encode(prompt), 16)
            report = compare_greedy(ref, out.token_ids, gaps, min_compared=8)
            assert report.ok, f"{prompt!r}: {report}"
