"""``AFD_KERNELS_MARCH``: the kernels built for an older CPU than this one (x86-64-v3: AVX2 and FMA, no AVX-512, no
AMX), as an AVX2 machine builds them, run here and equal their torch twins. CI's machines have AVX-512 or AMX, so
without this the AVX2 paths would only ever run on a user's AVX2 machine."""

import os
import platform
import subprocess
import sys

import pytest

from afd import env

CHECK = r"""
import torch
import torch.nn.functional as F
from afd.kernels import ops
from afd.models.layers import RMSNorm
k = ops()
assert k is not None, "not built"
print("simd", k.simd, "bf16", k.bf16_tiles, "int8", k.int8_tiles)
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for rows in (1, 5, 16):
        x, w = torch.randn(rows, 256, generator=g).to(dtype), torch.randn(96, 256, generator=g).to(dtype)
        want = F.linear(x.double(), w.double())
        err = (k.linear(x, w, None).double() - want).abs().max().item() / want.abs().max().item()
        assert err < (1e-6 if dtype == torch.float32 else 1e-2), (dtype, rows, err)
x = torch.randn(7, 128, generator=g)
norm = RMSNorm(128, 1e-6)
torch.nn.init.normal_(norm.weight, generator=g)
assert torch.allclose(k.rms_norm(x, norm.weight, 1e-6), norm.reference(x), atol=1e-5)
print("ok")
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v3 is an x86 -march")
def test_the_avx2_build_runs_here_and_equals_the_torch_twins(tmp_path):
    res = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "AFD_KERNELS_MARCH": "x86-64-v3"})
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr
    assert "simd avx2 bf16 none int8 avx2" in res.stdout, res.stdout


def test_a_bad_march_is_refused_not_a_silent_fallback(monkeypatch):
    monkeypatch.setenv("AFD_KERNELS_MARCH", "native; rm -rf /")
    with pytest.raises(ValueError, match="AFD_KERNELS_MARCH"):
        env.kernels_march()
