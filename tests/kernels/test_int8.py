"""The native int8 GEMM (``int8_matmul``: AMX-INT8 tiles up to 256 rows, afd/kernels/csrc/amx.cpp; AVX512-VNNI or
AVX2 register tiles at decode sizes, int8_linear.cpp; the int8 weight read in place) against the int32 product in
torch, exactly, through every set of tiles the CPU runs (an AMX CPU runs VNNI's and AVX2's too; a set it lacks is
refused with an error, which the test checks instead); the fused W8A8 linear (``int8_linear``: quantise, GEMM,
epilogue in one call) against its torch twin, bit for bit; and the W8A8 expert loop (``moe_experts_int8``) against GroupedExperts' Python loop."""

from __future__ import annotations

import pytest
import torch

from afd.kernels import ops as native_ops
from afd.models import int8
from tests import support

FLAGS = set(open("/proc/cpuinfo").read().split())
if not support.amx_granted():
    FLAGS -= {"amx_int8", "amx_tile"}
#: the tiles each path needs, as /proc/cpuinfo names the CPU's sets (AMX's only where the OS grants its state)
PATHS = {"amx": {"amx_int8", "amx_tile"}, "vnni": {"avx512_vnni", "avx512bw"}, "avx2": {"avx2"}}


def kernels():
    """The kernels; the best tiles the CPU has (AMX-INT8, else AVX512-VNNI, else AVX2; with none, ``int8_matmul`` is
    oneDNN's, and these tests check that one)."""
    k = native_ops()
    best = next((name for name, need in PATHS.items() if need <= FLAGS), None)
    assert k.int8_tiles == {"amx": "amx_int8", "vnni": "avx512_vnni", "avx2": "avx2", None: "none"}[best]
    assert k.int8_needs_row_bias == (PATHS["vnni"] <= FLAGS)
    return k


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 16, 17, 40, 256, 257])  # 17+: AMX's or oneDNN's; 257: oneDNN's
@pytest.mark.parametrize("n, k", [(2816, 2048), (70, 192), (37, 100), (8, 64), (130, 333), (1, 1)])  # 70: AMX's 32-row blocks
def test_int8_matmul_is_the_exact_int32_product(m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    q = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)  # -128 too: the unsigned bias must hold
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    ref = q.int() @ w.int().t()
    ops = kernels()
    assert torch.equal(ops.int8_matmul(q, w), ref)
    assert torch.equal(ops.int8_matmul(q, w, ops.int8_row_bias(w)), ref)
    for path, need in PATHS.items():
        if need <= FLAGS:
            assert torch.equal(ops.int8_matmul(q, w, ops.int8_row_bias(w), path=path), ref), path
        else:
            with pytest.raises(RuntimeError, match="do not run here"):
                ops.int8_matmul(q, w, path=path)
    if ops.int8_needs_row_bias and m <= 16:  # canary: a row bias off by one row's sum is caught by the VNNI tiles
        assert not torch.equal(ops.int8_matmul(q, w, ops.int8_row_bias(w).roll(1), path="vnni"), ref) or n == 1


def test_a_w8a8_linear_is_the_same_through_the_kernel_and_through_onednn(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (96, 200), dtype=torch.int8, generator=gen)
    scale = torch.rand(96, generator=gen) + 0.1
    x = torch.randn(6, 200, generator=gen)
    native = int8.int8_linear(x, w, scale, None, int8.kernel_row_bias(w))
    monkeypatch.setattr(int8, "native_ops", lambda: None)
    onednn = int8.int8_linear(x, w, scale)
    assert torch.equal(native, onednn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])  # 17, 40: past the tiles, oneDNN's GEMM
def test_the_fused_w8a8_linear_is_its_torch_twin_bit_for_bit(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randint(-127, 128, (130, 333), dtype=torch.int8, generator=gen)
    scale = torch.rand(130, generator=gen) + 0.1
    bias = torch.randn(130, generator=gen).to(dtype)
    x = (torch.randn(rows, 333, generator=gen) * 3).to(dtype)
    x[1:2] = 0  # a zero row (not at 1 row: the canary needs a nonzero one): scale 1, q 0, never a NaN
    for b in (None, bias):
        fused = kernels().int8_linear(x, w, scale, b, int8.kernel_row_bias(w))
        assert fused.dtype == dtype and not fused.isnan().any()
        assert torch.equal(fused, int8.int8_linear_reference(x, w, scale, b))
    # canary: the twin with the scales along the wrong rows differs
    assert not torch.equal(kernels().int8_linear(x, w, scale), int8.int8_linear_reference(x, w, scale.roll(1)))


def int8_experts(num_experts=6, hidden=96, inter=40, bias=False, limit=None):
    """GroupedExperts holding random int8 weights and per-row scales, as the loader leaves them."""
    from afd.models.layers import GroupedExperts

    gen = torch.Generator().manual_seed(num_experts + hidden)
    m = GroupedExperts(num_experts + 2, hidden, inter, range(num_experts), bias=bias, swiglu_limit=limit)  # 2 held elsewhere
    m.gate_up_proj = torch.nn.Parameter(torch.randint(-127, 128, (num_experts, 2 * inter, hidden), dtype=torch.int8, generator=gen),
                                        requires_grad=False)
    m.down_proj = torch.nn.Parameter(torch.randint(-127, 128, (num_experts, hidden, inter), dtype=torch.int8, generator=gen),
                                     requires_grad=False)
    if bias:
        m.gate_up_proj_bias.data = torch.randn(num_experts, 2 * inter, generator=gen)
        m.down_proj_bias.data = torch.randn(num_experts, hidden, generator=gen)
    m.hold_int8(torch.rand(num_experts, 2 * inter, generator=gen) * 1e-2, torch.rand(num_experts, hidden, generator=gen) * 1e-2,
                torch.float32)
    return m


@pytest.mark.parametrize("tokens", [1, 5, 40])
# hidden 128, inter 64: K a multiple of 64 and 32-row blocks, so AMX's tiles take the expert GEMMs where they run
@pytest.mark.parametrize("bias, limit, hidden, inter", [(False, None, 96, 40), (True, 7.0, 96, 40), (False, None, 128, 64)])
def test_the_native_w8a8_expert_loop_equals_the_python_loop(tokens, bias, limit, hidden, inter):
    """Per (token, slot) row the two loops compute the same ops, in float32 here; they differ in the order of the sum
    over slots and in libm's exp against torch's silu (which could round an activation onto the other side of a
    quantisation step: not with these seeds, so the bound is float32's, relative to the output)."""
    m = int8_experts(hidden=hidden, inter=inter, bias=bias, limit=limit)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(tokens)])  # ids 6, 7: held elsewhere
    ids[0, 0] = -1
    weights = torch.rand(tokens, 3, generator=gen)
    native, ref = m.forward(x, ids, weights), m.reference(x, ids, weights)
    assert (native - ref).abs().max() <= 1e-6 * ref.abs().max(), ((native - ref).abs().max(), ref.abs().max())
    # rows already int8 (an int8 dispatch): read as sent, not requantised from x (x zeroed: only q can give the output)
    q, s = int8.quantize_per_token(x)
    assert torch.allclose(m.forward(torch.zeros_like(x), ids, weights, (q, s)), native, rtol=0, atol=1e-5)
    # canary: a weight scale on the wrong expert is seen
    m.down_proj_scale.data = m.down_proj_scale.data.roll(1, 0)
    assert not torch.allclose(m.forward(x, ids, weights), native, atol=1e-3)
