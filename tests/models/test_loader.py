"""Role-aware loading: bytes counted at the reader, roles that add up to the model, clear errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from afd.config import CacheConfig
from afd.kvcache import PagedKVCache, SeqChunk, build_attention_metadata
from afd.models import (
    CheckpointError,
    MissingWeightsError,
    UnsupportedArchitectureError,
    WeightSelection,
    load_model,
)
from afd.testing.parity import compare_values

DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


def header_bytes(model_dir: Path) -> dict[str, int]:
    """Independent count: every tensor's size from the safetensors headers."""
    sizes = {}
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                sizes[name] = n * DTYPE_BYTES[sl.get_dtype()]
    return sizes


@pytest.fixture
def ckpt(checkpoints, tmp_path):
    src, _ = checkpoints["ds-noqlora-greedy"]
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def test_attention_only_reads_exactly_the_attention_tensors(ckpt):
    sizes = header_bytes(ckpt)
    model, report = load_model(ckpt, dtype="float32", selection=WeightSelection.attention_only())
    want = sum(b for n, b in sizes.items() if not is_expert(n))
    assert report.bytes_read == want
    assert not any(is_expert(n) for n in report.tensors)
    assert model.expert_ids == ()


@pytest.mark.parametrize("experts, shared", [({1, 6}, False), ({0, 3, 4}, True)])
def test_expert_subset_reads_exactly_those_experts(ckpt, experts, shared):
    sizes = header_bytes(ckpt)
    model, report = load_model(ckpt, dtype="float32", selection=WeightSelection.experts_only(experts, shared_experts=shared))
    want = sum(
        b
        for n, b in sizes.items()
        if (is_expert(n) and int(n.split(".mlp.experts.")[1].split(".")[0]) in experts) or (shared and ".shared_experts." in n)
    )
    assert report.bytes_read == want
    assert model.expert_ids == tuple(sorted(experts))
    with pytest.raises(MissingWeightsError, match="attention"):
        model.attention(0, torch.zeros(1, model.config.hidden_size), None, ())


def test_union_of_roles_equals_the_full_model(ckpt):
    full, _ = load_model(ckpt, dtype="float32")
    attn, _ = load_model(ckpt, dtype="float32", selection=WeightSelection.attention_only())
    ffn = [load_model(ckpt, dtype="float32", selection=WeightSelection.experts_only(ids))[0] for ids in ({0, 1, 2}, {3, 4, 5, 6, 7})]
    # every tensor is held by exactly one role and is bit-identical to the full model's
    for name, p in full.named_parameters():
        holders = [m for m in (attn, *ffn) if not dict(m.named_parameters())[name].is_meta]
        if "mlp.experts." in name:
            stacked = torch.cat([dict(m.named_parameters())[name] for m in ffn])
            assert torch.equal(stacked, p), name
        else:
            assert len(holders) == 1 and torch.equal(dict(holders[0].named_parameters())[name], p), name
    # and the halves compose into the monolithic forward
    ids = torch.tensor([0, 5, 17, 99, 3, 250, 11])
    meta = build_attention_metadata([SeqChunk([0, 1], 0, len(ids))], 4)
    cache_full = PagedKVCache(CacheConfig(4, 2), full.config.num_layers, full.kv_layout(), torch.float32)
    cache_attn = PagedKVCache(CacheConfig(4, 2), full.config.num_layers, full.kv_layout(), torch.float32)
    ref = full(ids, meta, cache_full)
    with torch.inference_mode():
        h = attn.embed(ids)
        for i in range(full.config.num_layers):
            out = attn.attention(i, h, meta, cache_attn.layer(i))
            if not full.config.is_moe_layer(i):
                h = out.residual + attn.dense_mlp(i, out.ffn_input)
                continue
            routing = attn.router(i, out.ffn_input)
            partial = [m.experts(i, out.ffn_input, routing) for m in ffn]
            h = out.residual + (partial[0] + partial[1] + attn.shared_experts(i, out.ffn_input))
    report = compare_values("split halves vs monolithic", ref, h)
    assert report.ok, str(report)


# ----------------------------------------------------------------------------- errors


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(tmp_path)
    assert "LlamaForCausalLM" in str(e.value) and "DeepseekV2ForCausalLM" in str(e.value) and "Qwen3MoeForCausalLM" in str(e.value)


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(tmp_path)


def test_no_safetensors(ckpt):
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    (ckpt / "model.safetensors.index.json").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(ckpt)


def _rewrite(ckpt: Path, edit) -> None:
    """Merge the shards into one edited model.safetensors."""
    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(f))
        f.unlink()
    (ckpt / "model.safetensors.index.json").unlink(missing_ok=True)
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"))
    with pytest.raises(CheckpointError, match="missing.*model.layers.1.self_attn.o_proj.weight"):
        load_model(ckpt)
    # ...but a role that does not need it loads fine
    load_model(ckpt, selection=WeightSelection.experts_only({0}))


def test_missing_expert_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.3.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match="model.layers.3.mlp.experts.5.up_proj.weight"):
        load_model(ckpt, selection=WeightSelection.experts_only({5}))


def test_unexpected_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.bogus.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected.*model.layers.0.mlp.bogus.weight"):
        load_model(ckpt)


