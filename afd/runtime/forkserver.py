"""A run's rank processes are forked from a server process of its own that imported torch and afd once.

Spawning a rank imports torch afresh: about 4 s of CPU here, per rank, so a 2A3F run paid five imports
before loading a weight, and a replacement FFN rank paid one more while the run waited for it. A run
instead starts one :class:`RunForkServer` (``multiprocessing``'s fork server, with ``afd.runtime.rank``
preloaded), and every rank, replacements included, is forked from it in a fraction of a second.

* The server is started with the run id in its environment (``AFD_RUN_ID``), so every rank forked from it
  carries the id in ``/proc/<pid>/environ`` and a run's processes can be found; nothing writes the id
  into the launcher's own environment. A rank names itself in ``/proc/<pid>/comm`` (``afd ffn 1``).
* The server dies with the thread that started it (``PR_SET_PDEATHSIG``), and every rank dies with the
  server: a launcher killed outright (SIGKILL, OOM) leaves nothing behind. (multiprocessing's server
  alone exits only once every holder of its "alive" pipe is gone, and every rank holds it.)
* Whoever starts a server owns it: a :class:`~afd.runtime.cluster.Cluster` starts its own and stops it
  when it shuts down, unless it was given one to share (a test session shares one across its runs).
* Nothing but imports has happened in the server (no threads, no accelerator context), so forking it is
  as clean as spawning.
* Connections and sentinels are multiprocessing's own: a rank is an ``mp.Process`` to the launcher.
* The server's socket lies in a run directory of its starter's (``afd-<run id>-*`` in the temporary
  directory, afd/runtime/procs.py), removed when the server stops, and by the next run's sweep when its
  starter was killed outright (multiprocessing's own address, a ``pymp-*`` directory, stayed behind then).
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import weakref
from multiprocessing import context, forkserver, popen_forkserver, resource_tracker, spawn, util
from pathlib import Path

from afd.runtime.procs import make_run_dir

PRELOAD = ["afd.runtime.rank"]  # torch, the models, connectors and workers


class RunForkServer(forkserver.ForkServer):
    """The fork server of one run (or of several that share it), started on first use."""

    def __init__(self, run_id: str) -> None:
        super().__init__()
        self.run_id = run_id
        self.set_forkserver_preload(PRELOAD)
        self._proc: subprocess.Popen | None = None
        self._dir: Path | None = None  # where the server's socket lies
        self._dir_finalizer: weakref.finalize | None = None  # removes it: on stop, or at this process's exit

    def process(self, target, args: tuple, name: str) -> "RankProcess":
        """A process that runs ``target(*args)``, forked from this server when started."""
        proc = RankProcess(target=target, args=args, name=name)
        proc.server = self
        return proc

    def ensure_running(self) -> None:
        """multiprocessing's own start, with two differences: the server's environment carries the run id,
        and the server dies with its starter (``die_with_parent``) before it imports anything."""
        with self._lock:
            resource_tracker.ensure_running()
            if self._forkserver_pid is not None:
                pid, _ = os.waitpid(self._forkserver_pid, os.WNOHANG)
                if not pid:
                    return  # still running
                os.close(self._forkserver_alive_fd)
                self._forkserver_address = self._forkserver_alive_fd = self._forkserver_pid = None
                self._remove_dir()
            data = {k: v for k, v in spawn.get_preparation_data("ignore").items() if k in ("main_path", "sys_path")}
            self._dir = make_run_dir(self.run_id, None)  # mode 0700, like multiprocessing's own
            self._dir_finalizer = weakref.finalize(self, shutil.rmtree, str(self._dir), True)
            with socket.socket(socket.AF_UNIX) as listener:
                address = str(self._dir / "forkserver")
                listener.bind(address)
                os.chmod(address, 0o600)
                listener.listen()
                alive_r, alive_w = os.pipe()  # every client holds the write end; the server exits when all are gone
                try:
                    code = ("from afd.runtime.procs import die_with_parent; die_with_parent(); "
                            "from multiprocessing.forkserver import main; "
                            f"main({listener.fileno()}, {alive_r}, {self._preload_modules!r}, **{data!r})")
                    exe = spawn.get_executable()
                    env = {"TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING": "0",  # p2p on two-rank groups: serial by design
                           **os.environ, "AFD_RUN_ID": self.run_id}
                    self._proc = subprocess.Popen([exe, *util._args_from_interpreter_flags(), "-c", code], executable=exe,
                                                  pass_fds=(listener.fileno(), alive_r), env=env)
                except BaseException:
                    os.close(alive_w)
                    raise
                finally:
                    os.close(alive_r)
                self._forkserver_address, self._forkserver_alive_fd, self._forkserver_pid = address, alive_w, self._proc.pid

    def stop(self) -> None:
        """After every rank exited: the server goes too (it would also die with its starter)."""
        self._stop()
        if self._proc is not None:
            self._proc.returncode = self._proc.returncode or 0  # reaped by _stop's waitpid
            self._proc = None
        self._remove_dir()

    @property
    def socket_dir(self) -> Path | None:
        """The run directory the server's socket lies in (None until it starts, and after it stops)."""
        return self._dir

    def _remove_dir(self) -> None:
        if self._dir_finalizer is not None:
            self._dir_finalizer()
        self._dir = self._dir_finalizer = None


class _RunPopen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, asking the rank's own server (not the process-wide one)."""

    def _launch(self, process_obj) -> None:
        server = process_obj.server
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
    """A rank, forked from ``server`` (which is not pickled into the child)."""

    server: RunForkServer | None = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("server", None)
        return state

    @staticmethod
    def _Popen(process_obj):
        return _RunPopen(process_obj)
