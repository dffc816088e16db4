"""hybridmem.integrations.ray on a real local Ray (CPU): placement, the process group the actors join with
torchrun's variables, errors by rank, and an actor SIGKILLed in the middle of TRAIN -> INFER (the survivors
raise within the deadline with their training state bitwise intact; the driver names the dead actor).

The tasks run in the actors are the torchrun tests' own (tests/distributed/_dead_rank_tasks.py): the same
FSDP2 job, manager and fault, placed by Ray instead of spawned.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._full import TESTS_FULL

ray = pytest.importorskip("ray")

from hybridmem.errors import ConfigError  # noqa: E402
from hybridmem.integrations.ray import (  # noqa: E402
    HybridWorker,
    HybridWorkerGroup,
    PlacementError,
    WorkerDiedError,
    WorkerGroupError,
    placement_bundles,
)
from tests.distributed import _dead_rank_tasks  # noqa: E402
from tests.distributed.fsdp_job import save_tiny_qwen2  # noqa: E402
from tests.integrations import _ray_tasks  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = str(Path(__file__).resolve().parents[2])
ENV = {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
"""The actors import the tasks from this repository's tests package."""


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Two GPUs and two NPUs declared to Ray (none here): what Ray does with a bundle's device is tested
    # without one.
    ray.init(address="local", num_cpus=4, num_gpus=2, resources={"NPU": 2}, object_store_memory=128 * 2**20,
             include_dashboard=False)
    yield
    ray.shutdown()


def test_placement_bundles_hold_one_device_each():
    assert placement_bundles(3, device="cuda", cpus_per_worker=4) == [{"CPU": 4.0, "GPU": 1.0}] * 3
    assert placement_bundles(2, device="npu", cpus_per_worker=2) == [{"CPU": 2.0, "NPU": 1.0}] * 2
    assert placement_bundles(2, device="cpu") == [{"CPU": 1.0}] * 2
    for bad, named in ((dict(world_size=0), "world_size=0"),
                       (dict(world_size=2, device="xpu"), "device='xpu'"),
                       (dict(world_size=2, cpus_per_worker=0), "cpus_per_worker=0")):
        with pytest.raises(ValueError, match=named):
            placement_bundles(**bad)


def test_actors_join_one_process_group_with_torchruns_variables(local_ray):
    with HybridWorkerGroup(HybridWorker, 2, device="cpu", env_vars=ENV) as group:
        got = group.run(_ray_tasks.environment)
        nodes = group.placements
    assert [g["dist_rank"] for g in got] == [0, 1] and [g["RANK"] for g in got] == ["0", "1"]
    assert {g["WORLD_SIZE"] for g in got} == {"2"} and {g["dist_world"] for g in got} == {2}
    assert {g["LOCAL_RANK"] for g in got} == {"0"} and {g["backend"] for g in got} == {"gloo"}
    assert ({g["MASTER_ADDR"] for g in got} == {nodes[0]["address"]}
            and len({g["MASTER_PORT"] for g in got}) == 1)
    assert [g["sum"] for g in got] == [1.0, 1.0]  # 0 + 1 over the group
    assert len({g["pid"] for g in got} | {os.getpid()}) == 3  # an actor process each, not the driver


def test_a_failing_rank_arrives_as_its_named_error(local_ray):
    with HybridWorkerGroup(HybridWorker, 2, device="cpu", env_vars=ENV) as group:
        with pytest.raises(WorkerGroupError) as info:
            group.run(_ray_tasks.raise_on, 1)
    err = info.value
    assert not isinstance(err, WorkerDiedError)
    assert isinstance(err.errors[1], ConfigError) and err.errors[1].key == "offload_train_param", err.errors
    assert err.results == {0: 0} and "rank 1 raised ConfigError" in str(err), str(err)


def test_a_group_the_cluster_cannot_place_is_refused_naming_what_it_has(local_ray):
    with pytest.raises(PlacementError, match=r"3 bundles.*GPU.*'GPU': 2\.0"):  # one GPU more than Ray has
        HybridWorkerGroup(HybridWorker, 3, device="cuda", placement_timeout_s=3)
    assert ray.available_resources().get("CPU") == 4.0  # nothing left held


