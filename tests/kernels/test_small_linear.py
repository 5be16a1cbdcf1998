"""The native decode-size linear (afd/kernels/csrc/small_linear.cpp) against F.linear and float64 arithmetic,
over the shapes its tiles split into (row tiles of 1-8, weight tiles of 1, 2, 4 and 8 rows, K tails), and the
claim that a CPU model's decode-size projections run it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from afd.kernels import ops as native_ops
from afd.models.layers import GatedMLP, Linear, linear
from tests import support

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close_to_exact(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """At most twice F.linear's own error against float64 (the sums run in another order, nothing else)."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    want = F.linear(x, w, b)
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[x.dtype]
    assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + ulp * exact.abs().max(), (
        (got.double() - exact).abs().max(), (want.double() - exact).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11, 16, 17, 32, 40])  # past 16 (AVX-512) or 32 (AVX2) float32 rows: at::linear
# weight-row and K tails (203: 3 past a vector of 8 or 16, 11 past a line of 32 bf16); 96: an odd number of bf16 lines
@pytest.mark.parametrize("n, k", [(13, 24), (384, 256), (66, 203), (5, 96)])
def test_native_linear_matches_float64_like_f_linear(dtype, rows, n, k):
    assert native_ops() is not None, "afd/kernels did not build here"
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    _close_to_exact(native_ops().linear(x, w), x, w, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_linear_adds_the_bias_and_reads_a_strided_view(dtype):
    gen = torch.Generator().manual_seed(3)
    both = torch.randn(3, 80, generator=gen).to(dtype)
    x = both[:, 16:]  # a split of a wider projection: rows with a stride
    w = torch.randn(40, 64, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype)
    _close_to_exact(native_ops().linear(x, w, b), x, w, b)
    _close_to_exact(linear(x, w, b), x, w, b)


def test_the_native_linear_is_built_here():
    """The register tiles this CPU allows are the ones built (AVX-512 or AVX2): a build that fell back to
    at::linear would leave every other test here comparing torch with itself."""
    assert native_ops() is not None, "afd/kernels did not build (see the warning in the log); AFD_KERNELS=0 turns it off"
    assert native_ops().simd == support.expected_simd()
    if native_ops().simd != "none":
        assert native_ops().small_linear_vectorized and native_ops().small_linear_max_rows >= 8


def test_a_models_decode_size_projections_run_the_native_linear(monkeypatch):
    """Counted: a decode step's rows through a SwiGLU MLP are three kernel calls; a prefill's go to F.linear."""
    kernels = native_ops()
    calls: list[int] = []
    real = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or real(x, w, b))
    mlp = GatedMLP(32, 48)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(8, 32)
    got = mlp(x)
    assert calls == [8, 8, 8]
    want = F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight), mlp.down_proj.weight)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    calls.clear()
    mlp(torch.randn(kernels.small_linear_max_rows + 1, 32))
    assert calls == []
    assert isinstance(mlp.gate_proj, torch.nn.Linear) and isinstance(mlp.gate_proj, Linear)  # loaders see nn.Linear


def _amx_bf16_expected() -> bool:
    return "amx_bf16" in support.cpu_flags() and support.amx_granted()


def test_bf16_weights_take_dot_product_instructions_where_the_cpu_has_them():
    """AVX-512 tiles on a CPU with AVX512-BF16 read bfloat16 weights with vdpbf16ps; elsewhere they widen them."""
    assert native_ops().bf16_dot == (support.expected_simd() == "avx512" and "avx512_bf16" in support.cpu_flags())


