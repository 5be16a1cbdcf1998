"""Per-replica scheduler: which tokens of which requests run in the next step.

Continuous batching over the paged KV cache: running requests go first (one
decode token each, or the next chunk of a long prompt), then waiting requests
are admitted while the token budget, the sequence limit and free blocks allow.
Prompts longer than the budget are prefilled in chunks. When blocks run out,
the newest running request is preempted: its blocks are freed and it is
recomputed later from its prompt and the tokens it already produced.

With prefix caching, a request is admitted on the cached blocks of its longest
cached prefix and computes only the rest; a request that asks for prompt
logprobs computes every position (it may fill the cache, it never reads it).

A model with sliding windows may keep its sliding layers in a pool of their own
(:class:`afd.kvcache.WindowedBlocks`): before each step a running request gives
back the window blocks no query will read again, and both pools must have room.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from afd.engine.request import Request, Status
from afd.kvcache import BlockManager, SeqChunk, WindowedBlocks


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request: Request
    chunk: SeqChunk


class Scheduler:
    def __init__(self, blocks: BlockManager | WindowedBlocks, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found cached (not computed)

    def add(self, request: Request, max_total_tokens: int) -> None:
        need = self.blocks.blocks_for(max_total_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"request {request.request_id} may need {max_total_tokens} tokens ({need} KV blocks) "
                f"but the cache has only {self.blocks.num_blocks} blocks; raise the KV cache size or lower max_tokens"
            )
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledChunk] = []
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted in this loop
            n = min(req.num_pending, budget)
            self.blocks.advance(req.request_id, req.num_computed)  # behind every window now: back to the pool
            if not self._reserve(req, n):
                continue
            batch.append(ScheduledChunk(req, self.blocks.chunk(req.request_id, req.num_computed, n)))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            prefix = self.blocks.lookup(req.all_ids) if req.prompt_logprobs is None else []
            cached = len(prefix) * self.blocks.block_size
            n = min(req.num_tokens - cached, budget)
            if not self.blocks.can_admit(cached + n, prefix):
                break
            if self.blocks.enable_caching:
                self.prefix_queries += req.num_tokens
                self.prefix_hits += cached
            self.waiting.popleft()
            self.blocks.attach(req.request_id, prefix)
            req.num_computed = cached
            self.blocks.ensure(req.request_id, cached + n)
            req.status = Status.RUNNING
            self.running.append(req)
            batch.append(ScheduledChunk(req, self.blocks.chunk(req.request_id, req.num_computed, n)))
            budget -= n
        return batch

    def _reserve(self, req: Request, n: int) -> bool:
        """Make room for ``n`` more tokens of ``req``, preempting newer requests; False if ``req`` itself was preempted."""
        while not self.blocks.can_ensure(req.request_id, req.num_computed + n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        self.blocks.ensure(req.request_id, req.num_computed + n)
        return True

    def preempt(self, req: Request) -> None:
        self.blocks.free(req.request_id)
        self.running.remove(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def abort(self, req: Request) -> None:
        """Forget a request at any stage (a client went away), freeing its blocks."""
        if req.status is Status.RUNNING:
            self.finish(req, "abort")
        elif req.status is Status.WAITING:  # waiting requests hold no blocks (preemption freed them)
            self.waiting.remove(req)
            req.status, req.finish_reason = Status.FINISHED, "abort"

    def finish(self, req: Request, reason: str) -> None:
        self.blocks.free(req.request_id)
        self.running.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
