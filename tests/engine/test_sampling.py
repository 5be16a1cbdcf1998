"""The batched sampler against an independent per-row reference of vLLM's definitions (plain Python
over lists, logits in, logits out), alone and in mixed batches; seeded draws independent of the batch;
and the engine's penalised greedy generation against a reference loop over fresh forwards."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from afd.config import CacheConfig, EngineConfig, SamplingParams
from afd.engine.llm_engine import LLMEngine
from afd.engine.sampling import (
    PenaltyState,
    logprobs_of,
    make_generator,
    process_logits,
    sample,
)
from afd.engine.tokenizer import Tokenizer
from afd.models import load_model

INF = float("inf")
EOS = frozenset({1})


@dataclass
class Row:
    """What the sampler reads of a request."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator = field(default_factory=lambda: make_generator(0))
    penalty: PenaltyState | None = None

    def __post_init__(self) -> None:
        if self.params.has_penalties:
            self.penalty = PenaltyState.start(self.prompt_ids, self.output_ids, 64)


def reference(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams, eos=EOS) -> list[float]:
    """vLLM's definitions, one token at a time."""
    x = list(logits)
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = -INF
    for t, b in p.logit_bias:
        x[t] += b
    counts = Counter(output)
    for t in range(len(x)):
        if t in prompt or counts[t]:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    if p.temperature == 0:
        return x
    x = [v / p.temperature for v in x]
    if p.min_p > 0:
        z = max(x)
        probs = [math.exp(v - z) for v in x]
        top = max(probs)
        x = [-INF if q < p.min_p * top else v for v, q in zip(x, probs)]
    if 0 < p.top_k < len(x):
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [-INF if v < kth else v for v in x]
    if p.top_p < 1:
        order = sorted(range(len(x)), key=lambda t: -x[t])
        z = max(x)
        w = [math.exp(x[t] - z) if x[t] > -INF else 0.0 for t in order]
        total, before = sum(w), 0.0
        for t, wt in zip(order, w):
            if before / total >= p.top_p:
                x[t] = -INF
            before += wt
    return x


CASES = {
    "plain": SamplingParams(temperature=0.0),
    "repetition": SamplingParams(temperature=0.0, repetition_penalty=1.7),
    "repetition<1": SamplingParams(temperature=0.0, repetition_penalty=0.6),
    "frequency": SamplingParams(temperature=0.0, frequency_penalty=0.8),
    "presence": SamplingParams(temperature=0.0, presence_penalty=-1.2),
    "all penalties, sampled": SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
    "min_tokens": SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=(3, 9)),
    "min_tokens, ignore_eos": SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=(3,), ignore_eos=True),
    "logit_bias": SamplingParams(temperature=0.0, logit_bias=((2, 5.0), (7, -100.0), (11, 0.25))),
    "min_p": SamplingParams(temperature=0.9, min_p=0.2),
    "top_k": SamplingParams(temperature=1.3, top_k=5),
    "top_p": SamplingParams(temperature=1.0, top_p=0.6),
    "everything": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, min_tokens=8, stop_token_ids=(4,),
                                 logit_bias=((5, 2.0),), repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2),
}


def rows_for(names: list[str], seed: int = 0) -> tuple[torch.Tensor, list[Row]]:
    rng = random.Random(seed)
    logits = torch.randn(len(names), 64, generator=torch.Generator().manual_seed(seed)) * 3
    rows = [Row(CASES[n], [rng.randrange(64) for _ in range(rng.randrange(1, 12))], [rng.randrange(64) for _ in range(rng.randrange(0, 10))])
            for n in names]
    return logits, rows