@ray.remote
class _Probe:
    def visible(self, variable, resource):
        return os.environ.get(variable), ray.get_runtime_context().get_accelerator_ids()[resource]


@pytest.mark.parametrize("device,variable,resource", [("cuda", "CUDA_VISIBLE_DEVICES", "GPU"),
                                                      ("npu", "ASCEND_RT_VISIBLE_DEVICES", "NPU")])
def test_each_bundle_gives_its_actor_one_device_of_its_own(local_ray, device, variable, resource):
    """What Ray sets and hybridmem relies on (the actor's device is cuda:0, npu:0): each actor of a ``cuda``
    (``npu``) group sees one device, its bundle's, none the same."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from hybridmem.integrations.ray import worker_options

    pg = placement_group(placement_bundles(2, device=device), strategy="PACK")
    ray.get(pg.ready(), timeout=30)
    try:
        probes = [_Probe.options(**worker_options(pg, r, device=device)).remote() for r in range(2)]
        seen = ray.get([p.visible.remote(variable, resource) for p in probes], timeout=60)
    finally:
        remove_placement_group(pg)
    assert sorted(v for v, _ in seen) == ["0", "1"], seen
    assert all([v] == ids for v, ids in seen), seen


WORLD, BAD = 4, 3
DEADLINE_S, MARGIN_S = 6.0, 10.0
"""As tests/distributed/test_dead_rank.py: the sync's collective deadline, and the time a survivor may take
after it to roll back on a loaded machine."""


FULL = TESTS_FULL


# exchange: inside the weight sync (its first bucket); resume: before it (the engine taking its memory back).
@pytest.mark.parametrize("where", ["exchange", pytest.param("resume", marks=pytest.mark.skipif(
    not FULL, reason="the same fault one step earlier; HYBRIDMEM_TESTS_FULL=1 runs it"))])
def test_an_actor_killed_during_train_to_infer_fails_the_others_by_the_deadline(local_ray, tmp_path, where):
    model_dir = save_tiny_qwen2(tmp_path / "qwen2")
    with HybridWorkerGroup(HybridWorker, WORLD, device="cpu", env_vars=ENV) as group:
        with pytest.raises(WorkerDiedError) as info:
            group.run(_dead_rank_tasks.bad_rank_task, model_dir, bad_rank=BAD, how="kill", where=where,
                      call=1, direction="to_infer", deadline_s=DEADLINE_S, stall_s=DEADLINE_S + MARGIN_S)
    err = info.value
    assert list(err.died) == [BAD] and f"rank {BAD}'s actor died" in str(err), str(err)
    assert f"pid {group.placements[BAD]['pid']}" in err.died[BAD], err.died
    assert sorted(err.results) == [0, 1, 2] and not err.errors and not err.missing, str(err)
    for rank, r in err.results.items():
        assert r["error"] == "SwitchCollectiveTimeoutError" and r["collective"], (rank, r)
        assert r["seconds"] < DEADLINE_S + MARGIN_S, (rank, r["seconds"])
        assert r["phase"] == "TRAIN" and r["state_intact"], (rank, r)
    assert any(BAD in r["peers"] for r in err.results.values()), [r["peers"] for r in err.results.values()]


def test_the_group_errors_survive_pickling():
    """A driver may hand them on (to its own driver, a Ray task, a multiprocessing pool)."""
    import pickle

    died = WorkerDiedError("update", errors={0: ConfigError("offload_train_param", "maybe", "true or false")},
                           results={1: {"loss": 1.5}}, missing=[2], died={3: "node ab12, pid 7: killed"})
    back = pickle.loads(pickle.dumps(died))
    assert type(back) is WorkerDiedError and str(back) == str(died)
    assert back.died == died.died and back.results == died.results and back.missing == [2]
    assert isinstance(back.errors[0], ConfigError) and back.errors[0].key == "offload_train_param"
    placement = PlacementError([{"CPU": 1.0, "GPU": 1.0}], "PACK", {"CPU": 4.0}, 3.0)
    assert str(pickle.loads(pickle.dumps(placement))) == str(placement)
