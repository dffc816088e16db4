"""Shared fixtures. Tests mirror the package; CUDA tests skip cleanly without a GPU.

Every test passes alone and in any order (docs/testing.md): pytest-randomly shuffles the order and
reseeds ``random`` and numpy before each test; torch's global generator is reseeded here the same way, so
no test depends on what the tests before it drew, and a test that needs particular values seeds itself.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, settings

from hybridmem.testing.tiny import TinyNet

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Data generation and examples slow down several times on a loaded 2-core machine: no per-example deadline
# and no health check on generation speed (a test's own @settings still overrides these).
settings.register_profile("hybridmem", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("hybridmem")


_ENVIRONMENT_AT_START = dict(os.environ)
"""``os.environ`` before the test modules are imported."""


def _restore_environment(saved: dict[str, str]) -> None:
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


ONE_WORKER_MODULES = frozenset({
    # engines a module-scoped fixture starts (a ``vllm serve``, an AsyncLLM, a vLLM per rank, a TRL run):
    # 30 s to 4 min each on a 2-core machine
    "tests/adapters/test_vllm_serve.py",
    "tests/adapters/test_vllm_server_faults.py",
    "tests/adapters/test_vllm_server.py",
    "tests/adapters/test_vllm_real.py",
    "tests/adapters/test_vllm_real_defaults.py",
    "tests/adapters/test_vllm_lora.py",
    "tests/adapters/test_vllm_rollouts.py",
    "tests/adapters/test_vllm_names_check.py",
    "tests/integrations/test_trl.py",
    "tests/adapters/test_fsdp.py",
    "tests/integrations/test_ray_group.py",
    # worker pools a module-scoped fixture starts (4 processes importing torch, some vLLM's model classes:
    # 10-40 s each)
    "tests/reshard/test_vllm_names.py",
    "tests/reshard/test_vllm_multimodal.py",
    "tests/reshard/test_distributed.py",
    "tests/reshard/test_layout_stream.py",
    "tests/reshard/test_megatron_names.py",
    "tests/distributed/test_collective_faults.py",
    "tests/engines/test_reference_tp.py",
    "tests/engines/test_reshard_into_engine.py",
    "tests/engines/nn/test_gpt.py",
})
"""Modules whose tests share what their module-scoped fixtures start; see
:func:`pytest_xdist_make_scheduler`."""
ONE_WORKER_FOLDERS = ("tests/megatron/",)
"""Folders whose modules share session-scoped worker pools (tests/megatron/conftest.py): one worker runs
them all, so each pool starts once per run."""


def _one_worker_scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    if path in ONE_WORKER_MODULES:
        return path
    return next((folder for folder in ONE_WORKER_FOLDERS if path.startswith(folder)), nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist's default ``--dist load`` (the README's ``-n 2``), each of
    :data:`ONE_WORKER_MODULES` runs whole on one worker, so its engines start once instead of once per
    worker (and again on a worker that went to another module in between) that draws one of its tests;
    every other test is scheduled on its own, as ``load`` does. xdist's ``loadscope`` scheduler, told that
    only these modules are one scope, does this, and hands out the scopes with the most tests first (its
    ``--loadscope-reorder``), so these long units start early and the short tests fill the workers' ends.
    Other ``--dist`` modes are left alone."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling  # only under xdist

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _one_worker_scope(nodeid)

    return OneWorkerModules(config, log)


def pytest_collection_finish(session) -> None:
    """Collecting imports every test module and the libraries they import, and some set variables at import
    (``import trl`` sets ``VLLM_LOGGING_LEVEL=ERROR``, which a vLLM started by a later test would inherit):
    the tests start from the environment the run started with, whichever modules were collected."""
    _restore_environment(_ENVIRONMENT_AT_START)


@pytest.fixture(autouse=True)
def _environment():
    """``os.environ`` after each test as it was before: code a test runs in this process may set variables
    for the processes it starts (the demo's ``main`` sets ``OMP_NUM_THREADS``, ``vllm.LLM`` its own), and
    the tests after it would inherit them."""
    before = dict(os.environ)
    yield
    _restore_environment(before)


@pytest.fixture(autouse=True)
def _torch_seed(request) -> None:
    """torch's global seed before each test: pytest-randomly's seed of the run (0 without it) plus a hash
    of the test's id, as pytest-randomly seeds ``random`` and numpy; ``-p randomly --randomly-seed=N``
    replays a run's values."""
    base = request.config.getoption("randomly_seed", default=None)
    torch.manual_seed(
        ((base if isinstance(base, int) else 0) + zlib.crc32(request.node.nodeid.encode())) % 2**32)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])])
def device(request) -> str:
    """Each test using it runs on CPU always and on CUDA when a GPU is present."""
    return request.param


@pytest.fixture
def tiny_setup():
    """Factory: ``(model, optimizer)`` for an optimizer name ("adamw" or "sgd") on a device."""

    def build(device: str = "cpu", optimizer: str = "adamw", seed: int = 0):
        torch.manual_seed(seed)
        model = TinyNet().to(device)
        if optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        elif optimizer == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        else:
            raise ValueError(f"optimizer={optimizer!r}")
        return model, opt

    return build
