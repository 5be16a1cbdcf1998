"""What each rank of a disaggregated run does, from start to exit.

A rank is a process (shm transport) or a thread (loopback). It loads only its
own weights, opens its links, reports READY with the tensors it holds and the
bytes it read, then serves: an attention rank runs an engine replica on the
requests the launcher sends it; an FFN rank runs the worker loop until every
attention rank has said SHUTDOWN.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from afd import env
from afd.attention.runner import DisaggregatedRunner
from afd.config import EngineConfig, PipelineConfig
from afd.connectors.endpoints import AttentionEndpoint
from afd.connectors.factory import LinkSpec, make_mailbox
from afd.connectors.protocol import Role, rank_name
from afd.distributed.devices import device_module
from afd.distributed.topology import DeviceSpec, ExpertPlacement, Topology
from afd.engine.llm_engine import LLMEngine, cache_config_for
from afd.engine.tokenizer import Tokenizer
from afd.ffn.worker import FFNWorker
from afd.kvcache import SeqChunk
from afd.models import WeightSelection, load_model
from afd.models.quant import DEFAULT_FP8_MODE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineArgs:
    """An attention rank's engine flags. None: derived (afd/engine/budget.py; the launcher resolves them
    once, before any rank starts, so every rank and the links are sized alike)."""

    dtype: str = "auto"
    kv_cache_memory: int = 256 << 20
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_step_memory: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    fp8_weights: str = DEFAULT_FP8_MODE  # fp8 block-scaled checkpoints: dequantize at load | keep (afd/models/quant.py)


@dataclass(frozen=True)
class RankSpec:
    role: Role
    index: int
    model_dir: Path
    topology: Topology
    placement: ExpertPlacement
    link: LinkSpec
    engine: EngineArgs = field(default_factory=EngineArgs)
    link_timeout: float = 60.0
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    steps: tuple[str, int] | None = None  # (host, port) of the step agreement's store; None: one attention rank
    generation: int = 0  # > 0: the generation-th replacement of a lost FFN rank (links of its own)
    placement_version: int = 0  # of ``placement`` (a replacement started after a rebalance holds a later one)
    incarnation: int = 0  # > 0: the incarnation-th restart of a lost attention rank (links of its own)
    ffn_generations: tuple[int, ...] = ()  # a restarted attention rank: each FFN rank's generation now
    attention_restart: bool = False  # an FFN rank: a lost attention rank is restarted (wait for it, take it back)
    env: dict[str, str] | None = None  # a process rank's environment (the launcher's when it started the rank)

    @property
    def name(self) -> str:
        return rank_name(self.role, self.index)

    @property
    def device(self) -> DeviceSpec:
        devices = self.topology.attention_devices if self.role == Role.ATTENTION else self.topology.ffn_devices
        return devices[self.index]


@dataclass(frozen=True)
class ReadyReport:
    rank: str
    pid: int
    tensors: tuple[str, ...]
    bytes_read: int


def selection_for(spec: RankSpec) -> WeightSelection:
    t = spec.topology
    if spec.role == Role.ATTENTION:
        return WeightSelection.attention_only(
            shared_experts=t.shared_experts_on == "attention",
            routers=t.gate == "attention",
            dense_mlp=t.dense_on == "attention",
        )
    return WeightSelection.experts_only(  # shared experts and dense layers on the FFN side: replicated on every FFN rank
        spec.placement.experts_of(spec.index),
        shared_experts=t.shared_experts_on == "ffn",
        routers=t.gate == "ffn",
        dense_mlp=t.dense_on == "ffn",
    )


COMBINE_BACKSTOP_S = 300.0
JOIN_TIMEOUT_S = 120.0  # a restart waits this long (plus the link timeout) for the others to take it into their steps


def failover_enabled(topology: Topology, placement: ExpertPlacement) -> bool:
    """Whether attention ranks survive an FFN rank's loss: redundant copies, on a transport whose links can
    be lost and reopened, shm or tcp (a torch.distributed group cannot lose or gain a member; loopback ranks
    are threads)."""
    from afd.connectors.factory import REOPENABLE

    return placement.redundant > 0 and topology.transport in REOPENABLE


def die_with_parent() -> None:
    """This process dies with the one that started it, whatever kills that one (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def report_failure(conn, who: str, e: BaseException) -> None:
    """Tell the parent why this process fails: ("error", one line naming ``who`` and its pid, traceback)."""
    detail = "".join(traceback.format_exception_only(type(e), e)).strip()
    try:
        conn.send(("error", f"{who} (pid {os.getpid()}) failed: {detail}", traceback.format_exc()))
    except Exception:
        pass


def process_title(spec: RankSpec) -> str:
    """What ``ps`` and ``/proc/<pid>/comm`` show for a rank (at most 15 bytes): ``afd attn 0``, ``afd ffn 1 g2``
    (a replacement), ``afd attn 0 r1`` (a restart)."""
    role = "attn" if spec.role == Role.ATTENTION else "ffn"
    return (f"afd {role} {spec.index}" + (f" g{spec.generation}" if spec.generation else "")
            + (f" r{spec.incarnation}" if spec.incarnation else ""))


def _setup_process(spec: RankSpec, is_process: bool) -> None:
    if is_process:
        die_with_parent()
        if spec.env is not None:  # forked from a fork server that may have started under another environment
            for key in set(os.environ) - set(spec.env):
                del os.environ[key]
            os.environ.update(spec.env)
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, process_title(spec).encode()[:15])  # PR_SET_NAME
        except OSError:
            pass
        logging.basicConfig(level=logging.INFO if env.io_log() else logging.WARNING, stream=sys.stderr,
                            format=f"%(asctime)s {spec.name} %(levelname)s %(name)s: %(message)s")
        cores = spec.device.cores
        if cores:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(env.num_threads() or (len(cores) if cores else 1))
    if spec.device.is_accelerator:  # this process's (or thread's) current device: default allocations land there
        device_module(spec.device.kind).set_device(spec.device.torch_device)


