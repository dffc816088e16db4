"""Configuration: :class:`HybridConfig` (MindSpeed-RL's keys) and :class:`ParallelLayout`.

Keys keep MindSpeed-RL's names so a user's existing YAML file drives hybridmem unchanged
(``actor_config:`` holds the training layout, ``generate_config:`` the inference layout, the
``offload_train_*`` switches and ``gpu_memory_utilization``). Keys hybridmem adds live in an optional
``hybridmem:`` section. Unknown keys and sections are errors that suggest the closest known name.

[Note: YAML sections]
A MindSpeed-RL file has top-level sections (mindspeed.SECTIONS) plus an optional ``hybridmem:``.
hybridmem reads its keys from these places; a later row wins over an earlier one:

  megatron_training  training layout (MindSpeed-RL merges it under actor_config)
  actor_config       training layout
  generate_config    offload switches, inference layout, gpu_memory_utilization
  hybridmem          any HybridConfig key

Every other key of those sections (and every key of rl_config) must be one that some MindSpeed-RL
release defines there (mindspeed holds the union over releases, so a file written for any of them
loads): its config classes reject anything else, so an unknown key is a typo and raises with a
suggestion. A top-level section outside SECTIONS raises the same way. Sections hybridmem does not read
(ref_config, profiler_config, ...) are not checked: they belong to the user's framework.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from hybridmem.config import mindspeed
from hybridmem.errors import ConfigError

__all__ = ["ParallelLayout", "HybridConfig", "DEVICE_CHOICES", "LoraBase"]

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")


class LoraBase(Enum):
    """Where a LoRA model's base weights stay when only its adapters are synced
    (:attr:`HybridConfig.lora_base`; see [Note: lora base] in :mod:`hybridmem.switch.lora_base`). In every
    mode the trainer's frozen base stays on the device: only the adapters, their gradients and optimizer
    state are offloaded."""

    ENGINE_SLEEPS = "engine_sleeps"
    """The engine releases its weights on leaving INFER, at its own sleep level (vLLM's level 1 keeps them in
    host memory, so no base is sent again) and takes them back on entering it: one copy of the base on the
    device while training, two while generating; each switch moves the engine's base over the host link."""
    ENGINE_RESIDENT = "engine_resident"
    """The engine keeps its weights on the device through TRAIN: two copies of the base always, and a switch
    moves the adapters and the KV cache only."""
    SHARED = "shared"
    """One copy: the trainer's frozen base parameters become views of the engine's weights
    (:func:`hybridmem.weight_sync.shared_base.share_base`; tensor-parallel size 1 and an engine that keeps its
    layout unrepacked, e.g. vLLM on GPUs), which stay resident; a switch moves the adapters and the KV cache
    only."""

def _check_positive_int(key: str, value: object, *, source: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "a positive int", source=source)


def _check_bool(key: str, value: object, *, source: str | None = None) -> None:
    if not isinstance(value, bool):
        raise ConfigError(key, value, "true or false", source=source)


def _check_optional_positive_int(key: str, value: object, *, source: str | None = None) -> None:
    if value is not None:
        _check_positive_int(key, value, source=source)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """How one side (training or inference) shards the model over ranks.

    Ranks not used by ``tp * pp`` form data-parallel replicas; ``ep`` splits the experts of MoE layers
    inside the data-parallel dimension, as Megatron-core and vLLM both do.
    """

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (number of stages)."""
    ep: int = 1
    """Expert-parallel size (1 for dense models)."""

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "ep"):
            _check_positive_int(key, getattr(self, key))

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one full copy of the model: ``tp * pp``."""
        return self.tp * self.pp

    def data_parallel_size(self, world_size: int) -> int:
        """Number of model replicas on ``world_size`` ranks.

        Raises:
            ValueError: If ``world_size`` is not a multiple of ``tp * pp``, or the replicas cannot be
                split ``ep`` ways.
        """
        _check_positive_int("world_size", world_size)
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"world_size={world_size} is not divisible by tp*pp={self.tp}*{self.pp}="
                f"{self.model_parallel_size}"
            )
        dp = world_size // self.model_parallel_size
        if (dp * self.tp) % self.ep:
            raise ValueError(
                f"expert parallel size ep={self.ep} does not divide dp*tp={dp}*{self.tp}={dp * self.tp} "
                f"on world_size={world_size} with pp={self.pp}"
            )
        return dp

    def __str__(self) -> str:
        return f"TP{self.tp}xPP{self.pp}xEP{self.ep}"


