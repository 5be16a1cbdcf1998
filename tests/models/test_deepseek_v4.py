"""DeepSeek-V4 over afd's paged cache (issue 28): the config as transformers reads it, chunk invariance of the
compressed attention, and canaries that the model-level checks catch. Parity with transformers (per-layer values,
expert ids, cached decode, greedy) runs in tests/models/test_parity_hf.py over ``support.V4_CASES``."""

from __future__ import annotations

import pytest
import torch

from afd.models import UnsupportedArchitectureError, load_model, parse_hf_config
from afd.models import deepseek_v4 as d4
from afd.models import v4_compressor as v4c
from afd.testing.parity import compare_values
from tests import support

SEQ = [0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99, 61, 221, 103, 50, 299, 190, 17, 65, 115, 173, 204, 101, 152, 72, 60, 257, 236,
       152, 309, 221, 214, 11, 4, 5, 6, 7, 8]  # 40 tokens: 5 windows of the window (8), 10 CSA and 5 HCA windows
CHUNKINGS = {
    "16-token chunks": [16, 16, 8],
    "mid-window chunks": [3, 5, 7, 1, 9, 2, 13],  # chunk ends inside CSA (4) and HCA (8) windows, and exactly on them
    "decode": [13] + [1] * 27,
}


@pytest.mark.parametrize("raw", [
    dict(num_hidden_layers=5, compress_ratios=[0, 0, 4, 128, 4], num_hash_layers=2, qk_rope_head_dim=64,
         rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}),
    dict(num_hidden_layers=6),  # V4-Pro's default schedule, 3 hash layers
    dict(num_hidden_layers=4, compress_rate_csa=8, compress_rate_hca=64, compress_ratios=[4, 128, 0, 4], num_hash_layers=0),
])
def test_config_parse_equals_transformers(raw):
    """The layer kinds, compress rates, hash layers and both rotaries, legacy keys included, as
    ``DeepseekV4Config.__post_init__`` derives them."""
    from transformers import DeepseekV4Config

    raw = dict(raw, vocab_size=100, hidden_size=64, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=4)
    theirs = DeepseekV4Config(**raw).to_dict()
    ours = parse_hf_config({**raw, "model_type": "deepseek_v4"})
    rates = theirs["compress_rates"]
    assert ours.compressed.rates == tuple(rates.get(k, 0) for k in theirs["layer_types"])
    assert ours.compressed.csa_layers == tuple(i for i, k in enumerate(theirs["layer_types"]) if k == "compressed_sparse_attention")
    assert ours.moe.hash_layers == tuple(i for i, k in enumerate(theirs["mlp_layer_types"]) if k == "hash_moe")
    for rope, name in ((ours.rope, "main"), (ours.compressed.compress_rope, "compress")):
        params = theirs["rope_parameters"][name]
        assert rope.theta == params["rope_theta"] and rope.type == params.get("rope_type", "default") and rope.interleaved
        assert rope.dim == int(theirs["head_dim"] * params["partial_rotary_factor"])
        if rope.type == "yarn":
            assert (rope.factor, rope.attention_factor) == (params["factor"], params["attention_factor"])


def test_bad_configs_are_refused_with_the_reason():
    base = dict(model_type="deepseek_v4", vocab_size=100, hidden_size=64, moe_intermediate_size=16, n_routed_experts=8,
                num_experts_per_tok=2, num_attention_heads=4, num_hidden_layers=2)
    with pytest.raises(UnsupportedArchitectureError, match="compress_ratios must each be 0, 4 or 128"):
        parse_hf_config({**base, "compress_ratios": [0, 8]})
    with pytest.raises(ValueError, match="compress rate 128 needs a sliding window of at least 128"):
        parse_hf_config({**base, "compress_ratios": [0, 128], "sliding_window": 64})
    with pytest.raises(ValueError, match="compress rate 4 needs a sliding window of at least 8"):  # CSA pools the window before
        parse_hf_config({**base, "compress_ratios": [4, 0], "sliding_window": 6})


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    hf = support.build_hf_model(support.v4_config(**support.V4_CASES["v4-csa-hca"]), seed=80)
    path = support.save_checkpoint(hf, tmp_path_factory.mktemp("v4") / "ckpt")
    return load_model(path, dtype="float32")[0], hf