def test_amx_bf16_tiles_are_built_where_the_cpu_and_the_os_allow_them():
    assert native_ops().bf16_tiles == ("amx_bf16" if _amx_bf16_expected() else "none")
    want = 128 if _amx_bf16_expected() else (native_ops().small_linear_max_half_rows if native_ops().simd != "none" else 0)
    assert native_ops().small_linear_max_bf16_rows == want


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 100, 128])  # one or two B tiles, a partial last one
@pytest.mark.parametrize("n, k", [(64, 32), (100, 256), (80, 64), (63, 96), (96, 2048)])  # W rows past the last block of 32 (4, 16, 31)
def test_amx_bf16_product_is_the_float32_sum_of_exact_products(rows, n, k):
    """bf16 x bf16 products are exact in float32: the tiles' sums differ from float64's by float32 rounding only."""
    if not _amx_bf16_expected():
        with pytest.raises(RuntimeError, match="no AMX-BF16"):
            native_ops().bf16_matmul_amx(torch.ones(rows, k, dtype=torch.bfloat16), torch.ones(n, k, dtype=torch.bfloat16))
        return
    gen = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    exact = x.double() @ w.double().t()
    got = native_ops().bf16_matmul_amx(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t())  # |sum error| <= k eps sum|ab|
    assert ((got.double() - exact).abs() <= bound).all()
    with pytest.raises(RuntimeError, match="take"):
        native_ops().bf16_matmul_amx(torch.ones(129, k, dtype=torch.bfloat16), w)  # past 128 rows: the caller's other path


def test_prefill_sized_bf16_linears_and_experts_take_the_amx_tiles(monkeypatch):
    """Where AMX-BF16 runs, a 48-row bf16 projection (a prefill's rows of one expert) goes to the native linear, and
    its result is the tiles' float32 product rounded once to bf16."""
    kernels = native_ops()
    if not _amx_bf16_expected():  # oneDNN's past 6 rows with AVX512-BF16; without it the register tiles' up to 63
        widen = {"avx512": 64, "avx2": 128}.get(kernels.simd, 1)
        assert kernels.small_linear_max_bf16_rows == (6 if kernels.bf16_dot else widen - 1)
        return
    calls: list[int] = []
    real = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or real(x, w, b))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(48, 256, generator=gen).to(torch.bfloat16)
    w = torch.randn(96, 256, generator=gen).to(torch.bfloat16)
    got = linear(x, w)
    assert calls == [48]
    assert torch.equal(got, kernels.bf16_matmul_amx(x, w).to(torch.bfloat16))


def test_half_precision_row_counts_reach_onednn_in_few_shapes():
    """oneDNN builds a kernel per new shape: past the native tiles, bf16/fp16 rows are padded to a bucket that is
    never smaller, at most 25 % larger, and one of four sizes an octave (so a server's ever-new row counts are a
    few dozen shapes, each built once)."""
    bucket = native_ops().linear_rows_bucket
    sizes = [bucket(m) for m in range(1, 8193)]
    assert all(m <= b <= max(m, 1.25 * m) for m, b in zip(range(1, 8193), sizes))
    assert sizes[:16] == list(range(1, 17))
    assert len(set(sizes)) <= 16 + 4 * 9  # 16 exact, then four an octave from 16 to 8192
    assert all(bucket(b) == b for b in sizes)  # a bucket is its own bucket


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [129, 200, 333])
def test_half_precision_rows_past_the_tiles_are_padded_and_equal_f_linear(monkeypatch, dtype, rows):
    """``linear`` sends every half-precision row count to the native op; past its tiles the op calls torch with the
    rows padded (or, without half-precision dot products, widens W: the test above) and returns the input's rows, as
    close to float64 as F.linear of them alone."""
    kernels = native_ops()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    w = (torch.randn(48, 64, generator=gen) / 8).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype)
    calls: list[int] = []
    real = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or real(x, w, b))
    got = linear(x, w, b)
    assert calls == [rows] and got.shape == (rows, 48) and got.dtype == dtype
    _close_to_exact(got, x, w, b)
    assert kernels.linear_rows_bucket(rows) > rows  # these counts are padded where torch takes them


