"""The weight-sync interface: :class:`WeightSync`, what one sync did (:class:`SyncStats`), and the helpers
every sync uses to say what it wrote (coverage, element types).

[Note: no silent dtype change]
A weight the engine holds in another element type than the trainer differs from it (an fp32 trainer into
a bf16 engine: by up to 2^-9 relative), and in RL that is an error in the importance ratio the user cannot
see. So nothing converts on its own: the resharding engine's wire dtype defaults to the trainer's
(``ReshardSync(dtype=None)``), and with equal dtypes the engine's weights are the trainer's bit for bit.
A conversion happens only where the engine was built in another dtype (what the user asked for) or a
wire dtype was given; every sync then says so in ``SyncStats.dtype_note``, which the switch report shows
in its caption, and the first one logs a warning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hybridmem.contract.engine import InferenceEngine, capabilities_of
from hybridmem.reshard import TransferStats

__all__ = ["SyncStats", "WeightSync", "engine_unwritten", "dominant_dtype", "dtype_note", "engine_dtypes"]


@dataclass(frozen=True, slots=True)
class SyncStats(TransferStats):
    """What one weight sync did on this rank: what it moved (:class:`~hybridmem.reshard.TransferStats`; a
    stream into ``load_weights`` counts every tensor as received), and what the engine ended up with."""

    engine_nbytes: int = 0
    """Bytes of the trainer's weights this sync wrote into the engine on this rank: the resharding plan's
    local copies and the bytes received from other ranks alike (``received_nbytes`` counts the latter
    only), padding not counted. The bytes that reached the engine, which a TRL run's
    ``hybridmem/synced_bytes`` reports."""
    unwritten: tuple[str, ...] = ()
    """Engine tensors of this rank not entirely written (see [Note: weight coverage] in
    :mod:`hybridmem.weight_sync`)."""
    coverage_checked: bool = False
    """Whether ``unwritten`` is a proof (False: the engine cannot report what it received)."""
    dtype_note: str = ""
    """How the weights' element types changed on the way, when they did (see [Note: no silent dtype
    change]); empty when the engine received the trainer's dtypes unchanged."""
    route: str = ""
    """How the weights went, where a sync has several ways (a LoRA sync: the adapters only, or merged
    weights and why, see [Note: lora sync] in :mod:`hybridmem.weight_sync.lora`); the switch report shows
    it."""


def dominant_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype | None:
    """The element type holding most bytes of ``tensors`` (``None`` when there are none)."""
    nbytes: dict[torch.dtype, int] = {}
    for t in tensors:
        nbytes[t.dtype] = nbytes.get(t.dtype, 0) + t.numel() * t.element_size()
    return max(nbytes, key=nbytes.__getitem__) if nbytes else None


def dtype_note(sources: Iterable[torch.dtype], engine: Iterable[torch.dtype],
               wire: torch.dtype | None = None) -> str:
    """Describe the casts between the trainer's dtypes, the wire's and the engine's; ``""`` when there are
    none (see [Note: no silent dtype change])."""
    names = lambda dtypes: "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))  # noqa: E731
    src, dst = set(sources), set(engine)
    if not dst or (src == dst and (wire is None or {wire} == src)):
        return ""
    via = f" over a {names([wire])} wire" if wire is not None and {wire} != src else ""
    return f"weights cast: trainer {names(src)} -> engine {names(dst)}{via}"


class WeightSync(ABC):
    """Writes training weights into the engine; the TRAIN->INFER weight-sync step calls it."""

    def temp_nbytes(self) -> int:
        """Peak temporary device bytes one :meth:`sync` needs (for the memory plan)."""
        return 0

    @property
    def adapters_only(self) -> bool:
        """The sync moves a LoRA model's adapters alone: the engine's base weights stay valid from one switch
        to the next, and the trainer's frozen base is not what moves ([Note: lora base] in
        :mod:`hybridmem.switch.lora_base`). ``False`` (default): every sync writes the whole model."""
        return False

    def engine_holds_base(self) -> None:  # noqa: B027 - optional: most syncs ignore it
        """Told by the manager that the engine holds the trainer's base now (a shared base): a sync that would
        send the base first need not. The default does nothing."""

    @abstractmethod
    def sync(self) -> SyncStats:
        """Write the weights; the engine's weight storage is resumed before this is called."""

    def collective(self) -> tuple[Any, float] | None:
        """``(group, deadline_s)`` when a sync spans several ranks, which then vote on each switch's
        outcome over ``group`` ([Note: switch agreement] in :mod:`hybridmem.switch.agreement`); ``None``
        (default): this rank's sync involves no other rank."""
        return None


def engine_dtypes(engine: InferenceEngine) -> set[torch.dtype]:
    """The element types the engine holds its weights in, where it says (``describes_weights``); else
    empty."""
    dtype = engine.dtype if capabilities_of(engine).describes_weights else None
    return {dtype} if isinstance(dtype, torch.dtype) else set()


def engine_unwritten(engine: InferenceEngine) -> tuple[tuple[str, ...], bool]:
    """``(engine tensors not entirely written by load_weights, whether the engine could tell)``."""
    if not capabilities_of(engine).reports_weight_coverage:
        return (), False
    return tuple(engine.unwritten_weights()), True
