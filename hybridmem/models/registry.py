"""The families hybridmem knows, by ``model_type``, with their aliases."""

from __future__ import annotations

from hybridmem.models.deepseek_v3 import DEEPSEEK_V3
from hybridmem.models.deepseek_v32 import DEEPSEEK_V32, GLM_MOE_DSA
from hybridmem.models.ernie4_5 import ERNIE4_5
from hybridmem.models.family import ConfigGetter, Family
from hybridmem.models.gemma3 import GEMMA3
from hybridmem.models.gemma4 import GEMMA4
from hybridmem.models.glm4_moe import GLM4_MOE
from hybridmem.models.gpt_oss import GPT_OSS
from hybridmem.models.granite import GRANITE
from hybridmem.models.llama import LLAMA
from hybridmem.models.llama4 import LLAMA4
from hybridmem.models.minimax_m2 import MINIMAX_M2
from hybridmem.models.mixtral import MIXTRAL
from hybridmem.models.phi3 import PHI3
from hybridmem.models.qwen2 import QWEN2
from hybridmem.models.qwen2_moe import QWEN2_MOE
from hybridmem.models.qwen3 import QWEN3
from hybridmem.models.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from hybridmem.models.qwen3_moe import QWEN3_MOE

__all__ = ["FAMILIES", "ALIASES", "MULTIMODAL", "ARCHITECTURES", "get_family", "family_name", "model_type_of",
           "structural_model_type"]

FAMILIES: dict[str, Family] = {f.name: f for f in (
    LLAMA, QWEN2, QWEN3, QWEN2_MOE, QWEN3_MOE, DEEPSEEK_V3, MIXTRAL, PHI3, GEMMA3, GLM4_MOE, GRANITE, GPT_OSS,
    MINIMAX_M2, LLAMA4, GEMMA4, QWEN3_5, QWEN3_5_MOE, DEEPSEEK_V32, GLM_MOE_DSA,
    ERNIE4_5,
)}
"""Every family by its own ``model_type``."""

ALIASES: dict[str, str] = {alias: f.name for f in FAMILIES.values() for alias in f.aliases}
"""Other ``model_type`` values -> the family that describes them."""


MULTIMODAL: dict[str, str] = {mm: f.name for f in FAMILIES.values() for mm in f.multimodal_types}
"""``model_type`` values of multimodal configs -> the family of their ``text_config``."""


ARCHITECTURES: dict[str, str] = {arch: f.name for f in FAMILIES.values() for arch in f.architectures}
"""transformers' and vLLM's model class names (a config's ``architectures``) -> the family of that class."""


def structural_model_type(*, mla: bool, moe: bool, qkv_bias: bool) -> str:
    """The family a model that names none is read as, from its structure alone (a Megatron-core
    ``TransformerConfig`` names no HF family): DeepSeek-V3 with multi-latent attention (the one such family),
    else Qwen2-MoE with routed experts (its reader takes a model without a shared expert), else Qwen2 with
    q/k/v biases, else Llama."""
    if mla:
        return DEEPSEEK_V3.name
    if moe:
        return QWEN2_MOE.name
    return QWEN2.name if qkv_bias else LLAMA.name


def model_type_of(get: ConfigGetter) -> str:
    """The ``model_type`` a config is read as: its own; absent, the family of the first of its
    ``architectures`` that :data:`ARCHITECTURES` knows (a config saved without ``model_type``); neither:
    ``"llama"``."""
    model_type = get("model_type")
    if model_type:
        return str(model_type)
    for arch in get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    return LLAMA.name


def family_name(model_type: str) -> str:
    """The family describing ``model_type`` (itself, the family it is an alias of, or the text family of a
    multimodal ``model_type``).

    Raises:
        ValueError: No family describes it; the message lists the supported ones.
    """
    if model_type in FAMILIES:
        return model_type
    if model_type in ALIASES:
        return ALIASES[model_type]
    if model_type in MULTIMODAL:
        return MULTIMODAL[model_type]
    known = sorted([*FAMILIES, *ALIASES, *MULTIMODAL])
    raise ValueError(f"model_type={model_type!r} is not supported; expected one of {known}")


def get_family(model_type: str) -> Family:
    """The :class:`Family` describing ``model_type`` (see :func:`family_name`)."""
    return FAMILIES[family_name(model_type)]