def run_rank(spec: RankSpec, conn, hub=None, is_process: bool = True) -> None:
    """Entry point of every rank; reports an exception to the launcher before exiting non-zero."""
    try:
        _setup_process(spec, is_process)
        if spec.role == Role.ATTENTION:
            _attention_main(spec, conn, hub)
        else:
            _ffn_main(spec, conn, hub)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher
        report_failure(conn, spec.name, e)
        if is_process:
            os._exit(1)
        raise


def _load(spec: RankSpec):
    model, report = load_model(spec.model_dir, dtype=spec.engine.dtype, selection=selection_for(spec), device=spec.device.torch_device,
                               fp8=spec.engine.fp8_weights)
    return model, ReadyReport(spec.name, os.getpid(), report.tensors, report.bytes_read)


def _attention_main(spec: RankSpec, conn, hub) -> None:
    model, ready = _load(spec)
    t = spec.topology
    generations = dict(enumerate(spec.ffn_generations))
    if spec.incarnation:  # a restart: the FFN ranks open their ends of its links once its weights are in
        conn.send(("loaded", spec.incarnation))
    mailbox = make_mailbox(spec.link, Role.ATTENTION, spec.index, t.num_ffn_ranks, hub, spec.device.torch_device,
                           incarnation=spec.incarnation, ffn_generations=generations)
    mailbox.jitter = env.send_jitter()
    fault = env.fault()
    if fault is not None and spec.index == 0 and fault[0] not in ("engine-step", "ffn-kill", "ffn-hang"):
        mailbox.fault = fault
    # a combine's wait is bounded by liveness (a peer silent for the link timeout is hung); the endpoint's own
    # timeout is only the backstop for a peer that beats but never answers (a bug), so it is long
    endpoint = AttentionEndpoint(mailbox, t, spec.placement, max(COMBINE_BACKSTOP_S, spec.link_timeout),
                                 failover=failover_enabled(t, spec.placement), placement_version=spec.placement_version,
                                 generations=generations)

    def ffn_lost(loss) -> None:  # the launcher's news too: it kills a hung one and counts the loss
        conn.send(("ffn_lost", loss.rank, loss.generation, loss.reason, loss.hung))
        _trace(runner, "ffn_lost", f"ffn rank {loss.rank} lost ({loss.reason}); {loss.redispatched} in-flight units re-dispatched")

    endpoint.on_ffn_lost = ffn_lost
    rejoining = bool(spec.incarnation) and spec.steps is not None  # a restart that joins the others' step agreement
    if not rejoining:  # (a restart's HELLO says the epoch it is taken back in: below, once it knows)
        endpoint.handshake()  # protocol version agreed with every FFN rank before READY
    mailbox.start_heartbeats(spec.link.heartbeat_interval, spec.link.link_timeout)  # a restart beats while it waits
    e = spec.engine
    dtype = model.model.embed_tokens.weight.dtype
    cache = cache_config_for(model, e.kv_cache_memory, e.block_size, dtype)
    plane = None
    if spec.steps is not None:
        from afd.attention.steps import StepPlane

        members = () if rejoining else range(t.num_attention_ranks)
        plane = StepPlane(spec.index, members, *spec.steps, timeout=max(600.0, spec.link_timeout),
                          incarnation=spec.incarnation if rejoining else 0)
    runner = DisaggregatedRunner(model, cache, endpoint, t, spec.pipeline, plane=plane)
    config = EngineConfig(cache=cache, max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                          dtype="bfloat16" if dtype == torch.bfloat16 else "float32", max_model_len=e.max_model_len,
                          enable_prefix_caching=e.enable_prefix_caching)
    tokenizer = Tokenizer(spec.model_dir) if (Path(spec.model_dir) / "tokenizer.json").is_file() else None  # token ids only
    engine = LLMEngine(model, tokenizer, config, runner)

    def ffn_join(cmd) -> None:  # ("ffn_join", FFN rank, generation): link to a replacement; never fatal
        try:
            endpoint.join(cmd[1], cmd[2])
        except Exception as e:  # noqa: BLE001 - a replacement that fails to start is the launcher's to retry
            log.warning("%s: could not link to the replacement of ffn rank %d: %s", spec.name, cmd[1], e)
            conn.send(("ffn_join_failed", cmd[1], cmd[2], str(e)))
            return
        if plane is None:  # no one to agree with: use it at once
            endpoint.admit(endpoint.ready_mask)
        conn.send(("ffn_joined", cmd[1], cmd[2]))
        _trace(runner, "ffn_joined", f"linked to ffn rank {cmd[1]}'s replacement (generation {cmd[2]})")

    def placement(cmd) -> None:  # ("placement", version, ExpertPlacement): every FFN rank holds its copies; vote it
        endpoint.install(cmd[1], cmd[2])

    def placement_in_use(version: int) -> None:
        conn.send(("placement_in_use", version))
        _trace(runner, "placement", f"expert placement version {version} from this step")

    def admit(cmd) -> None:  # ("admit", attention rank, incarnation): vote its restart into the steps
        plane.admit(cmd[1], cmd[2])
        _trace(runner, "admit", f"attention rank {cmd[1]}'s restart (incarnation {cmd[2]}) asks to join")

    runner.on_placement = placement_in_use
    own = {"ffn_join": ffn_join, "placement": placement, "admit": admit}

    if rejoining:  # everything is built: ask to join, and wait at most a link timeout past a step's for the welcome
        conn.send(("joining", spec.incarnation))
        plane.join(JOIN_TIMEOUT_S + spec.link_timeout)
        endpoint.handshake(epoch=plane.epoch)
        log.warning("%s (incarnation %d): taken back into the agreed steps from step %d (epoch %d, members %s)", spec.name,
                    spec.incarnation, plane.step, plane.epoch, list(plane.members))
    conn.send(("ready", ready))
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "serve":  # ("serve", pipeline, options): requests until ("stop",); see afd.engine.serve_loop
                from afd.engine.serve_loop import serve_requests

                runner.pipeline = cmd[1] or spec.pipeline
                options = cmd[2] if len(cmd) > 2 else {}
                serve_requests(engine, conn, lambda: _link_stats(mailbox, endpoint), capture=options.get("capture"), commands=own)
            elif cmd[0] in own:
                own[cmd[0]](cmd)
            elif cmd[0] == "pipeline":
                runner.pipeline = cmd[1]
                conn.send(("pipeline", cmd[1]))
            elif cmd[0] == "trace":
                runner.trace = [] if cmd[1] else None
                conn.send(("trace", None))
            elif cmd[0] == "get_trace":
                conn.send(("get_trace", (list(runner.trace or []), runner.last_plan)))
            elif cmd[0] == "capture":  # ("capture", prompts[, together]): see _capture
                conn.send(("capture", _capture(engine, cmd[1], together=len(cmd) > 2 and cmd[2])))
            elif cmd[0] == "runner_stats":
                conn.send(("runner_stats", {"steps": runner.num_steps, "idle_steps": runner.num_idle_steps,
                                            "degraded_steps": runner.num_degraded_steps,
                                            "votes": plane.num_votes if plane is not None else 0}))
            elif cmd[0] == "stats":
                conn.send(("stats", mailbox.stats))
            elif cmd[0] == "sleep":  # tests: keep this rank's links idle
                time.sleep(cmd[1])
                conn.send(("sleep", None))
            elif cmd[0] == "shutdown":
                endpoint.shutdown()
                conn.send(("bye", mailbox.stats))
                return
            else:
                raise ValueError(f"unknown command {cmd[0]!r}")
    finally:
        mailbox.close()


