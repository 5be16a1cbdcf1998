"""The model a benchmark runs and the engine it runs in: a checkpoint, the built-in model, or a synthetic
random-weight model (DeepSeek-V2-Lite- or V3-shaped; written as an fp8 or W8A8 checkpoint and loaded through the
loader where asked). ``afd bench generate`` and ``afd bench roofline`` share them."""

from __future__ import annotations

import argparse
import sys

import torch

from afd.cli.common import device_arg, resolve_model
from afd.config import SamplingParams

SYNTHETIC = ("deepseek-v2-lite", "deepseek-v3")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model a benchmark runs (``load_for_bench`` reads these): a checkpoint, the built-in one, or a synthetic one."""
    p.add_argument("model", nargs="?", help="model directory (default: the built-in model)")
    p.add_argument("--synthetic", choices=SYNTHETIC, help="use a random-weight model of this shape instead of a checkpoint")
    p.add_argument("--synthetic-layers", type=int, help="layers of the synthetic model, the first dense (default: 8 for "
                   "deepseek-v2-lite, 4 for deepseek-v3)")
    p.add_argument("--fp8", choices=["dequantize", "keep"],
                   help="synthetic model only: write it as an fp8 block-scaled (128x128) checkpoint and load it this way "
                        "(--fp8-weights); default: bf16/fp32 weights built in memory")
    p.add_argument("--w8a8", action="store_true",
                   help="synthetic model only: write it as a W8A8 int8 checkpoint (compressed-tensors, as llm-compressor does) and "
                        "load it (int8 weights, per-token int8 activations)")
    p.add_argument("--fp8-weights", choices=["dequantize", "keep"], default="dequantize",
                   help="with a checkpoint: how fp8 block-scaled weights are held")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")


def load_for_bench(args: argparse.Namespace):
    """(model, label) as :func:`add_model_args`' arguments say."""
    import tempfile

    from afd.models import WeightSelection, load_model
    from afd.models.synthetic import SYNTHETIC_SHAPES, random_model, write_random_checkpoint

    args.device = device_arg(getattr(args, "device", "cpu"))  # checked before the (long) load
    if args.synthetic:
        dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        layers = args.synthetic_layers or (4 if args.synthetic == "deepseek-v3" else 8)
        raw = SYNTHETIC_SHAPES[args.synthetic](num_layers=layers)
        label = f"synthetic {args.synthetic} ({layers} layers, {raw['n_routed_experts']} experts, random)"
        if not args.fp8 and not args.w8a8:
            return random_model(raw, dtype).to(args.device), label
        with tempfile.TemporaryDirectory(prefix="afd-bench-quant-") as tmp:
            print(f"writing a {'W8A8' if args.w8a8 else 'fp8'} checkpoint of the {label} model to {tmp}", file=sys.stderr, flush=True)
            write_random_checkpoint(raw, tmp, torch.bfloat16, fp8_block=None if args.w8a8 else (128, 128), w8a8=args.w8a8)
            model, _ = load_model(tmp, dtype=dtype, selection=WeightSelection.full(), device=args.device, fp8=args.fp8 or "dequantize")
        return model, f"{label}, {'W8A8' if args.w8a8 else f'fp8 {args.fp8}'}"
    if args.fp8 or args.w8a8:
        raise ValueError("--fp8 is for --synthetic models; a checkpoint's fp8 weights are loaded as --fp8-weights says")
    model_dir = resolve_model(args.model)
    model, _ = load_model(model_dir, dtype=args.dtype, selection=WeightSelection.full(), device=args.device, fp8=args.fp8_weights)
    return model, str(model_dir)


def kv_bytes_per_token(model) -> int:
    """Bytes of KV cache one token holds across the model's layers, in its compute dtype."""
    dtype = model.model.embed_tokens.weight.dtype
    return sum(torch.Size(s).numel() for s in model.kv_layout()) * model.config.num_layers * dtype.itemsize


def make_engine(model, num_seqs: int, prompt_len: int, new_tokens: int, device: str, seed: int):
    """An engine holding ``num_seqs`` random prompts of ``prompt_len`` tokens, each to decode ``new_tokens`` greedily
    (ignoring EOS), with cache and a step budget for them all: its first ``step()`` prefills every prompt."""
    from afd.config import EngineConfig
    from afd.engine.llm_engine import LLMEngine, cache_config_for

    need = num_seqs * (prompt_len + new_tokens + 16)
    cache = cache_config_for(model, need * kv_bytes_per_token(model), 16, model.model.embed_tokens.weight.dtype)
    config = EngineConfig(cache=cache, max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * prompt_len,
                          device=device)  # each step ends by copying the logits to the host: steps are synchronous
    engine = LLMEngine(model, None, config)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(num_seqs):
        engine.add_request(torch.randint(0, model.config.vocab_size, (prompt_len,), generator=gen).tolist(), params)
    return engine
