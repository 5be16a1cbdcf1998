"""The one Router against pure-torch references of each family's rule (written here, from the papers'
and transformers' definitions), and the canaries that tell the rules apart."""

from __future__ import annotations

import pytest
import torch

from afd.config import MoEConfig
from afd.models.base import Router


def make(seed: int = 0, **kw) -> tuple[Router, torch.Tensor]:
    moe = MoEConfig(num_experts=16, intermediate_size=8, layers=(0,), router_fp32=True, **{"top_k": 4, **kw})
    router = Router(32, moe)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen) * 0.3)
        if moe.score_bias:
            router.e_score_correction_bias.copy_(torch.rand(16, generator=gen) - 0.5)
    return router, torch.randn(64, 32, generator=gen)


def reference(router: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, plain Python loops: (sorted expert ids [T, k], weights in that order [T, k])."""
    moe = router.moe
    logits = x.float() @ router.weight.float().T
    ids_out, w_out = [], []
    for row in logits:
        scores = row.softmax(-1) if moe.scoring == "softmax" else row.sigmoid()
        choice = scores + router.e_score_correction_bias if moe.score_bias else scores.clone()
        per = moe.num_experts // moe.num_groups
        if moe.topk_method != "greedy":
            groups = [choice[g * per:(g + 1) * per] for g in range(moe.num_groups)]
            rank = [sorted(g.tolist())[-1] if moe.topk_method == "group_limited_greedy" else sum(sorted(g.tolist())[-2:]) for g in groups]
            kept = sorted(range(moe.num_groups), key=lambda g: -rank[g])[: moe.topk_groups]
            choice = torch.tensor([c if e // per in kept else float("-inf") for e, c in enumerate(choice.tolist())])
        ids = sorted(sorted(range(moe.num_experts), key=lambda e: -choice[e])[: moe.top_k])
        w = scores[ids]
        if moe.scale_after_norm:
            w = (w / w.sum() if moe.norm_topk_prob else w) * moe.routed_scaling_factor
        else:
            w = w / w.sum() if (moe.norm_topk_prob and moe.top_k > 1) else w * moe.routed_scaling_factor
        ids_out.append(ids)
        w_out.append(w)
    return torch.tensor(ids_out), torch.stack(w_out)


VARIANTS = {
    "v2-greedy-scaled": dict(routed_scaling_factor=2.5),
    "v2-grouped-normalised": dict(topk_method="group_limited_greedy", num_groups=4, topk_groups=2, norm_topk_prob=True,
                                  routed_scaling_factor=2.5),
    "qwen-normalised": dict(norm_topk_prob=True),
    "v3-noaux-grouped": dict(scoring="sigmoid", topk_method="noaux_tc", num_groups=4, topk_groups=2, norm_topk_prob=True,
                             routed_scaling_factor=2.5, scale_after_norm=True),
    "v3-noaux-unnormalised": dict(scoring="sigmoid", topk_method="noaux_tc", num_groups=1, topk_groups=1, norm_topk_prob=False,
                                  routed_scaling_factor=1.7, scale_after_norm=True),
}


def sorted_routing(router: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = router(x)
    order = r.topk_ids.argsort(dim=-1)
    return r.topk_ids.gather(1, order), r.topk_weights.gather(1, order)


@pytest.mark.parametrize("variant", VARIANTS)
def test_router_equals_reference(variant):
    router, x = make(**VARIANTS[variant])
    ids, weights = sorted_routing(router, x)
    ref_ids, ref_w = reference(router, x)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


def test_v2_normalises_or_scales_v3_normalises_then_scales():
    """Canary of the two weight rules: with norm_topk_prob and factor 2.5, V2's weights sum to 1 and V3's to 2.5."""
    v2, x = make(**VARIANTS["v2-grouped-normalised"])
    v3, _ = make(**VARIANTS["v3-noaux-grouped"])
    torch.testing.assert_close(v2(x).topk_weights.sum(-1), torch.ones(64))
    torch.testing.assert_close(v3(x).topk_weights.sum(-1), torch.full((64,), 2.5))


def test_bias_selects_but_never_weights():
    router, x = make(**VARIANTS["v3-noaux-grouped"])
    ids, weights = sorted_routing(router, x)
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
    ids0, _ = sorted_routing(router, x)
    assert not torch.equal(ids, ids0), "the bias changed no selection: the test cannot see it"
    scores = (x @ router.weight.T).sigmoid().gather(1, ids)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True) * 2.5)


def test_noaux_config_is_validated():
    with pytest.raises(ValueError, match="at least 2"):
        MoEConfig(num_experts=8, top_k=2, intermediate_size=8, layers=(0,), topk_method="noaux_tc", num_groups=8, topk_groups=2)
    with pytest.raises(ValueError, match="fewer than"):
        MoEConfig(num_experts=8, top_k=6, intermediate_size=8, layers=(0,), topk_method="noaux_tc", num_groups=4, topk_groups=2)