def run_chunks(model, seq, sizes, block_size=4, seq_id=0, other=None):
    """Per-layer outputs of ``seq`` fed in chunks of ``sizes`` ([T, N, H] per layer), with ``other`` (a second
    sequence) in every step's batch first when given."""
    runner, blocks = support.runner_and_blocks(model, block_size, 64, 2)
    outs, pos, opos = {}, 0, 0
    for n in sizes:
        blocks.ensure(seq_id, pos + n)
        chunks, ids = [blocks.chunk(seq_id, pos, n)], seq[pos:pos + n]
        if other is not None:
            m = min(n, len(other) - opos) or 1
            blocks.ensure(1 - seq_id, opos + m)
            chunks, ids = [blocks.chunk(1 - seq_id, opos, m), *chunks], other[opos:opos + m] + ids
            opos += m
        cap = support.Capture()
        runner.run(ids, chunks, observer=cap)
        skip = chunks[0].length if other is not None else 0
        for (layer, boundary), v in cap.values.items():
            if boundary == "ffn_output":
                outs.setdefault(layer, []).append(v[skip:])
        pos += n
    return {layer: torch.cat(v) for layer, v in outs.items()}


def chunk_failures(model, sizes, other=None):
    whole = run_chunks(model, SEQ, [len(SEQ)])
    got = run_chunks(model, SEQ, sizes, other=other)
    return [str(r) for r in (compare_values(f"layer {i}", whole[i], got[i]) for i in whole) if not r.ok]


@pytest.mark.parametrize("sizes", CHUNKINGS.values(), ids=CHUNKINGS.keys())
def test_any_chunking_equals_one_piece(v4, sizes):
    """Prefill whole = in 16-token chunks = in chunks that end mid-window = a prompt then decode tokens, on every layer
    (block size 4: the HCA windows span two blocks)."""
    model, _ = v4
    assert not chunk_failures(model, sizes)


def test_chunking_beside_another_sequence(v4):
    """A second sequence in every step's batch (its own rows, blocks and compressor windows) changes nothing."""
    model, _ = v4
    assert not chunk_failures(model, CHUNKINGS["mid-window chunks"], other=list(reversed(SEQ)))


def test_canary_compressor_one_token_early_fails(v4, monkeypatch):
    """An entry pooled one token early (window w = tokens w r - 1 .. (w + 1) r - 2) must fail against transformers."""
    model, hf = v4
    plain = v4c.compress_span

    def early(kv, gate, first, rate, *args, **kw):
        return plain(torch.roll(kv, 1, 0), torch.roll(gate, 1, 0), first, rate, *args, **kw)

    monkeypatch.setattr(d4, "compress_span", early)
    assert _transformers_failures(model, hf), "an entry pooled one token early went unnoticed"


def test_canary_window_buffer_dropped_at_a_chunk_boundary_fails(v4, monkeypatch):
    """The compressor's pending tokens lost at a chunk boundary (read back as zeros) must fail chunk invariance."""
    model, _ = v4
    plain = d4.V4Attention._emit

    def forgetful(self, seq, cache, rope):
        pending = torch.arange(seq.start - seq.start % self.rate, seq.start)
        saved = [(t, t[seq.window_slots[pending - seq.window_start]].clone()) for t in cache[1:3]]
        for t, _ in saved:
            t[seq.window_slots[pending - seq.window_start]] = 0
        plain(self, seq, cache, rope)
        for t, rows in saved:
            t[seq.window_slots[pending - seq.window_start]] = rows

    monkeypatch.setattr(d4.V4Attention, "_emit", forgetful)
    assert chunk_failures(model, CHUNKINGS["mid-window chunks"]), "a dropped window buffer went unnoticed"


