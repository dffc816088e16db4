"""Test-only harness: run real megatron-core code on a machine without CUDA.

Megatron-core (0.16.x) assumes CUDA in a handful of places:
factories with ``device=torch.cuda.current_device()`` or ``device='cuda'``, ``.cuda()`` and
``.pin_memory()``, ``param.type() == 'torch.cuda.FloatTensor'`` checks in the optimizers,
``torch.cuda.Stream``/``Event``/``stream()`` in DDP and the MoE dispatcher, the CUDA RNG tracker, and
``te_general_gemm`` referenced without Transformer Engine, and multi-latent attention's ``HAVE_TE`` set
by Transformer Engine stand-ins. :func:`megatron_on_cpu` maps each of those
to the CPU for the duration of a ``with`` block and restores everything on exit.

Never use this in library code paths: it changes process-wide behaviour of ``torch.cuda`` and of every
tensor factory. It is for tests and the CPU demo only.

[Note: CUDA RNG on CPU]
Megatron's ``CudaRNGStatesTracker`` keeps named RNG states and forks into them around dropout and
weight init in tensor-parallel regions. On CPU there is one generator, the CPU default one, so the
harness makes "the CUDA RNG" that generator: ``get_rng_state``/``set_rng_state``/``manual_seed``
act on it. Forking into a tracked state and back then behaves as on CUDA (the outer stream of random
numbers is unchanged by a fork), which keeps runs deterministic.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["megatron_on_cpu", "active", "CpuDeviceMode"]


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # torch.cuda.current_device() returns an int: a CUDA ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


_CPU_TYPE_TO_CUDA = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
}


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU in every torch call, and makes ``.cuda()``/``.pin_memory()``
    return the tensor itself; ``tensor.type()`` (no argument) answers with the CUDA type name so
    Megatron's dtype checks (``param.type() == 'torch.cuda.FloatTensor'``) pass."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.autograd.backward, torch.autograd.grad):
            # torch >= 2.13 routes autograd.backward/grad through torch-function modes, and a mode is
            # popped while its handler runs: the whole backward pass (which re-runs autograd
            # Functions' Python code, e.g. Megatron's all-to-all) would run without this mode. Run it
            # under a fresh instance, with the Python-level override check of torch.autograd off so
            # the fresh mode does not intercept the same call again.
            saved = torch.autograd.has_torch_function
            torch.autograd.has_torch_function = lambda *a: False
            try:
                with CpuDeviceMode():
                    return func(*args, **kwargs)
            finally:
                torch.autograd.has_torch_function = saved
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CPU_TYPE_TO_CUDA.get(name, name)
        if func is torch.Tensor.is_pinned:
            return False
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _Event:
    """A CPU stand-in for ``torch.cuda.Event``: everything is already complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def record(self, stream: Any = None) -> None:
        del stream

    def wait(self, stream: Any = None) -> None:
        del stream

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        del other
        return 0.0


class _Stream:
    """A CPU stand-in for ``torch.cuda.Stream``: work runs in program order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_stream(self, other: Any) -> None:
        del other

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _Stream()


def _move_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """CPU version of ``moe_utils.maybe_move_tensor_to_cpu``: every tensor counts as a device tensor."""
    del record_stream
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().numpy()
    return tensor


def _cuda_patches() -> list[tuple[Any, str, Any]]:
    """(object, attribute, replacement) for every CUDA entry point Megatron touches on our paths."""
    cuda = torch.cuda
    patches: list[tuple[Any, str, Any]] = [
        (cuda, "current_device", lambda: 0),
        (cuda, "device_count", lambda: 1),
        (cuda, "set_device", lambda device: None),
        (cuda, "synchronize", lambda device=None: None),
        (cuda, "empty_cache", lambda: None),
        (cuda, "Stream", _Stream),
        (cuda, "Event", _Event),
        (cuda, "stream", lambda stream=None: contextlib.nullcontext()),
        (cuda, "current_stream", lambda device=None: _DEFAULT_STREAM),
        (cuda, "default_stream", lambda device=None: _DEFAULT_STREAM),
        # The CPU default generator is the CUDA one ([Note: CUDA RNG on CPU]).
        (cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
        (cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state)),
        # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly.
        (cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(seed)),
        (cuda, "manual_seed_all", lambda seed: None),
        (cuda.random, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
    ]
    from megatron.core.tensor_parallel import random as mrandom  # noqa: PLC0415 - Megatron is optional

    patches += [
        (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        (mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
    ]
    from megatron.core.transformer.moe import (  # noqa: PLC0415 - Megatron is optional
        moe_utils,
        token_dispatcher,
    )

    # The all-to-all dispatcher moves its split sizes "to CPU as numpy" only when they are CUDA
    # tensors; on CPU they would stay tensors, which all_to_all_single rejects as split sizes.
    patches += [
        (mod, "maybe_move_tensor_to_cpu", _move_to_host)
        for mod in (moe_utils, token_dispatcher)
        if hasattr(mod, "maybe_move_tensor_to_cpu")
    ]

    if not hasattr(moe_utils, "te_general_gemm"):
        # 0.16.1 imports it inside a try without a fallback: a NameError without Transformer Engine.
        patches.append((moe_utils, "te_general_gemm", None))
    from megatron.core.transformer import (  # noqa: PLC0415 - Megatron is optional
        multi_latent_attention as mla,
    )

    if not _transformer_engine_installed():
        # megatron.core.extensions.transformer_engine imports without Transformer Engine (it stubs it with
        # MagicMocks), so MLA's HAVE_TE is True and isinstance(..., TELinear) fails on the mock.
        patches.append((mla, "HAVE_TE", False))
    return patches


def _transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


_MISSING = object()


def active() -> bool:
    """Whether a :func:`megatron_on_cpu` block is running (its stand-in CUDA streams are in place)."""
    return torch.cuda.Stream is _Stream


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Run Megatron-core on CPU inside the block (see the module docstring); restores on exit.

    Build the model, DDP wrapper and optimizer *inside* the block as well as training with them:
    construction allocates buffers on ``torch.cuda.current_device()`` and creates streams.

    Raises:
        ImportError: megatron-core is not installed.
    """
    patches = _cuda_patches()
    saved = [(obj, name, getattr(obj, name, _MISSING)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        with CpuDeviceMode():
            yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
