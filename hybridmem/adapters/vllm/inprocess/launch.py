"""How :meth:`VLLMEngine.create` builds vLLM in the calling process: the executor, what it sets meanwhile.

[Note: vllm launch]
The adapter needs vLLM's engine core and worker in the calling process (see [Note: vllm co-location] in
:mod:`hybridmem.adapters.vllm.inprocess.engine`). ``VLLMEngine.create(...,
distributed_executor_backend="auto")``, the default, picks the executor from how the program was started:

- **torchrun, or a process group already initialised** (``RANK``/``WORLD_SIZE`` in the environment, or
  ``torch.distributed.is_initialized()``): ``"external_launcher"``, one vLLM worker inside each rank,
  tensor parallel across the ranks, when ``tensor_parallel_size`` equals the world size; ``None`` (one
  in-process worker per rank, each rank its own replica) when it is 1. Other sizes are refused with a
  line naming both numbers. vLLM's ``external_launcher`` reads ``RANK`` and ``LOCAL_RANK``; where the
  group was initialised without them (``init_process_group(init_method="tcp://...")``) they are set from
  the group for the duration of the build.
- **a plain process** (``python train.py``): ``None``, vLLM's single in-process worker (TP 1; a larger
  ``tensor_parallel_size`` is refused, naming the torchrun command that runs it).

An in-process worker needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while the ``LLM`` is built (vLLM reads it
once, when it creates its engine-core client; ``external_launcher`` sets it itself). ``create`` sets what
it needs for the build only and puts every variable it set back afterwards. Building an ``LLM`` also
re-seeds Python's, NumPy's and torch's global generators (vLLM's ``seed``); ``create`` saves them before
and restores them after, so creating an engine does not change what the training code draws next.
What vLLM itself leaves in the environment (``LD_PRELOAD``, ``VLLM_WORKER_MULTIPROC_METHOD`` and a few
private variables) and the ``torch.distributed`` group its worker initialises stay as vLLM left them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from hybridmem.accel import Accelerator
from hybridmem.accel.group import rank_and_size
from hybridmem.adapters.vllm.compat import platform_is_cpu
from hybridmem.adapters.vllm.cpu_kv import cpu_kv_default
from hybridmem.adapters.vllm.source import check_model_source

log = logging.getLogger(__name__)

__all__ = ["AUTO", "Launch", "build_llm", "plan_launch", "launching"]

AUTO = "auto"
"""``distributed_executor_backend`` value that lets :func:`plan_launch` choose (see [Note: vllm launch])."""

OUT_OF_PROCESS_BACKENDS = ("mp", "ray")
"""Executors whose workers run in other processes: the adapter cannot pass tensors to them."""

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True, slots=True)
class Launch:
    """How to build the ``LLM``."""

    backend: str | None
    """``distributed_executor_backend`` to pass (``None``: vLLM's single in-process worker)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables to set while the ``LLM`` is built (restored afterwards)."""
    why: str = ""
    """How the choice was made, for logs and errors."""


def _world() -> tuple[int, int, str] | None:
    """``(world size, rank, where from)`` of the process group this process belongs to, if any."""
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        rank, size = rank_and_size()
        return size, rank, "the initialised torch.distributed group"
    if all(v in os.environ for v in _TORCHRUN_VARS):
        return int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), "torchrun (RANK/WORLD_SIZE)"
    return None


