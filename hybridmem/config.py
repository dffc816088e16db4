"""Configuration: :class:`HybridConfig` (MindSpeed-RL's keys) and :class:`ParallelLayout`.

Keys keep MindSpeed-RL's names so a user's existing YAML file drives hybridmem unchanged
(``actor_config:`` holds the training layout, ``generate_config:`` the inference layout and the
``offload_train_*`` switches). Keys hybridmem adds live in an optional ``hybridmem:`` section.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridmem.errors import ConfigError

__all__ = ["ParallelLayout", "HybridConfig", "DEVICE_CHOICES"]

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")

# Sections of a MindSpeed-RL YAML file hybridmem reads, in the order they are merged.
_YAML_SECTIONS = ("actor_config", "rl_config", "integrated_mode_config", "generate_config", "hybridmem")


def _check_positive_int(key: str, value: object, *, source: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "a positive int", source=source)


def _check_bool(key: str, value: object, *, source: str | None = None) -> None:
    if not isinstance(value, bool):
        raise ConfigError(key, value, "true or false", source=source)


def _check_optional_nbytes(key: str, value: object, *, source: str | None = None) -> None:
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
    tensor_model_parallel_size: int = 1
    """Training tensor-parallel size (MindSpeed-RL ``actor_config``)."""
    pipeline_model_parallel_size: int = 1
    """Training pipeline-parallel size."""
    expert_model_parallel_size: int = 1
    """Training expert-parallel size."""
    infer_tensor_parallel_size: int = 1
    """Inference tensor-parallel size (MindSpeed-RL ``generate_config``)."""
    infer_pipeline_parallel_size: int = 1
    """Inference pipeline-parallel size."""
    infer_expert_parallel_size: int = 1
    """Inference expert-parallel size."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the inference engine (weights + KV cache) may use, as in vLLM."""
    device: str = "auto"
    """Accelerator backend: one of :data:`DEVICE_CHOICES`; ``auto`` picks npu, then cuda, then cpu."""
    pin_memory: bool = True
    """Pin host arenas (ignored on backends without pinned memory, e.g. cpu)."""
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
    use_integrated_worker: bool = True
    """MindSpeed-RL ``rl_config``: actor, reference and rollout share the same devices."""
    ref_forward_micro_batch_size: int = 1
    """MindSpeed-RL ``rl_config``: micro-batch size of reference log-prob computation."""
    actor_forward_micro_batch_size: int = 1
    """MindSpeed-RL ``rl_config``: micro-batch size of old-policy log-prob computation."""
    ref_model_load_path: str | None = None
    """MindSpeed-RL ``integrated_mode_config``: where to load reference weights from, if not the actor."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                _check_bool(f.name, value)
            elif f.type == "int":
                _check_positive_int(f.name, value)
            elif f.type == "int | None":
                _check_optional_nbytes(f.name, value)
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(
            self.gpu_memory_utilization, (int, float)
        ) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization", self.gpu_memory_utilization, "a float in (0, 1]")
        if self.device not in DEVICE_CHOICES and not str(self.device).startswith(("cuda:", "npu:")):
            raise ConfigError("device", self.device, f"one of {DEVICE_CHOICES} or 'cuda:N' / 'npu:N'")
        if self.ref_model_load_path is not None and not isinstance(self.ref_model_load_path, str):
            raise ConfigError("ref_model_load_path", self.ref_model_load_path, "a path string or null")

    @property
    def train_layout(self) -> ParallelLayout:
        """The training layout from ``*_model_parallel_size``."""
        return ParallelLayout(
            tp=self.tensor_model_parallel_size,
            pp=self.pipeline_model_parallel_size,
            ep=self.expert_model_parallel_size,
        )

    @property
    def infer_layout(self) -> ParallelLayout:
        """The inference layout from ``infer_*_parallel_size``."""
        return ParallelLayout(
            tp=self.infer_tensor_parallel_size,
            pp=self.infer_pipeline_parallel_size,
            ep=self.infer_expert_parallel_size,
        )

    def replace(self, **changes: Any) -> HybridConfig:
        """A copy with ``changes`` applied (and checked)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str | None = None) -> HybridConfig:
        """Build from a flat mapping of keys to values.

        Unknown keys are ignored with one ``UserWarning`` that lists them.

        Raises:
            ConfigError: A known key has a bad value (the message names key, value and ``source``).
        """
        if not isinstance(values, Mapping):
            raise ConfigError("<config>", values, "a mapping of keys to values", source=source)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            where = f" in {source}" if source else ""
            warnings.warn(f"hybridmem ignores unknown config keys{where}: {', '.join(unknown)}", stacklevel=2)
        try:
            return cls(**{k: v for k, v in values.items() if k in known})
        except ConfigError as exc:
            if source is None:
                raise
            raise ConfigError(exc.key, exc.value, exc.allowed, source=source) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> HybridConfig:
        """Read a MindSpeed-RL style YAML file.

        Keys are taken from the ``actor_config``, ``rl_config``, ``integrated_mode_config``,
        ``generate_config`` and ``hybridmem`` sections; a key in a later section of that list wins.
        Other sections (``megatron_training``, ``defaults``, ...) are not hybridmem's and are skipped
        silently; unknown keys inside the sections read are ignored with a warning.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ConfigError: The file is not valid YAML, a section is not a mapping, or a value is bad.
        """
        import yaml

        path = Path(path)
        text = path.read_text(encoding="utf-8")
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError("<yaml>", where, f"valid YAML ({problem})", source=str(path)) from exc
        if doc is None:
            doc = {}
        if not isinstance(doc, Mapping):
            raise ConfigError("<yaml>", type(doc).__name__, "a mapping of sections at top level", source=str(path))
        merged: dict[str, Any] = {}
        for section in _YAML_SECTIONS:
            body = doc.get(section)
            if body is None:
                continue
            if not isinstance(body, Mapping):
                raise ConfigError(section, body, "a mapping of keys to values", source=str(path))
            merged.update(_flatten_section(section, body))
        return cls.from_dict(merged, source=str(path))


# MindSpeed-RL keys in the sections hybridmem reads that belong to other parts of a training job
# (the optimizer, the data, vLLM's scheduler). They are expected there, so they are not warned about.
_FOREIGN_KEYS = frozenset(
    {
        "model", "micro_batch_size", "lr", "lr_decay_style", "min_lr", "weight_decay", "lr_warmup_fraction",
        "clip_grad", "adam_beta1", "adam_beta2", "finetune", "load", "save", "no_load_optim", "no_load_rng",
        "guarantee_order", "blocking", "gamma", "lam", "adv_estimator", "kl_penalty", "kl_ctrl_type",
        "init_kl_coef", "mini_batch_size", "max_prompt_length", "epochs", "clip_ratio", "entropy_coeff",
        "shuffle_minibatch", "n_samples_per_prompt", "rule_reward", "verifier_function", "verifier_weight",
        "num_cpus_for_local_task", "use_tensorboard", "actor_resource", "trust_remote_code", "max_num_seqs",
        "max_model_len", "max_num_batched_tokens", "dtype", "sampling_config", "enforce_eager",
        "enable_prefix_caching", "num_scheduler_steps", "limit_mm_image_per_prompt", "use_wandb",
        "wandb_project", "wandb_exp_name", "wandb_save_dir", "tokenizer_name_or_path",
    }
)


def _flatten_section(section: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """Drop the section's keys that belong to other parts of a MindSpeed-RL job."""
    return {k: v for k, v in body.items() if k not in _FOREIGN_KEYS}
