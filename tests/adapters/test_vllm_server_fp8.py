"""An engine in its own process that serves an FP8 model with 128x128 blocks ([Note: vllm fp8 server] in
:mod:`hybridmem.adapters.vllm.server.engine`): the manager's sync hands ``VLLMServerEngine`` FP8 shards and
scales, and they reach the worker through the real buckets and channel.

- In one process, without vLLM: ``VLLMServerEngine`` over a stand-in worker client that runs the worker's own
  receiving code (:func:`~hybridmem.adapters.vllm.server.receive.receive_stream` and ``StreamUpdate``, what
  vLLM's workers run, [Note: vllm receive] in :mod:`hybridmem.adapters.vllm.server.receive`) into tensors
  named, shaped and typed as vLLM's FP8 Qwen3 holds them. After every training step the worker must hold,
  bit for bit, what vLLM's own quantizer (``per_block_cast_to_fp8``, its eager body) makes of the trained
  weights, fused and cut by hand (``tests/weight_sync/_fp8_engine.py``); buckets smaller than the largest
  tensor split the e4m3 tensors.
- Refused by name: another quantization in the served config, a worker layout without the FP8 block form, a
  cast to or from e4m3 in the packer.
- vLLM's own classes built with ``quantization="fp8"`` (only the GEMM kernel choice stood in, as
  ``tests/reshard/_fp8_tasks.py``): the worker backend writing a sync into the FP8 model gives what vLLM's
  ``load_weights`` gives from the FP8 checkpoint (``tests/adapters/_vllm_fp8_transfer_program.py``), under a
  release named in ``HYBRIDMEM_VLLM_PYTHONS`` (the installed one with ``HYBRIDMEM_TESTS_FULL=1``). A real
  ``vllm serve`` cannot build FP8 layers on a CPU without AMX, so none is started here.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from hybridmem import HybridConfig, ShardingManager
from hybridmem.adapters.vllm.server import VLLMServerEngine
from hybridmem.adapters.vllm.server.buckets import dtype_name, open_buckets
from hybridmem.adapters.vllm.server.channel import WorkerChannel
from hybridmem.adapters.vllm.server.engine import check_fp8_layout
from hybridmem.adapters.vllm.server.packing import BucketWriter
from hybridmem.adapters.vllm.server.receive import StreamUpdate, receive_stream
from hybridmem.reshard.vllm_versions import SUPPORTED_VLLM_VERSIONS
from hybridmem.weight_sync import ReshardRoute, ReshardSync
from tests.adapters._transport import LocalWorker, start_transport
from tests.weight_sync._fp8_engine import CONFIG, FP8, full_weights, reference, same, train_step

transformers = pytest.importorskip("transformers")

BUCKET_NBYTES = 64 << 10
"""Smaller than the fused q/k/v and gate/up weights in e4m3 (1024 x 256: 256 KiB): split over buckets."""


class StandInWorker(LocalWorker):
    """One vLLM worker's side of the RL API in this process: its weight-transfer backend's receiving code
    (``receive_stream`` into ``StreamUpdate``) writing into ``dest``, whose names, shapes and dtypes are the
    worker's layout; generation is not offered."""

    where = "a stand-in vLLM worker"
    timeout_s = 30.0
    generate_timeout_s = 30.0

    def __init__(self, dest: dict[str, torch.Tensor]):
        super().__init__()
        self.dest = dest
        self.layout = {n: (tuple(t.shape), t.dtype) for n, t in dest.items()}
        self.info: dict[str, Any] = {}
        self.views: list[torch.Tensor] = []

    def _init_weight_transfer_engine(self, info: dict[str, Any]) -> None:
        self.info = info
        self.views = open_buckets(info["ranks"][0]["buckets"], bucket_nbytes=info["bucket_nbytes"],
                                  device=torch.device("cpu"))
        params = [[n, list(shape), dtype_name(dtype)] for n, (shape, dtype) in self.layout.items()]
        with open(os.path.join(info["layout_dir"], "layout-rank0.json"), "w") as f:
            json.dump({"rank": 0, "params": params}, f)

    def _update_weights(self, info: dict[str, Any]) -> None:
        channel = WorkerChannel(self.info["ranks"][0]["channel"], rank=0, run=self.info["run"],
                                generation=info["generation"])
        update = StreamUpdate(self.layout, run=self.info["run"], verify=info["verify"],
                              who="vLLM worker rank 0", tensors=self.dest)
        receive_stream(channel, self.views, update, wait_s=self.timeout_s)

    def _finish_weight_update(self, version: str | None) -> None:
        self.version = self.version if version is None else version

    def _start_weight_update(self) -> None:
        pass

    def _pause(self, mode: str) -> None:
        pass

    def _resume(self) -> None:
        pass


def _model(dtype: torch.dtype):
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG)).to(dtype)


def _served_config(quantization_config: Any = FP8) -> Any:
    return transformers.Qwen3Config(**CONFIG, quantization_config=quantization_config)


def _engine(dest: dict[str, torch.Tensor], directory: str, config: Any = None) -> VLLMServerEngine:
    return VLLMServerEngine(StandInWorker(dest), hf_config=config or _served_config(), accel="cpu",
                            staging_dir=directory, bucket_nbytes=BUCKET_NBYTES, timeout_s=30.0)


