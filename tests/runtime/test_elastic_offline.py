"""The elastic FFN tier offline (``afd.serving.offline.generate``, real processes over shm and over tcp): an injected FFN
fault in the middle of a batch changes no output, the loss and the re-dispatch are in the trace, and the
replacement, once back in use, computes rows of the next batch."""

from __future__ import annotations

import pytest

from afd.cli.common import BUILTIN_MODEL
from afd.config import EngineArgs, FaultPlan, PipelineConfig, SamplingParams, Timeouts
from afd.distributed.topology import Topology, parse_devices
from afd.engine.tokenizer import Tokenizer
from afd.models import load_model
from afd.runtime.cluster import Cluster
from afd.runtime.messages import GetTrace, SetTrace
from afd.serving.offline import generate
from afd.testing.parity import compare_greedy
from tests import support

pytestmark = pytest.mark.procs

PROMPTS = ["ROMEO:", "KING.\nWhat say you", "Enter a Messenger.\n\n", "To be, or not"]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def cluster(transport: str, **kw) -> Cluster:
    """A run of its own (its own fork server, ports and run directory): a fault test is isolated."""
    t = Topology(parse_devices("cpu"), parse_devices("cpu,cpu"), transport=transport, redundant_experts=8)
    return Cluster(BUILTIN_MODEL, t, EngineArgs(dtype="float32"), pipeline=PipelineConfig("async", 2, "token"),
                   timeouts=Timeouts(hang=2.0, heartbeat=0.5), **kw)


@pytest.mark.faults
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_ffn_rank_dying_mid_batch_changes_no_output_and_its_replacement_serves(transport):
    model, tok = load_model(BUILTIN_MODEL, dtype="float32")[0], Tokenizer(BUILTIN_MODEL)
    # the last FFN rank dies on receiving its 40th work part
    with cluster(transport, faults=FaultPlan("ffn-kill", 40)) as c:
        c.request(0, SetTrace(True))
        outs = generate(c, PROMPTS, PARAMS)
        for prompt, out in zip(PROMPTS, outs):  # the monolithic model's greedy text, near-ties aside (parity.md)
            ref, gaps = support.greedy_with_gaps(model, tok.encode(prompt), PARAMS.max_tokens)
            report = compare_greedy(ref, out.token_ids, gaps, min_compared=8)
            assert report.ok, f"{prompt!r}: {report}"
        losses = c.status.ffn_losses
        assert len(losses) == 1 and losses[0].rank == 1 and "SIGKILL" in losses[0].cause, losses
        events, _ = c.request(0, GetTrace())
        lost = [e for e in events if e.action == "ffn_lost"]
        assert len(lost) == 1 and "ffn rank 1 lost" in lost[0].note and "re-dispatched" in lost[0].note

        # it loads, links, and is voted back in at an agreed step
        support.wait_for(lambda: c.status.ffn_replacements, 60, "the replacement of ffn rank 1 back in use")
        assert [e.generation for e in c.status.ffn_replacements] == [1]
        rows_before = _rows(c)
        again = generate(c, PROMPTS, PARAMS)
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
        # its counters come once a second, from the replacement's own process
        support.wait_for(lambda: _rows(c) > rows_before, 10, "the replacement of ffn rank 1 computing rows")
    replacement = next(r for r in c.ranks if r.spec.role.name == "FFN" and r.spec.generation == 1)
    assert replacement.final_stats["tokens"] > 0, "the replacement computed no row"


def _rows(c: Cluster) -> int:
    stats = c.status.ffn_stats.get("ffn rank 1")
    return stats["tokens"] if stats is not None else 0
