"""The native int8 GEMM at decode sizes (``int8_matmul``, afd/kernels/csrc/int8_linear.cpp: AVX512-VNNI, the int8
weight read in place) against the int32 product in torch, exactly; and a W8A8 linear through it against the same
linear through ``torch._int_mm`` (oneDNN), which is what runs where the kernel does not."""

from __future__ import annotations

import pytest
import torch

from afd.kernels import ops as native_ops
from afd.models import int8



def kernels():
    """The kernels; their VNNI path exactly where the CPU has AVX512-VNNI (elsewhere ``int8_matmul`` is oneDNN's, and
    these tests check that one)."""
    k = native_ops()
    flags = open("/proc/cpuinfo").read()
    assert k.int8_linear_vectorized == ("avx512_vnni" in flags and "avx512bw" in flags)
    return k


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("n, k", [(2816, 2048), (37, 100), (8, 64), (130, 333), (1, 1)])
def test_int8_matmul_is_the_exact_int32_product(m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    q = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)  # -128 too: the unsigned bias must hold
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    ref = q.int() @ w.int().t()
    ops = kernels()
    assert torch.equal(ops.int8_matmul(q, w), ref)
    assert torch.equal(ops.int8_matmul(q, w, ops.int8_row_bias(w)), ref)
    # canary: a row bias off by one row's sum is caught
    assert not torch.equal(ops.int8_matmul(q, w, ops.int8_row_bias(w).roll(1)), ref) or n == 1


def test_a_w8a8_linear_is_the_same_through_the_kernel_and_through_onednn(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (96, 200), dtype=torch.int8, generator=gen)
    scale = torch.rand(96, generator=gen) + 0.1
    x = torch.randn(6, 200, generator=gen)
    native = int8.int8_linear(x, w, scale, None, int8.kernel_row_bias(w))
    monkeypatch.setattr(int8, "native_ops", lambda: None)
    onednn = int8.int8_linear(x, w, scale)
    assert torch.equal(native, onednn)
