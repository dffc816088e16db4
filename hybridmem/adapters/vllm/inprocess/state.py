"""The one record of a :class:`~hybridmem.adapters.vllm.VLLMEngine`'s state: where each tag's memory is, and
what the served weights hold.

Every change goes through a method of :class:`EngineState` named after what vLLM did (``slept``, ``woke``,
``loaded``...): it checks the state it starts from, then sets the new one, all fields at once; the same
change twice is a no-op. The tags vLLM's executor holds asleep are not kept apart: with a sleep mode they
are exactly the tags not resident (a sleep sends both, a wake brings one back; see [Note: vllm sleep
granularity] in :mod:`hybridmem.adapters.vllm.inprocess.sleep`).
"""

from __future__ import annotations

from enum import Enum

from hybridmem.contract.engine import check_tags
from hybridmem.contract.kinds import ENGINE_TAGS, KV_CACHE, WEIGHTS
from hybridmem.errors import PhaseError

__all__ = ["TagState", "WeightsContent", "EngineState"]


class TagState(Enum):
    """Where one tag's memory is."""

    RESIDENT = "resident"
    """Mapped on the device (vLLM awake for this tag)."""
    ON_HOST = "on_host"
    """Weights only: unmapped, contents kept in vLLM's pinned host backup (a level-1 sleep)."""
    RELEASED = "released"
    """Unmapped, contents discarded."""


class WeightsContent(Enum):
    """What the served weights hold, and what vLLM owes them before the next generation."""

    CURRENT = "current"
    """The latest weights, processed, the prefix cache consistent with them."""
    UPDATED = "updated"
    """Written in place since the last generation: the prefix cache must be reset and, for models that
    need it (``reprocess_after_update``), vLLM's post-load processing rerun."""
    REPROCESS_OWED = "reprocess_owed"
    """Written in place, the prefix cache already reset (a sleep or a KV resume did it); the post-load
    processing is still owed."""
    STALE = "stale"
    """Discarded by a sleep and not loaded since: generation is refused until a weight sync."""


class EngineState:
    """Where each tag's memory is (:class:`TagState`) and what the weights hold (:class:`WeightsContent`).

    Args:
        sleep_mode: Whether vLLM has a sleep mode (without one, release and resume only change the record).
    """

    __slots__ = ("sleep_mode", "_tags", "_content")

    def __init__(self, *, sleep_mode: bool):
        self.sleep_mode = bool(sleep_mode)
        self._tags = dict.fromkeys(ENGINE_TAGS, TagState.RESIDENT)
        self._content = WeightsContent.CURRENT

    def __getitem__(self, tag: str) -> TagState:
        return self._tags[check_tags([tag])[0]]

    @property
    def content(self) -> WeightsContent:
        return self._content

    @property
    def asleep(self) -> list[str]:
        """The tags vLLM's executor holds asleep, weights first: with a sleep mode, every tag not resident."""
        return [t for t in ENGINE_TAGS if self.sleep_mode and self._tags[t] is not TagState.RESIDENT]

    def resident(self, tag: str) -> bool:
        return self[tag] is TagState.RESIDENT

    def check_resident(self, operation: str, tag: str, hint: str) -> None:
        """Raise :class:`~hybridmem.errors.PhaseError` naming ``tag``'s state unless it is resident."""
        if self[tag] is not TagState.RESIDENT:
            raise PhaseError(operation, self[tag], hint)

    def check_serving(self, operation: str) -> None:
        """Raise :class:`~hybridmem.errors.PhaseError` unless every tag is resident and the weights valid."""
        for tag in ENGINE_TAGS:
            self.check_resident(operation, tag, f"{tag!r} is not resident; resume it first")
        if self._content is WeightsContent.STALE:
            raise PhaseError(operation, WeightsContent.STALE,
                             "the weights were discarded by a sleep, not reloaded")

    # Memory --------------------------------------------------------------------------------------------
    def slept(self, level: int) -> None:
        """``LLM.sleep(level)`` ran: both pools unmapped, the weights kept on host (level 1, which also
        resets the prefix cache) or discarded (level 2), the KV cache discarded."""
        if not self.sleep_mode or self.asleep:
            raise RuntimeError(f"vLLM sleep at level {level} recorded in state {self!r}: needs a sleep mode "
                               f"and every tag awake (vLLM's executor ignores a sleep while a tag sleeps)")
        if level == 1:
            tags = {WEIGHTS: TagState.ON_HOST, KV_CACHE: TagState.RELEASED}
            content = self._content  # LLM.sleep resets the prefix cache
            if content is WeightsContent.UPDATED:
                content = WeightsContent.REPROCESS_OWED
        else:
            tags = {WEIGHTS: TagState.RELEASED, KV_CACHE: TagState.RELEASED}
            content = WeightsContent.STALE
        self._content = content
        self._tags = tags

    def woke(self, tag: str) -> None:
        """``LLM.wake_up(tags=[tag])`` ran: ``tag`` is resident (weights back from host keep their values)."""
        if self[tag] is TagState.RESIDENT:
            return
        if not self.sleep_mode:
            raise RuntimeError(f"vLLM wake-up of {tag!r} recorded in state {self!r} without a sleep mode")
        self._tags = {**self._tags, tag: TagState.RESIDENT}

    def host_copy_dropped(self) -> None:
        """Weights parked on host (``ON_HOST``) are released: their copy is no longer kept as theirs."""
        if self._tags[WEIGHTS] is not TagState.ON_HOST:
            return
        self._content = WeightsContent.STALE
        self._tags = {**self._tags, WEIGHTS: TagState.RELEASED}

    def marked(self, tags: list[str], state: TagState) -> None:
        """Without a sleep mode: ``tags`` count as ``state`` (``RESIDENT`` or ``RELEASED``); the memory never
        moves and the weights stay valid."""
        if self.sleep_mode or state is TagState.ON_HOST:
            raise RuntimeError(f"{tags} marked {state.name} in state {self!r}: only without a sleep mode, "
                               f"as RESIDENT or RELEASED")
        self._tags = {**self._tags, **dict.fromkeys(check_tags(tags), state)}

    # Weights -------------------------------------------------------------------------------------------
    def prefix_reset(self) -> None:
        """The prefix cache was reset: an in-place update now owes only its post-load processing."""
        if self._content is WeightsContent.UPDATED:
            self._content = WeightsContent.REPROCESS_OWED

    def loaded(self) -> None:
        """Weights were loaded (processed by vLLM, the prefix cache reset): they are current."""
        self.check_resident("record loaded weights", WEIGHTS, "resume(['weights']) first")
        self._content = WeightsContent.CURRENT

    def written_in_place(self) -> None:
        """The worker's own tensors were handed out for writing: the weights are (about to be) updated."""
        self._content = WeightsContent.UPDATED

    def served(self) -> None:
        """What an in-place update owed (a prefix reset, the post-load processing) was paid."""
        if self._content in (WeightsContent.UPDATED, WeightsContent.REPROCESS_OWED):
            self._content = WeightsContent.CURRENT

    def __repr__(self) -> str:
        tags = ", ".join(f"{t}={s.value}" for t, s in self._tags.items())
        return f"EngineState({tags}, weights {self._content.value}, sleep_mode={self.sleep_mode})"
