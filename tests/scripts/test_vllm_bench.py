"""The against-vLLM summary of scripts/clients/vllm_bench.py: the ratios per round and which rounds count."""

from __future__ import annotations

import pytest

from scripts.clients.vllm_bench import round_ratios


def run(tok_s: float, tpot: float, ttft: float, lost: int = 0) -> dict:
    return {"output_throughput": tok_s, "median_tpot_ms": tpot, "median_ttft_ms": ttft, "lost": lost}


def test_a_round_in_which_a_server_lost_a_request_is_left_out_of_the_median():
    # run 2 of this stop's bench: vLLM lost 1 of 64 requests in its first 32-stream round (345 tok/s)
    results = {("vllm serve", 32, 0): run(345.0, 11.5, 298.6, lost=1), ("afd serve", 32, 0): run(2377.7, 8.8, 159.0),
               ("vllm serve", 32, 1): run(1752.3, 13.5, 150.7), ("afd serve", 32, 1): run(2912.7, 8.3, 88.8),
               ("vllm serve", 32, 2): run(1928.6, 13.1, 117.0), ("afd serve", 32, 2): run(2736.5, 8.4, 92.2)}
    ratios, whole, medians = round_ratios(results, 32, 3)
    assert whole == [False, True, True]
    assert ratios["throughput"][0] == pytest.approx(2377.7 / 345.0)  # shown, in brackets
    assert medians["throughput"] == pytest.approx((2912.7 / 1752.3 + 2736.5 / 1928.6) / 2)  # not 1.66x with it
    assert medians["tpot"] == pytest.approx((8.3 / 13.5 + 8.4 / 13.1) / 2)


def test_with_no_whole_round_there_is_no_median():
    results = {("vllm serve", 8, 0): run(900.0, 7.0, 40.0), ("afd serve", 8, 0): run(1600.0, 4.0, 28.0, lost=2)}
    ratios, whole, medians = round_ratios(results, 8, 1)
    assert whole == [False] and medians == {"throughput": None, "tpot": None, "ttft": None}
    assert ratios["ttft"] == [pytest.approx(0.7)]
