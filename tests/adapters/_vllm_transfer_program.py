"""One check of the server adapter's weight transfer against the installed vLLM's own model classes, as a
program of its own: ``python -m tests.adapters._vllm_transfer_program MODEL_DIR OUT.json`` (from the
repository root), run by test_vllm_transfer_versions.py under each vLLM release it finds.

No vLLM engine runs: the model is built twice with the installed vLLM's classes on CPU (``initialize_model``
under a ``VllmConfig``, vLLM's parallel state over gloo for one process), each loaded as vLLM's loader loads
it (the model's ``load_weights``, then ``process_weights_after_loading``, where vLLM's CPU build repacks the
linear weights):

- A, the reference, from the checkpoint in ``MODEL_DIR``;
- B from the same checkpoint with every value negated; hybridmem's worker-side backend
  (``HybridmemWeightTransferEngine``) is built on B, and :class:`InProcessWorker` calls it as vLLM's worker
  does (``Worker.init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
  ``finish_weight_update`` in ``vllm/v1/worker/gpu_worker.py``, 0.32 and 0.33: the update session's flag
  included). ``VLLMServerEngine`` drives it through that client as it drives a server: two CPU buckets in
  ``/dev/shm`` smaller than the largest tensor, the rank's Unix-socket channel, ``load_layout_weights`` fed
  by ``iter_layout_tensors`` (what ``ReshardSync`` feeds it) from the checkpoint's tensors to hybridmem's
  vLLM layout, then ``commit_weights``.

First an update whose bucket is damaged after its figures were taken must be refused by the worker, naming
the tensor; then a good update must leave every parameter and buffer of B equal to A's (``torch.equal``),
and every linear layer's output on a fixed input equal to A's (the repacked kernel weights hold what the
parameters no longer show on vLLM's CPU build). Before the updates each tensor the layout writes differs
from A's (padding rows aside), so the equality is the update's. The findings go to ``OUT.json``; a failed
check exits non-zero.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
from typing import Any

from tests.reshard import _vllm_tasks

BUCKET_NBYTES = 16384
"""Smaller than the largest tensor of the test models (the embedding, 256 x 128 fp32): it is split."""
CORRUPTED = "model.layers.1.mlp.down_proj.weight"
"""The tensor the damaged update flips a bit of, after its figures were taken."""


def vllm_config_of(model_dir: str) -> Any:
    """A ``VllmConfig`` of the model in ``model_dir`` on CPU, TP 1, fp32 (one per model built: vLLM keeps
    each attention layer by name in its config)."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                               max_model_len=64, seed=0)
    return VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="dummy"),
                      parallel_config=ParallelConfig(), device_config=DeviceConfig(device="cpu"))


def build(vllm_config: Any, weights: dict) -> Any:
    """The installed vLLM's model of ``vllm_config``, loaded from ``weights`` as vLLM's loader does."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    with set_current_vllm_config(vllm_config), torch.device("cpu"):
        model = initialize_model(vllm_config=vllm_config)
        model.load_weights(iter(sorted(weights.items())))
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    return model


def worker_client(transfer_engine: Any) -> Any:
    """A :class:`~hybridmem.adapters.vllm.server.client.VLLMClient` whose engine is ``transfer_engine`` in
    this process, called as vLLM's worker calls its weight-transfer backend."""
    from tests.adapters._transport import LocalWorker

    class InProcessWorker(LocalWorker):
        def __init__(self) -> None:
            super().__init__()
            self.active = False

        def _init_weight_transfer_engine(self, init_info: dict) -> None:
            transfer_engine.init_transfer_engine(transfer_engine.parse_init_info(init_info))

        def _start_weight_update(self) -> None:
            if self.active:
                raise RuntimeError("start_weight_update called while a weight update is already active")
            transfer_engine.start_weight_update()
            self.active = True

        def _update_weights(self, update_info: Any) -> None:
            if not self.active:
                raise RuntimeError("start_weight_update must be called before update_weights")
            try:
                transfer_engine.update_weights(update_info[0] if isinstance(update_info, list)
                                               else update_info)
            except BaseException:
                self.active = False
                raise

        def _finish_weight_update(self, version: str | None) -> None:
            if not self.active:
                raise RuntimeError("finish_weight_update called without a matching start_weight_update")
            transfer_engine.finish_weight_update()
            self.active = False
            if version is not None:
                self.version = version

    return InProcessWorker()


@contextlib.contextmanager
def one_process_groups(vllm_config: Any, prefix: str):
    """vLLM's distributed environment and tp/pp groups for this one process (gloo over a file), built under
    ``vllm_config``; on the way out they are destroyed and the files they made removed: the shared-memory
    files vLLM's CPU communicator made (named after ``VLLM_DIST_IDENT``) and the init file."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    init_file = tempfile.mktemp(prefix=prefix)
    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(1, 0, f"file://{init_file}", 0, backend="gloo")
        parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
        _vllm_tasks._unlink_segments(os.environ["VLLM_DIST_IDENT"])
        with contextlib.suppress(FileNotFoundError):
            os.unlink(init_file)


def tensors(model: Any) -> dict:
    """Every parameter and buffer of ``model`` by name, cloned."""
    out = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update((f"buffer:{n}", b.detach().clone()) for n, b in model.named_buffers())
    return out


def linear_outputs(model: Any) -> dict:
    """Each linear layer's output on a fixed input (through the kernel vLLM's CPU build packed)."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase

    out = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                x = torch.linspace(-1, 1, 3 * module.input_size).reshape(3, -1)
                y = module(x)
                out[name] = (y[0] if isinstance(y, tuple) else y).clone()
    return out


