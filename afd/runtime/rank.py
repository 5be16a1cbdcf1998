"""The rank entry point: how every rank of a disaggregated run starts (what it is told: afd/runtime/spec.py).

A rank is a process forked from the run's fork server (shm, tcp and torch transports) or a thread of the
launcher's process (loopback). It loads only its own weights, opens its links, reports READY with the
tensors it holds and the bytes it read, then serves: an attention rank runs an engine replica
(afd/runtime/attention_rank.py), an FFN rank the worker loop (afd/runtime/ffn_rank.py). Whatever goes
wrong reaches the launcher as :class:`~afd.runtime.messages.Failed` before the process exits non-zero.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from afd.connectors.wire import Role
from afd.distributed.devices import device_module
from afd.runtime.attention_rank import attention_main
from afd.runtime.ffn_rank import ffn_main
from afd.runtime.procs import die_with_parent, keep_freed_memory, report_failure, set_title
from afd.runtime.spec import RankSpec


def run_rank(spec: RankSpec, conn, hub=None, is_process: bool = True) -> None:
    """Entry point of every rank; reports an exception to the launcher before exiting non-zero."""
    try:
        _setup(spec, is_process)
        (attention_main if spec.role == Role.ATTENTION else ffn_main)(spec, conn, hub)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher
        report_failure(conn, spec.name, e)
        if is_process:
            os._exit(1)
        raise


def _setup(spec: RankSpec, is_process: bool) -> None:
    if is_process:
        die_with_parent()
        set_title(spec.title)
        keep_freed_memory()
        logging.basicConfig(level=logging.INFO if spec.link.io_log else logging.WARNING, stream=sys.stderr,
                            format=f"%(asctime)s {spec.name} %(levelname)s %(name)s: %(message)s")
        cores = spec.device.cores
        if cores:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(spec.threads or (len(cores) if cores else 1))
    if spec.device.is_accelerator:  # this process's (or thread's) current device: default allocations land there
        device_module(spec.device.kind).set_device(spec.device.torch_device)