def assert_matches_reference(got: torch.Tensor, logits: torch.Tensor, rows: list[Row]) -> None:
    for i, r in enumerate(rows):
        want = torch.tensor(reference(logits[i].tolist(), r.prompt_ids, r.output_ids, r.params))
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (r.params, got[i], want)
        finite = ~torch.isinf(want)
        torch.testing.assert_close(got[i][finite], want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_each_option_alone_equals_the_reference(name):
    logits, rows = rows_for([name], seed=hash(name) % 1000)
    raw = logits.clone()
    assert_matches_reference(process_logits(logits, rows, EOS), logits, rows)
    assert torch.equal(logits, raw), "the raw logits (the logprobs' source) must stay as they are"


def test_a_mixed_batch_equals_the_reference_row_by_row():
    names = list(CASES) * 3
    random.Random(7).shuffle(names)
    logits, rows = rows_for(names, seed=3)
    got = process_logits(logits, rows, EOS)
    assert_matches_reference(got, logits, rows)
    plain = [i for i, n in enumerate(names) if n == "plain"]
    assert torch.equal(got[plain], logits[plain])  # rows without options are untouched


def test_the_reference_can_fail():
    """Canary: a sampler that counts the prompt in the frequency penalty (a plausible mix-up) is caught."""
    logits, rows = rows_for(["frequency"], seed=5)
    r = rows[0]
    wrong = Row(r.params, r.prompt_ids, r.prompt_ids + r.output_ids)
    with pytest.raises(AssertionError):
        assert_matches_reference(process_logits(logits, [wrong], EOS), logits, rows)


def test_seeded_draws_do_not_depend_on_the_batch():
    names = ["everything", "all penalties, sampled", "top_p", "plain", "min_p", "top_k"]
    logits, rows = rows_for(names, seed=11)
    target = 0
    alone_rows = [Row(rows[target].params, rows[target].prompt_ids, list(rows[target].output_ids), make_generator(99))]
    mixed = [Row(r.params, r.prompt_ids, list(r.output_ids), make_generator(99 if i == target else 1000 + i)) for i, r in enumerate(rows)]
    alone = [sample(logits[[target]], alone_rows, EOS)[0] for _ in range(50)]
    together = [sample(logits, mixed, EOS)[target] for _ in range(50)]
    assert alone == together
    assert len(set(alone)) > 1  # it really sampled


def test_a_seeded_request_resumed_elsewhere_draws_what_it_would_have():
    """A request's seed gives one seed per output token (token_seed): a fresh row -- a new engine, another
    replica -- holding the first k tokens draws token k as the original row does, and the draws still vary."""
    torch.manual_seed(0)
    logits = torch.randn(40, 64) * 2
    params = SamplingParams(temperature=1.0, seed=7, presence_penalty=0.3)
    original = Row(params, [2, 3], [], make_generator(7))
    for t in range(40):
        token = sample(logits[[t]], [original], EOS)[0]
        original.output_ids.append(token)
        original.penalty.add(token)
    for k in (0, 5, 23):
        resumed = Row(params, [2, 3], list(original.output_ids[:k]), make_generator(12345))  # its own, unrelated state
        for t in range(k, 40):
            token = sample(logits[[t]], [resumed], EOS)[0]
            assert token == original.output_ids[t], (k, t)
            resumed.output_ids.append(token)
            resumed.penalty.add(token)
    assert len(set(original.output_ids)) > 5


@pytest.mark.parametrize("stream", ["own", "shared"])
def test_draw_frequencies_follow_the_processed_distribution(stream):
    """A seeded request draws from its own stream; requests without a seed draw in one batched call from
    the engine's: in a batch, each row still follows its own processed distribution."""
    logits, rows = rows_for(["everything", "top_k", "all penalties, sampled"], seed=2)
    shared = make_generator(5)
    if stream == "shared":
        rows = [Row(r.params, r.prompt_ids, r.output_ids, None) for r in rows]
    probs = process_logits(logits, rows, EOS).softmax(-1)
    n = 3000
    draws = torch.tensor([sample(logits, rows, EOS, shared) for _ in range(n)])  # [n, rows]
    for i in range(len(rows)):
        counts = torch.bincount(draws[:, i], minlength=64).float()
        expect = probs[i] * n
        assert ((counts - expect).abs() < 5 * expect.sqrt() + 5).all(), i
        assert counts[probs[i] == 0].sum() == 0


def test_logprobs_are_raw_with_rank_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, 2.9], [0.0, 0.0, 5.0, 1.0, -1.0]])
    out = logprobs_of(logits, torch.tensor([3, 2]), 2)
    lp = torch.log_softmax(logits, -1)
    assert out[0].logprob == pytest.approx(float(lp[0, 3])) and out[0].rank == 5  # the least likely of 5
    assert [t for t, _ in out[0].top] == [1, 4] and out[1].rank == 1


# ----------------------------------------------------------------------------- in the engine


@pytest.fixture(scope="module")
def model_dir(checkpoints):
    return checkpoints["ds-noqlora-greedy"][0]


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dtype="float32")[0]


def make_engine(model, model_dir) -> LLMEngine:
    return LLMEngine(model, Tokenizer(model_dir), EngineConfig(cache=CacheConfig(block_size=4, num_blocks=256)))


