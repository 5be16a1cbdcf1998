"""Offline generation through the serving front end: every prompt at once, balanced and streamed as a
server would take them, the outputs in prompt order (``afd generate``, tests, benchmarks)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Sequence

from afd.config import PipelineConfig, SamplingParams
from afd.engine.request import RequestOutput
from afd.runtime.clients import ClusterClient, ReplicaClient, ReplicaFailed
from afd.runtime.cluster import Cluster
from afd.runtime.launcher import RankFailedError
from afd.serving.frontend import Frontend


def run_offline(client: ReplicaClient, tokenizer, prompts: Sequence[str | Sequence[int]],
                params: SamplingParams | Sequence[SamplingParams], progress: bool = False, shutdown: bool = True) -> list[RequestOutput]:
    """Every prompt through a :class:`Frontend` over ``client`` at once, as a server would take them
    (``afd generate``, :func:`generate`); outputs in prompt order. Prompt i is request i of this
    front end (captures are keyed by it). ``shutdown`` False: the replicas outlive the call."""
    prompts = list(prompts)
    per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
    ids = []
    for p in prompts:
        if isinstance(p, str) and tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        ids.append(tokenizer.encode(p) if isinstance(p, str) else list(p))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(p.max_tokens for p in per_prompt), desc="generate", unit="tok", leave=False)

    async def one(frontend: Frontend, i: int) -> RequestOutput:
        tokens, text, reason = [], [], "stop"
        async for d in frontend.generate(ids[i], per_prompt[i]):
            if d.tag != i:
                raise AssertionError(f"prompt {i} became request {d.tag}")
            if d.token_id is not None:
                tokens.append(d.token_id)
                if bar is not None:
                    bar.update(1)
            text.append(d.text)
            reason = d.finish_reason or reason
        return RequestOutput(i, prompts[i] if isinstance(prompts[i], str) else "", ids[i], "".join(text), tokens, reason)

    async def main() -> list[RequestOutput]:
        frontend = Frontend(client, tokenizer=tokenizer)
        frontend.start(asyncio.get_running_loop())
        try:
            return list(await asyncio.gather(*(one(frontend, i) for i in range(len(prompts)))))
        finally:
            await asyncio.get_running_loop().run_in_executor(None, lambda: frontend.close(shutdown=shutdown))
            if frontend.failure is not None:
                raise ReplicaFailed(frontend.failure)

    try:
        return asyncio.run(main())
    finally:
        if bar is not None:
            bar.close()


def generate(cluster: Cluster, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
             pipeline: PipelineConfig | None = None, capture_dir: str | Path | None = None, progress: bool = False) -> list[RequestOutput]:
    """Run prompts to completion on a started :class:`Cluster` (which stays up for more); outputs in prompt
    order. ``capture_dir``: each attention rank records its steps there, keyed by the prompt's index.
    Raises RankFailedError when the run fails."""
    if cluster.tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise ValueError(f"{cluster.model_dir} has no tokenizer.json: pass token ids")
    client = ClusterClient(cluster, pipeline, str(capture_dir) if capture_dir is not None else None)
    try:
        return run_offline(client, cluster.tokenizer, prompts, params, progress=progress, shutdown=False)
    except ReplicaFailed as e:
        raise RankFailedError(str(e)) from None