def test_warm_up_builds_every_half_precision_shape_a_step_will_ask_for(monkeypatch):
    """``warm_up_linears`` calls each distinct bf16 weight shape once per padded row count that a step of up to R rows
    gives oneDNN (past the rows afd's kernels take), fewest rows first, none past the largest product allowed, and
    stops at its time budget; float32 builds nothing."""
    import types

    from afd.models import layers

    real = native_ops()
    assert layers.warm_up_linears(torch.nn.Linear(64, 48).to(torch.bfloat16), real.small_linear_max_bf16_rows) == (0, 0)
    # the native rows as on an AVX512-BF16 CPU without AMX (6), whatever this CPU takes (AVX2: every bf16 row count)
    kernels = types.SimpleNamespace(small_linear_max_bf16_rows=6, small_linear_max_half_rows=6, small_linear_widen_rows=0,
                                    linear_rows_bucket=real.linear_rows_bucket, broadcast_linear_takes=lambda dtype, rows, k: False)
    monkeypatch.setattr(layers, "native_ops", lambda: kernels)
    model = torch.nn.Sequential(Linear(64, 48, bias=False), Linear(64, 48, bias=False), Linear(48, 32, bias=False)).to(torch.bfloat16)
    seen = []
    monkeypatch.setattr(layers, "linear", lambda x, w, b=None: seen.append((x.shape[0], tuple(w.shape))))
    calls, reached = layers.warm_up_linears(model, 100)
    want = {(kernels.linear_rows_bucket(r), s) for r in range(7, 101) for s in ((48, 64), (32, 48))}
    assert set(seen) == want and len(seen) == len(want) == calls  # each once, both shapes, none of the native rows
    assert reached == max(r for r, _ in want) >= 100
    assert [r for r, _ in seen] == sorted(r for r, _ in seen)
    seen.clear()  # 48 x 64 past 40 rows, 32 x 48 past 80, are more than the largest product allowed
    calls, reached = layers.warm_up_linears(model, 100, most_product=40 * 48 * 64 + 1)
    assert set(seen) == {(r, s) for r, s in want if r * s[0] * s[1] <= 40 * 48 * 64 + 1} and reached == 80 == max(r for r, _ in seen)
    seen.clear()
    assert layers.warm_up_linears(model, 100, budget_s=0.0) == (0, 0) and not seen
    assert layers.warm_up_linears(model.float(), 100) == (0, 0) and not seen
    model.to(torch.bfloat16)  # .float() converted it in place
    # bf16 on vdpbf16ps from 21 rows, K >= 64 here: the buckets whose every row count it takes (21-24 ... 81-96)
    # are not oneDNN's; 17-20 (padded to 20) and 97-100 (to 112) still are; a weight of shorter K, all of them
    kernels.broadcast_linear_takes = lambda dtype, rows, k: dtype == torch.bfloat16 and 21 <= rows <= 96 and k >= 64  # K 48 not
    calls, _ = layers.warm_up_linears(model, 100)
    assert set(seen) == {(r, s) for r, s in want if s == (32, 48) or not 21 < r <= 96} and len(seen) == calls, sorted(seen)
    assert (20, (48, 64)) in seen and (24, (48, 64)) not in seen and (112, (48, 64)) in seen
    seen.clear()
    kernels.broadcast_linear_takes = lambda dtype, rows, k: False
    kernels.small_linear_widen_rows = 64  # no half-precision dot products: past the tiles W is widened, not oneDNN's
    assert layers.warm_up_linears(model, 100) == (0, 0) and not seen


def _mm_calls(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name == "aten::mm" for e in prof.events())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, n, k", [(63, 96, 256), (64, 96, 256), (100, 33, 70), (127, 40, 64), (128, 40, 64), (512, 200, 1408),
                                         (128, 8200, 2048)])
