"""vLLM plugin entry point: registers hybridmem's weight-transfer backend in every vLLM process.

vLLM calls ``vllm.general_plugins`` entry points in each of its processes (API server, engine core, every
worker; on its CPU build the workers are spawned, so a registration made in the trainer's process does
not reach them). ``pyproject.toml`` declares ``hybridmem = "hybridmem.adapters.vllm.plugin:register"``.
Importing this module imports neither vLLM nor torch; the backend module is imported by vLLM when a
worker creates the engine (see [Note: vllm transfer backend] in
:mod:`hybridmem.adapters.vllm.server.transfer`).
"""

from __future__ import annotations

__all__ = ["BACKEND_NAME", "BACKEND_MODULE", "BACKEND_CLASS", "register"]

BACKEND_NAME = "hybridmem"
"""The name ``WeightTransferConfig.backend`` takes to select the backend (``vllm serve
--weight-transfer-config '{"backend": "hybridmem"}'``, AsyncLLM's ``weight_transfer_config``)."""

BACKEND_MODULE = "hybridmem.adapters.vllm.server.transfer"
"""The module vLLM imports in a worker to build the backend."""

BACKEND_CLASS = "HybridmemWeightTransferEngine"


def register() -> None:
    """Register :data:`BACKEND_NAME` with vLLM's ``WeightTransferEngineFactory`` (twice is a no-op)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory  # noqa: PLC0415

    if BACKEND_NAME in getattr(WeightTransferEngineFactory, "_registry", {}):
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, BACKEND_MODULE, BACKEND_CLASS)
    except ValueError:  # registered meanwhile (the factory refuses a second registration of a name)
        pass
