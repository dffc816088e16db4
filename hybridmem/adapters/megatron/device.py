"""Which device megatron-core can run on here, asked before it fails deep inside a CUDA call.

megatron-core (0.16.x) assumes CUDA: ``model_parallel_cuda_manual_seed``, ``DistributedDataParallel``
(streams, buffers on ``torch.cuda.current_device()``) and its optimizers call ``torch.cuda``, so on a
CPU-only torch its first such call fails with ``Torch not compiled with CUDA enabled``, which says
neither that megatron-core needs CUDA nor that there is a way to run it on CPU. :func:`megatron_device`
answers before the first of those calls, in one line that names both.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["megatron_device", "MEGATRON_CPU_HARNESS"]

MEGATRON_CPU_HARNESS = "hybridmem.testing.megatron_cpu.megatron_on_cpu()"
"""The CPU harness (tests and demos): maps megatron-core's CUDA calls to the CPU inside a ``with`` block."""


def _harness_active() -> bool:
    harness = sys.modules.get("hybridmem.testing.megatron_cpu")  # imported by whoever entered it
    return harness is not None and harness.active()


def megatron_device() -> str:
    """``"cuda"`` where torch sees a CUDA device, ``"cpu"`` inside the CPU harness
    (:data:`MEGATRON_CPU_HARNESS`); call it before megatron-core's first CUDA call (right after
    ``init_process_group``) and build the model on the device it returns.

    Raises:
        RuntimeError: No CUDA device and no CPU harness; the message names the torch build and the
            harness.
    """
    if _harness_active():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    build = ("a CPU-only build" if torch.version.cuda is None
             else f"built for CUDA {torch.version.cuda}, with no CUDA device visible")
    raise RuntimeError(
        f"megatron-core needs CUDA (its model-parallel seeding, DistributedDataParallel and optimizers call "
        f"torch.cuda), and torch {torch.__version__} here is {build} (torch.cuda.is_available() is False): "
        f"run on a CUDA machine, or, to try it on CPU, build and train the model inside "
        f"{MEGATRON_CPU_HARNESS} (a test harness that maps megatron-core's CUDA calls to the CPU)"
    )
