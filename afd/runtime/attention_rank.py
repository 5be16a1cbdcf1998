"""An attention rank, from start to exit: load the attention side, link to every FFN rank, report READY,
then take the launcher's commands -- serve requests (an engine replica over a :class:`DisaggregatedRunner`),
answer requests for traces, captures and counters -- until ``Shutdown``."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from afd.attention.disagg_runner import DisaggregatedRunner, TraceEvent
from afd.attention.steps import StepPlane
from afd.config import EngineConfig
from afd.connectors.dispatch import AttentionEndpoint, FFNLoss
from afd.connectors.factory import make_mailbox
from afd.connectors.wire import Role
from afd.engine.llm_engine import LLMEngine, cache_config_for
from afd.engine.messages import UnhandledMessage
from afd.engine.serve_loop import serve_requests
from afd.engine.tokenizer import Tokenizer
from afd.runtime.faults import engine_runner, rank_mailbox
from afd.runtime.messages import (Admit, Bye, Capture, FfnJoin, FfnJoined, FfnJoinFailed, FfnLost, GetLinkStats, GetRunnerStats,
                                  GetTrace, InstallPlacement, Joining, Loaded, PlacementInUse, Ready, Reply, RunnerStats, Serve,
                                  SetPipeline, SetTrace, Shutdown, Sleep)
from afd.runtime.spec import RankSpec, failover_enabled, load

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how often a rank that waits for its launcher's next command reads its links


def attention_main(spec: RankSpec, conn, hub) -> None:
    model, ready = load(spec)
    t, timeouts = spec.topology, spec.link.timeouts
    generations = dict(enumerate(spec.ffn_generations))
    mailbox = rank_mailbox(make_mailbox(spec.link, Role.ATTENTION, spec.index, t.num_ffn_ranks, hub, spec.device.torch_device,
                                        incarnation=spec.incarnation, ffn_generations=generations), spec)
    if spec.incarnation:  # a restart: the FFN ranks open their ends of its links once its readers are open
        conn.send(Loaded())
    mailbox.connect(timeouts.ready)
    # a combine's wait is bounded by liveness (a peer silent for the hang timeout is hung); the endpoint's own
    # timeout is only the backstop for a peer that beats but never answers (a bug), so it is long
    endpoint = AttentionEndpoint(mailbox, t, spec.placement, timeouts.backstop, failover=failover_enabled(t, spec.placement),
                                 placement_version=spec.placement_version, generations=generations, link_timeout=timeouts.hang)
    rejoining = bool(spec.incarnation) and spec.steps is not None  # a restart that joins the others' step agreement
    if not rejoining:  # (a restart's HELLO says the epoch it is taken back in: below, once it knows)
        endpoint.handshake()  # protocol version agreed with every FFN rank before READY
    mailbox.start_heartbeats(timeouts.heartbeat, timeouts.hang)  # a restart beats while it waits
    e = spec.engine
    dtype = model.model.embed_tokens.weight.dtype
    cache = cache_config_for(model, e.kv_cache_memory, e.block_size, dtype, e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len,
                             e.state_dtype)
    plane = None
    if spec.steps is not None:
        members = () if rejoining else range(t.num_attention_ranks)
        plane = StepPlane(spec.index, members, *spec.steps, timeout=timeouts.vote, incarnation=spec.incarnation if rejoining else 0)
    runner = DisaggregatedRunner(model, cache, endpoint, t, spec.pipeline, plane=plane)
    config = EngineConfig(cache=cache, max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                          dtype="bfloat16" if dtype == torch.bfloat16 else "float32", max_model_len=e.max_model_len,
                          enable_prefix_caching=e.enable_prefix_caching)
    tokenizer = Tokenizer(spec.model_dir) if (Path(spec.model_dir) / "tokenizer.json").is_file() else None  # token ids only
    engine = LLMEngine(model, tokenizer, config, engine_runner(runner, spec.faults))
    rank = _AttentionRank(spec, conn, engine, runner, endpoint, mailbox)
    if rejoining:  # everything is built: ask to join, and wait at most a hang timeout past a step's for the welcome
        conn.send(Joining(spec.incarnation))
        plane.join(timeouts.rejoin)
        endpoint.handshake(epoch=plane.epoch)
        log.warning("%s (incarnation %d): taken back into the agreed steps from step %d (epoch %d, members %s)", spec.name,
                    spec.incarnation, plane.step, plane.epoch, list(plane.members))
    conn.send(Ready(ready))
    try:
        rank.serve_commands()
    finally:
        mailbox.close()


class _AttentionRank:
    """The launcher's commands to one attention rank, and what the rank tells the launcher."""

    def __init__(self, spec: RankSpec, conn, engine: LLMEngine, runner: DisaggregatedRunner, endpoint: AttentionEndpoint,
                 mailbox) -> None:
        self.spec, self.conn, self.engine, self.runner = spec, conn, engine, runner
        self.endpoint, self.mailbox = endpoint, mailbox
        endpoint.on_ffn_lost = self.ffn_lost
        endpoint.on_link = self.ffn_linked
        runner.on_placement = self.placement_in_use

    def serve_commands(self) -> None:
        while True:
            while not self.conn.poll(IDLE_POLL_S):  # between commands the links are read too (a replacement's HELLO)
                self.runner.maintain()
            msg = self.conn.recv()
            match msg:
                case Serve(pipeline, capture):  # requests until StopServing (afd/engine/serve_loop.py)
                    self.runner.pipeline = pipeline or self.spec.pipeline
                    serve_requests(self.engine, self.conn, self.link_stats, capture=capture, on_command=self.control)
                case SetPipeline(pipeline):
                    self.runner.pipeline = pipeline
                    self.conn.send(Reply())
                case SetTrace(on):
                    self.runner.trace = [] if on else None
                    self.conn.send(Reply())
                case GetTrace():
                    self.conn.send(Reply((list(self.runner.trace or []), self.runner.last_plan)))
                case Capture(prompts, together):
                    self.conn.send(Reply(run_capture(self.engine, self.runner, [list(p) for p in prompts], together)))
                case GetRunnerStats():
                    r, plane = self.runner, self.runner.plane
                    self.conn.send(Reply(RunnerStats(r.num_steps, r.num_idle_steps, r.num_degraded_steps,
                                                     plane.num_votes if plane is not None else 0, r.learner.model, r.ffn_busy_s)))
                case GetLinkStats():
                    self.conn.send(Reply(self.mailbox.stats))
                case Sleep(seconds):  # tests: keep this rank's links idle
                    time.sleep(seconds)
                    self.conn.send(Reply())
                case Shutdown():
                    self.endpoint.shutdown()
                    self.conn.send(Bye(self.mailbox.stats))
                    return
                case _:
                    if not self.control(msg):
                        raise UnhandledMessage(self.spec.name, msg)

    def control(self, msg: object) -> bool:
        """The launcher's commands that come while serving too (between steps); False for any other."""
        match msg:
            case FfnJoin(rank, generation):  # link to a replacement, without waiting for it; never fatal
                try:
                    self.endpoint.join(rank, generation)
                except Exception as e:  # noqa: BLE001 - a replacement that fails to start is the launcher's to retry
                    self.ffn_linked(rank, generation, str(e))
            case InstallPlacement(version, placement):  # every FFN rank holds its copies: vote it
                self.endpoint.install(version, placement)
            case Admit(rank, incarnation):  # vote attention rank ``rank``'s restart into the steps
                self.runner.plane.admit(rank, incarnation)
                self.trace("admit", f"attention rank {rank}'s restart (incarnation {incarnation}) asks to join")
            case _:
                return False
        return True

    def ffn_lost(self, loss: FFNLoss) -> None:  # the launcher's news too: it kills a hung one and counts the loss
        self.conn.send(FfnLost(loss.rank, loss.generation, loss.reason, loss.hung))
        self.trace("ffn_lost", f"ffn rank {loss.rank} lost ({loss.reason}); {loss.redispatched} in-flight units re-dispatched")

    def ffn_linked(self, rank: int, generation: int, error: str | None) -> None:
        """A replacement's link is up (``error`` None) or given up."""
        if error is not None:
            log.warning("%s: could not link to the replacement of ffn rank %d: %s", self.spec.name, rank, error)
            self.conn.send(FfnJoinFailed(rank, generation, error))
            return
        if self.runner.plane is None:  # no one to agree with: use it at once
            self.endpoint.admit(self.endpoint.ready_mask)
        self.conn.send(FfnJoined(rank, generation))
        self.trace("ffn_joined", f"linked to ffn rank {rank}'s replacement (generation {generation})")

    def placement_in_use(self, version: int) -> None:
        self.conn.send(PlacementInUse(version))
        self.trace("placement", f"expert placement version {version} from this step")

    def trace(self, action: str, note: str) -> None:
        """An instant in the rank's trace (``afd generate --trace``), when one is being recorded."""
        runner = self.runner
        if runner.trace is not None:
            now = time.perf_counter()
            runner.trace.append(TraceEvent(now, now, action, 0, -1, runner.seq, runner.endpoint.num_in_flight, note))

    def link_stats(self) -> dict:
        s, e = self.mailbox.stats, self.endpoint
        return {"connector_bytes_sent": s.bytes_sent, "connector_bytes_received": s.bytes_received,
                "connector_round_trips": e.round_trips, "connector_round_trip_s": e.round_trip_s, "connector_wait_s": e.wait_s,
                "ffn_ranks_lost": len(e.losses), "connector_redispatched": e.num_retried, "connector_stale_results": e.stale_results,
                "connector_rows_sent": dict(e.rows_sent)}


