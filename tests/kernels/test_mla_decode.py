"""MLA's absorbed decode in one native call (afd/kernels/csrc/mla_decode.cpp) against a float64 reference written
here (W_UK folded into the query, softmax over each token's cached latents, W_UV after it) and against the torch
ops it replaces in ``MLAttention.forward``: at least as close to float64 as they are."""

from __future__ import annotations

import pytest
import torch

from afd.kernels import ops as native_ops

BS = 4


def case(nh, d, dn, dr, r, dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 3 * BS + 2, (d,), generator=gen)
    per = (lens.max().item() + BS - 1) // BS
    tables = torch.randperm(d * per, generator=gen).view(d, per)  # blocks scattered over the cache
    cache = torch.randn(d * per * BS, r + dr, generator=gen).to(dtype)
    w = (torch.randn(nh, dn + dv, r, generator=gen) / r**0.5).to(dtype)
    q_nope = torch.randn(nh, d, dn, generator=gen).to(dtype).transpose(0, 1)  # strided, as q_proj's split view is
    q_pe = torch.randn(d, nh, dr, generator=gen).to(dtype)
    return q_nope, q_pe, w, cache, tables, lens


def reference(q_nope, q_pe, w, cache, tables, lens, scale):
    dn = q_nope.shape[-1]
    r = w.shape[-1]
    w_uk, w_uv = w.double().split([dn, w.shape[1] - dn], dim=1)
    out = []
    for d in range(q_nope.shape[0]):
        query = torch.cat((torch.einsum("hn,hnr->hr", q_nope[d].double(), w_uk), q_pe[d].double()), dim=-1)  # [nh, R + dr]
        slots = (tables[d][:, None] * BS + torch.arange(BS)).flatten()[: lens[d]]
        ctx = cache.double()[slots]  # [L, R + dr]
        probs = (query @ ctx.t() * scale).softmax(-1)
        out.append(torch.einsum("hr,hvr->hv", probs @ ctx[:, :r], w_uv))
    return torch.stack(out)


def torch_ops(q_nope, q_pe, w, cache, tables, lens, scale):
    """MLAttention.forward's absorbed decode in torch ops over the native attention kernel (what mla_decode replaces)."""
    dn, r = q_nope.shape[-1], w.shape[-1]
    w_uk, w_uv = w.split([dn, w.shape[1] - dn], dim=1)
    query = torch.cat((torch.bmm(q_nope.transpose(0, 1), w_uk), q_pe.transpose(0, 1)), dim=-1)
    latent = native_ops().paged_decode_attention(query.transpose(0, 1).contiguous(), cache[:, None, :], cache.new_empty(0), tables,
                                                 lens, BS, scale, r, 0, torch.empty(0))
    return torch.bmm(w_uv, latent.transpose(0, 1).transpose(1, 2)).permute(2, 0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh, d, dn, dr, r, dv", [(4, 1, 32, 16, 64, 32),  # one token, the register tile's columns
                                                  (3, 13, 16, 8, 128, 24),  # query rows past two tiles of 6 (2 on AVX2)
                                                  (2, 5, 8, 4, 40, 8)])  # R not whole tiles: the plain loop
def test_mla_decode_is_as_close_to_float64_as_the_torch_ops(dtype, nh, d, dn, dr, r, dv):
    assert native_ops() is not None, "afd/kernels did not build here"
    args = case(nh, d, dn, dr, r, dv, dtype)
    exact = reference(*args, 0.3)
    got = native_ops().mla_decode(*args[:4], args[4], args[5], BS, 0.3, 0)
    assert got.shape == (d, nh, dv) and got.dtype == dtype
    ops_err = (torch_ops(*args, 0.3).double() - exact).abs().max()
    ulp = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert (got.double() - exact).abs().max() <= 2 * ops_err + ulp * exact.abs().max(), ((got.double() - exact).abs().max(), ops_err)


def test_mla_decode_refuses_mismatched_inputs():
    q_nope, q_pe, w, cache, tables, lens = case(2, 3, 8, 4, 64, 8, torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        native_ops().mla_decode(q_nope.bfloat16(), q_pe, w, cache, tables, lens, BS, 1.0, 0)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        native_ops().mla_decode(q_nope, q_pe, w[:, :, :32], cache, tables, lens, BS, 1.0, 0)
