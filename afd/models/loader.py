"""Role-aware loading of a Hugging Face checkpoint onto a meta-initialised model.

The model is built on the ``meta`` device (no memory), then only the tensors
of the chosen :class:`WeightSelection` are read, one at a time, converted to
the target dtype and copied into freshly allocated parameters. Tensors outside
the selection are never read; parameters outside it stay on ``meta`` and any
half that needs them raises :class:`~afd.models.base.MissingWeightsError`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from afd.config import DEFAULT_FP8_MODE, FP8_MODES, ModelConfig
from afd.kernels import ops as native_ops
from afd.models.base import MoEModel
from afd.models.checkpoint import CheckpointError, CheckpointReader
from afd.models.hf_config import load_model_config, read_config_json
from afd.models.layers import GroupedExperts
from afd.models.int8 import SCALE_SUFFIX as INT8_SCALE
from afd.models.int8 import Int8Linear, dequantize_int8, int8_scheme, row_scales
from afd.models.mxfp4 import DEFAULT_MXFP4_MODE, MXFP4_MODES, as_mxfp4, dequantize_mxfp4, is_mxfp4
from afd.models.quant import SCALE_SUFFIX, Fp8Linear, dequantize, fp8_format, fp8_scale_name
from afd.models.weight_plan import CONVERTS, category, plan_copies, skipped_tensors
from afd.models.registry import model_class

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: checkpoint tensors that are derived buffers, not weights (older exports carry them)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightSelection:
    """Which tensors a process holds.

    attention       embeddings, attention, norms and the LM head
    routers         the MoE gates
    dense_mlp       the MLPs of dense layers
    shared_experts  the shared experts of MoE layers
    experts         logical ids of the routed experts to hold; ``None`` means all
    """

    attention: bool = True
    shared_experts: bool = True
    experts: frozenset[int] | None = None
    routers: bool = True
    dense_mlp: bool = True

    @classmethod
    def full(cls) -> "WeightSelection":
        return cls()

    @classmethod
    def attention_only(cls, shared_experts: bool = True, routers: bool = True, dense_mlp: bool = True) -> "WeightSelection":
        return cls(attention=True, shared_experts=shared_experts, experts=frozenset(), routers=routers, dense_mlp=dense_mlp)

    @classmethod
    def experts_only(
        cls, expert_ids: Iterable[int], shared_experts: bool = False, routers: bool = False, dense_mlp: bool = False
    ) -> "WeightSelection":
        return cls(attention=False, shared_experts=shared_experts, experts=frozenset(expert_ids), routers=routers, dense_mlp=dense_mlp)

    def held_experts(self, num_experts: int) -> list[int]:
        if self.experts is None:
            return list(range(num_experts))
        bad = sorted(e for e in self.experts if not 0 <= e < num_experts)
        if bad:
            raise ValueError(f"expert ids {bad} out of range: the model has {num_experts} routed experts")
        return sorted(self.experts)


@dataclass(frozen=True)
class LoadReport:
    """What a process read: the checkpoint tensors and their bytes (counted at the reader)."""

    tensors: tuple[str, ...]
    bytes_read: int
    shards_opened: tuple[str, ...]
    dtype: torch.dtype
    fp8: str | None = None  # how fp8 block-scaled weights were loaded (dequantize | keep); None: none were
    skipped_mtp: int = 0  # tensors of multi-token-prediction layers left unread
    skipped_vision: int = 0  # tensors of a multimodal release's vision tower left unread
    mxfp4: str | None = None  # how MXFP4 experts were loaded (dequantize); None: none were


def resolve_dtype(dtype: str | torch.dtype, raw_config: dict) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        name = raw_config.get("dtype") or raw_config.get("torch_dtype") or "float32"
        return DTYPES.get(name, torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[attr] = nn.Parameter(value, requires_grad=False)


def _target_dtype(model: MoEModel, name: str, dtype: torch.dtype) -> torch.dtype:
    if model.fp32_modules.intersection(name.split(".")):
        return torch.float32
    if name.endswith("mlp.gate.tid2eid"):
        return torch.long  # DeepSeek-V4's hash table: expert ids
    if name.endswith("mlp.gate.e_score_correction_bias") or (name.endswith(("mlp.gate.weight", "mlp.gate.bias"))
                                                              and model.config.moe.router_fp32):
        return torch.float32  # DeepSeek and GLM keep the router in fp32
    return dtype


def build_meta_model(config: ModelConfig, expert_ids: Iterable[int] | None = None) -> MoEModel:
    with torch.device("meta"):
        return model_class(config.architecture)(config, expert_ids=None if expert_ids is None else list(expert_ids))


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    selection: WeightSelection = WeightSelection(),
    device: str | torch.device = "cpu",
    fp8: str = DEFAULT_FP8_MODE,
    mxfp4: str = DEFAULT_MXFP4_MODE,
) -> tuple[MoEModel, LoadReport]:
    """Load the tensors of ``selection`` from a local Hugging Face directory.

    ``fp8``: how an fp8 block-scaled checkpoint's weights are held (:mod:`afd.models.quant`):
    ``dequantize`` once here into ``dtype``, or ``keep`` fp8 and dequantise per GEMM. ``mxfp4``: likewise for
    gpt-oss's MXFP4 experts (:mod:`afd.models.mxfp4`).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    if fp8 not in FP8_MODES:
        raise ValueError(f"fp8 weights mode must be one of {', '.join(FP8_MODES)}; got {fp8!r}")
    if mxfp4 not in MXFP4_MODES:
        raise ValueError(f"mxfp4 weights mode must be one of {', '.join(MXFP4_MODES)}; got {mxfp4!r}")
    raw = read_config_json(model_dir)
    config = load_model_config(model_dir)
    fmt = fp8_format(raw)
    w8a8 = int8_scheme(raw)
    mxfp4_mode, mxfp4 = mxfp4, is_mxfp4(raw)
    target = resolve_dtype(dtype, raw)
    held = selection.held_experts(config.moe.num_experts)
    reader = CheckpointReader(model_dir)
    config = model_class(config.architecture).checkpoint_layout(config, reader.names())
    model = build_meta_model(config, held)

    full_plan = plan_copies(build_meta_model(config), range(config.moe.num_experts), mxfp4)
    expected = {c.source for c in full_plan} | {c.scales for c in full_plan if c.scales}
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    available = reader.names()
    if fmt is not None:
        expected |= {s for n in expected for s in [fp8_scale_name(n, available)] if s is not None}
    if w8a8 is not None:
        expected |= {n + INT8_SCALE for n in expected if n + INT8_SCALE in available}
    skipped = skipped_tensors(available, config)
    for what, names in skipped.items():
        log.info("skipping the %s: %d tensors not loaded", what, len(names))
    mtp = skipped.get("multi-token-prediction", set())
    unexpected = sorted(n for n in available - expected - set().union(*skipped.values()) if not n.endswith(_IGNORED_SUFFIXES) and n != "lm_head.weight")
    if unexpected:
        raise CheckpointError(
            f"{len(unexpected)} unexpected tensors in {model_dir} for {config.architecture}: "
            f"{', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}"
        )

    wanted = {
        "attention": selection.attention,
        "routers": selection.routers,
        "dense_mlp": selection.dense_mlp,
        "shared_experts": selection.shared_experts,
        "experts": True,
    }
    plan = [c for c in plan_copies(model, held, mxfp4) if wanted[category(c.param)]]
    if config.tie_word_embeddings and "lm_head.weight" not in available:
        plan = [replace(c, source="model.embed_tokens.weight") if c.source == "lm_head.weight" else c for c in plan]
    missing = sorted({n for c in plan for n in (c.source, c.scales) if n and n not in available})
    if missing:
        raise CheckpointError(
            f"{len(missing)} tensors missing from {model_dir}: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )

    params = dict(model.named_parameters())
    for c in plan:
        param = params[c.param]
        want = tuple(param.shape[1:]) if c.index is not None else tuple(param.shape)
        if c.rows is not None:
            want = (c.rows.stop - c.rows.start, *want[1:])
        got = reader.shape(c.source)
        if c.convert is not None:
            want = tuple(CONVERTS[c.convert][1](want))
        if c.scales is not None:  # MXFP4: [rows, cols] as blocks [rows, cols / 32, 16] and scales [rows, cols / 32]
            if want[-1] % 32:
                raise CheckpointError(f"{c.param}: {want[-1]} columns are not whole MXFP4 groups of 32")
            want_scales = (*([config.moe.num_experts] if c.expert is not None else []), *want[:-1], want[-1] // 32)
            if reader.shape(c.scales) != want_scales:
                raise CheckpointError(f"tensor {c.scales} has shape {list(reader.shape(c.scales))}, the model expects {list(want_scales)}")
            # stacked (gpt-oss): blocks [E, rows, cols / 32, 16]; one tensor per expert (DeepSeek-V4): [rows, cols / 2]
            want = (*want_scales, 16) if c.expert is not None else (*want[:-1], want[-1] // 2)
        elif c.expert is not None:  # stacked: [num_experts, *one expert's]
            want = (config.moe.num_experts, *want)
        if got != want:
            raise CheckpointError(f"tensor {c.source} has shape {list(got)}, the model expects {list(want)}")

    quantized = {c.source for c in plan if fmt is not None and c.scales is None and fp8_scale_name(c.source, available)}
    # W8A8: the targeted linear weights, held int8 (MLA's kv_b_proj dequantised here: its absorbed decode reads it whole)
    int8 = {c.source for c in plan if w8a8 is not None and c.source.endswith(".weight") and _is_linear(model, c.param)
            and w8a8.quantises(c.source.removesuffix(".weight"))}
    int8_scales: dict[str, dict[tuple[int | None, int], torch.Tensor]] = {}
    keep = fp8 == "keep"
    materialised: dict[str, torch.Tensor] = {}
    scales: dict[str, dict[tuple[int | None, int], torch.Tensor]] = {}  # keep: param -> (expert index, first row) -> scales
    # MXFP4 keep: param -> local expert -> first row -> (blocks, scales)
    packed: dict[str, dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
    for c in plan:
        if c.scales is not None and mxfp4_mode == "keep":  # held as they are stored (gate_up's rows gate first)
            blocks, group_scales = as_mxfp4(reader.read(c.source, c.expert), reader.read(c.scales, c.expert))
            if c.convert == "rows_interleaved":
                blocks, group_scales = (torch.cat((t[0::2], t[1::2])) for t in (blocks, group_scales))
            packed.setdefault(c.param, {}).setdefault(c.index, {})[c.rows.start if c.rows else 0] = (blocks, group_scales)
            continue
        is_q = c.source in quantized
        is_int8 = c.source in int8 and not c.param.endswith("kv_b_proj.weight")
        if c.param not in materialised:
            param = params[c.param]
            p_dtype = torch.int8 if is_int8 else fmt.dtype if (is_q and keep) else _target_dtype(model, c.param, target)
            materialised[c.param] = torch.empty(param.shape, dtype=p_dtype, device=device)
        dst = materialised[c.param]
        if is_q and keep != (dst.dtype == fmt.dtype):
            raise CheckpointError(f"{c.param} mixes fp8 and unquantised source tensors ({c.source})")
        if c.index is not None:
            dst = dst[c.index]
        if c.rows is not None:
            dst = dst[c.rows]
        value = reader.read(c.source, c.expert)
        if c.scales is not None:
            value = dequantize_mxfp4(*as_mxfp4(value, reader.read(c.scales, c.expert)), torch.float32)
        if c.convert is not None:
            value = CONVERTS[c.convert][0](value)
        if c.source in int8:
            if value.dtype != torch.int8 or c.source + INT8_SCALE not in available:
                raise CheckpointError(f"{c.source} is a W8A8 target: it must be int8 beside {c.source + INT8_SCALE} "
                                      f"(stored {value.dtype}{', no scale' if c.source + INT8_SCALE not in available else ''})")
            scale = row_scales(reader.read(c.source + INT8_SCALE), value.shape[0])
            if is_int8:
                int8_scales.setdefault(c.param, {})[(c.index, c.rows.start if c.rows else 0)] = scale
            else:
                value = dequantize_int8(value, scale, torch.float32)
        elif value.dtype == torch.int8 and w8a8 is not None:
            raise CheckpointError(f"{c.source} is stored int8 but the W8A8 scheme does not target it (its ignore list or targets)")
        if is_q:
            scale = reader.read(fp8_scale_name(c.source, available))
            if keep:
                scales.setdefault(c.param, {})[(c.index, c.rows.start if c.rows else 0)] = scale
            else:
                value = dequantize(value, scale, fmt.block, torch.float32)
        elif value.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"tensor {c.source} is fp8 but has no {c.source + SCALE_SUFFIX} (or .scale)")
        dst.copy_(value)
    for name, value in materialised.items():
        _set_param(model, name, value)
    if scales:
        _keep_fp8(model, scales, fmt.block, target)
    if int8_scales:
        _keep_int8(model, int8_scales, target)
    if packed:
        _keep_mxfp4(model, packed, target, device)
    reader.close()
    model.eval()
    report = LoadReport(
        tensors=tuple(c.source for c in plan),
        bytes_read=reader.stats.bytes_read,
        shards_opened=tuple(sorted(reader.stats.shards_opened)),
        dtype=target,
        fp8=fp8 if quantized else None,
        skipped_mtp=len(mtp),
        skipped_vision=len(skipped.get("vision tower", ())),
        mxfp4=mxfp4_mode if mxfp4 else None,
    )
    log.info("loaded %d tensors (%.1f MB) from %s as %s%s", len(plan), report.bytes_read / 1e6, model_dir, target,
             f", {len(quantized)} fp8 weights ({fp8})" if quantized else "")
    if torch.device(device).type == "cpu":
        native_ops()  # built (or found) now, while the process starts, never at a server's first request
    return model, report


def _keep_mxfp4(model: MoEModel, packed: dict[str, dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]], dtype: torch.dtype,
                device: str | torch.device) -> None:
    """Hold the MXFP4 blocks and scales just read in the experts, decoded per expert inside the expert loop (an
    expert's gate and up read as two tensors, DeepSeek-V4's, are concatenated by their first rows)."""
    modules: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, parts in packed.items():
        module_name, _, attr = name.rpartition(".")
        local = range(len(parts))
        rows = [[parts[e][r] for r in sorted(parts[e])] for e in local]
        blocks = torch.stack([torch.cat([b for b, _ in row]) for row in rows]).to(device)
        group_scales = torch.stack([torch.cat([s for _, s in row]) for row in rows]).to(device)
        modules.setdefault(module_name, {})[attr] = (blocks, group_scales)
    for module_name, held in modules.items():
        experts = model.get_submodule(module_name)
        if not isinstance(experts, GroupedExperts) or set(held) != {"gate_up_proj", "down_proj"}:
            raise CheckpointError(f"MXFP4 weights of {module_name} are not gate_up_proj and down_proj of routed experts")
        for attr, (blocks, _) in held.items():
            _set_param(model, f"{module_name}.{attr}", blocks)
        experts.hold_mxfp4(held["gate_up_proj"][1], held["down_proj"][1], dtype)


def _is_linear(model: MoEModel, param: str) -> bool:
    """Whether ``param`` is the weight of a linear layer (what compressed-tensors' ``Linear`` target names): a linear
    module's, or a routed expert's projection (per expert a linear in the checkpoint); not an embedding, a norm or the
    router."""
    module = model.get_submodule(param.rpartition(".")[0])
    return isinstance(module, nn.Linear) or (isinstance(module, GroupedExperts) and param.endswith(("gate_up_proj", "down_proj")))


def _keep_int8(model: MoEModel, scales: dict[str, dict[tuple[int | None, int], torch.Tensor]], dtype: torch.dtype) -> None:
    """Turn the int8 parameters just loaded into W8A8 modules: linears into :class:`Int8Linear`, routed experts held
    int8 with their per-row scales (an expert's gate and up rows read as two tensors are concatenated)."""
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name, parts in scales.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, GroupedExperts):
            per_expert = [torch.cat([parts[k] for k in sorted(k for k in parts if k[0] == e)]) for e in range(len(module.expert_ids))]
            experts.setdefault(module_name, {})[attr] = torch.stack(per_expert)
        elif isinstance(module, nn.Linear):
            parent_name, _, child = module_name.rpartition(".")
            model.get_submodule(parent_name)._modules[child] = Int8Linear(module.weight, parts[(None, 0)], dtype, module.bias)
        else:
            raise CheckpointError(f"int8 weight {name} belongs to a {type(module).__name__}, which cannot hold int8")
    for module_name, held in experts.items():
        if set(held) != {"gate_up_proj", "down_proj"}:
            raise CheckpointError(f"the routed experts of {module_name} are int8 in part ({sorted(held)}): W8A8 needs both projections")
        model.get_submodule(module_name).hold_int8(held["gate_up_proj"], held["down_proj"], dtype)


def _keep_fp8(model: MoEModel, scales: dict[str, dict[tuple[int | None, int], torch.Tensor]], block: tuple[int, int],
              dtype: torch.dtype) -> None:
    """Turn the fp8 parameters just loaded into modules that dequantise per GEMM."""
    inter = model.config.moe.intermediate_size
    for name, parts in scales.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, GroupedExperts):
            local = range(len(module.expert_ids))
            if attr == "gate_up_proj":
                stacked = torch.stack([torch.stack((parts[(e, 0)], parts[(e, inter)])) for e in local])  # [E, 2, nI, nH]
            else:
                stacked = torch.stack([parts[(e, 0)] for e in local])  # [E, nH, nI]
            module.hold_fp8(attr, stacked, block, dtype)
        elif isinstance(module, nn.Linear):
            parent_name, _, child = module_name.rpartition(".")
            fp8 = Fp8Linear(module.weight, parts[(None, 0)], block, dtype, module.bias)
            model.get_submodule(parent_name)._modules[child] = fp8
        else:
            raise CheckpointError(f"fp8 weight {name} belongs to a {type(module).__name__}, which cannot hold fp8")
