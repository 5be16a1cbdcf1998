"""The engine's step loop: schedule -> execute -> sample -> check stops, over the paged KV cache."""

from __future__ import annotations

import itertools
import logging
import random
import time
from pathlib import Path
from typing import Iterable, Sequence

import torch
from tqdm import tqdm

from afd.config import CacheConfig, EngineArgs, EngineConfig, SamplingParams
from afd.engine.detokenizer import OutputText
from afd.engine.request import Request, RequestOutput, Status, TokenDelta
from afd.engine.budget import (engine_limits, kv_layer_bytes, kv_pools, no_prefix_cache_reason, state_slot_bytes, state_slots,
                               window_pool_blocks)
from afd.engine.model_runner import ModelRunner, Runner
from afd.engine.sampling import PROMPT_LOGITS_BYTES, PenaltyState, PositionLogprobs, logprobs_of, make_generator, sample
from afd.engine.scheduler import Scheduler
from afd.engine.tokenizer import Tokenizer
from afd.kvcache import PagedKVCache, make_blocks
from afd.models import WeightSelection, load_model
from afd.models.base import MoEModel
from afd.models.layers import warm_up_linears

log = logging.getLogger(__name__)


def cache_config_for(model: MoEModel, kv_cache_memory: int, block_size: int, dtype: torch.dtype, max_num_seqs: int = 0,
                     max_num_batched_tokens: int = 0, max_model_len: int | None = None, state_dtype: str = "float32") -> CacheConfig:
    """The cache of ``kv_cache_memory`` bytes; with the step's limits given, a model with sliding windows
    gets its window pool (:func:`afd.engine.budget.window_pool_blocks`), as :func:`engine_limits` sizes it,
    and a hybrid model its state slots (:func:`afd.engine.budget.state_slots`) out of the same memory."""
    config = model.config
    slots = state_slots(config, dtype, kv_cache_memory, max(max_num_seqs, 1), state_dtype)
    probe = CacheConfig(block_size=block_size, num_blocks=1, num_state_slots=slots, state_dtype=state_dtype)
    layers, linear = len(config.kv_layers), len(config.linear.layers) if config.linear else 0
    if model.cache_layouts() is None and (PagedKVCache.bytes_per_block(probe, layers, model.kv_layout(), dtype) != kv_layer_bytes(config, dtype) * block_size * layers
            or PagedKVCache.bytes_per_slot(probe, linear, model.state_layout(), dtype) != state_slot_bytes(config, dtype, state_dtype)):
        raise AssertionError("afd/engine/budget.py counts another KV entry or state than the model's kv_layout and state_layout")
    kv_cache_memory -= slots * state_slot_bytes(config, dtype, state_dtype)
    max_num_seqs = slots or max_num_seqs
    window = window_pool_blocks(config, block_size, max_num_seqs, max_num_batched_tokens,
                                max_model_len or config.max_position_embeddings) if max_num_seqs else 0
    return CacheConfig(block_size=block_size, num_blocks=kv_pools(config, dtype, kv_cache_memory, block_size, window),
                       num_window_blocks=window, num_state_slots=slots, state_dtype=state_dtype)


