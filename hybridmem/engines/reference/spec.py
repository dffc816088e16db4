"""TPShard: how tensor parallelism splits a Llama/Qwen2 decoder (a :class:`~hybridmem.reshard.ModelSpec` the
embedded blocks run, see :func:`hybridmem.engines.nn.config.embedded_spec`).

:class:`TPShard` holds the per-rank sizes vLLM uses for the model at a tensor-parallel size (see
[Note: vLLM per-rank layout] in :mod:`hybridmem.engines.reference.layout`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmem.reshard.spec import ModelSpec

__all__ = ["TPShard", "VOCAB_PADDING", "pad_vocab", "tp_shard"]

VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the embedding and LM head are padded to a multiple of it."""


def pad_vocab(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    """``vocab_size`` rounded up to a multiple of ``pad_to`` (vLLM's ``pad_vocab_size``)."""
    return -(-vocab_size // pad_to) * pad_to


@dataclass(frozen=True, kw_only=True, slots=True)
class TPShard:
    """What rank ``tp_rank`` of ``tp_size`` holds, as vLLM's parallel layers split it.

    Query heads and the MLP are split evenly. KV heads are split evenly when ``tp_size <= num_kv_heads``;
    otherwise each rank holds ONE kv head, replicated over ``tp_size // num_kv_heads`` ranks, and rank
    ``r`` holds kv head ``r // num_kv_head_replicas`` (vLLM ``QKVParallelLinear``).
    """

    spec: ModelSpec
    """The model."""
    tp_size: int
    """Tensor-parallel size."""
    tp_rank: int
    """This rank."""

    def __post_init__(self) -> None:
        s = self.spec
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size!r} must be a positive int")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} must be in [0, {self.tp_size})")
        if s.num_attention_heads % self.tp_size:
            raise ValueError(f"num_attention_heads={s.num_attention_heads} is not divisible by "
                             f"tp_size={self.tp_size}")
        if s.num_key_value_heads % self.tp_size and self.tp_size % s.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={s.num_key_value_heads} and tp_size={self.tp_size}: one must divide "
                "the other"
            )
        if s.intermediate_size % self.tp_size:
            raise ValueError(
                f"intermediate_size={s.intermediate_size} is not divisible by tp_size={self.tp_size}"
            )
        if self.padded_vocab_size % self.tp_size:
            raise ValueError(
                f"padded vocab {self.padded_vocab_size} is not divisible by tp_size={self.tp_size}"
            )

    @property
    def num_heads(self) -> int:
        """Query heads on this rank."""
        return self.spec.num_attention_heads // self.tp_size

    @property
    def num_kv_head_replicas(self) -> int:
        """How many ranks hold each kv head (1 unless ``tp_size > num_kv_heads``)."""
        return max(1, self.tp_size // self.spec.num_key_value_heads)

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank."""
        return max(1, self.spec.num_key_value_heads // self.tp_size)

    @property
    def kv_head_start(self) -> int:
        """Global index of this rank's first kv head."""
        return (self.tp_rank // self.num_kv_head_replicas) * self.num_kv_heads

    @property
    def intermediate_size(self) -> int:
        """MLP width on this rank."""
        return self.spec.intermediate_size // self.tp_size

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded to :data:`VOCAB_PADDING` (all ranks together)."""
        return pad_vocab(self.spec.vocab_size)

    @property
    def vocab_rows(self) -> int:
        """Embedding / LM-head rows on this rank (``padded_vocab_size // tp_size``)."""
        return self.padded_vocab_size // self.tp_size


def tp_shard(spec: ModelSpec, tp_size: int, tp_rank: int) -> TPShard:
    """Per-rank sizes of ``spec`` at tensor-parallel size ``tp_size`` (see :class:`TPShard`)."""
    return TPShard(spec=spec, tp_size=tp_size, tp_rank=tp_rank)