def _trace(runner: DisaggregatedRunner, action: str, note: str) -> None:
    """An instant in the rank's trace (``afd generate --trace``), when one is being recorded."""
    if runner.trace is not None:
        from afd.attention.runner import TraceEvent

        now = time.perf_counter()
        runner.trace.append(TraceEvent(now, now, action, 0, -1, runner.seq, runner.endpoint.num_in_flight, note))


def _link_stats(mailbox, endpoint: AttentionEndpoint) -> dict:
    s = mailbox.stats
    return {"connector_bytes_sent": s.bytes_sent, "connector_bytes_received": s.bytes_received,
            "connector_round_trips": endpoint.round_trips, "connector_round_trip_s": endpoint.round_trip_s,
            "connector_wait_s": endpoint.wait_s, "ffn_ranks_lost": len(endpoint.losses), "connector_redispatched": endpoint.num_retried,
            "connector_stale_results": endpoint.stale_results}


def _capture(engine: LLMEngine, prompts: list[list[int]], together: bool = False) -> tuple[dict, torch.Tensor] | None:
    """One prefill batch of token-id prompts with every boundary captured (for parity checks). Alone
    (a solo step), or ``together``: every attention rank got the command and they run it as one
    agreed step, aggregated on the FFN ranks (a rank with no prompts votes without work; None)."""
    runner = engine.runner
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
            chunks = [SeqChunk(engine.blocks.ensure(s, len(p)), 0, len(p)) for s, p in zip(seqs, prompts)]
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


