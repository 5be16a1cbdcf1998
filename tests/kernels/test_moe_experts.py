"""The native experts op against the Python loop it replaces and against a dense reference written here
(every token through each of its experts, one at a time, in float64). Past decode sizes it runs the loop's
own ATen ops (bit for bit equal), but for float32 experts of H and I >= 128 in AVX-512 builds (one C++ loop,
kept transposed where an expert's rows fit x^T); at decode sizes it runs the loop in C++ with float32 intermediates. The C++ loops are at
least as close to float64 as the Python loop is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from afd.kernels import ops as native_ops
from afd.models.layers import GroupedExperts
from tests import support


def make_experts(held: list[int], num_experts: int = 8, hidden: int = 24, inter: int = 10, dtype=torch.float32, seed: int = 0,
                 gpt_oss: bool = False):
    """``gpt_oss``: biased experts with the clamped SwiGLU, a limit low enough that both clamps bite."""
    gen = torch.Generator().manual_seed(seed)
    experts = GroupedExperts(num_experts, hidden, inter, held, bias=gpt_oss, swiglu_limit=0.6 if gpt_oss else None, swiglu_alpha=1.702)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        if gpt_oss:
            experts.gate_up_proj.mul_(3)  # activations past the limit on both sides
    return experts.to(dtype)


def routing(num_tokens: int, k: int, num_experts: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(num_tokens)])  # [T, k] distinct
    ids[torch.rand(num_tokens, k, generator=gen) < 0.2] = -1  # slots routed elsewhere (attention-side M2N)
    return ids, torch.rand(num_tokens, k, generator=gen)


def dense_reference(experts: GroupedExperts, x, ids, weights) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            if e in experts.expert_ids:
                i = experts.expert_ids.index(e)
                gate_up = x[t].double() @ experts.gate_up_proj[i].double().T
                if experts.bias:
                    gate_up += experts.gate_up_proj_bias[i].double()
                gate, up = gate_up.chunk(2)
                if experts.swiglu_limit is None:
                    act = F.silu(gate) * up
                else:  # written out here: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
                    lim = experts.swiglu_limit
                    g = torch.minimum(gate, torch.tensor(lim, dtype=torch.float64))
                    act = (torch.clamp(up, -lim, lim) + 1) * g / (1 + torch.exp(-experts.swiglu_alpha * g))
                y = act @ experts.down_proj[i].double().T
                if experts.bias:
                    y += experts.down_proj_bias[i].double()
                out[t] += weights[t, slot].double() * y
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])  # 1 and 7: decode sizes (every expert within the kernel's rows)
@pytest.mark.parametrize("held", [list(range(8)), [1, 4, 6]])  # all, or an FFN rank's shard
@pytest.mark.parametrize("gpt_oss", [False, True])  # gpt-oss: biases and the clamped SwiGLU
def test_native_experts_equal_the_python_loop_and_a_dense_reference(dtype, num_tokens, held, gpt_oss):
    assert native_ops() is not None, "afd/kernels did not build here"
    x = torch.randn(num_tokens, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    ids, weights = routing(num_tokens, 3, 8)
    native = make_experts(held, dtype=dtype, gpt_oss=gpt_oss)
    got = native(x, ids, weights)
    python = make_experts(held, dtype=dtype, gpt_oss=gpt_oss)
    want = python.reference(x, ids, weights)
    assert got.dtype == want.dtype == dtype
    assert native.tokens_routed == python.tokens_routed and sum(native.tokens_routed) > 0
    dense = dense_reference(python, x, ids, weights)
    most = max(python.tokens_routed)
    kernels = native_ops()
    in_loop = most <= (kernels.small_linear_max_rows if dtype == torch.float32 else
                       max(kernels.small_linear_max_half_rows, kernels.moe_experts_bf16_dot_rows))
    if not in_loop:
        # the loop's own ATen ops, in its order
        assert torch.equal(got, want), (got - want).abs().max()
    else:  # the C++ loop: float32 throughout, rounded once
        ulp = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
        assert (got.double() - dense).abs().max() <= 2 * (want.double() - dense).abs().max() + ulp * dense.abs().max()
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.double(), dense, atol=tol * max(1.0, dense.abs().max().item()), rtol=0)


def _aten_ops(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_decode_sized_experts_run_no_aten_op_per_expert():
    """Counted: at decode sizes the expert loop is C++ over scratch buffers (no gather, silu or scatter op per
    expert, which had cost as much as the GEMMs); a prefill's rows take the ATen ops."""
    per_expert_ops = {"aten::sigmoid", "aten::index_select", "aten::index_put_"}
    experts = make_experts(list(range(8)), gpt_oss=True)  # biases and the clamped activation in C++ too
    ids, weights = routing(8, 2, 8)
    decode = _aten_ops(lambda: experts(torch.randn(8, 24), ids, weights))
    if native_ops().small_linear_vectorized:  # AVX-512 or AVX2 tiles (test_the_native_linear_is_built_here: wherever they can be)
        assert not decode & per_expert_ops, decode
    else:
        assert per_expert_ops <= decode, decode
    ids, weights = routing(200, 2, 8)
    prefill = _aten_ops(lambda: experts(torch.randn(200, 24), ids, weights))
    assert per_expert_ops <= prefill, prefill


