"""Suite-wide fixtures and the accelerator rule: tests marked ``cuda``/``npu`` are deselected
by name where the device is absent, and the run says how many were not run and why."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests import support


def _has_npu() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


_NOT_RUN: dict[str, int] = {}


def pytest_collection_modifyitems(config, items):
    absent = {"cuda": not torch.cuda.is_available(), "npu": not _has_npu()}
    keep, drop = [], []
    for item in items:
        missing = [m for m, gone in absent.items() if gone and item.get_closest_marker(m)]
        if missing:
            drop.append(item)
            for m in missing:
                _NOT_RUN[m] = _NOT_RUN.get(m, 0) + 1
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter):
    if _NOT_RUN:
        why = {"cuda": "no CUDA device on this machine", "npu": "torch_npu / Ascend NPU not installed"}
        parts = [f"{n} need {m.upper()} ({why[m]})" for m, n in sorted(_NOT_RUN.items())]
        terminalreporter.write_line(f"NOT RUN (deselected by marker): {sum(_NOT_RUN.values())} tests: " + "; ".join(parts))
    else:
        terminalreporter.write_line("NOT RUN (deselected by marker): 0 tests")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, in-memory transformers model) for every parity case."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for seed, (name, overrides) in enumerate(support.DEEPSEEK_CASES.items()):
        hf = support.build_hf_model(support.deepseek_config(**overrides), seed=seed)
        hub = name == "ds-qlora-grouped-yarn"  # legacy hub config.json + sharded safetensors
        out[name] = (support.save_checkpoint(hf, root / name, max_shard_size="100KB" if hub else None, hub_style=hub), hf)
    for seed, (name, overrides) in enumerate(support.QWEN_CASES.items(), start=10):
        hf = support.build_hf_model(support.qwen3_config(**overrides), seed=seed)
        out[name] = (support.save_checkpoint(hf, root / name), hf)
    return out