def reference_generation(model, model_dir, prompt_ids: list[int], params: SamplingParams, steps: int) -> list[int]:
    """Greedy generation one fresh forward per step, the reference processor applied to its logits."""
    out: list[int] = []
    for _ in range(steps):
        e = make_engine(model, model_dir)
        seq = prompt_ids + out
        e.add_request(seq, SamplingParams(max_tokens=1, temperature=0.0))
        chunk = e.scheduler.schedule()[0].chunk
        logits = e.runner.execute(seq, [chunk])[0].tolist()
        x = reference(logits, prompt_ids, out, params, eos=e.eos_ids)
        out.append(max(range(len(x)), key=lambda t: x[t]))
    return out


PENALISED = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=3.0, frequency_penalty=2.0,
                           presence_penalty=2.0, logit_bias=((7, 1.5),), min_tokens=4, stop_token_ids=(2,))


def test_penalised_greedy_generation_equals_the_reference_alone_and_in_a_batch(model, model_dir):
    prompt = [144, 72] * 3  # greedy alone repeats itself after this prompt (for this checkpoint)
    want = reference_generation(model, model_dir, prompt, PENALISED, 12)
    e = make_engine(model, model_dir)
    alone = e.generate([prompt], PENALISED)[0].token_ids
    batch = make_engine(model, model_dir).generate(
        [[4, 4, 4, 4], prompt, [11, 12]], [SamplingParams(max_tokens=12, temperature=0.9, seed=3), PENALISED,
                                          SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=-1.0)])[1].token_ids
    assert alone == want[: len(alone)] and batch == alone
    # the options did something: plain greedy differs
    plain = make_engine(model, model_dir).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    assert plain != alone
    assert len(set(alone)) == len(alone) > len(set(plain))  # here: no token repeats


def test_stop_token_ids_min_tokens_and_stop_text(model, model_dir):
    prompt = [5, 9, 17]
    greedy = make_engine(model, model_dir).generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    stop_tok = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_tok)
    e = make_engine(model, model_dir)
    e.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_tok,)))
    deltas = []
    while e.has_unfinished():
        deltas += e.step_deltas()
    assert [d.token_id for d in deltas] == greedy.token_ids[: first + 1]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop_tok
    tok = Tokenizer(model_dir)
    assert "".join(d.text for d in deltas) == tok.decode(greedy.token_ids[:first])  # the stop token's text is left out
    kept = make_engine(model, model_dir).generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                                           stop_token_ids=(stop_tok,), include_stop_str_in_output=True))[0]
    assert kept.text == tok.decode(greedy.token_ids[: first + 1])
    # min_tokens masks the stop token: it cannot end the request before then
    late = make_engine(model, model_dir).generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                                           stop_token_ids=(stop_tok,), min_tokens=first + 2))[0]
    assert stop_tok not in late.token_ids[: first + 2]


def test_skip_special_tokens(model, model_dir):
    forced = ((0, 100.0),)  # the BOS token <s>, a special token, made certain
    tok = Tokenizer(model_dir)
    on = make_engine(model, model_dir).generate([[5, 9]], SamplingParams(max_tokens=3, temperature=0.0, logit_bias=forced))[0]
    off = make_engine(model, model_dir).generate([[5, 9]], SamplingParams(max_tokens=3, temperature=0.0, logit_bias=forced,
                                                                          skip_special_tokens=False))[0]
    assert on.token_ids == off.token_ids == [0, 0, 0]
    assert on.text == "" and off.text == tok.decode([0, 0, 0], skip_special_tokens=False) != ""


def test_top_p_beyond_the_candidates_equals_the_reference():
    """A flat row puts its top_p mass beyond the first TOP_P_CANDIDATES tokens (the full-sort path), a
    peaked row within them; both equal the reference."""
    from afd.engine import sampling

    vocab = sampling.TOP_P_CANDIDATES * 3
    gen = torch.Generator().manual_seed(4)
    logits = torch.stack([torch.randn(vocab, generator=gen) * 0.05, torch.randn(vocab, generator=gen) * 4])
    rows = [Row(SamplingParams(temperature=1.0, top_p=0.9), [1], []), Row(SamplingParams(temperature=0.7, top_p=0.5, top_k=2000), [1], [])]
    got = process_logits(logits, rows, EOS)
    assert int(torch.isfinite(got[0]).sum()) > sampling.TOP_P_CANDIDATES  # the flat row really needed the full sort
    assert_matches_reference(got, logits, rows)
