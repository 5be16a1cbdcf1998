"""One run's rank processes are forked from a server process of their own that imported torch and afd once.

Spawning a rank imports torch afresh: about 4 s of CPU here, per rank, so a 2A3F run paid five imports
before loading a weight, and a replacement FFN rank paid one more while the run waited for it. A run
instead starts one :class:`RunForkServer` (``multiprocessing``'s fork server, with ``afd.engine.ranks``
preloaded), and every rank, replacements included, is forked from it in a fraction of a second.

* The server is the run's own, started after ``AFD_RUN_ID`` is set: every rank inherits that environment,
  so ``/proc/<pid>/environ`` still finds a run's processes. (A rank names itself in ``/proc/<pid>/comm``,
  e.g. ``afd ffn 1``: a forked process cannot carry an environment of its own there.) Where the run id
  was preset (a supervisor, a benchmark or a test session running many runs under one id), the runs of
  one process share one server, kept until the process exits.
* A rank's ``os.environ`` is the launcher's at the moment it started the rank (the spec carries it), not
  the server's older one: a variable set or removed since is seen as it is now.
* Nothing but imports has happened in the server (no threads, no accelerator context), so forking it is
  as clean as spawning.
* A rank's parent is the server, which exits when the launcher does; ranks die with it
  (``PR_SET_PDEATHSIG``, afd/engine/ranks.py), as they died with the launcher before.
* Connections and sentinels are multiprocessing's own: a rank is an ``mp.Process`` to the launcher.
"""

from __future__ import annotations

import io
import os
import threading
from multiprocessing import context, forkserver, popen_forkserver, spawn, util

PRELOAD = ["afd.engine.ranks"]  # torch, the models, connectors and workers

_SERVERS: dict[str, "RunForkServer"] = {}  # run id -> its server (in the launcher's process)
_LOCK = threading.Lock()


class RunForkServer:
    """The fork server of one run (one per :class:`afd.engine.launcher.Cluster`)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._server = forkserver.ForkServer()
        self._server.set_forkserver_preload(PRELOAD)
        with _LOCK:
            _SERVERS[run_id] = self

    @classmethod
    def of_run(cls, run_id: str) -> "RunForkServer":
        """The server of runs under ``run_id`` in this process: started on first use."""
        with _LOCK:
            server = _SERVERS.get(run_id)
        return server if server is not None else cls(run_id)

    def process(self, target, args: tuple, name: str) -> "RankProcess":
        proc = RankProcess(target=target, args=args, name=name)
        proc._afd_run = self.run_id
        return proc

    def stop(self) -> None:
        """After every rank exited: the server goes too (it would also exit with this process)."""
        with _LOCK:
            _SERVERS.pop(self.run_id, None)
        self._server._stop()


class _RunPopen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, asking the run's own server (not the process-wide one)."""

    def _launch(self, process_obj) -> None:
        server = _SERVERS[process_obj._afd_run]._server
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            context.reduction.dump(prep_data, buf)
            context.reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = server.connect_to_new_process(self._fds)
        parent_w = os.dup(w)  # the child's view of its parent, kept open as long as this Popen
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class RankProcess(context.ForkServerProcess):
    _afd_run = ""

    @staticmethod
    def _Popen(process_obj):
        return _RunPopen(process_obj)
