"""The bucket transport of the engine in its own process, on a GPU without vLLM: CUDA IPC buckets measured
against a raw device copy and against host staging, and the weights checked where they land.

    python benchmarks/bucket_transport.py --device cuda --json buckets.json           # ~4 GB, < 60 s
    python benchmarks/bucket_transport.py --device cpu --quick --json buckets.json    # /dev/shm, ~10 MB

This process is the trainer rank: it holds a synthetic model of LLM shapes in the vLLM layout (a
Qwen2.5-7B-sized embedding and head in bf16, one layer in fp32 and two in bf16: 4.04 GB on a GPU; the
embedding and head are larger than a bucket, so they are split across buckets), builds the rank's real
:class:`~hybridmem.adapters.vllm.server.buckets.Buckets` (two, of the engine's default size) and channel
listener, and streams the model with the real
:class:`~hybridmem.adapters.vllm.server.packing.BucketWriter`. The worker is this script with ``--worker``
in a process of its own, a stand-in for vLLM's worker: it opens the buckets once
(:func:`~hybridmem.adapters.vllm.server.buckets.open_buckets`: CUDA IPC handles, or the shared files) and
takes every update with the very receive code vLLM's workers run
(:func:`~hybridmem.adapters.vllm.server.receive.receive_stream` and
:class:`~hybridmem.adapters.vllm.server.receive.StreamUpdate`; see [Note: vllm receive] in
:mod:`hybridmem.adapters.vllm.server.receive`) into device tensors of its own. It refuses to run if
anything it imported pulled vLLM in.

Rounds: one warm-up, ``--rounds`` timed (without figures: the transport alone), two with figures (the
engine's default ``verify=True``: each tensor's checksum on both sides; the first is each process's first
use of the checksum's kernels, the second is what every later switch pays). The sources are negated between
rounds, so each round writes other values than the one before. Printed and written (``--json``):

- the sync in GB/s (the model's bytes over the wall time of a round, from the trainer's wait for its
  worker's connection to the worker's answer that every tensor is written), the median of the timed
  rounds; the raw device-to-device copy of the same tensors (``copy_`` into tensors of the same shapes,
  timed with CUDA events, the best of three) and the ratio of the two (target 0.8, reported, not
  enforced); the host-staged path the engine moved weights by before the buckets (device -> host ->
  device, the whole model through pinned and through pageable host memory; on CUDA only);
- memory during the sync: ``torch.cuda.max_memory_allocated`` in both processes against what each held
  before the first round, and each process's resident set (``VmRSS``) and peak (``VmHWM``);
- against vLLM's own packed IPC (CUDA only): the same tensors between the same two processes through
  ``packed_ipc_producer`` / ``packed_ipc_consumer`` of vLLM's ``distributed/weight_transfer/packed_tensor.py``
  (loaded from its file, which imports only torch: the installed vLLM's, or the copy
  ``HYBRIDMEM_VLLM_PACKED_TENSOR`` names), one warm-up and two timed rounds after the worker zeroed its
  tensors (``--no-vllm-reference`` skips them);
- the check: after the last round the worker regenerates every source from its seed (the same
  generator on the same device, negated as often as the trainer negated it) and compares it with
  ``torch.equal`` to what it received; any difference, or a worker that failed (figures that differ, a
  broken channel), is exit status 1 naming the tensors or the cause.

``--device cuda`` where torch sees no CUDA device writes and prints why it skipped (exit status 0); on
``--device cpu`` the CUDA transfer is skipped with that reason and the same path runs with the CPU buckets
(files in ``/dev/shm``), whose figures say only that the path works.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GB = 1e9
SEED = 1234
TARGET_RATIO = 0.8
"""Bucket sync over the raw device copy that would call the transport as fast as the device allows."""
WAIT_S = 120.0
"""The longest either side waits for the other's next message."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Model:
    """A decoder's tensors in the vLLM layout (fused ``qkv_proj`` and ``gate_up_proj``)."""

    hidden: int
    intermediate: int
    kv: int
    """Width of K (and of V): KV heads x head size."""
    vocab: int
    layers: tuple[str, ...]
    """Each layer's dtype; the embedding, the final norm and the head are bf16."""
    bucket_nbytes: int | None
    """``None``: the engine's default for the device (``default_bucket_nbytes``)."""

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        h, bf16 = self.hidden, torch.bfloat16
        out = {"model.embed_tokens.weight": ((self.vocab, h), bf16)}
        for i, name in enumerate(self.layers):
            dtype, p = getattr(torch, name), f"model.layers.{i}."
            out.update({
                p + "input_layernorm.weight": ((h,), dtype),
                p + "self_attn.qkv_proj.weight": ((h + 2 * self.kv, h), dtype),
                p + "self_attn.qkv_proj.bias": ((h + 2 * self.kv,), dtype),
                p + "self_attn.o_proj.weight": ((h, h), dtype),
                p + "post_attention_layernorm.weight": ((h,), dtype),
                p + "mlp.gate_up_proj.weight": ((2 * self.intermediate, h), dtype),
                p + "mlp.down_proj.weight": ((h, self.intermediate), dtype)})
        out["model.norm.weight"] = ((h,), bf16)
        out["lm_head.weight"] = ((self.vocab, h), bf16)
        return out


