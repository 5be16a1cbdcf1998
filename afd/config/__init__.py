"""Frozen configuration objects. Validated on construction; change with ``dataclasses.replace``.

Nothing here imports the rest of afd. Parsing of Hugging Face ``config.json`` files lives in
:mod:`afd.models.hf_config`; these classes are the normalised result every other layer reads.

* model.py: a checkpoint's architecture (attention, MoE, rotary);
* engine.py: an engine's cache, batching and sampling, and its flags (:class:`EngineArgs`);
* run.py: how a disaggregated run steps (the pipeline and its cost model), every timeout, injected faults.
"""

from afd.config.engine import (DEFAULT_FP8_MODE, DEFAULT_MXFP4_MODE, FP8_MODES, MAX_LOGPROBS, MXFP4_MODES, STATE_DTYPES, CacheConfig, EngineArgs,
                               EngineConfig, SamplingParams)
from afd.config.model import (ROPE_TYPES, SCORING_FUNCS, SUPPORTED_ACTIVATIONS, TOPK_METHODS, CompressedAttentionConfig, DSAConfig, LinearAttentionConfig, MLAConfig, ModelConfig, MoEConfig,
                              RopeConfig, yarn_mscale)
from afd.config.run import FAULT_KINDS, PROTOCOL_FAULTS, CostModel, FaultPlan, PipelineConfig, Timeouts

__all__ = ["CacheConfig", "CostModel", "DEFAULT_FP8_MODE", "DEFAULT_MXFP4_MODE", "MXFP4_MODES", "DSAConfig", "EngineArgs", "EngineConfig", "FAULT_KINDS", "FP8_MODES", "FaultPlan", "LinearAttentionConfig",
           "CompressedAttentionConfig", "MAX_LOGPROBS", "MLAConfig", "ModelConfig", "MoEConfig", "PROTOCOL_FAULTS", "PipelineConfig", "ROPE_TYPES", "RopeConfig",
           "SCORING_FUNCS", "STATE_DTYPES", "SUPPORTED_ACTIVATIONS", "SamplingParams", "TOPK_METHODS", "Timeouts", "yarn_mscale"]