@pytest.mark.parametrize("num_tokens", [7, 64, 1700])  # 1700 x 3 x 0.8 / 8: past 512 rows an expert, the GEMMs' chunks
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_bf16_experts_on_amx_tiles_are_as_close_as_the_loop_and_run_no_aten_op_per_expert(num_tokens, gpt_oss):
    """Where AMX-BF16 runs, bf16 experts of more than the register tiles' rows (H and I multiples of 32) take the C++
    loop on the tiles, an expert's rows in chunks of up to 512: float32 intermediates, the activation rounded once for
    the down GEMM, so at least as close to float64 as the Python loop (which rounds after every op), with no gather,
    silu or scatter op per expert. Where the tiles do not run, the loop's own ATen ops, bit for bit."""
    kernels = native_ops()
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ids, weights = routing(num_tokens, 3, 8)
    native = make_experts(list(range(8)), hidden=64, inter=32, dtype=torch.bfloat16, gpt_oss=gpt_oss)
    python = make_experts(list(range(8)), hidden=64, inter=32, dtype=torch.bfloat16, gpt_oss=gpt_oss)
    ops = _aten_ops(lambda: native(x, ids, weights))
    got, want = native(x, ids, weights), python.reference(x, ids, weights)
    dense = dense_reference(python, x, ids, weights)
    most = max(python.tokens_routed)
    assert kernels.moe_experts_bf16_tiles == ("amx_bf16" in support.cpu_flags() and support.amx_granted())
    if num_tokens == 1700:
        assert most > 512
    if kernels.moe_experts_bf16_tiles and most > kernels.small_linear_max_half_rows:
        assert not ops & {"aten::silu", "aten::sigmoid", "aten::index_select", "aten::index_put_"}, ops
        assert (got.double() - dense).abs().max() <= 2 * (want.double() - dense).abs().max() + 1e-2 * dense.abs().max()
    elif most > max(kernels.small_linear_max_half_rows, kernels.moe_experts_bf16_dot_rows):
        assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("skewed", [False, True])
def test_bf16_experts_side_by_side_on_the_threads_equal_one_at_a_time(skewed):
    """On AMX-BF16, experts whose rows are spread run side by side, each thread taking the next chunk, each (token,
    slot) row written once and a token's slots summed at the end in slot order; one expert holding most rows (skewed)
    runs alone, split over the threads. Both as close to
    float64 as the Python loop, at 1 thread and at 2 (where side by side runs), and as close to each other."""
    kernels = native_ops()
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ids, weights = routing(300, 3, 8)
    if skewed:  # one slot each, expert 0 for all but a few tokens: more than a thread's share of the rows
        ids[:, 1:] = -1
        ids[10:, 0] = 0
    experts = make_experts(list(range(8)), hidden=64, inter=32, dtype=torch.bfloat16)
    dense = dense_reference(experts, x, ids, weights)
    loop = (experts.reference(x, ids, weights).double() - dense).abs().max()
    threads = torch.get_num_threads()
    try:
        got = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            got[n] = experts(x, ids, weights).double()
            # whichever thread took which expert, the same bits every call (each (token, slot) row written once)
            assert all(torch.equal(experts(x, ids, weights).double(), got[n]) for _ in range(3))
    finally:
        torch.set_num_threads(threads)
    if not kernels.moe_experts_bf16_tiles:
        assert torch.equal(got[1], got[2])
    for out in got.values():
        assert (out - dense).abs().max() <= 2 * loop + 1e-2 * dense.abs().max()
    # the two differ only by the order the partial outputs of a token's slots are added: a bf16 rounding at most
    assert torch.allclose(got[1], got[2], rtol=1e-2, atol=1e-2 * dense.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("held", [list(range(8)), [0, 2, 3, 5, 7]])
def test_decode_sized_experts_side_by_side_give_the_same_bits_at_any_thread_count(dtype, gpt_oss, held):
    """At decode sizes the register tiles run the experts side by side on the threads (one expert a thread at a
    time), each held (token, slot) row kept in float32 and added into its token's row at the end in expert order, as
    one thread adds them: 1, 2 and 3 threads give the same bits, every call; and as close to float64 as the loop."""
    x = torch.randn(20, 24, generator=torch.Generator().manual_seed(6)).to(dtype)
    ids, weights = routing(20, 3, 8, seed=7)  # ~7 rows an expert: within the tiles' rows for float32 and bf16
    experts = make_experts(held, dtype=dtype, gpt_oss=gpt_oss)
    threads = torch.get_num_threads()
    try:
        got = {}
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got[n] = experts(x, ids, weights)
            assert all(torch.equal(experts(x, ids, weights), got[n]) for _ in range(2))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[1], got[2]) and torch.equal(got[1], got[3]), ((got[1] - got[2]).abs().max(), (got[1] - got[3]).abs().max())
    dense = dense_reference(experts, x, ids, weights)
    loop = (experts.reference(x, ids, weights).double() - dense).abs().max()
    ulp = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert (got[2].double() - dense).abs().max() <= 2 * loop + ulp * dense.abs().max()