class LLMEngine:
    """The generation engine of one attention replica. With the default runner it is monolithic
    (the reference for every disaggregated mode); with a :class:`DisaggregatedRunner` the FFN
    half of each layer runs on the FFN ranks."""

    def __init__(self, model: MoEModel, tokenizer: Tokenizer | None, config: EngineConfig, runner: Runner | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.runner = runner or ModelRunner(model, config.cache, config.device)
        caching = config.enable_prefix_caching
        reason = no_prefix_cache_reason(model.config, model.model.embed_tokens.weight.dtype, config.cache.state_dtype,
                                        config.cache.block_size)
        if caching and reason:
            caching = False
            log.warning("%s", reason)
        self.blocks = make_blocks(config.cache.num_blocks, config.cache.block_size, caching,
                                  config.cache.num_window_blocks, model.config.sliding_window or 0, config.cache.num_state_slots)
        max_num_seqs = min(config.max_num_seqs, config.cache.num_state_slots or config.max_num_seqs)  # one slot per sequence
        self.scheduler = Scheduler(self.blocks, max_num_seqs, config.max_num_batched_tokens)
        self.max_model_len = config.max_model_len or model.config.max_position_embeddings
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        # offline the engine works out each request's text and stop strings; a server's engine core sends
        # token ids and its front end does (afd/engine/serve_loop.py sets this False)
        self.detokenize = tokenizer is not None
        self._ids = itertools.count()
        self._generator = make_generator(random.Random().getrandbits(63))  # the draws of requests without a seed
        self._requests: dict[int, Request] = {}
        self.capture = None  # an afd.obs.capture.CaptureStore to record the safe boundaries of every step
        self.num_steps = 0
        self.busy_s = 0.0  # wall time inside steps
        self.peak_blocks = 0
        self.limits = None  # the EngineLimits it was sized by, when built by from_pretrained

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, args: EngineArgs = EngineArgs(), device: str = "cpu") -> "LLMEngine":
        """The monolithic engine of a checkpoint. The token cap, step memory and context left None
        are derived (afd/engine/budget.py); ``engine.limits`` says what they came to."""
        model, _ = load_model(model_dir, dtype=args.dtype, selection=WeightSelection.full(), device=device, fp8=args.fp8_weights, mxfp4=args.mxfp4_weights)
        model_dtype = model.model.embed_tokens.weight.dtype
        limits = engine_limits(model.config, model_dtype, args.kv_cache_memory, args.block_size, args.max_num_seqs, args.max_model_len,
                               args.max_step_memory, args.max_num_batched_tokens, args.state_dtype)
        config = EngineConfig(
            cache=CacheConfig(block_size=args.block_size, num_blocks=limits.num_blocks, num_window_blocks=limits.num_window_blocks,
                              num_state_slots=limits.num_state_slots, state_dtype=args.state_dtype),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            dtype="bfloat16" if model_dtype == torch.bfloat16 else "float32",
            device=device,
            max_model_len=limits.max_model_len,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        has_tokenizer = (Path(model_dir) / "tokenizer.json").is_file()  # without one, prompts are token ids
        engine = cls(model, Tokenizer(model_dir) if has_tokenizer else None, config)
        engine.limits = limits
        warm_up_linears(model, max(config.max_num_seqs, config.max_num_batched_tokens))
        return engine

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, tag: int | None = None,
                    output_ids: Sequence[int] = ()) -> int:
        """``output_ids``: a request moved here from a lost replica, with the tokens it already streamed.
        They count as output (max_tokens, min_tokens, penalties, a seeded request's next draw) and are
        recomputed with the prompt; only the tokens after them are produced (and its prompt logprobs,
        sent already, are not)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            prompt_ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            prompt_ids, text = list(prompt), ""
        if not prompt_ids:
            raise ValueError("empty prompt: give at least one token")
        vocab = self.model.config.vocab_size
        for what, ids in (("prompt", prompt_ids), ("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", [t for t, _ in params.logit_bias])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{what}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        bad = [t for t in output_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"output_ids: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens does not fit the model's context of {self.max_model_len} tokens"
            )
        generator = make_generator(params.seed) if params.seed is not None else None  # None: the engine's stream
        request = Request(next(self._ids), text, prompt_ids, params, generator, output_ids=list(output_ids))
        request.tag = request.request_id if tag is None else tag
        if self.detokenize:
            request.text = OutputText(self.tokenizer, params)
            for token in output_ids:
                request.text.add(token)
        if params.prompt_logprobs is not None and not output_ids:
            request.prompt_logprobs = [None]  # the first prompt token has no context to be predicted from
        max_total = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        self.scheduler.add(request, max_total)
        self._requests[request.request_id] = request
        return request.request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def must_step(self) -> bool:
        """Whether to step now: requests are unfinished, or the agreed steps of the attention ranks go on
        (a disaggregated rank votes every step of a wave, with work or not)."""
        waves = self.runner.waves
        return self.scheduler.has_unfinished() or (waves is not None and waves.in_wave)

    def abort(self, request_id: int) -> bool:
        """Drop a request wherever it is (waiting or running) and free its KV blocks; False if unknown or done."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(req)
        return True

    def stats(self) -> dict[str, float]:
        """Counters a server exports: queue, KV blocks (used, total, peak), preemptions, steps, busy time."""
        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "kv_blocks_used": self.blocks.num_used_blocks,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_peak": self.peak_blocks,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.scheduler.prefix_queries,
            "prefix_cache_hits": self.scheduler.prefix_hits,
            "steps": self.num_steps,
            "busy_s": self.busy_s,
        }

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one step; return the requests that finished in it."""
        return [self._output(req) for req, _, _ in self._step() if req.status is Status.FINISHED]

    def step_deltas(self) -> list[TokenDelta]:
        """Run one step; return what it produced for every request that sampled a token (streaming)."""
        deltas = []
        for req, token, lp in self._step():
            done = req.status is Status.FINISHED
            first = len(req.output_ids) <= 1  # the first delta carries the prompt logprobs
            deltas.append(TokenDelta(
                req.request_id, req.tag, token, req.text.piece(done) if req.text is not None else "",
                logprob=lp.logprob if lp else None, top_logprobs=lp.top if lp else (),
                finish_reason=req.finish_reason if done else None, num_prompt_tokens=len(req.prompt_ids),
                stop_reason=req.stop_reason if done else None,
                prompt_logprobs=tuple(req.prompt_logprobs) if first and req.prompt_logprobs is not None else None,
            ))
            if done:
                self._requests.pop(req.request_id, None)
        return deltas

    def _step(self) -> list[tuple[Request, int | None, PositionLogprobs | None]]:
        """One step: (request, sampled token, its logprobs) for every request whose prompt is complete;
        the token is None for a request that generates nothing (max_tokens 0)."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            if self.runner.waves is not None and self.runner.waves.in_wave:
                self.runner.idle()  # no work here this step: vote, run nothing
                return []
            raise RuntimeError("scheduler produced an empty step with unfinished requests (KV cache too small?)")
        self.peak_blocks = max(self.peak_blocks, self.blocks.num_used_blocks)
        token_ids: list[int] = []
        for item in batch:
            token_ids.extend(item.request.all_ids[item.chunk.start : item.chunk.end])
        observer, values = None, {}
        if self.capture is not None:
            def observer(layer: int, boundary: str, tensor: torch.Tensor) -> None:
                values[(layer, boundary)] = tensor

        hidden = self.runner.run(token_ids, [item.chunk for item in batch], observer)  # [T, H]
        if self.capture is not None:
            self._record(batch, values)
        ready: list[tuple[int, Request]] = []  # (row of its last token, request) of requests that sample now
        out: list[tuple[Request, int | None, PositionLogprobs | None]] = []
        row = 0
        for item in batch:
            req = item.request
            if req.prompt_logprobs is not None:
                self._score_prompt(req, item.chunk.start, hidden[row : row + item.chunk.length])
            row += item.chunk.length
            req.num_computed += item.chunk.length
            if self.blocks.needs_commit(req.request_id, req.num_computed):  # full blocks become reusable
                self.blocks.commit(req.request_id, req.all_ids, req.num_computed)
            if req.num_pending:
                continue  # a chunk of a longer prompt: nothing to sample yet
            if req.params.max_tokens == 0:  # prompt logprobs only
                self.scheduler.finish(req, "length")
                out.append((req, None, None))
            else:
                ready.append((row - 1, req))
        if ready:
            out += self._sample([req for _, req in ready], self.model.head(hidden[[r for r, _ in ready]]).cpu())
        self.num_steps += 1
        self.busy_s += time.perf_counter() - t0
        return out

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[tuple[Request, int, PositionLogprobs | None]]:
        """logits [S, V] fp32 of the requests' last tokens -> each one's token, stop checks applied."""
        for req in reqs:
            if req.penalty is None and req.params.has_penalties:
                req.penalty = PenaltyState.start(req.prompt_ids, req.output_ids, logits.shape[-1])
        tokens = sample(logits, reqs, self.eos_ids, self._generator)
        wanted = [i for i, req in enumerate(reqs) if req.params.logprobs is not None]
        lps: list[PositionLogprobs | None] = [None] * len(reqs)
        if wanted:  # raw logprobs, one batched pass
            n = max(reqs[i].params.logprobs for i in wanted)
            for i, lp in zip(wanted, logprobs_of(logits[wanted], torch.tensor([tokens[i] for i in wanted]), n)):
                lps[i] = lp._replace(top=lp.top[: reqs[i].params.logprobs])
        out = []
        for req, token, lp in zip(reqs, tokens, lps):
            req.output_ids.append(token)
            if req.penalty is not None:
                req.penalty.add(token)
            reason = self._check_stop(req, token)
            if reason:
                self.scheduler.finish(req, reason)
            out.append((req, token, lp))
        return out

    def _score_prompt(self, req: Request, start: int, hidden: torch.Tensor) -> None:
        """Prompt logprobs from one chunk's hidden states [t, H] (positions start..start+t-1): position p
        predicts prompt token p + 1. Positions already scored (before a preemption) are skipped; the
        logits are computed a bounded slice of rows at a time."""
        lo = max(start, len(req.prompt_logprobs) - 1)
        hi = min(start + hidden.shape[0], len(req.prompt_ids) - 1)
        step = max(1, PROMPT_LOGITS_BYTES // (4 * self.model.config.vocab_size))
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            logits = self.model.head(hidden[a - start : b - start])
            targets = torch.tensor(req.prompt_ids[a + 1 : b + 1], device=logits.device)
            req.prompt_logprobs.extend(logprobs_of(logits, targets, req.params.prompt_logprobs))

    def _record(self, batch, values: dict) -> None:
        from afd.obs.capture import BOUNDARIES

        for (layer, boundary), tensor in values.items():
            if boundary not in BOUNDARIES:
                continue
            start = 0
            for item in batch:
                n = item.chunk.length
                self.capture.add(item.request.tag, range(item.chunk.start, item.chunk.end), layer, boundary, tensor[start : start + n])
                start += n

    def _check_stop(self, req: Request, token: int) -> str | None:
        """Why ``req`` ends with ``token``, if it does (vLLM's rules): nothing but the length before
        ``min_tokens``; EOS (unless ignore_eos) or a stop token; a stop string (afd/engine/detokenizer.py,
        when this engine detokenizes; else the front end's)."""
        p = req.params
        if len(req.output_ids) > p.min_tokens:
            stop_token = token in p.stop_token_ids
            if stop_token or (token in self.eos_ids and not p.ignore_eos):
                if req.text is not None:
                    req.text.add(token, ends_by_token=True)
                req.stop_reason = token if stop_token else None
                return "stop"
        if req.text is not None and (hit := req.text.add(token)) is not None:
            req.stop_reason = hit
            return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, req: Request) -> RequestOutput:
        self._requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_ids=req.prompt_ids,
            text=req.output_text,
            token_ids=list(req.output_ids),
            finish_reason=req.finish_reason or "stop",
        )

    # ------------------------------------------------------------------ batch API
    def generate(
        self,
        prompts: Iterable[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        progress: bool = False,
        tags: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order. ``tags`` name the requests in captures."""
        prompts = list(prompts)
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        tags = list(tags) if tags is not None else [None] * len(prompts)
        ids = [self.add_request(p, sp, tag) for p, sp, tag in zip(prompts, per_prompt, tags)]
        done: dict[int, RequestOutput] = {}
        total = sum(sp.max_tokens for sp in per_prompt)
        # no tqdm object at all unless asked: it allocates a multiprocessing lock per process
        bar = tqdm(total=total, desc="generate", unit="tok", leave=False) if progress else None
        while self.must_step():
            for out in self.step():
                done[out.request_id] = out
            if bar is not None:
                produced = sum(len(done[i].token_ids) if i in done else len(self._requests[i].output_ids) for i in ids)
                bar.update(produced - bar.n)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]
