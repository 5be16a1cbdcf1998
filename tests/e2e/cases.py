"""The named end-to-end cases (the seed PR's e2e matrix, done on CPU in CI).

Each case is a set of CLI flags; the topology comes from AFD_E2E_ATTENTION_DEVICES
and AFD_E2E_FFN_DEVICES (read in afd.env, fed to the same --attention-devices /
--ffn-devices flags as the CLI, checked by validate_topology). A case whose
devices need CUDA or an NPU carries that marker and is deselected, and reported
as not run, where the device is absent.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd import env


@dataclass(frozen=True)
class E2ECase:
    name: str
    flags: tuple[str, ...]
    accelerator: str | None = None  # "cuda" / "npu": needs that device

    def argv(self) -> list[str]:
        attention, ffn = self.devices()
        return ["generate", "--prompt", "x", "--attention-devices", attention, "--ffn-devices", ffn, *self.flags]

    def devices(self) -> tuple[str, str]:
        if self.accelerator:
            return f"{self.accelerator}:0", f"{self.accelerator}:1"
        return env.e2e_devices()


CASES = [
    E2ECase("sync-eager", ("--mode", "sync", "--transport", "shm")),
    E2ECase("async-eager", ("--mode", "async", "--num-microbatches", "1", "--transport", "shm")),
    E2ECase("async-ubatch-request-m2", ("--mode", "async", "--num-microbatches", "2", "--split", "request", "--transport", "shm")),
    E2ECase("async-ubatch-request-m3", ("--mode", "async", "--num-microbatches", "3", "--split", "request", "--transport", "torch")),
    E2ECase("async-ubatch-token-m2", ("--mode", "async", "--num-microbatches", "2", "--split", "token", "--transport", "torch")),
    E2ECase("async-ubatch-token-m3", ("--mode", "async", "--num-microbatches", "3", "--split", "token", "--transport", "shm")),
    E2ECase("async-ubatch-token-m2-cuda", ("--mode", "async", "--num-microbatches", "2", "--split", "token", "--transport", "torch"), "cuda"),
    E2ECase("async-ubatch-token-m2-npu", ("--mode", "async", "--num-microbatches", "2", "--split", "token", "--transport", "torch"), "npu"),
]
