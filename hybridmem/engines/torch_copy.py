"""TorchCopyEngine: an inference "engine" that is a same-layout copy of a torch module.

It is the simplest engine that honours the :class:`~hybridmem.contract.engine.InferenceEngine`
contract for real: its weights are storage that is released and resumed, ``load_weights`` writes the
training weights into it by name, and an optional KV-cache pool is released and re-taken on every
switch. It runs the copied module's ``forward`` for inference. Use it for models whose inference layout
equals their training layout (no resharding), for tests, and for the switch-latency benchmark.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from enum import Enum
from typing import Any

import torch

from hybridmem.contract.engine import EngineCapabilities, check_tags
from hybridmem.contract.kinds import ENGINE_TAGS, KV_CACHE, WEIGHTS
from hybridmem.errors import PhaseError

__all__ = ["TorchCopyEngine", "EngineMemoryState"]


class EngineMemoryState(Enum):
    """Where one tag's memory is."""

    RESIDENT = "resident"
    """The tag's storages hold device memory."""
    RELEASED = "released"
    """The tag's storages are resized to 0 bytes; contents are gone (see [Note: engine memory tags] in
    :mod:`hybridmem.contract.engine`)."""


class TorchCopyEngine:
    """A released-by-default copy of ``module`` used as the inference engine.

    Args:
        module: The training model; it is deep-copied (grads dropped), then the copy's storage is
            released, so construction briefly needs one extra copy of the weights.
        kv_cache_nbytes: Size of a scratch KV-cache pool taken on ``resume(["kv_cache"])``.
    """

    loads_training_names = True
    """Its ``load_weights`` takes the training model's own names and layout (it is a copy of the module),
    so the default weight sync streams the training state's ``named_weights()`` into it as they are."""
    capabilities = EngineCapabilities(writes_in_place=True, reports_weight_coverage=True,
                                      reports_residency=True, loads_training_names=True, binds_phase=True)
    """See [Note: engine capabilities] in :mod:`hybridmem.contract.engine`."""

    def __init__(self, module: torch.nn.Module, *, kv_cache_nbytes: int = 0):
        if kv_cache_nbytes < 0:
            raise ValueError(f"kv_cache_nbytes={kv_cache_nbytes} must be >= 0")
        self.module = copy.deepcopy(module).eval()
        for p in self.module.parameters():
            p.grad = None
            p.requires_grad_(False)
        first = next(iter(self.module.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._tensors = dict(self.module.named_parameters())
        self._tensors.update(self.module.named_buffers())
        storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in self._tensors.values()}
        self._weight_storages = [(s, s.nbytes()) for s in storages.values()]
        self.kv_cache = torch.empty(kv_cache_nbytes, dtype=torch.uint8, device=self.device)
        self._kv_nbytes = kv_cache_nbytes
        self._state = {WEIGHTS: EngineMemoryState.RESIDENT, KV_CACHE: EngineMemoryState.RESIDENT}
        self._written: set[str] = set()
        self._phase: Any = None
        self.release(list(ENGINE_TAGS))

    # InferenceEngine ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each ``(name, tensor)`` into the weight of that name.

        Raises:
            PhaseError: The weights are released.
            KeyError: A name the engine does not have.
            ValueError: A shape that does not match.
        """
        if self._state[WEIGHTS] is not EngineMemoryState.RESIDENT:
            raise PhaseError("load weights", self._state[WEIGHTS], "resume(['weights']) first")
        with torch.no_grad():
            for name, tensor in weights:
                dst = self._tensors.get(name)
                if dst is None:
                    raise KeyError(f"engine has no weight {name!r} (it has {len(self._tensors)}, e.g. "
                                   f"{next(iter(self._tensors), None)!r})")
                if dst.shape != tensor.shape:
                    raise ValueError(f"weight {name!r}: engine shape {tuple(dst.shape)} != given "
                                     f"{tuple(tensor.shape)}")
                dst.copy_(tensor)
                self._written.add(name)

    def release(self, tags: Sequence[str]) -> None:
        """Free every storage of ``tags``, whatever state the tag is in (an interrupted resume may have
        grown some; see [Note: switch transactions] in :mod:`hybridmem.switch.transaction`). Idempotent."""
        for tag in check_tags(tags):
            for storage, _ in self._storages(tag):
                storage.resize_(0)
            self._state[tag] = EngineMemoryState.RELEASED

    def resume(self, tags: Sequence[str]) -> None:
        """Re-allocate the storage of ``tags`` (contents undefined); all-or-nothing."""
        done: list[tuple[torch.UntypedStorage, int]] = []
        resumed: list[str] = []
        try:
            for tag in check_tags(tags):
                if self._state[tag] is EngineMemoryState.RESIDENT:
                    continue
                for storage, nbytes in self._storages(tag):
                    storage.resize_(nbytes)
                    done.append((storage, nbytes))
                resumed.append(tag)
        except BaseException:
            for storage, _ in done:
                storage.resize_(0)
            raise
        for tag in resumed:
            self._state[tag] = EngineMemoryState.RESIDENT
            if tag == WEIGHTS:
                self._written.clear()

    # Optional protocol methods --------------------------------------------------------------------
    def resident_nbytes(self, tag: str) -> int:
        """Device bytes held under ``tag`` now."""
        return sum(s.nbytes() for s, _ in self._storages(check_tags([tag])[0]))

    def planned_nbytes(self, tag: str) -> int:
        """Device bytes ``resume([tag])`` allocates."""
        return sum(n for _, n in self._storages(check_tags([tag])[0]))

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine's weight tensors by name (for in-place weight sync)."""
        return iter(self._tensors.items())

    def state(self, tag: str) -> EngineMemoryState:
        """Where ``tag``'s memory is."""
        return self._state[check_tags([tag])[0]]

    def unwritten_weights(self) -> list[str]:
        """Weights not written by :meth:`load_weights` since the weights were last resumed (see
        [Note: weight coverage] in :mod:`hybridmem.weight_sync`)."""
        return [name for name in self._tensors if name not in self._written]

    def bind_phase(self, phase: Any) -> None:
        """Name ``phase()`` (the owning manager's phase) when refusing work outside INFER."""
        self._phase = phase

    # Inference ------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the copied module's forward.

        Raises:
            PhaseError: The weights are released (the manager is not in INFER).
        """
        if self._state[WEIGHTS] is not EngineMemoryState.RESIDENT:
            if self._phase is not None:
                raise PhaseError("run the engine", self._phase(), "its weights are released; use it inside "
                                                                  "`with manager.inference()`")
            raise PhaseError("run the engine", self._state[WEIGHTS], "its weights are released; use it "
                                                                     "inside inference()")
        return self.module(*args, **kwargs)

    def _storages(self, tag: str) -> list[tuple[torch.UntypedStorage, int]]:
        if tag == WEIGHTS:
            return self._weight_storages
        return [(self.kv_cache.untyped_storage(), self._kv_nbytes)] if self._kv_nbytes else []
