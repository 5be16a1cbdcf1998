"""The native RMSNorm and rotary embedding against their torch forms (the reference methods they replace) and
against float64 arithmetic written here; the dtype rules of the torch forms hold (bf16 rounding points)."""

from __future__ import annotations

import pytest
import torch

from afd.config import RopeConfig
from afd.kernels import ops as native_ops
from afd.models.layers import RMSNorm, RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 256), (3, 5, 576)])  # a row, a batch, heads of a latent
def test_native_rms_norm_equals_the_torch_form(dtype, shape):
    assert native_ops() is not None, "afd/kernels did not build here"
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1], generator=gen) + 0.5)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    got, want = norm(x), norm.reference(x)
    assert got.dtype == want.dtype == dtype and got.shape == x.shape
    # float32: the sum of squares in another order (last bits); half precision: the same rounding points,
    # so at most one unit in the last place apart where the float32 statistics differ in their last bit
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol * 4, rtol=tol)
    x64 = x.double()
    exact = norm.weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + 1e-6


def test_native_rms_norm_reads_a_strided_view_as_its_values():
    """MLA's latent is a split of the projection: a non-contiguous view (copied before the kernel)."""
    norm = RMSNorm(8)
    both = torch.randn(4, 12)
    latent = both[:, :8]
    torch.testing.assert_close(norm(latent), norm.reference(latent))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rope_dim", [16, 64])
def test_native_rotary_equals_the_torch_form(dtype, interleaved, rope_dim):
    rope = RotaryEmbedding(RopeConfig(dim=rope_dim, theta=10000.0, interleaved=interleaved))
    positions = torch.tensor([0, 1, 5, 77, 1023])
    cos, sin = rope.cos_sin(positions)
    x = torch.randn(5, 3, rope_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    got, want = rope.apply(x, cos, sin), rope.reference(x, cos, sin)
    assert got.dtype == dtype
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol * 4, rtol=tol)
    # an independent reference: the rotation of each pair by its position's angle, in float64
    pairs = (torch.stack((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)), -1) if interleaved
             else torch.stack((torch.arange(rope_dim // 2), torch.arange(rope_dim // 2, rope_dim)), -1))
    angle = positions.double()[:, None] * rope.inv_freq.double()[None, :]  # [T, D/2]
    c, s = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b = x.double()[..., pairs[:, 0]], x.double()[..., pairs[:, 1]]
    exact = torch.empty(x.shape, dtype=torch.float64)
    exact[..., pairs[:, 0]], exact[..., pairs[:, 1]] = a * c - b * s, a * s + b * c
    assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + 1e-5


def test_partial_rotary_passes_the_unrotated_channels_through():
    """GLM: rope dim < head dim, only the first channels turn (the kernel sees just those)."""
    rope = RotaryEmbedding(RopeConfig(dim=8, theta=10000.0, interleaved=False))
    cos, sin = rope.cos_sin(torch.arange(4))
    x = torch.randn(4, 2, 12)
    got = rope.apply(x, cos, sin)
    torch.testing.assert_close(got[..., :8], rope.reference(x[..., :8], cos, sin))
    assert torch.equal(got[..., 8:], x[..., 8:])


def test_native_rotary_refuses_mismatched_tables():
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        native_ops().rotary(torch.randn(3, 2, 8), torch.randn(2, 4), torch.randn(2, 4), False)
