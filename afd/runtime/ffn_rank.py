"""An FFN rank, from start to exit: load its experts, open its links, report READY, run the worker loop
(afd/ffn/worker.py) until every attention rank said SHUTDOWN. The launcher's commands arrive on a thread of
their own, so that loading a new placement's experts never stops the loop."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import replace

from afd.connectors.factory import make_mailbox
from afd.connectors.wire import Role
from afd.engine.messages import UnhandledMessage
from afd.ffn.worker import FFNWorker
from afd.runtime.faults import SlowFFNWorker, rank_mailbox
from afd.runtime.messages import (AttentionGone, AttentionJoin, AttentionSilent, Bye, Failed, FfnStats, InstallPlacement, Loaded,
                                  PlacementReady, Ready)
from afd.runtime.spec import RankSpec, load

log = logging.getLogger(__name__)


def ffn_main(spec: RankSpec, conn, hub) -> None:
    model, ready = load(spec)
    timeouts = spec.link.timeouts
    mailbox = rank_mailbox(make_mailbox(spec.link, Role.FFN, spec.index, spec.topology.num_attention_ranks, hub,
                                        spec.device.torch_device, generation=spec.generation), spec)
    if spec.generation:  # a replacement: its readers are open, the attention ranks may link to it now (never waiting)
        conn.send(Loaded())
    mailbox.connect(timeouts.ready)
    conn.send(Ready(ready))
    try:
        worker_type, extra = (SlowFFNWorker, {"delay": spec.faults.ffn_delay}) if spec.faults and spec.faults.ffn_delay else (FFNWorker, {})
        worker = worker_type(model, mailbox, spec.topology.num_attention_ranks, placement=spec.placement,
                             placement_version=spec.placement_version, relink_timeout=timeouts.hang, **extra)
        send = _locked(conn)  # the worker loop and the command thread both report
        threading.Thread(target=_commands, args=(spec, conn, send, worker), name=f"{spec.name} commands", daemon=True).start()
        worker.on_installed = lambda version: send(PlacementReady(version))
        worker.on_attention_silent = lambda rank, reason: send(AttentionSilent(rank, reason))
        worker.attention_restart = spec.attention_restart
        for a in mailbox.skipped:  # died before this rank linked: lost to it until its restart says HELLO
            worker.unions.lost |= 1 << a
        # live counters for a server's /metrics: at most once a second, and only when they changed
        # (an idle run sends nothing, so nothing piles up in a pipe nobody reads)
        worker.on_tick = lambda: send(FfnStats(worker.live_stats()))
        mailbox.start_heartbeats(timeouts.heartbeat, timeouts.hang, only_to=worker.owes)
        worker.serve()
        send(Bye(worker.stats()))
    finally:
        mailbox.close()


def _locked(conn):
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    return send


def _commands(spec: RankSpec, conn, send, worker: FFNWorker) -> None:
    """An FFN rank's commands from the launcher, off the worker loop. A new placement's experts are loaded
    from the checkpoint (fp8 included, as at start) while the loop serves the old ones; the loop installs
    them between two rounds and reports :class:`PlacementReady`."""
    try:
        while True:
            msg = conn.recv()
            match msg:
                case AttentionJoin(rank, incarnation):  # its restart's links
                    worker.relink(rank, incarnation)
                case AttentionGone(rank):  # it is not restarted
                    worker.relink(rank, None)
                case InstallPlacement(version, placement):
                    t0 = time.monotonic()
                    model, _ = load(replace(spec, placement=placement))
                    log.warning("%s: loaded the experts %s of placement version %d in %.1f s", spec.name,
                                list(placement.experts_of(spec.index)), version, time.monotonic() - t0)
                    worker.offer(version, model, placement)
                case _:
                    raise UnhandledMessage(spec.name, msg)
    except (EOFError, OSError):
        return  # the launcher is gone or the rank is exiting
    except BaseException as e:  # noqa: BLE001 - a failed load (or an unknown command) must reach the launcher
        send(Failed(f"{spec.name} failed: {type(e).__name__}: {e}", traceback.format_exc()))
