"""The elastic FFN tier offline (``Cluster.generate``, real processes over shm and over tcp): an injected FFN
fault in the middle of a batch changes no output, the loss and the re-dispatch are in the trace, and the
replacement, once back in use, computes rows of the next batch."""

from __future__ import annotations

import time

import pytest

from afd.cli.common import BUILTIN_MODEL
from afd.config import PipelineConfig, SamplingParams
from afd.distributed.topology import Topology, parse_devices
from afd.engine.launcher import Cluster
from afd.engine.ranks import EngineArgs
from afd.engine.tokenizer import Tokenizer
from afd.models import load_model
from afd.testing.parity import compare_greedy
from tests import support

PROMPTS = ["ROMEO:", "KING.\nWhat say you", "Enter a Messenger.\n\n", "To be, or not"]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def cluster(transport: str, **kw) -> Cluster:
    t = Topology(parse_devices("cpu"), parse_devices("cpu,cpu"), transport=transport, redundant_experts=8)
    return Cluster(BUILTIN_MODEL, t, EngineArgs(dtype="float32"), pipeline=PipelineConfig("async", 2, "token"), link_timeout=2.0,
                   heartbeat_interval=0.5, **kw)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_ffn_rank_dying_mid_batch_changes_no_output_and_its_replacement_serves(monkeypatch, transport):
    model, tok = load_model(BUILTIN_MODEL, dtype="float32")[0], Tokenizer(BUILTIN_MODEL)
    monkeypatch.setenv("AFD_FAULT", "ffn-kill@40")  # the last FFN rank dies on receiving its 40th work part
    with cluster(transport) as c:
        c.request(0, ("trace", True), "trace")
        outs = c.generate(PROMPTS, PARAMS)
        for prompt, out in zip(PROMPTS, outs):  # the monolithic model's greedy text, near-ties aside (parity.md)
            ref, gaps = support.greedy_with_gaps(model, tok.encode(prompt), PARAMS.max_tokens)
            report = compare_greedy(ref, out.token_ids, gaps)
            assert report.ok and report.num_compared >= 8, f"{prompt!r}: {report}"
        assert len(c.ffn_losses) == 1 and c.ffn_losses[0]["rank"] == 1 and "SIGKILL" in c.ffn_losses[0]["cause"]
        events, _ = c.request(0, ("get_trace",), "get_trace")
        lost = [e for e in events if e.action == "ffn_lost"]
        assert len(lost) == 1 and "ffn rank 1 lost" in lost[0].note and "re-dispatched" in lost[0].note

        deadline = time.monotonic() + 60
        while not c.ffn_replacements and time.monotonic() < deadline:  # loads, links, and is voted back in
            c.poll(0.2)
        assert [r["generation"] for r in c.ffn_replacements] == [1]
        again = c.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
        replacement = next(r for r in c.ranks if r.spec.role.name == "FFN" and r.spec.generation == 1)
        deadline = time.monotonic() + 10
        while not (replacement.live_stats or {}).get("expert_tokens") and time.monotonic() < deadline:  # reported once a second
            c.poll(0.2)
        assert sum(replacement.live_stats["expert_tokens"].values()) > 0, "the replacement computed no row"