@dataclass(frozen=True, kw_only=True, slots=True)
class HybridConfig:
    """Everything that decides how the actor switches between TRAIN and INFER.

    Build it directly, from a flat mapping (:meth:`from_dict`), or from a MindSpeed-RL YAML file
    (:meth:`from_yaml`). Every value is checked in ``__post_init__``; a bad one raises
    :class:`hybridmem.errors.ConfigError` (a ``ValueError``) naming the key, the value and what is allowed.
    """

    offload_train_param: bool = True
    """Move training weights to host memory while in INFER."""
    offload_train_grad: bool = True
    """Move gradients to host memory while in INFER (all-zero ones are released without a copy)."""
    offload_train_optimizer: bool = True
    """Move optimizer state (Adam moments, momentum, ...) to host memory while in INFER."""
    tensor_model_parallel_size: int | None = None
    """Training tensor-parallel size (MindSpeed-RL ``actor_config``). ``None``: what the training state
    reports (the Megatron adapter reads it from ``parallel_state``), else 1; a value that differs from
    what the training state reports is refused when the manager is built."""
    pipeline_model_parallel_size: int | None = None
    """Training pipeline-parallel size (``None``: as the training state reports, else 1)."""
    expert_model_parallel_size: int | None = None
    """Training expert-parallel size (``None``: as the training state reports, else 1)."""
    infer_tensor_parallel_size: int | None = None
    """Inference tensor-parallel size (MindSpeed-RL ``generate_config``). ``None``: what the engine reports
    (vLLM's ``tensor_parallel_size``, the embedded engine's TP group), else 1; a value that differs from what
    the engine reports is refused when the manager is built."""
    infer_pipeline_parallel_size: int | None = None
    """Inference pipeline-parallel size (``None``: as the engine reports, else 1)."""
    infer_expert_parallel_size: int | None = None
    """Inference expert-parallel size (``None``: 1)."""
    gpu_memory_utilization: float | None = None
    """Fraction of device memory the inference engine (weights + KV cache) may use, as vLLM's key of
    that name. ``None``: the engine's own setting stands. When set, :class:`~hybridmem.ShardingManager`
    refuses an engine built with another value (see :func:`hybridmem.engines.check_kv_utilization`)."""
    device: str = "auto"
    """Accelerator backend: one of :data:`DEVICE_CHOICES`; ``auto`` picks npu, then cuda, then cpu."""
    pin_memory: bool = True
    """Pin host arenas (ignored on backends without pinned memory, e.g. cpu)."""
    prewarm_host_buffers: bool = True
    """Allocate the host arenas in the background before the first switch needs them (see [Note: prewarmed
    arenas] in :mod:`hybridmem.offload.host_pool`)."""
    host_memory_budget_bytes: int | None = None
    """Upper bound on host bytes the buffer pool may hold; ``None`` means no bound."""
    device_memory_budget_bytes: int | None = None
    """Upper bound on device bytes a switch may reach at its peak; ``None`` uses what the device has."""
    skip_zero_grads: bool = True
    """Release all-zero gradient buffers without copying them (they are re-zeroed on onload)."""
    reshard_bucket_bytes: int = 512 * 2**20
    """Largest transfer bucket of the resharding engine; bounds its temporary memory."""
    verify_weight_sync: bool = False
    """Compare per-tensor checksums between training and the engine after each weight sync."""
    lora_base: str = LoraBase.ENGINE_SLEEPS.value
    """Where a LoRA model's base stays when its adapters alone are synced, one of :class:`LoraBase`'s values:
    ``engine_sleeps`` (default), ``engine_resident`` or ``shared``. Read only when the weight sync moves
    adapters only (:class:`~hybridmem.weight_sync.lora.LoraSync` on its adapter route)."""
    collective_deadline_s: float | None = None
    """Seconds a multi-rank weight sync's collectives have on each rank before the switch fails with
    ``CollectiveTimeoutError`` and rolls back (a peer stuck or dead); ``None``: sized from the plan (120 s
    plus the rank's bytes at 100 MB/s, see [Note: collective deadlines] in
    :mod:`hybridmem.reshard.execute`)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                _check_bool(f.name, value)
            elif f.type == "int":
                _check_positive_int(f.name, value)
            elif f.type == "int | None":
                _check_optional_positive_int(f.name, value)
        deadline = self.collective_deadline_s
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or not deadline > 0):
            raise ConfigError("collective_deadline_s", deadline, "a number of seconds > 0, or null")
        util = self.gpu_memory_utilization
        if util is not None and (isinstance(util, bool)
                                 or not isinstance(util, (int, float)) or not 0.0 < util <= 1.0):
            raise ConfigError("gpu_memory_utilization", util, "a float in (0, 1] or null")
        if self.lora_base not in {b.value for b in LoraBase}:
            raise ConfigError("lora_base", self.lora_base, f"one of {[b.value for b in LoraBase]}")
        if self.device not in DEVICE_CHOICES and not str(self.device).startswith(("cuda:", "npu:")):
            raise ConfigError("device", self.device, f"one of {DEVICE_CHOICES} or 'cuda:N' / 'npu:N'")

    @property
    def train_layout(self) -> ParallelLayout:
        """The training layout from ``*_model_parallel_size`` (an unset key counts as 1; the manager's
        copy of the config has them resolved from the training state)."""
        return ParallelLayout(
            tp=self.tensor_model_parallel_size or 1,
            pp=self.pipeline_model_parallel_size or 1,
            ep=self.expert_model_parallel_size or 1,
        )

    @property
    def infer_layout(self) -> ParallelLayout:
        """The inference layout from ``infer_*_parallel_size`` (an unset key counts as 1; the manager's copy
        of the config has them resolved from the engine)."""
        return ParallelLayout(
            tp=self.infer_tensor_parallel_size or 1,
            pp=self.infer_pipeline_parallel_size or 1,
            ep=self.infer_expert_parallel_size or 1,
        )

    def replace(self, **changes: Any) -> HybridConfig:
        """A copy with ``changes`` applied (and checked)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *,
                  source: str | None = None, strict: bool = True) -> HybridConfig:
        """Build from a flat mapping of hybridmem keys to values.

        Args:
            values: Keys are field names of this class.
            source: Where ``values`` came from, for messages (a file name).
            strict: Raise on an unknown key (the default); ``False`` skips unknown keys with one
                ``UserWarning`` attributed to the caller's line.

        Raises:
            ConfigError: An unknown key (when ``strict``; the message suggests the closest known key), or
                a known key with a bad value (the message names key, value and ``source``).
        """
        if not isinstance(values, Mapping):
            raise ConfigError("<config>", values, "a mapping of keys to values", source=source)
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [str(k) for k in values if k not in known]
        if unknown and strict:
            raise ConfigError.unknown(unknown[0], known, where="HybridConfig", source=source)
        if unknown:
            where = f" in {source}" if source else ""
            warnings.warn(f"hybridmem ignores unknown config keys{where}: {', '.join(sorted(unknown))}",
                          stacklevel=2)
        try:
            return cls(**{k: v for k, v in values.items() if k in known})
        except ConfigError as exc:
            if source is None:
                raise
            raise ConfigError(exc.key, exc.value, exc.allowed, source=source) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> HybridConfig:
        """Read a MindSpeed-RL training YAML file (see [Note: YAML sections]).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ConfigError: The file is not valid YAML, a section is not a mapping, a top-level section or a
                key of ``actor_config``/``rl_config``/``generate_config``/``hybridmem`` is unknown (the
                message names it and suggests the closest), or a value is bad.
        """
        import yaml  # noqa: PLC0415 - keeps `import hybridmem` light

        path = Path(path)
        text = path.read_text(encoding="utf-8")
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError("<yaml>", where, f"valid YAML ({problem})", source=str(path)) from exc
        if doc is None:  # nothing but comments or blank lines: most likely the wrong file
            raise ConfigError("<yaml>", str(path),
                              "a MindSpeed-RL YAML file with sections such as actor_config: "
                              "and generate_config:, not an empty one (for the defaults, use HybridConfig())",
                              message=f"{path} is empty (no YAML settings in it): give the MindSpeed-RL YAML "
                                      "file with actor_config:/generate_config: sections, or use "
                                      "HybridConfig() for the defaults")
        if not isinstance(doc, Mapping):
            raise ConfigError("<yaml>", type(doc).__name__,
                              "a mapping of sections at top level", source=str(path))
        return cls.from_dict(_merge_sections(doc, source=str(path)), source=str(path))