def run_capture(engine: LLMEngine, runner: DisaggregatedRunner, prompts: list[list[int]], together: bool = False):
    """One prefill batch of token-id prompts with every boundary captured (for parity checks). Alone
    (a solo step), or ``together``: every attention rank got the command and they run it as one
    agreed step, aggregated on the FFN ranks (a rank with no prompts votes without work; None)."""
    if together:
        runner.plane.join_wave(runner.plane.waves_done)
    values: dict = {}
    out = None
    tokens = sum(len(p) for p in prompts)
    if tokens > engine.config.max_num_batched_tokens:  # links and step memory are sized for the token cap
        raise ValueError(f"a capture of {tokens} tokens exceeds max_num_batched_tokens {engine.config.max_num_batched_tokens}")
    if prompts:  # blocks from the engine's own pool (never a running or cached sequence's), returned after
        seqs = [-1 - i for i in range(len(prompts))]
        try:
            for s, p in zip(seqs, prompts):
                engine.blocks.ensure(s, len(p))
            chunks = [engine.blocks.chunk(s, 0, len(p)) for s, p in zip(seqs, prompts)]
            logits = runner.execute([t for p in prompts for t in p], chunks, solo=not together,
                                    observer=lambda layer, b, x: values.__setitem__((layer, b), x.to("cpu", copy=True)))
        finally:
            for s in seqs:
                if engine.blocks.holds(s):
                    engine.blocks.free(s)
        out = values, logits.cpu()  # CPU tensors through the pipe, whatever the rank's device
    elif together:
        runner.idle()
    while together and runner.in_wave:  # the next step has no work anywhere: the wave ends
        runner.idle()
    return out