def plan_launch(requested: str | None, tensor_parallel_size: int) -> Launch:
    """The executor and environment for building an in-process ``LLM`` (see [Note: vllm launch]).

    Args:
        requested: ``distributed_executor_backend`` as the caller gave it (:data:`AUTO` to choose).
        tensor_parallel_size: vLLM's TP size.

    Raises:
        ValueError: An executor whose workers run in other processes, or a TP size the launch cannot run;
            the message names the value and what would run it.
    """
    if requested in OUT_OF_PROCESS_BACKENDS:
        raise ValueError(
            f"distributed_executor_backend={requested!r} runs vLLM's workers in other processes, where the "
            f"adapter cannot hand them weight tensors; use 'auto' (default), 'external_launcher' or None"
        )
    world = _world()
    if requested == AUTO:
        if world is None:
            if tensor_parallel_size != 1:
                raise ValueError(
                    f"tensor_parallel_size={tensor_parallel_size} needs one process per TP rank, and this is "
                    f"a plain process: start the program with `torchrun --nproc-per-node "
                    f"{tensor_parallel_size} ...` (in a plain process VLLMEngine.create runs one in-process "
                    f"vLLM worker, TP 1)"
                )
            requested, why = None, "a plain process: one in-process vLLM worker"
        else:
            size, _, source = world
            if tensor_parallel_size == 1:
                requested, why = None, f"{source}: one in-process vLLM worker per rank (a replica each)"
            elif tensor_parallel_size == size:
                requested = "external_launcher"
                why = f"{source}: one vLLM worker per rank, TP across all {size}"
            else:
                raise ValueError(
                    f"tensor_parallel_size={tensor_parallel_size} with {source} of world size {size}: "
                    f"VLLMEngine.create runs TP 1 (a replica per rank) or TP {size} (across every rank); "
                    f"pass distributed_executor_backend='external_launcher' with vLLM's data_parallel_size "
                    f"for others"
                )
    else:
        why = f"distributed_executor_backend={requested!r} as given"
    env: dict[str, str] = {}
    if requested is None:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    elif requested == "external_launcher" and world is not None and "RANK" not in os.environ:
        _, rank, _ = world
        cuda_ready = torch.cuda.is_available() and torch.cuda.is_initialized()
        local = torch.cuda.current_device() if cuda_ready else rank
        env.update(RANK=str(rank), LOCAL_RANK=str(os.environ.get("LOCAL_RANK", local)))
    return Launch(requested, env, why)


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.random.get_rng_state()}
    try:
        import numpy  # noqa: PLC0415

        states["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _restore_rng(states: Mapping[str, Any]) -> None:
    random.setstate(states["python"])
    torch.random.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy  # noqa: PLC0415

        numpy.random.set_state(states["numpy"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


@contextlib.contextmanager
def launching(launch: Launch) -> Iterator[None]:
    """Set ``launch.env`` and save the global random generators for the body; restore both after, also
    on an exception (see [Note: vllm launch])."""
    saved_env = {k: os.environ.get(k) for k in launch.env}
    rng = _rng_states()
    os.environ.update(launch.env)
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _restore_rng(rng)


def build_llm(vllm: ModuleType, launch: Launch, model_path_or_config: Any, *, accel: Accelerator,
              tensor_parallel_size: int, gpu_memory_utilization: float,
              llm_kwargs: dict[str, Any]) -> tuple[Any, str | None]:
    """Build ``vllm.LLM`` in this process by ``launch`` (:func:`plan_launch`), as :meth:`VLLMEngine.create`
    documents.

    Returns:
        The LLM, and the temporary directory a transformers config was written to for it (``None`` for a
        model directory or hub id): the caller removes it with the engine.
    """
    if accel.name == "npu" and os.environ.get("VLLM_ASCEND_ENABLE_NZ") != "0":
        # vllm-ascend's NPUWorker.wake_up refuses weights kept in FRACTAL_NZ layout, which an RL weight
        # update would corrupt.
        raise ValueError(
            "on Ascend NPUs set VLLM_ASCEND_ENABLE_NZ=0 before creating the engine: vllm-ascend keeps "
            f"weights in the FRACTAL_NZ layout otherwise, which a weight update corrupts (it is "
            f"{os.environ.get('VLLM_ASCEND_ENABLE_NZ', 'unset')!s})"
        )
    model, written = model_path_or_config, None
    if hasattr(model_path_or_config, "save_pretrained"):
        model = written = tempfile.mkdtemp(prefix="hybridmem-vllm-config-")
        model_path_or_config.save_pretrained(model)
        llm_kwargs.setdefault("load_format", "dummy")
        llm_kwargs.setdefault("skip_tokenizer_init", True)
    else:  # see [Note: vllm model source] in :mod:`hybridmem.adapters.vllm.source`
        check_model_source(str(model_path_or_config), llm_kwargs)
    on_cpu = platform_is_cpu(vllm)
    sleep_mode = not on_cpu  # the CPU backend refuses enable_sleep_mode=True
    if on_cpu:  # see [Note: vllm cpu kv default] in :mod:`hybridmem.adapters.vllm.cpu_kv`
        llm_kwargs.update(cpu_kv_default(model_path_or_config, llm_kwargs, gpu_memory_utilization))
    if llm_kwargs.pop("enable_sleep_mode", sleep_mode) is not sleep_mode:
        raise ValueError(f"VLLMEngine.create sets enable_sleep_mode={sleep_mode} on this platform; "
                         f"do not pass it")
    if launch.backend is not None:
        llm_kwargs["distributed_executor_backend"] = launch.backend
    if sleep_mode:
        llm_kwargs["enable_sleep_mode"] = True
    log.info("hybridmem vLLM adapter: %s", launch.why)
    with launching(launch):
        llm = vllm.LLM(
            model=str(model),
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            **llm_kwargs,
        )
    return llm, written