def _keyword_checked(init: Any) -> Any:
    """``HybridConfig.__init__`` refusing an unknown keyword with the closest known name (Python's own
    ``TypeError`` names only the keyword)."""

    @functools.wraps(init)
    def checked(self: HybridConfig, *args: Any, **kwargs: Any) -> None:
        known = [f.name for f in dataclasses.fields(HybridConfig)]
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=3, cutoff=0.6)
            hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
                    else "no known key is close")
            raise TypeError(f"HybridConfig got an unknown keyword {unknown[0]!r}: {hint} (keys: "
                            "docs/configuration.md)")
        init(self, *args, **kwargs)

    return checked


HybridConfig.__init__ = _keyword_checked(HybridConfig.__init__)  # type: ignore[method-assign]


_TRAIN_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                      "expert_model_parallel_size")
_GENERATE_KEYS = (
    "offload_train_param", "offload_train_grad", "offload_train_optimizer", "infer_tensor_parallel_size",
    "infer_pipeline_parallel_size", "infer_expert_parallel_size", "gpu_memory_utilization",
)
_HYBRIDMEM_SECTION = "hybridmem"
# (section, keys hybridmem reads from it, keys MindSpeed-RL defines there or None if not checked), in
# the order they are merged.
_SECTION_RULES: tuple[tuple[str, tuple[str, ...], frozenset[str] | None], ...] = (
    ("megatron_training", _TRAIN_LAYOUT_KEYS, None),
    ("actor_config", _TRAIN_LAYOUT_KEYS, mindspeed.MEGATRON_KEYS),
    ("rl_config", (), mindspeed.RL_KEYS),
    ("generate_config", _GENERATE_KEYS, mindspeed.GENERATE_KEYS),
)