def _dense_by_expert(experts: GroupedExperts, x, ids, weights) -> torch.Tensor:
    """dense_reference, an expert's tokens at a time (in float64): for experts too wide to convert per token."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for i, e in enumerate(experts.expert_ids):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if not len(tokens):
            continue
        gate_up = x[tokens].double() @ experts.gate_up_proj[i].double().T
        if experts.bias:
            gate_up += experts.gate_up_proj_bias[i].double()
        gate, up = gate_up.chunk(2, dim=-1)
        if experts.swiglu_limit is None:
            act = F.silu(gate) * up
        else:
            lim = experts.swiglu_limit
            g = gate.clamp(max=lim)
            act = (up.clamp(-lim, lim) + 1) * g / (1 + torch.exp(-experts.swiglu_alpha * g))
        y = act @ experts.down_proj[i].double().T
        if experts.bias:
            y += experts.down_proj_bias[i].double()
        out.index_add_(0, tokens, weights[tokens, slots].double()[:, None] * y)
    return out


PREFILL_H, PREFILL_I = 1024, 1536  # at broadcast_linear's K, H != I


def _at_threads(fn, counts) -> dict[int, torch.Tensor]:
    """fn() at each torch thread count of ``counts`` (the count restored after)."""
    threads = torch.get_num_threads()
    try:
        out = {}
        for n in counts:
            torch.set_num_threads(n)
            out[n] = fn()
        return out
    finally:
        torch.set_num_threads(threads)


def _prefill_routing(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, ids, weights) of 150 tokens, top-2 of 8: 110 rows on expert 0, 60 on experts 1 and 2, 8 on the rest."""
    t = torch.arange(150)
    ids = torch.stack([torch.where(t < 110, 0, 3 + t % 5), 1 + t % 2], dim=1)
    ids[::5, 1] = -1  # slots routed elsewhere
    weights = torch.rand(150, 2, generator=torch.Generator().manual_seed(8))
    return torch.randn(150, PREFILL_H, generator=torch.Generator().manual_seed(9)).to(dtype), ids, weights