def test_shape_mismatch_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.2.mlp.experts.3.down_proj.weight", torch.zeros(64, 31)))
    with pytest.raises(CheckpointError, match=r"model.layers.2.mlp.experts.3.down_proj.weight has shape \[64, 31\].*\[64, 32\]"):
        load_model(ckpt)


def test_expert_ids_out_of_range(ckpt):
    with pytest.raises(ValueError, match=r"expert ids \[8\] out of range"):
        load_model(ckpt, selection=WeightSelection.experts_only({8}))


# ----------------------------------------------------------------------------- memory

BIG_LAYERS, BIG_EXPERTS, BIG_HIDDEN, BIG_INTER = 2, 42, 1024, 1024


def write_big_checkpoint(path: Path) -> int:
    """A >= 500 MB bf16 DeepSeek-V2 checkpoint in two shards; returns its tensor bytes."""
    from afd.models.synthetic import write_random_checkpoint

    raw = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 512,
        "hidden_size": BIG_HIDDEN, "intermediate_size": 512, "moe_intermediate_size": BIG_INTER,
        "num_hidden_layers": BIG_LAYERS, "first_k_dense_replace": 0, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": None, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
        "n_routed_experts": BIG_EXPERTS, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "max_position_embeddings": 512, "rope_theta": 10000.0,
    }
    total = write_random_checkpoint(raw, path, dtype=torch.bfloat16, shard_bytes=300 << 20)
    assert len(list(path.glob("*.safetensors"))) >= 2
    return total


PEAK_SCRIPT = """
import sys, json
import torch
from afd.models import WeightSelection, load_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

kind = sys.argv[2]
sel = {"full": WeightSelection.full(), "attention": WeightSelection.attention_only(),
       "experts": WeightSelection.experts_only({0, 1, 2, 3})}[kind]
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS")
model, report = load_model(sys.argv[1], dtype="bfloat16", selection=sel)
print(json.dumps({"peak_delta_kb": status("VmHWM") - before, "bytes_read": report.bytes_read}))
"""


@pytest.mark.procs
@pytest.mark.slow
def test_role_peak_memory_on_a_500mb_checkpoint(tmp_path):
    total = write_big_checkpoint(tmp_path / "big")
    assert total >= 500e6
    res = {}
    for kind in ("full", "attention", "experts"):
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "big"), kind], capture_output=True, text=True, check=True)
        res[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    full_kb = res["full"]["peak_delta_kb"]
    assert res["full"]["bytes_read"] == total
    assert full_kb * 1024 >= 0.9 * total, res  # the full load really holds the model
    assert res["attention"]["bytes_read"] < 0.05 * total
    assert res["attention"]["peak_delta_kb"] < 0.2 * full_kb, res
    assert res["experts"]["peak_delta_kb"] < 0.3 * full_kb, res


CONFIGS = Path(__file__).parent.parent / "data" / "configs"


def test_published_deepseek_v3_config_parses():
    """DeepSeek-V3's config.json as published (fp8, YaRN, noaux_tc, MTP, unused keys such as aux_loss_alpha)."""
    from afd.models import parse_hf_config
    from afd.models.quant import fp8_format

    raw = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    c = parse_hf_config(raw)
    assert c.architecture == "DeepseekV3ForCausalLM" and c.num_layers == 61 and c.num_mtp_layers == 1
    assert c.mla.q_lora_rank == 1536 and c.mla.kv_lora_rank == 512 and c.rope.type == "yarn" and c.rope.interleaved
    m = c.moe
    assert (m.scoring, m.topk_method, m.scale_after_norm, m.norm_topk_prob) == ("sigmoid", "noaux_tc", True, True)
    assert (m.num_experts, m.top_k, m.num_groups, m.topk_groups, m.routed_scaling_factor) == (256, 8, 8, 4, 2.5)
    assert m.layers == tuple(range(3, 61)) and m.num_shared_experts == 1
    assert fp8_format(raw).block == (128, 128)


def test_published_glm45_config_parses():
    from afd.models import parse_hf_config

    c = parse_hf_config(json.loads((CONFIGS / "glm-4.5.json").read_text()))
    assert c.architecture == "Glm4MoeForCausalLM" and c.head_dim == 128 and c.rope.dim == 64 and not c.rope.interleaved
    assert c.qk_norm and c.attention_bias and c.num_mtp_layers == 1 and c.eos_token_ids == (151329, 151336, 151338)
    assert c.rope.theta == 1e6 and c.moe.layers == tuple(range(3, 92)) and c.moe.scale_after_norm and c.moe.routed_scaling_factor == 2.5


def test_v3_with_other_routing_is_refused():
    from afd.models import parse_hf_config

    raw = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    with pytest.raises(UnsupportedArchitectureError, match="scoring_func='softmax'"):
        parse_hf_config({**raw, "scoring_func": "softmax"})


def test_kimi_k2_layout_parses_as_deepseek_v3():
    """Kimi-K2 publishes V3's architecture under model_type kimi_k2 (384 experts, one group)."""
    from afd.models import parse_hf_config

    raw = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    raw.update(model_type="kimi_k2", n_routed_experts=384, n_group=1, topk_group=1, routed_scaling_factor=2.827,
               num_attention_heads=64, num_key_value_heads=64, first_k_dense_replace=1)
    c = parse_hf_config(raw)
    assert c.architecture == "DeepseekV3ForCausalLM" and c.moe.num_experts == 384 and c.moe.topk_method == "noaux_tc"
