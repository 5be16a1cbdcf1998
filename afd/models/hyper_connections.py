"""DeepSeek-V4's manifold-constrained hyper-connections: the residual stream is ``N = hc_mult`` streams wide.

Around each block (attention, and the MoE block) the N streams ``X [T, N, H]`` give, from one learned projection
of their unweighted-RMS-normed concatenation (fp32):

* ``pre [T, N]``  = sigmoid(.) + eps, which *collapses* the streams into the block's one input, sum_j pre_j X_j;
* ``post [T, N]`` = 2 sigmoid(.), which *expands* the block's one output back to N streams;
* ``comb [T, N, N]`` = softmax(.) + eps made doubly stochastic by Sinkhorn-Knopp (a column normalisation, then
  ``sinkhorn_iters - 1`` rounds of rows then columns), which *mixes* the input streams into the output ones.

The new streams are ``X'_k = post_k * out + sum_j comb[j, k] X_j`` (comb applied transposed). After the last
layer the :class:`HyperHead` collapses the streams once more before the final norm. In a disaggregated run all
of it stays on the attention side: what crosses the connector is still the MoE block's one input and one output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., N, N] positive -> (nearly) doubly stochastic: columns once, then ``iters - 1`` rounds of rows, columns."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mix(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The streams after a block: post [T, N], comb [T, N, N] (fp32), the block's output [T, H], the streams
    before it [T, N, H] -> [T, N, H], in the streams' dtype."""
    dtype = streams.dtype
    return post.to(dtype)[..., None] * out[:, None, :] + comb.to(dtype).transpose(-1, -2) @ streams


class HyperConnection(nn.Module):
    """The weights of one block's collapse, expansion and mixing (``fn``, ``base``, ``scale``, as transformers
    names them), held in fp32."""

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.n, self.sinkhorn_iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, H] -> (post [T, N], comb [T, N, N], the block's input [T, H] in the streams' dtype)."""
        t, n = streams.shape[0], self.n
        mixes = F.linear(unweighted_rms_norm(streams.reshape(t, -1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split((n, n, n * n), dim=-1)
        pre_b, post_b, comb_b = self.base.split((n, n, n * n))
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(t, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
        return post, sinkhorn(comb, self.sinkhorn_iters, self.eps), collapsed


class HyperHead(nn.Module):
    """The last collapse of the streams, before the final norm (``hc_fn``, ``hc_base``, ``hc_scale``)."""

    def __init__(self, hidden_size: int, hc_mult: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, N, H] -> [T, H] in the streams' dtype."""
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