@pytest.mark.parametrize("held", [list(range(8)), [0, 1, 3, 6]])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_float32_prefill_experts_run_transposed_with_no_aten_op_per_expert(held, gpt_oss):
    """float32 experts past decode sizes whose H and I reach broadcast_linear's K (AVX-512 builds) run one C++ loop
    (moe_experts_transposed.cpp): an expert of 17-96 rows kept transposed from its gathered columns to its weighted
    output (x^T, W . x^T, the activation, down . a^T), fewer on the register tiles and more on the BLAS, row-major; no
    gather, silu or scatter op per expert. One call here has all three (110 rows on expert 0, 60 on experts 1 and 2:
    x^T's columns padded to 64, 8 on the rest), H != I. It sums a token's experts in expert order, so the thread count
    changes no bit but the BLAS's own (1, 2, 3 threads; MKL's sums differ between 1 and 2), and it is as close to
    float64 as the Python loop. Elsewhere (AVX2) the loop's own ATen ops, bit for bit."""
    kernels = native_ops()
    assert kernels is not None, "afd/kernels did not build here"
    x, ids, weights = _prefill_routing(torch.float32)
    experts = make_experts(held, hidden=PREFILL_H, inter=PREFILL_I, gpt_oss=gpt_oss)
    ops = _aten_ops(lambda: experts(x, ids, weights))
    want = experts.reference(x, ids, weights)
    rows = [int((ids == e).sum()) for e in range(8)]
    assert rows[0] > 96 and rows[1] == rows[2] == 60 and all(rows[e] <= 16 for e in range(3, 8))
    assert experts.tokens_routed == [2 * rows[e] for e in experts.expert_ids]  # the native call and the loop's
    threads = torch.get_num_threads()
    try:
        got, tail = {}, {}  # tail: the last 50 tokens, 10 rows of expert 0 (the tiles, not the BLAS) and 20 of 1 and 2
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got[n] = experts(x, ids, weights)
            assert torch.equal(experts(x, ids, weights), got[n])
            tail[n] = experts(x[100:], ids[100:], weights[100:])
    finally:
        torch.set_num_threads(threads)
    if kernels.broadcast_linear_max_rows:
        assert not ops & {"aten::silu", "aten::sigmoid", "aten::index_select", "aten::index_put_"}, ops
        assert torch.equal(tail[1], tail[2]) and torch.equal(tail[1], tail[3]), (tail[1] - tail[2]).abs().max()
        for out, args in ((got[2], (x, ids, weights)), (tail[2], (x[100:], ids[100:], weights[100:]))):
            dense = _dense_by_expert(experts, *args)
            loop = (experts.reference(*args).double() - dense).abs().max()
            assert (out.double() - dense).abs().max() <= 2 * loop + 1e-6 * dense.abs().max()
            torch.testing.assert_close(out.double(), dense, atol=1e-5 * dense.abs().max().item(), rtol=0)
    else:
        assert {"aten::index_select", "aten::index_put_"} <= ops, ops
        assert torch.equal(got[2], want), (got[2] - want).abs().max()


def test_float32_experts_of_a_short_k_run_transposed_up_to_64_rows_an_expert():
    """The built-in model's experts (H 256, I 192: K under 1,024) take the C++ loop past 16 rows an expert: transposed
    at 17-64 rows, as broadcast_linear takes such rows (a decode step's experts, W from memory), and row-major on the
    BLAS past 64, with no ATen op of the Python loop's (gather, silu, scatter) either way. Within float32's rounding of
    float64, at least as close as the Python loop."""
    kernels = native_ops()
    assert kernels is not None, "afd/kernels did not build here"
    experts = make_experts(list(range(8)), hidden=256, inter=192)
    gen = torch.Generator().manual_seed(4)
    for per_expert in (17, 40, 64, 65, 80):
        t = 4 * per_expert  # top-2 of 8, spread evenly: per_expert rows on every expert
        x = torch.randn(t, 256, generator=gen)
        ids = (torch.arange(2 * t) % 8).view(t, 2)
        weights = torch.rand(t, 2, generator=gen)
        ops = _aten_ops(lambda: experts(x, ids, weights))
        if kernels.broadcast_linear_max_rows:  # AVX-512 builds: the C++ loop at every size here
            assert not ops & {"aten::silu", "aten::index_select", "aten::index_put_"}, (per_expert, ops)
            assert ("aten::mm" in ops) == (per_expert > 64), (per_expert, ops)  # the BLAS only past x^T's 64 columns
        dense = _dense_by_expert(experts, x, ids, weights)
        got = experts(x, ids, weights)
        loop = (experts.reference(x, ids, weights).double() - dense).abs().max()
        assert (got.double() - dense).abs().max() <= 2 * loop + 1e-6 * dense.abs().max(), per_expert


