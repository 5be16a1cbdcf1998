"""The named end-to-end cases (the seed PR's e2e matrix, done on CPU in CI).

Each case is a set of CLI flags; the topology comes from AFD_E2E_ATTENTION_DEVICES
and AFD_E2E_FFN_DEVICES (read in afd.env, fed to the same --attention-devices /
--ffn-devices flags as the CLI, checked by validate_topology). An accelerator
case names its own devices and carries the marker ``cuda(devices=N)`` /
``npu(devices=N)``: deselected, and reported as not run, where fewer exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd import env


@dataclass(frozen=True)
class E2ECase:
    name: str
    flags: tuple[str, ...]
    placed: tuple[str, str] | None = None  # (attention, FFN) devices of an accelerator case; None: the env's

    def argv(self) -> list[str]:
        attention, ffn = self.devices()
        return ["generate", "--prompt", "x", "--attention-devices", attention, "--ffn-devices", ffn, *self.flags]

    def devices(self) -> tuple[str, str]:
        return self.placed or env.e2e_devices()

    @property
    def needs(self) -> dict[str, int]:
        """Accelerator kind -> devices this case needs (its test marker): the highest index named, plus one."""
        out: dict[str, int] = {}
        for d in ",".join(self.placed or ()).split(","):
            kind, _, index = d.partition(":")
            if kind in ("cuda", "npu"):
                out[kind] = max(out.get(kind, 0), int(index) + 1)
        return out


_TOKEN_M2 = ("--mode", "async", "--num-microbatches", "2", "--split", "token")
CASES = [
    E2ECase("sync-eager", ("--mode", "sync", "--transport", "shm")),
    E2ECase("async-eager", ("--mode", "async", "--num-microbatches", "1", "--transport", "shm")),
    E2ECase("async-ubatch-request-m2", ("--mode", "async", "--num-microbatches", "2", "--split", "request", "--transport", "shm")),
    E2ECase("async-ubatch-request-m3", ("--mode", "async", "--num-microbatches", "3", "--split", "request", "--transport", "torch")),
    E2ECase("async-ubatch-token-m2", (*_TOKEN_M2, "--transport", "torch")),
    E2ECase("async-ubatch-token-m3", ("--mode", "async", "--num-microbatches", "3", "--split", "token", "--transport", "shm")),
    # accelerators: NCCL / HCCL device to device, and a CUDA attention rank with CPU experts staged over shm
    E2ECase("async-ubatch-token-m2-cuda-nccl", (*_TOKEN_M2, "--transport", "torch"), ("cuda:0", "cuda:1")),
    E2ECase("async-ubatch-token-m2-cuda-attention-cpu-ffn", (*_TOKEN_M2, "--transport", "shm"), ("cuda:0", "cpu")),
    E2ECase("async-ubatch-token-m2-npu-hccl", (*_TOKEN_M2, "--transport", "torch"), ("npu:0", "npu:1")),
]
