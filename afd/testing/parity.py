"""The rules of "split equals monolithic" (and "monolithic equals transformers"), as functions.

Each check returns a report instead of raising, so a test can assert that a
deliberately broken run *fails* the same check (the canary).

1. values: ``|got - ref|_inf <= rtol * max(1, |ref|_inf)`` (fp32 default rtol 1e-5);
2. expert ids: identical sets per token, except tokens whose reference gap
   between the k-th and (k+1)-th router score is below ``tie_margin`` (reported);
3. greedy tokens: identical up to the first step whose reference top-2 logit
   gap is below ``tie_gap``, over at least ``min_compared`` steps (steps
   compared are reported; too few fails);
4. bf16: mean absolute error against the fp32 reference at most ``factor`` x
   the bf16 reference's own (the mean, not the max: in bf16 a near-tied router
   decision may flip in either implementation, and one flipped token dominates
   a max; measured on random decisive models, such flips cost up to ~1.0 on
   one token while typical errors are ~0.05).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class ValueReport:
    name: str
    max_abs_err: float
    ref_inf_norm: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_err <= self.tolerance

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return f"{self.name}: max|err| {self.max_abs_err:.3g} vs tol {self.tolerance:.3g} ({verdict})"


def compare_values(name: str, ref: torch.Tensor, got: torch.Tensor, rtol: float = 1e-5) -> ValueReport:
    if ref.shape != got.shape:
        return ValueReport(name, float("inf"), float("nan"), 0.0)
    ref32, got32 = ref.float(), got.float()
    inf_norm = ref32.abs().max().item() if ref32.numel() else 0.0
    err = (ref32 - got32).abs().max().item() if ref32.numel() else 0.0
    if not torch.isfinite(got32).all():
        err = float("inf")
    return ValueReport(name, err, inf_norm, rtol * max(1.0, inf_norm))


@dataclass
class TopkReport:
    name: str
    num_tokens: int
    mismatched: list[int] = field(default_factory=list)  # tokens differing with a decisive margin
    near_ties: list[int] = field(default_factory=list)  # tokens excused by the margin rule

    @property
    def ok(self) -> bool:
        return not self.mismatched

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.num_tokens} tokens, {len(self.mismatched)} mismatched, "
            f"{len(self.near_ties)} near-ties excused"
        )


def topk_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [T, E] -> gap between the k-th and (k+1)-th largest score per token, [T]."""
    if k >= scores.shape[-1]:
        return torch.full(scores.shape[:1], float("inf"))
    top = scores.float().topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


def compare_topk(
    name: str, ref_ids: torch.Tensor, got_ids: torch.Tensor, ref_scores: torch.Tensor, tie_margin: float = 1e-6
) -> TopkReport:
    """ref_ids, got_ids [T, k]; ref_scores [T, E] the reference's selection scores."""
    k = ref_ids.shape[-1]
    report = TopkReport(name, ref_ids.shape[0])
    ref_sorted, _ = ref_ids.sort(dim=-1)
    got_sorted, _ = got_ids.sort(dim=-1)
    margin = topk_margin(ref_scores, k)
    for t in (ref_sorted != got_sorted).any(dim=-1).nonzero().flatten().tolist():
        (report.near_ties if margin[t] < tie_margin else report.mismatched).append(t)
    return report


@dataclass
class GreedyReport:
    num_steps: int
    num_compared: int  # steps compared before the first near-tie (or all)
    first_mismatch: int | None
    min_compared: int = 1  # fewer steps compared than this is a failure: a check of nothing is no check

    @property
    def ok(self) -> bool:
        return self.first_mismatch is None and self.num_compared >= self.min_compared

    def __str__(self) -> str:
        short = f" (fewer than the {self.min_compared} required)" if self.num_compared < self.min_compared else ""
        return f"greedy: {self.num_compared}/{self.num_steps} steps compared{short}, first mismatch {self.first_mismatch}"


def compare_greedy(ref_tokens: Sequence[int], got_tokens: Sequence[int], ref_top2_gaps: Sequence[float], tie_gap: float = 1e-3,
                   min_compared: int = 1) -> GreedyReport:
    """Token-identical up to the first step whose reference top-2 logit gap is below ``tie_gap``, over at least
    ``min_compared`` steps (a near-tie at step 0 compares nothing: that fails, it does not pass)."""
    n = min(len(ref_tokens), len(ref_top2_gaps))
    for i in range(n):
        if ref_top2_gaps[i] < tie_gap:
            return GreedyReport(n, i, None, min_compared)  # step i and later may legitimately differ
        if i >= len(got_tokens) or got_tokens[i] != ref_tokens[i]:
            return GreedyReport(n, i, i, min_compared)
    return GreedyReport(n, n, None, min_compared)


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return (top[0] - top[1]).item()


@dataclass
class Bf16Report:
    err_split: float
    err_reference: float
    factor: float

    @property
    def ok(self) -> bool:
        return self.err_split <= self.factor * max(self.err_reference, 1e-12)


def compare_bf16(ref_fp32: torch.Tensor, ref_bf16: torch.Tensor, got_bf16: torch.Tensor, factor: float = 2.0) -> Bf16Report:
    """Mean absolute errors of ``ref_bf16`` and ``got_bf16`` against ``ref_fp32`` (same shapes)."""
    err_ref = (ref_bf16.float() - ref_fp32.float()).abs().mean().item()
    err_got = (got_bf16.float() - ref_fp32.float()).abs().mean().item()
    return Bf16Report(err_got, err_ref, factor)