def _ffn_main(spec: RankSpec, conn, hub) -> None:
    model, ready = _load(spec)
    if spec.generation:  # a replacement: the attention ranks open their ends of its links once its weights are in
        conn.send(("loaded", spec.generation))
    mailbox = make_mailbox(spec.link, Role.FFN, spec.index, spec.topology.num_attention_ranks, hub, spec.device.torch_device,
                           generation=spec.generation)
    mailbox.jitter = env.send_jitter()
    conn.send(("ready", ready))
    try:
        worker = FFNWorker(model, mailbox, spec.topology.num_attention_ranks, placement=spec.placement,
                           placement_version=spec.placement_version)
        send = _locked(conn)  # the worker loop and the rebalance loader both report
        threading.Thread(target=_rebalance_loader, args=(spec, conn, send, worker), name=f"{spec.name} rebalance", daemon=True).start()
        worker.on_installed = lambda version: send(("placement_ready", version))
        worker.on_attention_silent = lambda rank, reason: send(("attention_silent", rank, reason))
        worker.attention_restart = spec.attention_restart
        for a in getattr(mailbox, "skipped", ()):  # died before this rank linked: lost to it until its restart says HELLO
            worker.lost_attention |= 1 << a
        worker.delay = env.ffn_delay()
        fault = env.fault()
        if (fault is not None and fault[0] in ("ffn-kill", "ffn-hang") and spec.index == spec.topology.num_ffn_ranks - 1
                and spec.generation == 0):  # not its replacement
            worker.fault = (signal.SIGKILL if fault[0] == "ffn-kill" else signal.SIGSTOP, fault[1])
        # live counters for a server's /metrics: at most once a second, and only when they changed
        # (an idle run sends nothing, so nothing piles up in a pipe nobody reads)
        worker.on_tick = lambda: send(("ffn_stats", worker.live_stats()))
        mailbox.start_heartbeats(spec.link.heartbeat_interval, spec.link.link_timeout, only_to=worker.owes)
        worker.serve()
        send(("bye", worker.stats()))
    finally:
        mailbox.close()


def _locked(conn):
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    return send


def _rebalance_loader(spec: RankSpec, conn, send, worker: FFNWorker) -> None:
    """An FFN rank's commands from the launcher, off the worker loop: ("placement", version, ExpertPlacement)
    loads this rank's copies of the new placement from the checkpoint (fp8 included, as at start) while the
    loop serves the old one; the loop installs them between two rounds and reports ("placement_ready", v)."""
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "attention_join":  # ("attention_join", attention rank, incarnation): its restart's links
                worker.relink(cmd[1], cmd[2])
                continue
            if cmd[0] == "attention_gone":  # ("attention_gone", attention rank): it is not restarted
                worker.relink(cmd[1], None)
                continue
            if cmd[0] != "placement":
                raise ValueError(f"unknown FFN rank command {cmd[0]!r}")
            version, placement = cmd[1], cmd[2]
            t0 = time.monotonic()
            model, _ = _load(replace(spec, placement=placement))
            log.warning("%s: loaded the experts %s of placement version %d in %.1f s", spec.name, list(placement.experts_of(spec.index)),
                        version, time.monotonic() - t0)
            worker.offer(version, model, placement)
    except (EOFError, OSError):
        return  # the launcher is gone or the rank is exiting
    except BaseException as e:  # noqa: BLE001 - a failed load must reach the launcher
        send(("error", f"{spec.name} (pid {os.getpid()}) failed to load a new expert placement: {e}", traceback.format_exc()))
