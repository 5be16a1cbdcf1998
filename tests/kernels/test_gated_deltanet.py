"""The native Gated DeltaNet decode (``gdn_decode``, afd/kernels/csrc/gated_deltanet.cpp) against its torch twin,
``recurrent_step`` with the gather, zeroing and scatter of the slots around it that GatedDeltaNet.forward does;
then the whole layer, kernel on and off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from afd.config.model import LinearAttentionConfig
from afd.kernels import ops as native_ops
from afd.kvcache import SeqChunk, build_attention_metadata
from afd.models import gated_deltanet
from afd.models.gated_deltanet import GatedDeltaNet, l2norm, recurrent_step


def inputs(d: int, h: int, dk: int, dv: int, gen: torch.Generator):
    """q, k (normalised, q scaled), v, g (<= 0), beta in (0, 1): what GatedDeltaNet.heads hands the recurrence."""
    q = l2norm(torch.randn(d, h, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(d, h, dk, generator=gen))
    v = torch.randn(d, h, dv, generator=gen)
    g = -torch.rand(d, h, generator=gen) * 2
    beta = torch.rand(d, h, generator=gen)
    return q, k, v, g, beta


def torch_step(q, k, v, g, beta, state, slots, fresh):
    """GatedDeltaNet.forward's torch path: the slots gathered, the fresh ones zeroed, the new states written back."""
    s = state[slots].masked_fill(fresh[:, None, None, None], 0)
    out, s = recurrent_step(q, k, v, g, beta, s)
    state[slots] = s
    return out


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("h, dk, dv, d, num_slots", [
    (4, 8, 8, 1, 3),
    (4, 8, 8, 5, 9),
    (32, 128, 128, 1, 4),
    (32, 128, 128, 5, 8),  # Qwen3.5's linear layers: 32 value heads of 128 x 128
    (4, 128, 64, 3, 7),  # dk != dv
    (4, 13, 40, 3, 7),  # dk not a multiple of the 4 rows a pass, dv not of the vector lanes
])
@pytest.mark.parametrize("fresh_rows", ["none", "every other"])
def test_gdn_decode_equals_the_torch_recurrence_in_place(h, dk, dv, d, num_slots, fresh_rows):
    gen = torch.Generator().manual_seed(h * 1000 + dk * 10 + d)
    state = torch.randn(num_slots, h, dk, dv, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:d]  # a permutation of some of the slots: not 0..D-1, not in order
    fresh = torch.tensor([fresh_rows == "every other" and i % 2 == 0 for i in range(d)])
    state[slots[fresh]] = float("nan")  # a fresh token's slot is never read: its old contents cannot leak
    want_state = state.clone()
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    before = state[untouched].clone()
    for step in range(3):  # the same sequences on: a later step reads what the kernel wrote
        step_fresh = fresh if step == 0 else torch.zeros_like(fresh)
        q, k, v, g, beta = inputs(d, h, dk, dv, gen)
        got = native_ops().gdn_decode(q, k, v, g, beta, state, slots, step_fresh)
        want = torch_step(q, k, v, g, beta, want_state, slots, step_fresh)
        assert got.shape == (d, h, dv) and got.dtype == torch.float32
        close(got, want)
        assert not state[slots].isnan().any()
        close(state[slots], want_state[slots])
        assert torch.equal(state[untouched], before)  # bit for bit


def test_gdn_decode_reads_strided_tokens():
    """The layer's q, k, v are slices of one row of convolved channels per token (GatedDeltaNet.heads): each
    token's heads are dense, the tokens a row apart."""
    gen = torch.Generator().manual_seed(5)
    d, h, dk, dv = 4, 4, 16, 24
    q, k, v, g, beta = inputs(d, h, dk, dv, gen)
    mixed = torch.cat((q.reshape(d, -1), k.reshape(d, -1), v.reshape(d, -1)), dim=-1)
    qs, ks, vs = (x.view(d, h, -1) for x in mixed.split((h * dk, h * dk, h * dv), dim=-1))
    assert not vs.is_contiguous()
    state = torch.randn(6, h, dk, dv, generator=gen)
    want_state = state.clone()
    slots, fresh = torch.tensor([4, 0, 2, 5]), torch.tensor([False, True, False, False])
    got = native_ops().gdn_decode(qs, ks, vs, g, beta, state, slots, fresh)
    close(got, torch_step(q, k, v, g, beta, want_state, slots, fresh))
    close(state, want_state)


