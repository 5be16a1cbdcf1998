"""DeepSeek-V4's KV compressors, as pure functions of a sequence's position: one compressed entry per window of
``rate`` tokens (HCA: 128; CSA: 4), emitted exactly when the window's last token arrives, whatever the chunking.

Each token projects to a value ``kv`` and a gate ``z`` (``kv_proj``, ``gate_proj``). A closed window w gives

    entry_w = rmsnorm( sum_j softmax_j(z_j + position_bias_j) * kv_j )     (softmax over the window's slots, fp32)

rotated (interleaved pairs) on its trailing rope slice at position ``w * rate`` by the compressed branch's rotary.
HCA's windows do not overlap. CSA's do (``overlap``): each token projects to two series, Ca (the first ``head_dim``
channels) and Cb (the rest); entry w pools window w-1's Ca with window w's Cb over 2 x rate slots (window 0 has
only its Cb).

**The per-sequence state** (what a chunk boundary must carry; afd keeps it in the sequence's state slot, like a
hybrid model's linear-attention state): the projected kv and gate of the tokens of the unfinished window, in a
ring indexed by ``position % rate`` (how many are pending is ``start % rate``: the position says it, nothing else
is stored), and for CSA the last closed window's Ca kv and gate (read only when such a window exists,
``start // rate > 0``; its gate is kept before the bias, as the ring's). A sequence starting at position 0 never reads its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.models.layers import RotaryEmbedding


@dataclass(frozen=True, slots=True)
class CompressorState:
    """Views into one sequence's state: ``ring_kv``, ``ring_gate`` [rate, D] (D = head_dim, or 2 x head_dim with
    overlap); with overlap ``prev_kv``, ``prev_gate`` [rate, head_dim]. Written in place."""

    ring_kv: torch.Tensor
    ring_gate: torch.Tensor
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None


def rms_norm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """V4's RMSNorm: normalised in fp32, multiplied by the fp32 weight in fp32, cast once at the end."""
    x32 = x.float()
    return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rotate_tail(x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    """x [n, ..., d] with its trailing ``rope.dim`` channels rotated (interleaved pairs) at ``positions`` [n]."""
    cos, sin = rope.cos_sin(positions)
    rd = 2 * cos.shape[-1]
    tail = x[..., -rd:]
    squeeze = tail.dim() == 2
    rotated = rope.apply(tail[:, None] if squeeze else tail, cos, sin, interleaved=True)
    return torch.cat((x[..., :-rd], rotated[:, 0] if squeeze else rotated), dim=-1)


def compress_span(kv: torch.Tensor, gate: torch.Tensor, first: int, rate: int, position_bias: torch.Tensor, norm_weight: torch.Tensor,
                  eps: float, rope: RotaryEmbedding, overlap: bool, prev: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The entries of n consecutive windows, a pure function of their tokens: kv, gate [n * rate, D] (gates before
    the bias) of windows first..first+n-1 -> [n, head_dim]. With ``overlap``, ``prev``: window first-1's Ca kv and
    gate [rate, head_dim] (None: there is none, ``first`` == 0)."""
    head_dim = norm_weight.shape[0]
    n = kv.shape[0] // rate
    ck = kv.view(n, rate, -1)
    cg = gate.view(n, rate, -1) + position_bias
    if overlap:  # [n, 2 rate, head_dim]: window w-1's Ca, then window w's Cb; no window before the first: weight 0
        prev_kv = ck.new_zeros(n, rate, head_dim)
        prev_gate = cg.new_full((n, rate, head_dim), float("-inf"))
        if prev is not None:
            prev_kv[0], prev_gate[0] = prev[0].to(ck.dtype), prev[1].to(cg.dtype) + position_bias[:, :head_dim]
        prev_kv[1:], prev_gate[1:] = ck[:-1, :, :head_dim], cg[:-1, :, :head_dim]
        ck = torch.cat((prev_kv, ck[..., head_dim:]), dim=1)
        cg = torch.cat((prev_gate, cg[..., head_dim:]), dim=1)
    pooled = (ck * cg.softmax(dim=1, dtype=torch.float32).to(ck.dtype)).sum(dim=1)
    entries = rms_norm_fp32_weight(pooled, norm_weight, eps)
    positions = (torch.arange(n, device=kv.device) + first) * rate
    return rotate_tail(entries, positions, rope)


def compress(kv: torch.Tensor, gate: torch.Tensor, start: int, state: CompressorState, rate: int, position_bias: torch.Tensor,
             norm_weight: torch.Tensor, eps: float, rope: RotaryEmbedding, overlap: bool) -> tuple[torch.Tensor, int]:
    """One chunk of a sequence: kv, gate [L, D] for positions start..start+L-1 -> (the entries of the windows that
    close in it [n, head_dim], the first one's window index). Updates ``state`` for the next chunk."""
    length = kv.shape[0]
    first, pending = divmod(start, rate)
    if pending:
        kv = torch.cat((state.ring_kv[:pending].to(kv.dtype), kv))
        gate = torch.cat((state.ring_gate[:pending].to(gate.dtype), gate))
    end = start + length
    n = end // rate - first  # windows that close in this chunk
    rest = kv.shape[0] - n * rate
    if rest:
        state.ring_kv[:rest] = kv[n * rate:]
        state.ring_gate[:rest] = gate[n * rate:]
    head_dim = norm_weight.shape[0]
    if n == 0:
        return kv.new_zeros(0, head_dim), first
    prev = (state.prev_kv, state.prev_gate) if overlap and first > 0 else None
    entries = compress_span(kv[: n * rate], gate[: n * rate], first, rate, position_bias, norm_weight, eps, rope, overlap, prev)
    if overlap:  # the last closed window's Ca, before the bias, for the next chunk
        state.prev_kv.copy_(kv[(n - 1) * rate: n * rate, :head_dim])
        state.prev_gate.copy_(gate[(n - 1) * rate: n * rate, :head_dim])
    return entries, first
