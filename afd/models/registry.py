"""Architecture name (``config.json: architectures[0]``) -> afd model class."""

from __future__ import annotations

from afd.models.base import MoEModel
from afd.models.deepseek_v4 import DeepseekV4Model
from afd.models.deepseek_v2 import DeepseekV2Model, DeepseekV3Model, DeepseekV32Model
from afd.models.glm4_moe import Glm4MoeModel
from afd.models.gpt_oss import GptOssModel
from afd.models.minimax_m2 import MiniMaxM2Model
from afd.models.qwen3_moe import Qwen3MoeModel
from afd.models.qwen3_next import Qwen3NextModel

MODEL_CLASSES: dict[str, type[MoEModel]] = {
    "DeepseekV2ForCausalLM": DeepseekV2Model,
    "DeepseekV3ForCausalLM": DeepseekV3Model,
    "DeepseekV32ForCausalLM": DeepseekV32Model,
    "GlmMoeDsaForCausalLM": DeepseekV32Model,
    "Glm4MoeForCausalLM": Glm4MoeModel,
    "Qwen3MoeForCausalLM": Qwen3MoeModel,
    "MiniMaxM2ForCausalLM": MiniMaxM2Model,
    "GptOssForCausalLM": GptOssModel,
    "Qwen3NextForCausalLM": Qwen3NextModel,
    "Qwen3_5MoeForCausalLM": Qwen3NextModel,
    "DeepseekV4ForCausalLM": DeepseekV4Model,
}


def model_class(architecture: str) -> type[MoEModel]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_CLASSES)}") from None