@pytest.mark.parametrize("held", [list(range(8)), [0, 1, 3, 6]])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_bfloat16_prefill_experts_run_transposed_without_amx(held, gpt_oss):
    """bf16 experts past decode sizes, on a CPU without AMX-BF16, take the same loop as float32's. Where bf16 is
    emulated (no bf16 dot products): x's rows widened as they are gathered, W widened in L1 a block at a time, the rest
    in float32. On bf16 dot products (AVX512-BF16): x^T and the activation (rounded to bf16 once) as pairs of rows
    against W as it is, on vdpbf16ps. Either way float32 sums and the output rounded to bf16 once. An expert past the
    96 columns x^T holds goes through in pieces of whole vectors of columns, each transposed (110 rows here: 64 and
    46), so no BLAS: the thread count changes no bit, no ATen op runs per expert, and the result is at least as close
    to float64 as the Python loop, which rounds after every op. On AMX-BF16 (or AVX2 builds) those CPUs' own bf16
    paths, against float64 as loosely as the loop."""
    kernels = native_ops()
    assert kernels is not None, "afd/kernels did not build here"
    x, ids, weights = _prefill_routing(torch.bfloat16)
    experts = make_experts(held, hidden=PREFILL_H, inter=PREFILL_I, gpt_oss=gpt_oss, dtype=torch.bfloat16)
    emulated = bool(kernels.broadcast_linear_max_rows) and kernels.bf16_tiles == "none" and not kernels.bf16_dot
    transposed = emulated or kernels.moe_experts_bf16_pairs
    ops = _aten_ops(lambda: experts(x, ids, weights))
    got = _at_threads(lambda: experts(x, ids, weights), (1, 2, 3))
    assert got[2].dtype == torch.bfloat16
    dense = _dense_by_expert(experts, x, ids, weights)
    loop = (experts.reference(x, ids, weights).double() - dense).abs().max()
    err = (got[2].double() - dense).abs().max()
    if transposed:
        assert not ops & {"aten::silu", "aten::sigmoid", "aten::index_select", "aten::index_put_", "aten::mm"}, ops
        assert torch.equal(got[1], got[2]) and torch.equal(got[1], got[3])
        # a column's result does not depend on its piece: the first 50 tokens alone (50 rows of expert 0: one piece)
        assert torch.equal(experts(x[:50], ids[:50], weights[:50]), got[2][:50])
        assert err <= loop, (err, loop)
        # one rounding to bf16 (up to 2^-8 of a value) and float32's sums: within 2^-7 of the largest output
        assert err <= dense.abs().max() / 128, (err, dense.abs().max())
    else:  # the register tiles in place (AVX2 builds) or AMX-BF16's tiles
        assert err <= 2 * loop + 1e-2 * dense.abs().max()


def test_bfloat16_experts_take_pairs_of_rows_where_the_cpu_has_bf16_dot_products_and_no_amx():
    """Where the CPU has AVX512-BF16 and no AMX-BF16 the build computes bf16 prefill experts on vdpbf16ps
    (broadcast_gemm_t_pairs); elsewhere not (read from the CPU's flags, not from the build)."""
    flags = support.cpu_flags()
    amx = "amx_bf16" in flags and support.amx_granted()
    assert native_ops().moe_experts_bf16_pairs == (support.expected_simd() == "avx512" and "avx512_bf16" in flags and not amx)


