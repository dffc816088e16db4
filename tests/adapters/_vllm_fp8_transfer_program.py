"""The server adapter's weight transfer into vLLM's own FP8 model classes, as a program of its own:
``python -m tests.adapters._vllm_fp8_transfer_program OUT.json`` (from the repository root), run by
test_vllm_server_fp8.py under each vLLM release it finds.

No vLLM engine runs (vLLM builds FP8 linear layers on a CPU only with its AMX kernel): a dense Qwen3 (dims
multiples of 128) is built twice with the installed vLLM's classes and ``quantization="fp8"``, 128x128 blocks,
only the ScaledMM kernel choice stood in (``tests/reshard/_fp8_tasks.py``), each loaded as vLLM's loader
loads it (``load_weights``, then ``process_weights_after_loading``):

- A, the reference, from the FP8 checkpoint vLLM's own quantizer (``per_block_cast_to_fp8``) makes of random
  bf16 weights (``tests/reshard/_fp8_program.py``);
- B from the FP8 checkpoint of the same weights times -2 (every e4m3 value and scale differs). Hybridmem's
  worker-side backend (``HybridmemWeightTransferEngine``) is built on B and called as vLLM's worker calls it
  (the in-process client of ``tests/adapters/_vllm_transfer_program.py``); ``VLLMServerEngine`` drives it
  through two CPU buckets smaller than the largest tensor, and a ``ReshardSync`` from the bf16 weights feeds
  it, as the manager's sync does: the engine reports the served model's FP8 config, so it is handed e4m3
  shards and scales.

Every parameter and buffer of B must then equal A's bit for bit (each tensor the layout writes differed
before). The findings go to ``OUT.json``; a failed check exits non-zero.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from typing import Any

from tests.reshard import _fp8_program, _fp8_tasks, _vllm_tasks

BUCKET_NBYTES = 65536
"""Smaller than the largest tensors (the fused q/k/v and gate/up weights in e4m3, 256 KiB): split."""


def _bits(t: Any) -> Any:
    import torch

    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def build(model_dir: str, weights: dict) -> tuple[Any, Any]:
    """``(vllm_config, model)``: the installed vLLM's FP8 model of ``model_dir`` (TP 1, bf16), loaded from
    ``weights`` as vLLM's loader does."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    model_config, vllm_config = _vllm_tasks.vllm_configs(model_dir, 1, 1, 1, dtype="bfloat16")
    assert model_config.quantization == "fp8", model_config.quantization
    with set_current_vllm_config(vllm_config):
        with torch.device("cpu"), _fp8_tasks._stand_in_scaled_mm_kernel():
            model = initialize_model(vllm_config=vllm_config)
        model.load_weights(iter(sorted(weights.items())))
        process_weights_after_loading(model, model_config, torch.device("cpu"))
    return vllm_config, model


def main(out_path: str) -> None:
    _vllm_tasks._environment()
    os.environ["VLLM_DIST_IDENT"] = f"hybridmem-fp8-transfer-{os.getpid()}"
    import safetensors.torch
    import torch
    import vllm
    import vllm.v1.worker.cpu_worker  # the CPU worker's stubs of torch.accelerator
    from vllm.config import WeightTransferConfig, set_current_vllm_config

    import hybridmem
    from hybridmem.adapters.vllm.server import VLLMServerEngine
    from hybridmem.adapters.vllm.server.transfer import HybridmemWeightTransferEngine
    from hybridmem.config import ParallelLayout
    from hybridmem.reshard import ModelSpec
    from hybridmem.weight_sync import ReshardRoute, ReshardSync
    from tests.adapters._vllm_transfer_program import one_process_groups, tensors, worker_client

    root = tempfile.mkdtemp(prefix="hybridmem-fp8-transfer-")
    model_dir, bf16, quantized = _fp8_program._checkpoint(root, _fp8_program.DENSE)
    checkpoint = safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors"))
    other = _fp8_tasks.quantize_with_vllm({n: -2 * t for n, t in bf16.items()}, list(quantized))
    with open(os.path.join(model_dir, "config.json")) as f:
        spec = ModelSpec.from_hf_config(json.load(f))
    report: dict[str, Any] = {"vllm": vllm.__version__, "hybridmem": os.path.abspath(hybridmem.__file__)}
    _, first = _vllm_tasks.vllm_configs(model_dir, 1, 1, 1, dtype="bfloat16")
    try:
        with one_process_groups(first, "hybridmem-fp8-transfer-dist-"):
            _, reference = build(model_dir, checkpoint)
            vllm_config, model = build(model_dir, other)
            want, before = tensors(reference), tensors(model)
            assert list(before) == list(want), "A and B are the same model"
            transfer = HybridmemWeightTransferEngine(WeightTransferConfig(backend="hybridmem"), vllm_config,
                                                     torch.device("cpu"), model)
            client = worker_client(transfer)
            with set_current_vllm_config(vllm_config):
                engine = VLLMServerEngine(client, hf_config=vllm_config.model_config.hf_config,
                                          bucket_nbytes=BUCKET_NBYTES, accel="cpu", release_now=False,
                                          timeout_s=60.0)
                try:
                    layout = engine.layout
                    assert engine.capabilities.reports_quantization, engine.capabilities
                    assert max(math.prod(s) * d.itemsize for s, d in layout.values()) > BUCKET_NBYTES
                    assert all(not torch.equal(_bits(before[f"param:{n}"]), _bits(want[f"param:{n}"]))
                               for n in layout), "every tensor the update writes starts other than A's"
                    sync = ReshardSync(spec, ParallelLayout(), ParallelLayout(), None, lambda: bf16, engine)
                    assert sync.route is ReshardRoute.LAYOUT_STREAM and sync.fp8 is not None
                    stats = sync.sync()
                    commit = engine.commit_weights()
                    report.update(
                        commit=commit, layout_tensors=len(layout), unwritten=list(stats.unwritten),
                        engine_dtype=str(engine.dtype), stream_nbytes=engine.last_stream.nbytes,
                        sync_engine_nbytes=stats.engine_nbytes,
                        fp8_tensors=sum(d == torch.float8_e4m3fn for _, d in layout.values()),
                        scales=sum(n.endswith("_scale_inv") for n in layout),
                        bf16_nbytes=sum(math.prod(s) * 2 for n, (s, _) in layout.items()
                                        if not n.endswith("_scale_inv")),
                        damaged=transfer.damaged)
                finally:
                    engine.close()
            got = tensors(model)
            assert list(got) == list(want), (f"B's tensors are named otherwise: "
                                             f"{sorted(set(got) ^ set(want))[:6]}")
            differ = [n for n in want if got[n].dtype != want[n].dtype
                      or not torch.equal(_bits(got[n]), _bits(want[n]))]
            report.update(differ=differ, compared=len(want))
            assert not differ, f"B differs from A at {differ[:5]}"
    finally:
        with open(out_path, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