def test_half_precision_rows_past_the_tiles_widen_w_for_the_float32_blas_without_half_dot_products(dtype, rows, n, k):
    """On a CPU without half-precision dot products (AVX2, or AVX-512 without AVX512-BF16) torch's bf16/fp16 GEMM is
    emulated: from 64 rows (AVX-512; 128 with AVX2) ``linear`` widens W to float32 (in blocks of at most 64 MB: 8,200 x
    2,048 takes two) and multiplies with the float32 BLAS; fewer rows stay on the register tiles. Either way the result
    is the float32 sum of exact products rounded once to the input's dtype."""
    kernels = native_ops()
    widens = kernels.simd in ("avx512", "avx2") and not kernels.bf16_dot  # the build's (its flags: the tests above)
    assert kernels.small_linear_widen_rows == ({"avx512": 64, "avx2": 128}[kernels.simd] if widens else 0)
    gen = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / 8).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    got = linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    exact = x.double() @ w.double().t() + b.double()
    fp32_sums = 4 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t() + b.double().abs())
    assert ((got.double() - exact).abs() <= fp32_sums + torch.finfo(dtype).eps * (exact.abs() + fp32_sums)).all()
    if widens:
        blocks = -(-n // ((64 << 20) // (4 * k)))  # W's rows in blocks of at most 64 MB of float32
        assert _mm_calls(lambda: linear(x, w, b)) == (blocks if rows >= kernels.small_linear_widen_rows else 0)
    with pytest.raises(RuntimeError):  # mixed dtypes are refused as F.linear refuses them, not widened alike
        linear(x, w.float(), b)


def _gemm_calls(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name in ("aten::mm", "aten::addmm") for e in prof.events())


# rows: 1-6 vectors of columns (panels of 3 + 1, 2 + 2, 3 + 3 at 16 lanes), tails of a vector, either side of 64 and
# 96; n: whole tiles of W rows and a last row past them (37 = 4 x 9 + 1 = 9 x 4 + 1); k: 1,024 (the least taken to 96
# rows), 1,000 (taken to 64 rows), 2,050 (a K tail), 12,000 (x^T past 1 MB from 24 rows: not taken), 256 (the built-in
# model's hidden size: taken to 64), 128 (the least taken), 127 (not taken)
@pytest.mark.parametrize("rows", [17, 24, 32, 33, 48, 64, 65, 80, 96, 97])
@pytest.mark.parametrize("n, k", [(37, 1024), (200, 2050), (40, 1000), (20, 12000), (384, 256), (37, 128), (30, 127)])
def test_float32_rows_past_the_tiles_run_transposed_with_w_broadcast(rows, n, k):
    """float32 linears of 17-96 rows with K >= 1,024 (a routed expert's in a prefill step), and of 17-64 rows with K of
    128-1,023 (a small model's decode step, W from memory), run transposed, y^T = W x^T with W's values broadcast
    (broadcast_linear.cpp), not on the BLAS, while x^T fits in 1 MB, in an AVX-512 build; other shapes (and every
    shape with AVX2, where it is built but slower than MKL) go to the BLAS. Either way within twice F.linear's own
    error against float64, bias added, x a strided view; where taken, the same bits as the kernel called directly."""
    kernels = native_ops()
    lanes = {"avx512": 16, "avx2": 8}.get(kernels.simd, 0)
    assert kernels.broadcast_linear_max_rows == (96 if lanes == 16 else 0)  # AVX2's 16 registers: built, slower than MKL
    gen = torch.Generator().manual_seed(rows * 7 + n)
    wide = torch.randn(rows, k + 8, generator=gen)
    x = wide[:, 3 : 3 + k]  # rows with a stride
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen)
    got = linear(x, w, b)
    assert got.is_contiguous()
    _close_to_exact(got, x, w, b)
    ld = -(-rows // lanes) * lanes if lanes else 0
    most = 96 if k >= 1024 else 64 if k >= 128 else 0
    takes = lanes == 16 and kernels.small_linear_max_rows < rows <= most and k * ld * 4 <= 1 << 20
    assert kernels.broadcast_linear_takes(torch.float32, rows, k) == takes
    tiles = bool(lanes) and rows <= kernels.small_linear_max_rows  # AVX2's tiles take up to 32 float32 rows
    assert _gemm_calls(lambda: linear(x, w, b)) == (0 if takes or tiles else 1)
    if takes:
        assert torch.equal(got, kernels.broadcast_linear(x, w, b))
    _close_to_exact(kernels.broadcast_linear(x, w), x, w, None) if lanes else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_transposed_column_does_not_depend_on_the_panel_it_is_computed_in(dtype):
    """broadcast_linear's panels (1-6 vectors of x^T's columns against tiles of 9, 6, 5 or 4 rows of W, by the panel's
    width; several panels past 96 columns) sum every output in the same order, so a row of x gives the same bits
    whatever the other rows: the experts' loop relies on it (a token's output does not depend on its expert's other
    rows or on how an expert's rows are cut into pieces)."""
    kernels = native_ops()
    if kernels.simd not in ("avx512", "avx2"):
        pytest.fail(f"no register tiles in this build ({kernels.simd}): broadcast_linear is not built")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(112, 2050, generator=gen).to(dtype)  # K: 8 blocks of 256 and a tail of 2
    w = (torch.randn(43, 2050, generator=gen) / 2050**0.5).to(dtype)  # 43 = 4 x 9 + 7 = 7 x 6 + 1 = 10 x 4 + 3 rows of W
    whole = kernels.broadcast_linear(x, w)  # 7 vectors: panels of 4 + 3 (AVX-512)
    for rows in (17, 33, 48, 49, 64, 80, 96):  # 2, 3, 3, 4, 4, 5 and 6 vectors in one panel
        assert torch.equal(kernels.broadcast_linear(x[:rows], w), whole[:rows]), rows


@pytest.mark.parametrize("rows", [16, 17, 20, 21, 40, 63, 64, 96, 97])
@pytest.mark.parametrize("n, k", [(37, 1024), (40, 1000), (200, 2050)])  # 2,050: a K tail through the dispatch
def test_bfloat16_rows_of_a_prefill_expert_run_transposed_without_amx(rows, n, k):
    """Where the CPU has neither bf16 dot products nor AMX-BF16 (bf16 emulated: the register tiles widen W for every
    tile of rows, and from 64 rows W is widened for the float32 BLAS), bfloat16 linears of 17-96 rows with K >= 1,024
    run broadcast_linear's transposed product too, each block of W widened to float32 in L1; on bf16 dot products
    without AMX-BF16, those of 21-96 rows, x^T as pairs of rows on vdpbf16ps. Either way no BLAS call and no register
    tile, the result rounded to bf16 once, within twice F.linear's own error against float64. Elsewhere (and at other
    shapes) the paths before it, as close."""
    kernels = native_ops()
    gen = torch.Generator().manual_seed(rows * 5 + n)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = linear(x, w, b)
    _close_to_exact(got, x, w, b)
    emulated = kernels.simd == "avx512" and not kernels.bf16_dot and kernels.bf16_tiles == "none"
    pairs = kernels.broadcast_linear_min_pair_rows
    assert pairs == (21 if kernels.moe_experts_bf16_pairs else 0)  # the experts' loop and the linears: one condition
    takes = (emulated and 16 < rows <= 96 and k >= 1024) or (pairs and pairs <= rows <= 96 and k >= 1024 and k % 2 == 0)
    assert kernels.broadcast_linear_takes(torch.bfloat16, rows, k) == bool(takes)  # what warm_up_linears asks
    assert not kernels.broadcast_linear_takes(torch.bfloat16, 48, 7168)  # x^T past 1 MB (V3's rows): oneDNN's, warmed
    assert not kernels.broadcast_linear_takes(torch.bfloat16, 32, 256)  # K under 1,024: float32's only (bf16: 0.78-1.63x)
    if pairs:
        assert _gemm_calls(lambda: linear(x, w, b)) == (0 if takes else 1)
    if kernels.small_linear_widen_rows:  # bf16 emulated: the tiles up to it, the widened BLAS from it, but where taken
        widened = rows >= kernels.small_linear_widen_rows
        assert _gemm_calls(lambda: linear(x, w, b)) == (0 if takes or not widened else 1)  # 64-96 rows: not widened
    if takes:  # the same bits as the kernel called directly (the tiles, below 64 rows, sum in another order)
        assert torch.equal(got, kernels.broadcast_linear(x, w, b))
    if emulated or pairs:
        _close_to_exact(kernels.broadcast_linear(x, w), x, w, None)