def test_canary_hash_table_read_off_by_one_fails(v4):
    """The hash-routed layer reading the previous position's token must fail the expert-id check."""
    model, hf = v4
    gate = model.model.layers[model.config.moe.hash_layers[0]].mlp.gate
    plain = gate.forward
    gate.forward = lambda x, token_ids=None: plain(x, torch.roll(token_ids, 1))
    try:
        assert _transformers_failures(model, hf), "the hash table read with the wrong token went unnoticed"
    finally:
        del gate.forward


def test_canary_sinkhorn_one_round_short_fails(v4):
    model, hf = v4
    layer = model.model.layers[1]
    layer.attn_hc.sinkhorn_iters -= 1
    try:
        assert _transformers_failures(model, hf), "Sinkhorn one round short went unnoticed"
    finally:
        layer.attn_hc.sinkhorn_iters += 1


def test_canary_streams_summed_not_mixed_fails(v4, monkeypatch):
    """merge adding the FFN output to every stream (a plain residual) in place of the hyper-connection's mixing."""
    model, hf = v4
    monkeypatch.setattr(type(model), "merge", lambda self, layer, out, y: out.residual + y[:, None, :])
    assert _transformers_failures(model, hf), "streams summed instead of mixed went unnoticed"


def test_canary_sinks_dropped_fails(v4):
    model, hf = v4
    saved = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
    try:
        for layer in model.model.layers:
            layer.self_attn.sinks.data.fill_(float("-inf"))  # a sink of weight 0: as if there were none
        assert _transformers_failures(model, hf), "dropping the sinks went unnoticed"
    finally:
        for layer, sinks in zip(model.model.layers, saved):
            layer.self_attn.sinks.data.copy_(sinks)


def test_canary_output_not_rotated_back_fails(v4, monkeypatch):
    """The attention output's rotated slice left rotated (the values' rotation not undone at the query's position)."""
    model, hf = v4
    plain = d4.rotate_tail
    monkeypatch.setattr(d4, "rotate_tail", lambda x, positions, rope: x if bool((positions < 0).any()) else plain(x, positions, rope))
    assert _transformers_failures(model, hf), "the output's rotated slice not rotated back went unnoticed"


def _transformers_failures(model, hf) -> list[str]:
    runner, blocks = support.runner_and_blocks(model, 4, 64, 1)
    cap = support.Capture()
    runner.run(SEQ, [support.new_chunk(blocks, 0, SEQ)], observer=cap)
    layers, router, _ = support.hf_reference(hf, SEQ)
    failures = [str(r) for i, ref in layers.items() for r in [compare_values(f"layer {i}", ref, cap[(i, "ffn_output")])] if not r.ok]
    return failures + [f"layer {i} experts" for i in router
                       if not torch.equal(router[i][1].sort(-1).values, cap[(i, "topk_ids")].sort(-1).values)]


def test_sanity_the_canaries_model_passes(v4):
    model, hf = v4
    assert not _transformers_failures(model, hf)


def test_a_synthetic_v4_checkpoint_loads_and_its_costs_fit(tmp_path):
    """The benchmarks' random-weight V4 (afd/models/synthetic.py, small dims): written under the names transformers
    writes, loaded by the loader with nothing missing or unexpected, a valid hash table (distinct experts per token),
    and `afd bench costs`' fit runs over it (the window pool, the streams, a top-k layer's FFN)."""
    from afd.cli.bench_costs import _fit
    from afd.models.synthetic import deepseek_v4_flash_shaped, write_random_checkpoint

    raw = deepseek_v4_flash_shaped(num_layers=3, vocab_size=300, num_experts=8)
    raw.update(hidden_size=256, head_dim=64, qk_rope_head_dim=16, num_attention_heads=4, q_lora_rank=32, o_lora_rank=32, o_groups=2,
               index_n_heads=4, index_head_dim=32, moe_intermediate_size=64, hc_mult=2)
    write_random_checkpoint(raw, tmp_path, dtype=torch.float32)
    model, report = load_model(tmp_path, dtype="float32")
    table = model.model.layers[0].mlp.gate.tid2eid
    assert table.shape == (300, 6) and all(len(set(row)) == 6 for row in table.tolist()) and int(table.max()) < 8
    coef = _fit(model, 1)
    assert coef["attn_token"] > 0 and len(coef["ffn_curve"]) == 11