def _merge_sections(doc: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """The hybridmem keys of a MindSpeed-RL document, merged by [Note: YAML sections]."""
    sections = sorted(mindspeed.SECTIONS | {_HYBRIDMEM_SECTION})
    for name in doc:
        if name not in sections:
            raise ConfigError.unknown(str(name), sections, where="the top level",
                                      source=source, kind="section")
    hybrid_keys = [f.name for f in dataclasses.fields(HybridConfig)]
    merged: dict[str, Any] = {}
    for section, reads, accepted in (*_SECTION_RULES, (_HYBRIDMEM_SECTION, tuple(hybrid_keys), None)):
        body = doc.get(section)
        if body is None:
            continue
        if not isinstance(body, Mapping):
            raise ConfigError(section, body, "a mapping of keys to values", source=source)
        body = {str(k).replace("-", "_"): v for k, v in body.items()}
        allowed = set(reads) | (accepted or set())
        if section == _HYBRIDMEM_SECTION or accepted is not None:
            for key in body:
                if key not in allowed:
                    _raise_misplaced_or_unknown(key, body[key], section, allowed, hybrid_keys, source)
        merged.update({k: v for k, v in body.items() if k in reads})
    return merged


def _raise_misplaced_or_unknown(key: str, value: Any, section: str, allowed: set[str], hybrid_keys: list[str],
                               source: str) -> None:
    if key in hybrid_keys:
        home = next((s for s, reads, _ in _SECTION_RULES if key in reads and s != "megatron_training"), None)
        places = f"{home} or {_HYBRIDMEM_SECTION}" if home else _HYBRIDMEM_SECTION
        raise ConfigError(
            f"{section}.{key}", value, f"{key} under {places}: MindSpeed-RL rejects it in {section}",
            source=source,
        )
    raise ConfigError.unknown(key, sorted(allowed), where=section, source=source)
