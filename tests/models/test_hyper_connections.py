"""DeepSeek-V4's hyper-connections against transformers' own modules (issue 28, first step)."""

from __future__ import annotations

import pytest
import torch

from afd.models import hyper_connections as hc
from afd.testing.parity import compare_values

H, N, ITERS = 32, 4, 3  # 3 Sinkhorn rounds: at transformers' 20 it has converged and one round short is invisible


@pytest.fixture(scope="module")
def modules():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

    config = DeepseekV4Config(vocab_size=64, hidden_size=H, num_hidden_layers=1, hc_mult=N, hc_sinkhorn_iters=ITERS, hc_eps=1e-6)
    gen = torch.Generator().manual_seed(11)
    theirs, ours = DeepseekV4HyperConnection(config), hc.HyperConnection(H, N, ITERS, 1e-6, config.rms_norm_eps)
    head, our_head = DeepseekV4HyperHead(config), hc.HyperHead(H, N, 1e-6, config.rms_norm_eps)
    with torch.no_grad():  # transformers starts base at zero: decisive values, large enough logits for Sinkhorn to matter
        for module, mine in ((theirs, ours), (head, our_head)):
            for (name, p), q in zip(module.named_parameters(), mine.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "fn" in name else 2.0))
                q.copy_(p)
    return theirs, ours, head, our_head


def _streams(t: int = 7, dtype=torch.float32):
    return (torch.randn(t, N, H, generator=torch.Generator().manual_seed(t)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_collapse_expand_and_mix_equal_transformers(modules, dtype):
    theirs, ours, _, _ = modules
    x, out = _streams(dtype=dtype), torch.randn(7, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    post, comb, collapsed = theirs(x[None])
    mine = ours(x)
    for name, ref, got in (("post", post[0], mine[0]), ("comb", comb[0], mine[1]), ("collapsed", collapsed[0], mine[2])):
        assert got.dtype == ref.dtype, name
        assert compare_values(name, ref.float(), got.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2).ok, name
    # transformers' decoder layer: post * out + comb^T @ streams (comb consumed transposed)
    ref = post.to(dtype).unsqueeze(-1) * out[None].unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x[None])
    report = compare_values("mixed streams", ref[0].float(), hc.mix(*mine[:2], out, x).float(), rtol=1e-5 if dtype == torch.float32 else 1e-2)
    assert report.ok, str(report)
    assert torch.allclose(mine[1].float().sum(-2), torch.ones(7, N), atol=1e-4)  # Sinkhorn ends on the columns


@torch.no_grad()
def test_hyper_head_equals_transformers(modules):
    _, _, head, our_head = modules
    x = _streams(5)
    report = compare_values("hyper head", head(x[None])[0], our_head(x))
    assert report.ok, str(report)


@torch.no_grad()
def test_canary_sinkhorn_one_round_short_fails(modules, monkeypatch):
    theirs, ours, _, _ = modules
    x = _streams()
    ref = theirs(x[None])[1][0]
    real = hc.sinkhorn
    monkeypatch.setattr(hc, "sinkhorn", lambda comb, iters, eps: real(comb, iters - 1, eps))
    assert not compare_values("comb", ref, ours(x)[1]).ok


@torch.no_grad()
def test_canary_streams_summed_instead_of_mixed_fails(modules):
    theirs, ours, _, _ = modules
    x, out = _streams(), torch.randn(7, H, generator=torch.Generator().manual_seed(3))
    post, comb, _ = theirs(x[None])
    ref = post.unsqueeze(-1) * out[None].unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x[None])
    mine_post, mine_comb, _ = ours(x)
    summed = mine_post[..., None] * out[:, None, :] + x.sum(dim=1, keepdim=True)  # every stream gets the plain sum
    assert not compare_values("summed", ref[0], summed).ok
    untransposed = mine_post[..., None] * out[:, None, :] + mine_comb @ x  # comb not transposed: also a different mix
    assert not compare_values("comb untransposed", ref[0], untransposed).ok
