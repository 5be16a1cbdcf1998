"""Suite-wide fixtures and the accelerator rule: tests marked ``cuda``/``npu`` are deselected
by name where the devices are absent, and the run says how many were not run and why."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests import support


def device_count(kind: str) -> int:
    """How many devices of ``kind`` ("cuda" / "npu") this machine has."""
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    import torch_npu  # noqa: F401 - registers torch.npu

    return torch.npu.device_count()


_NOT_RUN: dict[str, int] = {}  # reason -> tests


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` / ``@pytest.mark.npu`` (``devices=N``, default 1): deselected, and counted with the
    reason, where this machine has fewer such devices."""
    have = {kind: device_count(kind) for kind in ("cuda", "npu")}
    keep, drop = [], []
    for item in items:
        reasons = []
        for kind, n in have.items():
            mark = item.get_closest_marker(kind)
            need = mark.kwargs.get("devices", 1) if mark else 0
            if need > n:
                what = "CUDA" if kind == "cuda" else "Ascend NPU (torch_npu)"
                reasons.append(f"need {need} {what} device{'s' if need > 1 else ''}, this machine has {n}")
        if reasons:
            drop.append(item)
            _NOT_RUN["; ".join(reasons)] = _NOT_RUN.get("; ".join(reasons), 0) + 1
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_sessionfinish(session, exitstatus):
    support.stop_session_forks()


def pytest_terminal_summary(terminalreporter):
    if _NOT_RUN:
        parts = [f"{n} ({why})" for why, n in sorted(_NOT_RUN.items())]
        terminalreporter.write_line(f"NOT RUN (deselected by marker): {sum(_NOT_RUN.values())} tests: " + "; ".join(parts))
    else:
        terminalreporter.write_line("NOT RUN (deselected by marker): 0 tests")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, in-memory transformers model) for every parity case."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    families = [  # (cases, config builder, first seed)
        (support.DEEPSEEK_CASES, support.deepseek_config, 0),
        (support.QWEN_CASES, support.qwen3_config, 10),
        (support.DEEPSEEK_V3_CASES, support.deepseek_v3_config, 20),
        (support.GLM_CASES, support.glm4_moe_config, 30),
        (support.MINIMAX_CASES, support.minimax_m2_config, 40),
        (support.GPT_OSS_CASES, support.gpt_oss_config, 50),
        (support.DSA_CASES, support.dsa_config, 60),
        (support.HYBRID_CASES, support.hybrid_config, 70),
        (support.V4_CASES, support.v4_config, 80),
    ]
    for cases, config, first_seed in families:
        for seed, (name, overrides) in enumerate(cases.items(), start=first_seed):
            hf = support.build_hf_model(config(**overrides), seed=seed)
            hub = name == "ds-qlora-grouped-yarn"  # legacy hub config.json + sharded safetensors
            out[name] = (support.save_checkpoint(hf, root / name, max_shard_size="100KB" if hub else None, hub_style=hub,
                                                 with_mtp=name in ("dsv3-grouped-yarn", "qwen35-moe-vl")), hf)
    return out