def test_gdn_decode_refuses_bad_arguments():
    gen = torch.Generator().manual_seed(6)
    q, k, v, g, beta = inputs(2, 4, 8, 8, gen)
    state, fresh = torch.zeros(3, 4, 8, 8), torch.tensor([False, False])
    gdn = native_ops().gdn_decode
    with pytest.raises(RuntimeError, match="slot 3 is not in"):
        gdn(q, k, v, g, beta, state, torch.tensor([0, 3]), fresh)
    with pytest.raises(RuntimeError, match="slot 1 is given to two tokens"):
        gdn(q, k, v, g, beta, state, torch.tensor([1, 1]), fresh)
    with pytest.raises(RuntimeError, match="state must be a contiguous float32"):
        gdn(q, k, v, g, beta, state.to(torch.bfloat16), torch.tensor([0, 1]), fresh)
    with pytest.raises(RuntimeError, match="state must be a contiguous float32"):
        gdn(q, k, v, g, beta, state.transpose(2, 3), torch.tensor([0, 1]), fresh)
    with pytest.raises(RuntimeError, match="v must have the state's dv"):
        gdn(q, k, v[..., :4].contiguous(), g, beta, state, torch.tensor([0, 1]), fresh)
    with pytest.raises(RuntimeError, match="v's heads must be dense"):
        gdn(q, k, v.transpose(1, 2).contiguous().transpose(1, 2), g, beta, state, torch.tensor([0, 1]), fresh)
    with pytest.raises(RuntimeError, match="fresh must be a contiguous bool"):
        gdn(q, k, v, g, beta, state, torch.tensor([0, 1]), fresh.long())
    assert torch.equal(state, torch.zeros(3, 4, 8, 8))  # nothing written by a refused call


def make_layer(hidden: int = 48) -> GatedDeltaNet:
    lin = LinearAttentionConfig(layers=(0,), num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=24, conv_kernel=4)
    layer = GatedDeltaNet(SimpleNamespace(linear=lin, hidden_size=hidden, rms_norm_eps=1e-6))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def test_the_layer_with_the_kernel_equals_the_layer_without(monkeypatch):
    """A step of one prefill and three decodes (one of them its sequence's first token, in a slot an earlier
    sequence left), then two decode steps; the layer's linears take their kernel either way."""
    layer, hidden, num_slots, block_size = make_layer(), 48, 6, 16
    kernels, calls = native_ops(), []

    def counted(*args):
        calls.append(args[0].shape[0])
        return kernels.gdn_decode(*args)

    def run(native: bool):
        monkeypatch.setattr(gated_deltanet, "native_ops", (lambda: SimpleNamespace(gdn_decode=counted)) if native else (lambda: None))
        conv_state = torch.randn(num_slots, layer.conv_dim, layer.kernel - 1, generator=torch.Generator().manual_seed(9))
        rec_state = torch.randn(num_slots, layer.num_v_heads, layer.dk, layer.dv, generator=torch.Generator().manual_seed(9))
        steps = [[SeqChunk([0], 0, 5, state_slot=3), SeqChunk([1], 7, 1, state_slot=0), SeqChunk([2], 0, 1, state_slot=5),
                  SeqChunk([3], 2, 1, state_slot=1)]]
        steps += [[SeqChunk([0], 5 + i, 1, state_slot=3), SeqChunk([1], 8 + i, 1, state_slot=0), SeqChunk([2], 1 + i, 1, state_slot=5)]
                  for i in range(2)]
        outs = []
        for n, chunks in enumerate(steps):
            meta = build_attention_metadata(chunks, block_size)
            x = torch.randn(sum(c.length for c in chunks), hidden, generator=torch.Generator().manual_seed(n))
            with torch.inference_mode():
                outs.append(layer(x, None, None, None, (conv_state, rec_state), meta))
        monkeypatch.undo()
        return outs, rec_state

    native_outs, native_state = run(True)
    assert calls == [3, 3, 3]  # every step's decode tokens went through the kernel
    torch_outs, torch_state = run(False)
    assert len(calls) == 3
    for got, want in zip(native_outs, torch_outs):
        close(got, want)
    close(native_state, torch_state)