def layout_stream(model_dir: str, weights: dict):
    """The checkpoint's tensors as this rank's complete tensors of hybridmem's vLLM layout (TP 1), streamed
    as ``ReshardSync`` streams them into an engine that takes its own layout."""
    from hybridmem.config import ParallelLayout
    from hybridmem.reshard import ModelSpec, build_plan, hf_source_layout, iter_layout_tensors, vllm_layout

    with open(os.path.join(model_dir, "config.json")) as f:
        spec = ModelSpec.from_hf_config(json.load(f))
    plan = build_plan(hf_source_layout(spec, 1), vllm_layout(spec, ParallelLayout(tp=1), 1), itemsize=4,
                      rank=0)
    return iter_layout_tensors(plan, rank=0, src=weights)


def main(model_dir: str, out_path: str) -> None:
    _vllm_tasks._environment()
    os.environ["VLLM_DIST_IDENT"] = f"hybridmem-transfer-{os.getpid()}"
    # vllm.v1.worker.cpu_worker: what vLLM's CPU worker process runs in, with its stubs of torch.accelerator
    # (the backend's base class synchronizes it after every update).
    import safetensors.torch
    import torch
    import vllm
    import vllm.v1.worker.cpu_worker
    from vllm.config import WeightTransferConfig, set_current_vllm_config
    from vllm.model_executor.models import registry

    import hybridmem
    from hybridmem.adapters.vllm.server import VLLMServerEngine
    from hybridmem.adapters.vllm.server.packing import BucketWriter
    from hybridmem.adapters.vllm.server.transfer import HybridmemWeightTransferEngine
    from hybridmem.errors import EngineProcessError

    if hasattr(registry, "_run_in_subprocess"):  # inspect the model class here (no CUDA to protect)
        registry._run_in_subprocess = _vllm_tasks._call
    vllm_config = vllm_config_of(model_dir)  # B's, the model the backend writes
    weights = safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors"))
    report: dict[str, Any] = {"vllm": vllm.__version__, "hybridmem": os.path.abspath(hybridmem.__file__)}
    with set_current_vllm_config(vllm_config), one_process_groups(vllm_config, "hybridmem-transfer-dist-"):
        reference = build(vllm_config_of(model_dir), weights)
        model = build(vllm_config, {n: -t for n, t in weights.items()})
        want, want_out = tensors(reference), linear_outputs(reference)
        before, before_out = tensors(model), linear_outputs(model)
        assert list(before) == list(want), "A and B are the same model"

        transfer = HybridmemWeightTransferEngine(WeightTransferConfig(backend="hybridmem"), vllm_config,
                                                 torch.device("cpu"), model)
        client = worker_client(transfer)
        engine = VLLMServerEngine(client, hf_config=vllm_config.model_config.hf_config,
                                  bucket_nbytes=BUCKET_NBYTES, accel="cpu", release_now=False,
                                  timeout_s=60.0)
        try:
            layout = engine.layout
            largest = max(math.prod(s) * d.itemsize for s, d in layout.values())
            assert largest > engine.bucket_nbytes, (largest, engine.bucket_nbytes)
            # Every tensor the update writes that the model still shows starts other than A's (the
            # repacked ones: their layers' outputs, checked at the end).
            shown = [n for n in layout if want[f"param:{n}"].numel()]
            assert all(not torch.equal(before[f"param:{n}"], want[f"param:{n}"]) for n in shown)

            # A bucket damaged after its figures were taken: the worker refuses it, naming the tensor.
            original = BucketWriter._hand_over

            def hand_over(writer: BucketWriter) -> None:
                entry = next((e for e in writer._entries if e["name"] == CORRUPTED and e["start"] == 0),
                             None)
                if entry is not None:  # float32, little-endian: byte 3 holds the sign and exponent
                    writer.buckets.views[writer._current][entry["offset"] + 3] ^= 0x40
                return original(writer)

            BucketWriter._hand_over = hand_over
            try:
                engine.load_layout_weights(layout_stream(model_dir, weights))
            except EngineProcessError as exc:
                report["corrupted_error"] = str(exc)
            else:
                raise AssertionError("the damaged bucket was taken")
            finally:
                BucketWriter._hand_over = original
            report["damaged_after_refusal"] = transfer.damaged

            engine.load_layout_weights(layout_stream(model_dir, weights))
            commit = engine.commit_weights()
            report.update(commit=commit, worker_version=client.version, calls=client.calls,
                          damaged_after_update=transfer.damaged, layout_tensors=len(layout),
                          streamed=engine.last_stream.num_tensors, largest_nbytes=largest,
                          bucket_nbytes=engine.bucket_nbytes, unwritten=engine.unwritten_weights())
        finally:
            engine.close()

        got, got_out = tensors(model), linear_outputs(model)
        assert list(got) == list(want), (f"B's tensors are named otherwise: "
                                         f"{sorted(set(got) ^ set(want))[:6]}")
        differ = [n for n in want if not torch.equal(got[n], want[n])]
        assert not differ, f"B differs from A at {differ[:5]}"
        report["compared"] = len(want)
        report["params_shown"] = len(shown)
        assert list(got_out) == list(want_out) and want_out
        differ = [n for n in want_out if not torch.equal(got_out[n], want_out[n])]
        assert not differ, f"B's linear layers compute otherwise than A's at {differ[:5]}"
        assert all(not torch.equal(before_out[n], want_out[n]) for n in want_out), "B started as A"
        report["linear_outputs"] = len(want_out)
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
