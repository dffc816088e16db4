"""Release and resume of an in-process vLLM's memory by tag, through vLLM's sleep mode.

[Note: vllm sleep granularity]
vLLM's allocator cannot release one pool alone: a sleep unmaps both the ``"weights"`` and the
``"kv_cache"`` pools (level 1 backs the weights up to pinned host memory, level 2 discards them), while
``wake_up(tags=[...])`` re-maps one pool at a time; and the executor ignores a second ``sleep`` until
every tag is awake again. hybridmem's switch releases one tag per step (KV cache, then weights) and
resumes weights, syncs, then resumes the KV cache. The adapter maps this onto vLLM as follows:

- release of both tags, or of the weights: ``sleep(level=2)``; if the KV cache was to stay, it is woken
  again right away (its contents are dead anyway, see [Note: engine memory tags] in
  :mod:`hybridmem.contract.engine`);
- release of the KV cache alone while the weights are resident: by default ``sleep(level=2)`` too
  (:attr:`KVOnlyRelease.DISCARD_WEIGHTS`): the weights are derived state that every TRAIN->INFER switch
  rewrites, and level 2 is what verl and slime use; the weights are then marked stale, and generating
  before new weights are loaded raises. :attr:`KVOnlyRelease.OFFLOAD_WEIGHTS` uses ``sleep(level=1)``
  instead: the weights wait in host memory (state ``ON_HOST``) and ``resume(["weights"])`` restores them;
- a release while some other tag is still asleep (e.g. undoing ``resume(["weights"])`` before the KV
  cache was resumed) must first wake the sleeping tags, so that the executor accepts the sleep; this
  briefly maps their memory again and is logged. If that wake fails (say the KV cache does not fit),
  the release fails and the woken weights stay resident: the all-or-nothing promise of ``resume`` then
  cannot be kept through vLLM's public API, and the error says so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from hybridmem.accel import Accelerator
from hybridmem.adapters.vllm.inprocess.state import EngineState, TagState, WeightsContent
from hybridmem.contract.engine import check_tags
from hybridmem.contract.kinds import ENGINE_TAGS, KV_CACHE, WEIGHTS
from hybridmem.errors import add_note

__all__ = ["KVOnlyRelease", "SleepMode"]

log = logging.getLogger(__name__)


class KVOnlyRelease(Enum):
    """What ``release(["kv_cache"])`` does to the resident weights (see [Note: vllm sleep granularity])."""

    DISCARD_WEIGHTS = "discard_weights"
    """``sleep(level=2)``: weights discarded, to be rewritten by the next weight sync (fast, no host copy)."""
    OFFLOAD_WEIGHTS = "offload_weights"
    """``sleep(level=1)``: weights copied to pinned host memory and restored by ``resume(["weights"])``."""


class SleepMode:
    """Releases and resumes the tags of one ``vllm.LLM``, recording each step in ``state`` and measuring
    what each sleep frees and each wake-up takes (the accelerator's free-memory figure).

    Without a sleep mode (vLLM's CPU backend) only ``state`` changes: the memory never moves.

    Args:
        llm: The ``vllm.LLM``.
        accel: Measures the free-memory figure.
        state: The engine's state record.
        kv_only_release: See :class:`KVOnlyRelease`.
        nbytes_hint: Device bytes of each tag until a wake-up has measured them (ignored without a
            sleep mode).
    """

    def __init__(self, llm: Any, accel: Accelerator, state: EngineState, *, kv_only_release: KVOnlyRelease,
                 nbytes_hint: Mapping[str, int] | None = None):
        self.llm = llm
        self.accel = accel
        self.state = state
        self.kv_only_release = kv_only_release
        hint = dict(nbytes_hint or {}) if state.sleep_mode else {}
        check_tags(list(hint))
        self.nbytes: dict[str, int] = {t: int(hint.get(t, 0)) for t in ENGINE_TAGS}
        """Device bytes of each tag: what its last wake-up took, or the hint before any."""
        self.last_freed_nbytes = 0
        """Device bytes the last sleep freed (free-memory figure after minus before)."""

    def release(self, tags: Sequence[str]) -> None:
        """Give back the device memory of ``tags`` (see [Note: vllm sleep granularity])."""
        wanted = check_tags(tags)
        if not self.state.sleep_mode:
            self.state.marked(wanted, TagState.RELEASED)
            self.last_freed_nbytes = 0
            return
        if WEIGHTS in wanted:  # already off the device: only the record changes
            self.state.host_copy_dropped()
        to_free = {t for t in wanted if self.state.resident(t)}
        if not to_free:
            return
        # Weights whose contents must survive: resident ones not asked for, and ones parked on host.
        weights_kept = WEIGHTS not in to_free and self.state[WEIGHTS] is not TagState.RELEASED
        level = 1 if (weights_kept and self.kv_only_release is KVOnlyRelease.OFFLOAD_WEIGHTS) else 2
        kv_kept = KV_CACHE not in to_free and self.state.resident(KV_CACHE)
        self._sleep(level, rewake=[KV_CACHE] if kv_kept else [])

    def resume(self, tags: Sequence[str]) -> None:
        """Map the memory of ``tags`` again, weights before KV cache; all-or-nothing. A KV cache resumed
        after an in-place weight update resets the prefix cache."""
        order = [t for t in ENGINE_TAGS if t in check_tags(tags) and not self.state.resident(t)]
        if not self.state.sleep_mode:  # the memory never left
            self.state.marked(order, TagState.RESIDENT)
            self._reset_prefix_after_update(order)
            return
        prior = {t: self.state[t] for t in ENGINE_TAGS}
        done: list[str] = []
        try:
            for tag in order:
                self._wake([tag])
                done.append(tag)
        except BaseException as exc:
            if done:
                # Undo: put what this call woke back where it was (weights from a level-1 sleep go
                # back to host, at level 1; a KV cache that was resident before stays resident).
                level = 1 if prior[WEIGHTS] is TagState.ON_HOST else 2
                try:
                    self._sleep(level, rewake=[t for t in ENGINE_TAGS if prior[t] is TagState.RESIDENT])
                except Exception as undo_exc:  # reported on the original error
                    add_note(
                        exc,
                        f"hybridmem vLLM adapter: could not release {done} again ({undo_exc!r}): vLLM "
                        f"cannot put one tag back to sleep while another sleeps, so it had to wake "
                        f"{sorted(self.state.asleep)} first; {done} stay resident (see [Note: vllm sleep "
                        f"granularity])"
                    )
            raise
        self._reset_prefix_after_update(done)

    def resident_nbytes(self, tag: str) -> int:
        tag = check_tags([tag])[0]
        return self.nbytes[tag] if self.state.resident(tag) else 0

    def planned_nbytes(self, tag: str) -> int:
        tag = check_tags([tag])[0]
        return 0 if self.state.resident(tag) else self.nbytes[tag]

    def _reset_prefix_after_update(self, resumed: list[str]) -> None:
        if KV_CACHE in resumed and self.state.content is WeightsContent.UPDATED:
            self.llm.reset_prefix_cache()
            self.state.prefix_reset()

    def _sleep(self, level: int, *, rewake: list[str]) -> None:
        """``LLM.sleep(level)`` (both pools), waking any sleeping tag first, then waking ``rewake``."""
        asleep = self.state.asleep
        if asleep:
            # vLLM's executor ignores sleep() while any tag sleeps: wake them all first.
            log.warning(
                "hybridmem vLLM adapter: a level-%d sleep while %s sleep; waking them first (their memory is "
                "mapped again briefly, about %d bytes)",
                level, sorted(asleep), sum(self.nbytes[t] for t in asleep),
            )
            self._wake(asleep)
        free_before = self._free_nbytes()
        self.llm.sleep(level=level)
        self.last_freed_nbytes = self._free_nbytes() - free_before
        self.state.slept(level)
        self._wake(rewake)

    def _wake(self, tags: list[str]) -> None:
        """``LLM.wake_up`` for sleeping ``tags``, one at a time, measuring what each takes."""
        for tag in tags:
            free_before = self._free_nbytes()
            self.llm.wake_up(tags=[tag])
            taken = free_before - self._free_nbytes()
            if taken > 0:
                self.nbytes[tag] = taken
            self.state.woke(tag)

    def _free_nbytes(self) -> int:
        return self.accel.memory_figures().free_nbytes