@pytest.fixture(scope="module")
def untrained() -> dict[str, torch.Tensor]:
    """vLLM's FP8 shard of the untrained model: the names, shapes and dtypes of its workers' layout."""
    return reference(full_weights(_model(torch.bfloat16)))


def test_every_switch_hands_the_served_fp8_model_vllms_fp8_shard_through_the_buckets(shm_directory,
                                                                                      untrained):
    model = _model(torch.bfloat16)
    want = untrained
    dest = {n: torch.zeros_like(t) for n, t in want.items()}
    engine = _engine(dest, shm_directory)
    assert engine.capabilities.reports_quantization and engine.quantization_config == FP8
    assert engine.dtype == torch.bfloat16  # of the tensors vLLM does not quantize
    largest = max(t.numel() * t.element_size() for t in want.values())
    assert largest > BUCKET_NBYTES
    assert dest["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = ShardingManager(model, engine, optimizer=opt, config=HybridConfig(device="cpu"))
    try:
        sync = manager.weight_sync
        assert isinstance(sync, ReshardSync) and sync.route is ReshardRoute.LAYOUT_STREAM
        assert sync.fp8 is not None
        for step in range(2):
            want = train_step(model, opt)
            manager.to_infer()
            wrong = [n for n, t in want.items() if not same(dest[n], t)]
            assert not wrong, (step, wrong)
            assert engine.unwritten_weights() == [] and engine.weight_version() == f"hybridmem-{step + 1}"
            stream = engine.last_stream
            # the e4m3 weights travel one byte an element, their scales four, the rest two (bf16)
            assert stream.nbytes == sum(t.numel() * t.element_size() for t in want.values()) == 1_838_976
            assert stream.num_tensors == len(want) and stream.num_handed > 2
            manager.to_train()
    finally:
        manager.close()
        engine.close()


def test_another_quantization_or_a_worker_without_the_fp8_form_is_refused_by_name(shm_directory, untrained):
    want = untrained
    for quant, match in [({"quant_method": "fp8", "activation_scheme": "dynamic"},
                          "serves has quantization_config quant_method='fp8' without weight_block_size"),
                         ({"quant_method": "awq"}, "serves has quantization_config quant_method='awq'")]:
        with pytest.raises(ValueError, match=match):
            _engine({}, shm_directory, _served_config(quant))
    # a worker holding the model in bf16 (the server was told to quantize otherwise): no scales
    plain = {n: t.to(torch.bfloat16) for n, t in want.items() if not n.endswith("_scale_inv")}
    with pytest.raises(ValueError, match=r"rank 0 at a stand-in vLLM worker holds no weight_scale_inv"):
        _engine(plain, shm_directory)
    layout = {n: (tuple(t.shape), t.dtype) for n, t in want.items()}
    scale = "model.layers.1.mlp.down_proj.weight_scale_inv"
    with pytest.raises(ValueError, match=f"w holds {scale} in torch.bfloat16; FP8 block scales are float32"):
        check_fp8_layout({**layout, scale: (layout[scale][0], torch.bfloat16)}, "w")
    weight = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match=f"beside torch.bfloat16 as {weight}; expected torch.float8_e4m3fn"):
        check_fp8_layout({**layout, weight: (layout[weight][0], torch.bfloat16)}, "w")
    del layout[weight + "_scale_inv"]
    with pytest.raises(ValueError, match=f"holds {weight} in torch.float8_e4m3fn without {weight}_scale_inv"):
        check_fp8_layout(layout, "w")


def test_the_packer_never_casts_to_or_from_e4m3(shm_directory):
    layout = {"w": ((4, 4), torch.float8_e4m3fn), "b": ((4,), torch.bfloat16)}
    dest = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in layout.items()}
    run = "hybridmem-run-fp8"
    transport = start_transport(shm_directory, layout, dest, run=run, bucket_nbytes=4096, wait_s=20.0)
    try:
        writer = BucketWriter(transport.buckets, transport.listener.accept(timeout_s=20.0), layout, run=run,
                              verify=False, ack_timeout_s=20.0)
        with pytest.raises(ValueError, match=r"w: the stream gives torch.bfloat16, the worker's layout holds "
                                             r"torch.float8_e4m3fn; an FP8 tensor is never cast"):
            writer.put("w", torch.ones(4, 4, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="b: the stream gives torch.float8_e4m3fn"):
            writer.put("b", torch.ones(4).to(torch.float8_e4m3fn))
        writer.abandon()
        transport.thread.join(20.0)
    finally:
        transport.close()
    assert transport.update.touched is False


@pytest.mark.slow
@pytest.mark.parametrize("release", SUPPORTED_VLLM_VERSIONS)
def test_vllm_fp8_classes_take_a_sync_through_the_worker_backend(tmp_path, release):
    from tests.adapters.test_vllm_transfer_versions import release_program

    report = release_program(release, "tests.adapters._vllm_fp8_transfer_program",
                             out=tmp_path / "report.json", timeout_s=1200,
                             installed_only_when_full="the installed vLLM's run takes a minute")
    assert report["fp8_tensors"] == report["scales"] > 0 and report["differ"] == []
    assert report["compared"] >= report["layout_tensors"] and report["unwritten"] == []
    assert report["stream_nbytes"] < report["bf16_nbytes"]
