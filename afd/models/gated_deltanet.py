"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE): a layer whose per-sequence memory is a fixed-size
state, not a KV entry per token.

Per value head, with q and k L2-normalised (q also scaled by ``1/sqrt(dk)``), the state ``S [dk, dv]`` follows
the gated delta rule token by token:

    S <- exp(g_t) S                       (decay; g_t = -exp(A_log) softplus(a_t + dt_bias) <= 0)
    u_t = beta_t (v_t - S^T k_t)           (the part of v_t the state does not predict yet; beta_t = sigmoid(b_t))
    S <- S + k_t u_t^T,    o_t = S^T q_t

*Decode* runs that recurrence for one token, reading and writing the sequence's state slot in place
(:func:`recurrent_step`; on CPU the native kernel, ``gdn_decode`` in afd/kernels). *Prefill* uses the chunked
form (:func:`chunked_delta_rule`): within a chunk of C tokens the updates are solved together as one
unit-lower-triangular system, so the state is carried from chunk to chunk, not from token to token. With
gamma_t the decay accumulated from the chunk's start through t, A[t, s] = beta_t (gamma_t / gamma_s) k_t.k_s
(s < t) and T = (I + A)^-1,

    U   = T (beta V) - T (beta gamma K) S0                     (every token's u at once)
    O   = (gamma Q) S0 + ((gamma_t / gamma_s)_{s<=t} * Q K^T) U
    S_C = gamma_C S0 + (K gamma_C / gamma)^T U

Both forms carry the state across a step's chunk boundaries, so a prompt prefilled in pieces equals the
prompt in one piece. Before either, the q, k, v channels pass a depthwise causal convolution of kernel K over
the last K - 1 inputs, which the sequence's conv state holds between steps.

Everything of the recurrence is computed in fp32 (the state is fp32 unless ``--state-dtype`` says otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afd.config import ModelConfig
from afd.kernels import ops as native_ops
from afd.kvcache import AttentionMetadata
from afd.models.layers import Linear

#: tokens solved together by the chunked form (the triangular systems are CHUNK x CHUNK)
CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def conv_tail(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """The conv state after ``x`` [..., C, n] (the state before, then the new inputs): its last ``kernel - 1`` inputs."""
    return x[..., x.shape[-1] - (kernel - 1):]


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of D sequences. q, k [D, H, dk] (normalised, q scaled), v [D, H, dv], g, beta [D, H],
    state [D, H, dk, dv] fp32 -> (o [D, H, dv], the new state). The pure-torch reference of ``gdn_decode``."""
    state = state * g.exp()[..., None, None]
    u = (v - torch.einsum("dhk,dhkv->dhv", k, state)) * beta[..., None]
    state = state + k[..., :, None] * u[..., None, :]
    return torch.einsum("dhk,dhkv->dhv", q, state), state


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens of one sequence. q, k [L, H, dk] (normalised, q scaled), v [L, H, dv], g, beta [L, H], state
    [H, dk, dv] fp32 -> (o [L, H, dv], the state after the last token). The module docstring's chunked form."""
    length, heads, dk = k.shape
    pad = -length % chunk
    # [H, N, C, d]: heads first, then chunks of C tokens (the padded tail has beta = 0: it changes nothing)
    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, 0, 0, pad)) if pad else x
        return x.transpose(0, 1).reshape(heads, -1, chunk, *x.shape[2:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    c = g.cumsum(dim=-1)  # log gamma_t, within each chunk
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    ratio = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # gamma_t / gamma_s, s <= t
    a = (k @ k.transpose(-1, -2)) * ratio * beta[..., :, None]
    system = torch.eye(chunk, dtype=q.dtype, device=q.device) + a.tril(-1)
    w = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    kc = torch.linalg.solve_triangular(system, k * (beta * c.exp())[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * ratio  # [H, N, C, C]
    q_decayed = q * c.exp()[..., None]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]
    out = torch.empty_like(w)
    for n in range(q.shape[1]):
        u = w[:, n] - kc[:, n] @ state  # [H, C, dv]
        out[:, n] = q_decayed[:, n] @ state + inner[:, n] @ u
        state = state * c[:, n, -1].exp()[:, None, None] + k_to_end[:, n].transpose(-1, -2) @ u
    return out.reshape(heads, -1, v.shape[-1])[:, :length].transpose(0, 1), state


class GatedRMSNorm(nn.Module):
    """RMS norm of each head's output (plain weight, not zero-centred), then times silu(z), in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer. ``kv`` is its (conv state [slots, conv_dim, K - 1], recurrent state [slots, H,
    dk, dv]) in the state cache; ``meta.state`` says which slot each sequence of the batch owns and whether it
    starts fresh (its first token is position 0: the slot's previous contents are not read)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        lin, h = config.linear, config.hidden_size
        self.num_k_heads, self.num_v_heads = lin.num_key_heads, lin.num_value_heads
        self.dk, self.dv, self.kernel = lin.key_head_dim, lin.value_head_dim, lin.conv_kernel
        self.key_dim, self.conv_dim, self.fused = lin.num_key_heads * lin.key_head_dim, lin.conv_dim, lin.fused_projections
        if self.fused:  # Qwen3-Next: [q, k, v, z] and [b, a] grouped per key head
            self.in_proj_qkvz = Linear(h, self.conv_dim + lin.value_dim, bias=False)
            self.in_proj_ba = Linear(h, 2 * lin.num_value_heads, bias=False)
        else:
            self.in_proj_qkv = Linear(h, self.conv_dim, bias=False)
            self.in_proj_z = Linear(h, lin.value_dim, bias=False)
            self.in_proj_b = Linear(h, lin.num_value_heads, bias=False)
            self.in_proj_a = Linear(h, lin.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, lin.conv_kernel, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(lin.num_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(lin.num_value_heads))
        self.norm = GatedRMSNorm(lin.value_head_dim, config.rms_norm_eps)
        self.out_proj = Linear(lin.value_dim, h, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (qkv [T, conv_dim] as q, k, v, z [T, Hv, dv], b [T, Hv], a [T, Hv])."""
        t = x.shape[0]
        if not self.fused:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, self.num_v_heads, self.dv), self.in_proj_b(x), self.in_proj_a(x))
        r = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(t, self.num_k_heads, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split((self.dk, self.dk, r * self.dv, r * self.dv), dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.num_k_heads, 2 * r).split((r, r), dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return qkv, z.reshape(t, self.num_v_heads, self.dv), b.reshape(t, -1), a.reshape(t, -1)

    def heads(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """Convolved channels [n, conv_dim] -> q, k [n, Hv, dk] (normalised, repeated to the value heads, q
        scaled), v [n, Hv, dv], g and beta [n, Hv], all fp32."""
        n, r = mixed.shape[0], self.num_v_heads // self.num_k_heads
        q, k, v = mixed.float().split((self.key_dim, self.key_dim, self.num_v_heads * self.dv), dim=-1)
        q, k = (l2norm(x.view(n, self.num_k_heads, self.dk)).repeat_interleave(r, dim=1) for x in (q, k))
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q * self.dk**-0.5, k, v.view(n, self.num_v_heads, self.dv), g, b.float().sigmoid()

    def forward(self, x: torch.Tensor, rope, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        conv_state, rec_state = kv
        state = meta.state
        if state is None:
            raise ValueError("a linear-attention layer needs the step's state slots (build the metadata from chunks with a state_slot)")
        t = x.shape[0]
        qkv, z, b, a = self.project(x)
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        out = torch.empty(t, self.num_v_heads, self.dv, dtype=torch.float32, device=x.device)
        if state.decode_slots is not None:
            rows, slots, fresh = meta.decode.rows, state.decode_slots, state.decode_fresh
            window = torch.cat((conv_state[slots].masked_fill(fresh[:, None, None], 0), qkv[rows, :, None].to(conv_state.dtype)), dim=-1)
            conv_state[slots] = conv_tail(window, self.kernel)
            mixed = F.silu((window.to(weight.dtype) * weight).sum(-1)).to(x.dtype)
            q, k, v, g, beta = self.heads(mixed, b[rows], a[rows])
            kernels = native_ops() if x.device.type == "cpu" and rec_state.dtype == torch.float32 else None
            if kernels is not None:  # the recurrence read and written in place in the slots (afd/kernels/csrc/gated_deltanet.cpp)
                out[rows] = kernels.gdn_decode(q, k, v, g, beta, rec_state, slots, fresh)
            else:
                s = rec_state[slots].float().masked_fill(fresh[:, None, None, None], 0)
                out[rows], s = recurrent_step(q, k, v, g, beta, s)
                rec_state[slots] = s.to(rec_state.dtype)
        for chunk, slot in zip(meta.prefills, state.prefill_slots):
            rows = slice(chunk.row, chunk.row + chunk.length)
            before = conv_state[slot] if chunk.start else conv_state.new_zeros(conv_state.shape[1:])
            seq = torch.cat((before, qkv[rows].t().to(conv_state.dtype)), dim=-1)  # [C, K - 1 + L]
            conv_state[slot] = conv_tail(seq, self.kernel)
            mixed = F.silu(F.conv1d(seq[None].to(weight.dtype), self.conv1d.weight, groups=self.conv_dim))[0].t().to(x.dtype)
            q, k, v, g, beta = self.heads(mixed, b[rows], a[rows])
            s = rec_state[slot].float() if chunk.start else rec_state.new_zeros(rec_state.shape[1:], dtype=torch.float32)
            out[rows], s = chunked_delta_rule(q, k, v, g, beta, s)
            rec_state[slot] = s.to(rec_state.dtype)
        y = self.norm(out.to(x.dtype), z)
        return self.out_proj(y.reshape(t, -1))
