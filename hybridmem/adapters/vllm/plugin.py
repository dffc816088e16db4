"""vLLM plugin entry point: registers hybridmem's weight-transfer backend in every vLLM process.

Both of vLLM's registries take the name :data:`BACKEND_NAME`: the worker side's
(``WeightTransferEngineFactory``: :data:`BACKEND_CLASS` of :data:`BACKEND_MODULE`) and the trainer side's
(``WeightTransferTrainerFactory``: :data:`TRAINER_CLASS` of :data:`TRAINER_MODULE`, see
[Note: vllm trainer api] in :mod:`hybridmem.adapters.vllm.server.trainer`, which also registers itself on
import: a trainer process that starts no vLLM engine never runs the plugins).

vLLM calls ``vllm.general_plugins`` entry points in each of its processes (API server, engine core, every
worker; on its CPU build the workers are spawned, so a registration made in the trainer's process does
not reach them). ``pyproject.toml`` declares ``hybridmem = "hybridmem.adapters.vllm.plugin:register"``.
Importing this module imports neither vLLM nor torch; the backend module is imported by vLLM when a
worker creates the engine (see [Note: vllm transfer backend] in
:mod:`hybridmem.adapters.vllm.server.transfer`).
"""

from __future__ import annotations

__all__ = ["BACKEND_NAME", "BACKEND_MODULE", "BACKEND_CLASS", "TRAINER_MODULE", "TRAINER_CLASS", "register",
           "register_trainer"]

BACKEND_NAME = "hybridmem"
"""The name ``WeightTransferConfig.backend`` takes to select the backend (``vllm serve
--weight-transfer-config '{"backend": "hybridmem"}'``, AsyncLLM's ``weight_transfer_config``)."""

BACKEND_MODULE = "hybridmem.adapters.vllm.server.transfer"
"""The module vLLM imports in a worker to build the backend."""

BACKEND_CLASS = "HybridmemWeightTransferEngine"

TRAINER_MODULE = "hybridmem.adapters.vllm.server.trainer"
"""The module vLLM's ``WeightTransferTrainerFactory`` imports in the trainer to build its engine."""

TRAINER_CLASS = "HybridmemTrainerWeightTransferEngine"


def register() -> None:
    """Register :data:`BACKEND_NAME` with vLLM's ``WeightTransferEngineFactory`` and
    ``WeightTransferTrainerFactory`` (twice is a no-op), and apply ``HYBRIDMEM_VLLM_BUSY_POLL_S`` where set
    (see [Note: vllm busy poll] in :mod:`hybridmem.adapters.vllm.busy_poll`)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory  # noqa: PLC0415

    _register(WeightTransferEngineFactory, BACKEND_MODULE, BACKEND_CLASS)
    register_trainer()
    from hybridmem.adapters.vllm.busy_poll import apply_busy_poll  # noqa: PLC0415

    apply_busy_poll()


def register_trainer() -> None:
    """Register :data:`BACKEND_NAME` with vLLM's ``WeightTransferTrainerFactory`` (twice is a no-op)."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory  # noqa: PLC0415

    _register(WeightTransferTrainerFactory, TRAINER_MODULE, TRAINER_CLASS)


def _register(factory: type, module: str, cls: str) -> None:
    if BACKEND_NAME in getattr(factory, "_registry", {}):
        return
    try:
        factory.register_engine(BACKEND_NAME, module, cls)  # type: ignore[attr-defined]
    except ValueError:  # registered meanwhile (the factory refuses a second registration of a name)
        pass