def test_bfloat16_experts_of_17_to_63_rows_take_the_transposed_loop_without_amx():
    """Emulated bf16's register tiles reach 63 rows (bf16 dot products' decode path 32), but a call whose busiest expert
    has 17-63 rows takes the transposed loop as a larger one does (1.3-2.1x faster emulated, 1.15-1.4x on vdpbf16ps
    at 160-256 tokens of V2-Lite's experts): 40 tokens give experts 1 and 2 20 rows each and 3-7 8 each (those on
    the loop's row-major branch, small_gemm with a bf16 W), and with 70 more tokens on expert 0 alone the call is past
    the tiles anyway; an expert's columns do not depend on the others', so the 40 tokens' outputs are the same bits
    either way (the tiles would sum in another order). Elsewhere each CPU's own path, against float64."""
    kernels = native_ops()
    t = torch.arange(110)
    ids = torch.stack([torch.where(t < 40, 1 + t % 2, 0), torch.where(t < 40, 3 + t % 5, -1)], dim=1)
    weights = torch.rand(110, 2, generator=torch.Generator().manual_seed(3))
    x = torch.randn(110, PREFILL_H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    experts = make_experts(list(range(8)), hidden=PREFILL_H, inter=PREFILL_I, dtype=torch.bfloat16)
    part = (x[:40], ids[:40], weights[:40])
    assert max(int((ids[:40] == e).sum()) for e in range(8)) == 20 and int((ids == 0).sum()) == 70
    got = experts(*part)
    dense = _dense_by_expert(experts, *part)
    loop = (experts.reference(*part).double() - dense).abs().max()
    err = (got.double() - dense).abs().max()
    if (kernels.broadcast_linear_max_rows and kernels.bf16_tiles == "none" and not kernels.bf16_dot) or kernels.moe_experts_bf16_pairs:
        assert torch.equal(got, experts(x, ids, weights)[:40]), "the 40 tokens' outputs differ from the larger call's"
        assert err <= loop and err <= dense.abs().max() / 128, (err, loop)
    else:
        assert err <= 2 * loop + 1e-2 * dense.abs().max()


def test_native_experts_refuse_an_expert_id_out_of_range():
    experts = make_experts(list(range(8)))
    ids = torch.tensor([[0, 8]])  # local index 8 of 8 experts
    with pytest.raises(RuntimeError, match="local expert id 8 is not in"):
        native_ops().moe_experts(torch.randn(1, 24), ids, torch.ones(1, 2), experts.gate_up_proj, experts.down_proj)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_mxfp4_experts_decode_in_the_loop_as_the_reference_does(dtype, num_tokens):
    """MXFP4 blocks held (``--mxfp4-weights keep``): the C++ loop decodes each expert (16-value lookup, e8m0
    exponent) and equals the Python loop over afd/models/mxfp4.py's decoder, and a dense reference."""
    from tests.support import encode_mxfp4

    assert native_ops() is not None, "afd/kernels did not build here"
    held, hidden, inter = [0, 2, 5], 64, 32
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(4)).to(dtype)
    ids, weights = routing(num_tokens, 2, 8)
    experts = make_experts(held, hidden=hidden, inter=inter, gpt_oss=True)
    gate_up, gate_up_scales, gate_up_values = encode_mxfp4(experts.gate_up_proj.data)
    down, down_scales, down_values = encode_mxfp4(experts.down_proj.data)
    with torch.no_grad():
        experts.gate_up_proj.data, experts.down_proj.data = gate_up_values, down_values  # what the blocks decode to
    dense = dense_reference(experts, x, ids, weights)
    experts = experts.to(dtype)
    experts.gate_up_proj, experts.down_proj = torch.nn.Parameter(gate_up, requires_grad=False), torch.nn.Parameter(down, requires_grad=False)
    experts.hold_mxfp4(gate_up_scales, down_scales, dtype)
    got = experts(x, ids, weights)
    want = experts.reference(x, ids, weights)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    scale = max(1.0, dense.abs().max().item())
    torch.testing.assert_close(got.double(), want.double(), atol=tol * scale, rtol=0)
    torch.testing.assert_close(got.double(), dense, atol=tol * scale, rtol=0)


@pytest.mark.parametrize("path", ["native", "loop"])
def test_the_experts_count_their_gemms_and_rows_as_the_routing_implies(path):
    """What an FFN rank reports as rows per expert GEMM: per call, one GEMM pair per held expert with rows,
    counted here from the ids alone (held ones only: -1 and experts held elsewhere are not this rank's)."""
    if path == "native" and native_ops() is None:
        pytest.fail("the native kernels did not build")
    held = [0, 2, 3, 5, 6]
    experts = make_experts(held)
    gemms = rows = 0
    with torch.inference_mode():
        for tokens in (1, 3, 17):
            ids, weights = routing(tokens, 2, 8, seed=tokens)
            x = torch.randn(tokens, 24)
            experts(x, ids, weights) if path == "native" else experts.reference(x, ids, weights)
            mine = [e for e in ids.flatten().tolist() if e in held]
            gemms, rows = gemms + len(set(mine)), rows + len(mine)
    assert (sum(experts.gemms_run), sum(experts.tokens_routed)) == (gemms, rows) and gemms > 3


def test_with_every_expert_held_the_ids_go_unmapped_and_an_id_out_of_range_is_refused():
    """One FFN rank (or a monolithic model) holds every expert: the logical ids are the local indices and go to the
    kernel as they are; the kernel, not a lookup, is then what refuses an id past the experts."""
    if native_ops() is None:
        pytest.fail("the native kernels did not build")
    experts = make_experts(list(range(8)))
    ids, weights = routing(5, 2, 8, seed=3)
    x = torch.randn(5, 24)
    with torch.inference_mode():
        torch.testing.assert_close(experts(x, ids, weights).double(), dense_reference(experts, x, ids, weights), rtol=1e-4, atol=1e-5)
        bad = ids.clone()
        bad[2, 1] = 8
        with pytest.raises(RuntimeError, match=r"local expert id 8 is not in \[-1, 8\)"):
            experts(x, bad, weights)
