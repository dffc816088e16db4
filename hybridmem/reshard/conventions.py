"""What each side of a layout names and shards its own way (:class:`Side` and its conventions), and where a
rank sits in a layout (:class:`RankCoords`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hybridmem.reshard.fp8 import check_block
from hybridmem.reshard.stages import check_stage_layers
from hybridmem.reshard.vllm_versions import VLLM_NAMES, VLLMNames, resolve_vllm_version

__all__ = ["Side", "MegatronConvention", "VLLMConvention", "HFConvention", "RankCoords"]


class Side(Enum):
    """Which engine's naming and sharding a layout follows."""

    MEGATRON = "megatron"
    """Megatron-core GPTModel parameter names (training)."""
    VLLM = "vllm"
    """vLLM model parameter names and sharded shapes (inference)."""
    HF = "hf"
    """Unsharded HF names, every rank of a pipeline stage holding full tensors (``load_weights``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronConvention:
    """Megatron-core options that change names or shapes."""

    make_vocab_size_divisible_by: int = 128
    """Vocab is padded to a multiple of this times tp (Megatron's ``--make-vocab-size-divisible-by``)."""
    padded_vocab_size: int | None = None
    """The padded vocab rows over all TP ranks as the model holds them (``args.padded_vocab_size``, the
    ``vocab_size`` a GPTModel was built with); overrides ``make_vocab_size_divisible_by`` when set."""
    norm_style: str = "local"
    """``"local"``: ``input_layernorm``/``pre_mlp_layernorm``; ``"te"``: fused into
    ``linear_qkv.layer_norm_weight``/``linear_fc1.layer_norm_weight`` (Transformer Engine spec)."""
    stage_layers: tuple[int, ...] | None = None
    """Layers of each pipeline stage, first to last (see [Note: uneven stages] in
    :mod:`hybridmem.reshard.stages`); ``None``: the same number on every stage (``pp`` must divide the
    layers)."""

    def __post_init__(self) -> None:
        check_stage_layers(self.stage_layers)
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} must be >= 1")
        if self.padded_vocab_size is not None and self.padded_vocab_size < 1:
            raise ValueError(f"padded_vocab_size={self.padded_vocab_size} must be >= 1")
        if self.norm_style not in ("local", "te"):
            raise ValueError(f"norm_style={self.norm_style!r}; expected 'local' or 'te'")


@dataclass(frozen=True, kw_only=True, slots=True)
class VLLMConvention:
    """vLLM options that change names or shapes."""

    vocab_padding: int = 64
    """``VocabParallelEmbedding`` pads the vocab to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE)."""
    version: str | None = None
    """The vLLM release series the names follow, one of :data:`SUPPORTED_VLLM_VERSIONS` (a full version
    such as ``"0.33.0"`` is accepted); ``None``: decided by :func:`vllm_layout` (see
    [Note: vLLM versions] in :mod:`hybridmem.reshard.vllm_versions`)."""
    stage_layers: tuple[int, ...] | None = None
    """Layers of each pipeline stage, as ``VLLM_PP_LAYER_PARTITION`` gives them to vLLM (see [Note: uneven
    stages] in :mod:`hybridmem.reshard.stages`); ``None``: that variable of this process's environment when
    set, else vLLM's own split."""
    weight_block_size: tuple[int, int] | None = None
    """The engine holds its linear layers in FP8 with one float32 scale per block of this shape (vLLM's
    ``Fp8Config(weight_block_size=[128, 128])``; only ``(128, 128)``), each quantized weight beside its
    ``weight_scale_inv`` (see [Note: fp8 block layout] in :mod:`hybridmem.reshard.fp8`); ``None``: the
    weights as the model's dtype."""

    def __post_init__(self) -> None:
        check_stage_layers(self.stage_layers)
        if self.weight_block_size is not None:
            object.__setattr__(self, "weight_block_size", check_block(self.weight_block_size))
        if self.vocab_padding < 1:
            raise ValueError(f"vocab_padding={self.vocab_padding} must be >= 1")
        if self.version is not None:
            resolve_vllm_version(self.version)

    def padded_vocab(self, vocab_size: int) -> int:
        """``vocab_size`` rounded up to a multiple of :attr:`vocab_padding`, the rows a
        ``VocabParallelEmbedding`` (or its head) of that vocabulary holds over all ranks."""
        return -(-vocab_size // self.vocab_padding) * self.vocab_padding

    @property
    def names(self) -> VLLMNames:
        """The release's name table (the version must be set)."""
        if self.version is None:
            raise ValueError("VLLMConvention.version is None; build the layout with vllm_layout()")
        return VLLM_NAMES[resolve_vllm_version(self.version)]


@dataclass(frozen=True, kw_only=True, slots=True)
class HFConvention:
    """HF-full layout: what each vLLM pipeline stage loads, by HF name (see :func:`hf_layout`)."""

    every_stage: bool = False
    """Embedding, final norm and head on every stage (the vLLM release builds them so for this family)."""
    stage_layers: tuple[int, ...] | None = None
    """Layers of each pipeline stage, as the vLLM engine splits them (see :class:`VLLMConvention`)."""


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Where one rank sits in a layout."""

    tp_rank: int
    tp: int
    pp_rank: int
    pp: int
    moe_tp_rank: int
    moe_tp: int
    ep_rank: int
    ep: int
    layers: tuple[int, ...]
    """Global indices of the decoder layers on this rank's stage, ascending."""

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1