MODELS = {
    # Qwen2.5-7B's widths: embedding and head 1.09 GB each (bf16), more than the default 1 GiB bucket
    ("cuda", False): Model(hidden=3584, intermediate=18944, kv=512, vocab=152064,
                           layers=("float32", "bfloat16", "bfloat16"), bucket_nbytes=None),
    ("cuda", True): Model(hidden=1024, intermediate=4096, kv=256, vocab=32768, layers=("float32", "bfloat16"),
                          bucket_nbytes=32 << 20),
    ("cpu", False): Model(hidden=1024, intermediate=4096, kv=256, vocab=32768, layers=("float32", "bfloat16"),
                          bucket_nbytes=16 << 20),
    ("cpu", True): Model(hidden=256, intermediate=1024, kv=64, vocab=4096, layers=("float32", "bfloat16"),
                         bucket_nbytes=1 << 20),
}


def make_tensor(index: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Source tensor ``index``: normal values from its own seeded generator (both processes make the same)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(SEED * 1000 + index)
    return torch.randn(shape, generator=gen, dtype=dtype, device=device)


def host_memory() -> dict[str, int]:
    """This process's resident set now and at its peak (``/proc/self/status``), in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss_nbytes" if key == "VmRSS" else "rss_peak_nbytes"] = int(value.split()[0]) * 1024
    return out


def device_memory(device: torch.device, base: int | None) -> dict[str, int | None]:
    """``max_memory_allocated`` since the last reset and what was allocated at it (CUDA; ``None`` on CPU)."""
    if device.type != "cuda":
        return {"device_base_nbytes": None, "device_peak_nbytes": None}
    return {"device_base_nbytes": base, "device_peak_nbytes": torch.cuda.max_memory_allocated(device)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_unavailable() -> str | None:
    if not torch.cuda.is_available():
        return (f"needs --device cuda and a CUDA device (torch {torch.__version__}, "
                f"torch.cuda.is_available() is False)")
    return None


# The stand-in worker ------------------------------------------------------------------------------------
def worker_main(init_path: str) -> int:
    """The stand-in for vLLM's worker (``--worker INIT``): answers ``ready``, takes one update per line
    ``<generation> <verify>`` on stdin, and after ``done`` checks and answers ``result``."""
    from hybridmem.adapters.vllm.server.buckets import dtype_of, open_buckets
    from hybridmem.adapters.vllm.server.channel import WorkerChannel
    from hybridmem.adapters.vllm.server.receive import StreamUpdate, receive_stream

    if "vllm" in sys.modules:
        print("stand-in worker: importing hybridmem's receive code imported vLLM; it must not (see "
              "hybridmem/adapters/vllm/server/receive.py)", file=sys.stderr)
        return 1
    init = json.loads(Path(init_path).read_text())
    device = torch.device(init["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layout = {name: (tuple(shape), dtype_of(dtype)) for name, shape, dtype in init["layout"]}
    dest = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in layout.items()}
    buckets = open_buckets(init["buckets"], bucket_nbytes=init["bucket_nbytes"], device=device)
    sync(device)
    base = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    print("ready", flush=True)
    generation = 0
    different: list[str] | None = None  # of the buckets' last round, taken before any vLLM round
    for line in sys.stdin:
        words = line.split()
        if words == ["done"]:
            break
        if words == ["vllm"]:
            if different is None:
                different = check(layout, dest, generation, device)
            vllm_packed_round(dest, device)
            continue
        generation, verify = int(words[0]), bool(int(words[1]))
        channel = WorkerChannel(init["channel"], rank=0, run=init["run"], generation=generation)
        update = StreamUpdate(layout, run=init["run"], verify=verify, who="stand-in worker rank 0",
                              tensors=dest)
        receive_stream(channel, buckets, update, wait_s=WAIT_S)
    memory = {**device_memory(device, base), **host_memory()}
    vllm_different = None
    if different is None:
        different = check(layout, dest, generation, device)
    else:  # vLLM's packed rounds wrote last: what they left
        vllm_different = check(layout, dest, generation, device)
    print("result " + json.dumps({"memory": memory, "different": different, "generation": generation,
                                  "vllm_different": vllm_different, "vllm_imported": "vllm" in sys.modules}),
          flush=True)
    return 1 if different or vllm_different else 0


def check(layout: dict[str, tuple[tuple[int, ...], torch.dtype]], dest: dict[str, torch.Tensor],
          generation: int, device: torch.device) -> list[str]:
    """The tensors of ``dest`` that differ from the sources as the trainer held them at ``generation``
    (regenerated from their seeds)."""
    sign = -1 if generation % 2 == 0 else 1  # generation g carries the sources negated g - 1 times
    different = []
    for i, (name, (shape, dtype)) in enumerate(layout.items()):
        want = make_tensor(i, shape, dtype, device)
        if sign < 0:
            want.neg_()
        if not torch.equal(dest[name], want):
            different.append(name)
        del want
    return different


def vllm_packed_module() -> tuple[Any, str] | str:
    """vLLM's own ``packed_tensor.py`` (it imports only torch) loaded from its file without importing vLLM,
    and the file; or why it cannot be: ``HYBRIDMEM_VLLM_PACKED_TENSOR`` names the file (a GPU machine
    without vLLM gets it carried there), else the installed vLLM's is used."""
    import importlib.util

    path = os.environ.get("HYBRIDMEM_VLLM_PACKED_TENSOR")
    if not path:
        spec = importlib.util.find_spec("vllm")  # a top-level package is found without running it
        if spec is None or not spec.submodule_search_locations:
            return ("vLLM is not installed and HYBRIDMEM_VLLM_PACKED_TENSOR names no copy of its "
                    "distributed/weight_transfer/packed_tensor.py")
        path = os.path.join(next(iter(spec.submodule_search_locations)), "distributed", "weight_transfer",
                            "packed_tensor.py")
    if not os.path.isfile(path):
        return f"no vLLM packed_tensor.py at {path}"
    spec = importlib.util.spec_from_file_location("vllm_packed_tensor_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("packed_ipc_producer", "packed_ipc_consumer", "PackedBufferImporter"):
        if not hasattr(module, name):
            return f"{path} has no {name} (another vLLM release than 0.32/0.33)"
    return module, path


def vllm_packed_round(dest: dict[str, torch.Tensor], device: torch.device) -> None:
    """The worker's side of one update through vLLM's own packed IPC: each ``chunk`` line opened with
    ``packed_ipc_consumer`` (vLLM's: the buffer mapped once per update, every tensor cloned out of it), each
    tensor copied into this worker's tensor as vLLM's default weight loader does (``param.data.copy_``),
    then ``chunk-done``; ``end`` closes the mapping (vLLM's ``finish_weight_update``)."""
    from hybridmem.adapters.vllm.server.buckets import decode_ipc

    module = vllm_packed_module()
    assert not isinstance(module, str), module
    packed = module[0]
    importer = packed.PackedBufferImporter()
    for t in dest.values():  # what the round writes is checked afterwards: nothing left from before
        t.zero_()
    sync(device)
    print("vllm-ready", flush=True)
    for line in sys.stdin:
        kind, _, rest = line.strip().partition(" ")
        if kind == "end":
            importer.close()
            print("vllm-ok", flush=True)
            return
        chunk = json.loads(rest)
        handle = {chunk["uuid"]: decode_ipc(chunk["ipc"], device.index)}
        with torch.no_grad():
            for name, tensor in packed.packed_ipc_consumer(handle, chunk["names"], chunk["shapes"],
                                                           chunk["dtype_names"], chunk["tensor_sizes"],
                                                           device.index, importer):
                dest[name].data.copy_(tensor)
        torch.cuda.current_stream(device).synchronize()  # the producer reuses the buffer once answered
        print("chunk-done", flush=True)


def vllm_packed_reference(worker: Worker, sources: dict[str, torch.Tensor], device: torch.device,
                          total: int, rounds: int) -> dict[str, Any]:
    """The same tensors between the same two processes through vLLM's own packed IPC
    (``packed_ipc_producer``: one buffer, packed and handed over one chunk at a time, as vLLM's ``ipc``
    backend sends them): seconds a round (one warm-up, then the median of ``rounds``), or why it did not
    run."""
    from hybridmem.adapters.vllm.server.buckets import encode_ipc

    if device.type != "cuda":
        return {"skipped": "vLLM's packed IPC is CUDA only"}
    module = vllm_packed_module()
    if isinstance(module, str):
        return {"skipped": module}
    packed, path = module
    largest = max(t.numel() * t.element_size() for t in sources.values())
    # vLLM refuses a tensor larger than its buffer: the buffer a user of it would have to set
    buffer_nbytes = max(packed.DEFAULT_PACKED_BUFFER_SIZE_BYTES, -(-largest // 2**20) * 2**20)
    uuid_ = str(torch.cuda.get_device_properties(device).uuid)
    seconds, chunks = [], 0
    for _ in range(1 + rounds):
        worker.send("vllm")
        worker.expect("vllm-ready", timeout_s=WAIT_S)
        sync(device)
        t0 = time.perf_counter()
        chunks = 0
        for chunk in packed.packed_ipc_producer(iter(sources.items()), uuid_, lambda item: item[1],
                                                buffer_size_bytes=buffer_nbytes):
            worker.send("chunk " + json.dumps({
                "uuid": uuid_, "ipc": encode_ipc(chunk.ipc_handle[uuid_]), "names": chunk.names,
                "shapes": chunk.shapes, "dtype_names": chunk.dtype_names,
                "tensor_sizes": chunk.tensor_sizes}))
            worker.expect("chunk-done", timeout_s=WAIT_S)
            chunks += 1
        seconds.append(time.perf_counter() - t0)
        worker.send("end")
        worker.expect("vllm-ok", timeout_s=WAIT_S)
        torch.cuda.ipc_collect()
    median = statistics.median(seconds[1:])
    return {"source": path, "buffer_nbytes": buffer_nbytes, "chunks": chunks, "seconds": median,
            "first_seconds": seconds[0], "gbps": total / median / GB}


class Worker:
    """The stand-in's process, seen from the trainer: lines in on stdin, prefixed lines back on stdout."""

    def __init__(self, init_path: Path):
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", str(init_path)]
        self.log_path = init_path.with_name("worker.log")
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         env=env, bufsize=0)
        self._buffer = b""

    def last_error(self) -> str | None:
        """The last line the worker wrote to stderr (its exception, when it failed)."""
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else None

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def watch(self) -> None:
        """Raise once the worker exited (a stream's wait calls this)."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the stand-in worker exited with status {self.proc.returncode}: "
                               f"{self.last_error()}")

    def expect(self, prefix: str, timeout_s: float) -> str:
        """The rest of the worker's next line starting with ``prefix`` (others are passed on to stderr)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._buffer:
                line, _, self._buffer = self._buffer.partition(b"\n")
                text = line.decode(errors="replace")
                if text.split(" ", 1)[0] == prefix:
                    return text[len(prefix):].strip()
                print(f"[worker] {text}", file=sys.stderr)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the stand-in worker said no {prefix!r} within {timeout_s:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise RuntimeError(f"the stand-in worker exited with status {self.proc.wait()} before "
                                       f"{prefix!r}: {self.last_error()}")
                self._buffer += chunk

    def close(self) -> None:
        """End the worker if it still runs, and pass its stderr on to this process's."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        text = self.log_path.read_text(errors="replace")
        if text.strip():
            sys.stderr.write("".join(f"[worker] {line}\n" for line in text.rstrip().splitlines()))


# The trainer side -----------------------------------------------------------------------------------------
def raw_copy_s(sources: dict[str, torch.Tensor], device: torch.device, repeats: int = 3) -> float:
    """Seconds of ``copy_`` of every source into a tensor of its shape on the same device (best of
    ``repeats``, after one untimed pass)."""
    dests = [torch.empty_like(t) for t in sources.values()]
    best = float("inf")
    for i in range(repeats + 1):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for d, s in zip(dests, sources.values(), strict=True):
                d.copy_(s)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t = time.perf_counter()
            for d, s in zip(dests, sources.values(), strict=True):
                d.copy_(s)
            seconds = time.perf_counter() - t
        if i:
            best = min(best, seconds)
    del dests
    return best


def checksum_model_s(sources: dict[str, torch.Tensor], device: torch.device) -> list[float]:
    """Seconds of :func:`~hybridmem.reshard.checksum.tensor_checksum` of every source on the trainer's
    device, one read each, three times (the first in this process came with the round with figures)."""
    from hybridmem.reshard.checksum import tensor_checksum

    out = []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        for t in sources.values():
            tensor_checksum(t)
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def host_staged(sources: dict[str, torch.Tensor], device: torch.device, *, pinned: bool) -> dict[str, float]:
    """Every source through one host buffer of the model's size and back into device tensors of its shapes
    (the staging path: device -> host, then host -> device); the buffer is allocated and touched before the
    clock starts (the staging file was reused)."""
    from hybridmem.adapters.vllm.server.buckets import aligned

    offsets, total = [], 0
    for t in sources.values():
        offsets.append(total)
        total = aligned(total + t.numel() * t.element_size())
    host = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(0)
    dests = [torch.empty_like(t) for t in sources.values()]
    views = [host[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
             for o, t in zip(offsets, sources.values(), strict=True)]
    sync(device)
    t0 = time.perf_counter()
    for v, s in zip(views, sources.values(), strict=True):
        v.copy_(s, non_blocking=pinned)
    sync(device)
    t1 = time.perf_counter()
    for d, v in zip(dests, views, strict=True):
        d.copy_(v, non_blocking=pinned)
    sync(device)
    t2 = time.perf_counter()
    ok = all(torch.equal(d, s) for d, s in zip(dests, sources.values(), strict=True))
    if not ok:
        raise RuntimeError(f"the host-staged copy ({'pinned' if pinned else 'pageable'}) changed the tensors")
    return {"d2h_s": t1 - t0, "h2d_s": t2 - t1, "seconds": t2 - t0}


def trainer_main(args: argparse.Namespace) -> dict[str, Any]:
    """The trainer rank's side: the figures (see the module docstring)."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = tempfile.mkdtemp(prefix="hybridmem-bt-", dir=shm)  # the engine's shared directory
    try:
        return _trainer(args, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _trainer(args: argparse.Namespace, directory: str) -> dict[str, Any]:
    from hybridmem.adapters.vllm.server.buckets import (
        Buckets,
        bucket_limit,
        default_bucket_nbytes,
        dtype_name,
    )
    from hybridmem.adapters.vllm.server.channel import ChannelError, Listener, channel_path
    from hybridmem.adapters.vllm.server.packing import BucketWriter

    start = time.perf_counter()
    model = MODELS[(args.device, args.quick)]
    if args.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if model.bucket_nbytes is not None:
        bucket_nbytes = model.bucket_nbytes
    else:
        bucket_nbytes = default_bucket_nbytes(device.type, free_nbytes=bucket_limit(device, directory)[0])
    layout = model.layout()
    sources = {name: make_tensor(i, shape, dtype, device)
               for i, (name, (shape, dtype)) in enumerate(layout.items())}
    total = sum(t.numel() * t.element_size() for t in sources.values())
    larger = [n for n, t in sources.items() if t.numel() * t.element_size() > bucket_nbytes]
    sync(device)
    figures: dict[str, Any] = {
        "device": device.type, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "transport": "CUDA IPC buckets" if device.type == "cuda" else "CPU buckets (shared files)",
        "tensors": len(sources), "total_nbytes": total, "bucket_nbytes": bucket_nbytes,
        "larger_than_bucket": larger, "target_ratio": TARGET_RATIO}
    dtypes = ", ".join(sorted({dtype_name(t.dtype) for t in sources.values()}))
    print(f"{len(sources)} tensors, {total / GB:.3f} GB ({dtypes}); buckets 2 x "
          f"{bucket_nbytes / 2**20:.0f} MiB ({figures['transport']}); larger than a bucket: {larger}",
          flush=True)

    raw = raw_copy_s(sources, device)
    figures["raw_copy_s"] = raw
    figures["raw_copy_gbps"] = total / raw / GB

    buckets = Buckets(directory, 0, bucket_nbytes=bucket_nbytes, device=device)
    run = uuid.uuid4().hex
    listener = Listener(channel_path(directory, 0), 0, run=run)
    init_path = Path(directory) / "init.json"
    init_path.write_text(json.dumps({
        "run": run, "channel": listener.path, "buckets": buckets.descriptor(), "bucket_nbytes": bucket_nbytes,
        "device": str(device), "layout": [[n, list(s), dtype_name(d)] for n, (s, d) in layout.items()]}))
    worker = Worker(init_path)
    rounds: list[dict[str, Any]] = []
    try:
        worker.expect("ready", timeout_s=WAIT_S)
        base = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        # warm-up, timed, with figures twice (the first use of the checksum's kernels in each process,
        # then as every later switch runs them)
        plan = [False] * (1 + args.rounds) + [True, True]
        for generation, verify in enumerate(plan, start=1):
            if generation > 1:
                with torch.no_grad():
                    for t in sources.values():
                        t.neg_()
            if args.tamper and generation == len(plan):
                next(iter(sources.values())).view(-1)[0] += 1  # what the worker must catch
            sync(device)
            t0 = time.perf_counter()
            listener.expect(run, generation)
            worker.send(f"{generation} {int(verify)}")
            conn = listener.accept(timeout_s=WAIT_S, watch=worker.watch)
            writer = BucketWriter(buckets, conn, layout, run=run,
                                  verify=verify, ack_timeout_s=WAIT_S,
                                  watch=worker.watch)
            try:
                for name, t in sources.items():
                    writer.put(name, t)
                stats = writer.finish()
            except ChannelError as exc:  # the worker's own error says why
                writer.abandon()
                if worker.proc.poll() is None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        worker.proc.wait(timeout=10)
                said = "" if exc.kind == "error" else f"; the stand-in worker: {worker.last_error()}"
                raise RuntimeError(f"round {generation}: {exc}{said}") from exc
            conn.close()
            seconds = time.perf_counter() - t0
            listener.expect(None)
            rounds.append({"generation": generation, "verify": verify, "seconds": seconds,
                           "buckets_handed": stats.num_handed, "gbps": total / seconds / GB,
                           "trainer_checksum_s": stats.checksum_s,
                           "worker_checksum_s": stats.worker_checksum_s,
                           "worker_copy_s": stats.worker_copy_s})
        figures["trainer_memory"] = {**device_memory(device, base), **host_memory()}
        if args.vllm_reference:
            figures["vllm_packed"] = vllm_packed_reference(worker, sources, device, total, rounds=2)
        worker.send("done")
        result = json.loads(worker.expect("result", timeout_s=WAIT_S))
        rc = worker.proc.wait(timeout=WAIT_S)
    finally:
        worker.close()
        listener.close()
        buckets.close()
    timed = [r["seconds"] for r in rounds[1:] if not r["verify"]]
    figures.update({
        "rounds": rounds, "sync_s": statistics.median(timed), "first_sync_s": rounds[0]["seconds"],
        "verify_sync_s": rounds[-1]["seconds"], "first_verify_sync_s": rounds[-2]["seconds"],
        "worker_checksum_s": rounds[-1]["worker_checksum_s"], "worker_memory": result["memory"],
        "different": result["different"], "weights_equal": not result["different"] and rc == 0,
        "vllm_different": result["vllm_different"],
        "vllm_imported": result["vllm_imported"]})
    figures["sync_gbps"] = total / figures["sync_s"] / GB
    figures["ratio_to_raw"] = figures["sync_gbps"] / figures["raw_copy_gbps"]
    figures["ratio_met"] = figures["ratio_to_raw"] >= TARGET_RATIO
    reference = figures.get("vllm_packed", {})
    if "gbps" in reference:
        reference["ratio_to_raw"] = reference["gbps"] / figures["raw_copy_gbps"]
    figures["checksum_s"] = checksum_model_s(sources, device)
    if device.type == "cuda":
        staged = {}
        for kind in ("pinned", "pageable"):
            s = host_staged(sources, device, pinned=kind == "pinned")
            staged[kind] = {**s, "gbps": total / s["seconds"] / GB}
        figures["host_staged"] = staged
    figures["seconds"] = time.perf_counter() - start
    return figures


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _mem(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GB:.3f} GB"


def summary(f: dict[str, Any]) -> list[str]:
    """The figures as lines (printed here, and in the GPU suite's report)."""
    lines = [f"- {f['transport']}: {f['tensors']} tensors, {f['total_nbytes'] / GB:.3f} GB, buckets 2 x "
             f"{f['bucket_nbytes'] / 2**20:.0f} MiB, {len(f['larger_than_bucket'])} tensors larger than a "
             f"bucket",
             f"- sync {f['sync_gbps']:.1f} GB/s (median of {len(f['rounds']) - 3} rounds, "
             f"{f['sync_s'] * 1e3:.1f} ms; first {f['first_sync_s'] * 1e3:.1f} ms; with figures "
             f"{f['verify_sync_s'] * 1e3:.1f} ms, the worker's checksums {_ms(f['worker_checksum_s'])} ms of "
             f"it; the first round with figures {f['first_verify_sync_s'] * 1e3:.1f} ms); "
             f"raw device copy {f['raw_copy_gbps']:.1f} GB/s; ratio {f['ratio_to_raw']:.2f} (target "
             f"{f['target_ratio']}: {'met' if f['ratio_met'] else 'missed'})"]
    ref = f.get("vllm_packed")
    if ref and "gbps" in ref:
        mib = ref["buffer_nbytes"] / 2**20
        lines.append(f"- vLLM's own packed IPC (its packed_tensor.py: one {mib:.0f} MiB buffer, "
                     f"{ref['chunks']} chunks, each tensor cloned out of it and copied into the worker's "
                     f"tensor): {ref['gbps']:.1f} GB/s ({ref['seconds'] * 1e3:.1f} ms, median of 2; first "
                     f"{ref['first_seconds'] * 1e3:.1f} ms), ratio {ref['ratio_to_raw']:.2f} to the raw "
                     f"copy; the buckets {f['sync_gbps'] / ref['gbps']:.2f}x as fast")
    elif ref:
        lines.append(f"- vLLM's own packed IPC: skipped ({ref['skipped']})")
    lines.append(f"- checksum of the model where it lies (the trainer's figures, one read): "
                 f"{min(f['checksum_s']) * 1e3:.1f} ms, {f['total_nbytes'] / min(f['checksum_s']) / GB:.1f} "
                 f"GB/s (best of 3)")
    for kind, s in f.get("host_staged", {}).items():
        lines.append(f"- host-staged ({kind}): {s['gbps']:.1f} GB/s (device->host "
                     f"{s['d2h_s'] * 1e3:.0f} ms, host->device {s['h2d_s'] * 1e3:.0f} ms); the sync "
                     f"{f['sync_gbps'] / s['gbps']:.1f}x as fast")
    for who in ("trainer", "worker"):
        m = f[f"{who}_memory"]
        lines.append(f"- {who}: device held {_mem(m['device_base_nbytes'])}, peak during the sync "
                     f"{_mem(m['device_peak_nbytes'])}; host RSS {_mem(m['rss_nbytes'])} (peak "
                     f"{_mem(m['rss_peak_nbytes'])})")
    verdict = "equal to the sources" if f["weights_equal"] else f"**DIFFERENT**: {f['different']}"
    lines.append(f"- the worker's tensors after the last round: {verdict}")
    if f.get("vllm_different") is not None:
        bad = f["vllm_different"]
        verdict = f"**DIFFERENT**: {bad}" if bad else "equal to the sources"
        lines.append(f"- the worker's tensors after vLLM's packed rounds: {verdict}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--json", help="where to write the figures")
    parser.add_argument("--tamper", action="store_true",
                        help="change one source value before the last round behind the figures' back (the "
                             "check must fail: exit status 1)")
    parser.add_argument("--no-vllm-reference", dest="vllm_reference", action="store_false",
                        help="skip the rounds through vLLM's own packed IPC (its packed_tensor.py, loaded "
                             "from the installed vLLM or the file HYBRIDMEM_VLLM_PACKED_TENSOR names; CUDA "
                             "only)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}; expected at least 1")

    out: dict[str, Any] = {}
    why = cuda_unavailable()
    if args.device == "cuda" and why is not None:
        out["skipped"] = why
        print(f"skipped: {why}")
    else:
        if args.device == "cpu":
            out["cuda_skipped"] = ("needs --device cuda and a CUDA device; the same path ran with the CPU "
                                   "buckets (/dev/shm files) instead")
            print(f"CUDA IPC buckets skipped: {out['cuda_skipped']}", flush=True)
        try:
            out.update(trainer_main(args))
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if "error" in out:
        print(f"FAILED: the bucket transport broke: {out['error']}", file=sys.stderr)
        return 1
    if "skipped" in out:
        return 0
    print("\n".join(summary(out)))
    if not out["weights_equal"]:
        print(f"FAILED: the worker's tensors differ from the sources: {out['different']} (after vLLM's "
              f"packed rounds: {out.get('vllm_different')})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
