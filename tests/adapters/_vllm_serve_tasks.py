"""Scenarios with vLLM's engine as ``vllm serve`` (HTTP), each run in a process of its own by
test_vllm_serve.py: ``python _vllm_serve_tasks.py SCENARIO OUT.json [ARGS]`` writes its findings as JSON
(``fsdp_tp2`` runs under ``torchrun --nproc-per-node 2``; rank 0 writes them). References are transformers'
models on the trained weights; the server's own state is read over HTTP here, not through hybridmem.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request

from _vllm_server_tasks import (
    BUCKET_NBYTES,
    MAX_TOKENS,
    PROMPTS,
    VLLM_ENV,
    ShmSampler,
    hf_greedy,
    layout_nbytes,
    lm_step,
    save_policy,
)

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "16", "--enforce-eager",
               "--seed", "0"]
CORRUPTED = "model.layers.1.mlp.down_proj.weight"
"""The staged tensor the corruption scenario damages after its figures were taken."""


def http_get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=60) as response:
        return json.loads(response.read())


def hf_logprobs(model, prompts, outputs) -> list[list[float]]:
    """transformers' log_softmax of the raw logits at each token the engine sampled (teacher forcing)."""
    import torch

    out = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, outputs):
            ids = torch.tensor([list(prompt) + list(tokens)])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            out.append([float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)])
    return out


def snapshot(model, opt) -> list:
    """Every parameter and optimizer-state tensor, cloned."""
    import torch

    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def corrupting_hand_over(original):
    """``BucketWriter._hand_over`` that, when the bucket holds the first range of :data:`CORRUPTED`, flips a
    bit of the exponent byte of that range's first element before the bucket goes to the worker: what the
    worker reads differs from what the trainer took the figures of."""

    def hand_over(self):
        entry = next((e for e in self._entries if e["name"] == CORRUPTED and e["start"] == 0), None)
        if entry is not None:  # float32, little-endian: byte 3 holds the sign and exponent
            self.buckets.views[self._current][entry["offset"] + 3] ^= 0x40
        return original(self)

    return hand_over


def http_tp1(out: str, steps: str = "3") -> dict:
    """``VLLMServerEngine.launch`` (vllm serve, TP 1): the user's training loop with log-probs, then a
    switch whose bucket is corrupted after the figures were taken, then one more good switch. A thread samples
    what the engine's shared directory holds in ``/dev/shm`` during every switch."""
    import torch
    import transformers

    from hybridmem import Direction, Phase, ShardingManager
    from hybridmem.adapters.vllm.server import VLLMServerEngine
    from hybridmem.adapters.vllm.server.packing import BucketWriter
    from hybridmem.engines import SamplingParams
    from hybridmem.errors import EngineProcessError, PhaseError

    model_dir = save_policy(tempfile.mkdtemp(prefix="policy-"))
    start = time.monotonic()
    engine = VLLMServerEngine.launch(model_dir, server_args=SERVER_ARGS, bucket_nbytes=BUCKET_NBYTES)
    res: dict = {"launch_s": time.monotonic() - start, "url": engine.client.url,
                 "server_pid": engine.server.pid, "log_path": engine.server.log_path,
                 "argv": engine.server.argv, "verify": engine.verify,
                 "bucket_nbytes": engine.bucket_nbytes, "vllm_layout_nbytes": layout_nbytes(engine),
                 "steps": []}
    sampler = ShmSampler(engine.directory)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        manager = ShardingManager(model, engine, optimizer=opt)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True)
        for step in range(int(steps)):
            sampler.reset()
            manager.to_infer()
            shm_peak, samples = sampler.reset()
            outs = engine.generate(PROMPTS, params)
            manager.to_train()
            report = manager.last_reports[Direction.TO_INFER]
            sync = next(s for s in report.steps if s.name == "weight sync")
            res.setdefault("report", str(report))  # the first switch's report as printed
            got = [o.token_ids for o in outs]
            res["steps"].append({"got": got, "expected": hf_greedy(model),
                                 "logprobs": [o.logprobs for o in outs],
                                 "hf_logprobs": hf_logprobs(model, PROMPTS, got),
                                 "version": http_get(engine.client.url, "/weight_info")["weight_version"],
                                 "sync": dict(sync.extra), "shm_peak_nbytes": shm_peak,
                                 "shm_samples": samples})
            lm_step(model, opt, step, model.config.vocab_size)
        sampler.stop()

        # A bucket damaged after the trainer took the figures: the worker refuses the update.
        before = snapshot(model, opt)
        original = BucketWriter._hand_over
        BucketWriter._hand_over = corrupting_hand_over(original)
        try:
            manager.to_infer()
            res["corrupt"] = {"raised": None}
        except EngineProcessError as exc:
            res["corrupt"] = {"raised": type(exc).__name__, "message": str(exc)}
        finally:
            BucketWriter._hand_over = original
        after = snapshot(model, opt)
        corrupt = res["corrupt"]
        corrupt["phase"] = manager.phase.name
        corrupt["state_intact"] = len(before) == len(after) and all(torch.equal(a, b)
                                                                    for a, b in zip(before, after))
        corrupt["version"] = http_get(engine.client.url, "/weight_info")["weight_version"]
        try:
            engine.generate(PROMPTS[:1], params)
            corrupt["released_refused"] = None
        except PhaseError as exc:
            corrupt["released_refused"] = str(exc)
        # the engine itself, resident again, still refuses stale weights
        engine.resume(["weights", "kv_cache"])
        try:
            engine.generate(PROMPTS[:1], params)
            corrupt["stale_refused"] = None
        except PhaseError as exc:
            corrupt["stale_refused"] = str(exc)
        corrupt["server_paused"] = http_get(engine.client.url, "/is_paused")["is_paused"]
        engine.release(["kv_cache", "weights"])
        assert manager.phase is Phase.TRAIN

        # The next complete update serves the trained weights again.
        with manager.inference() as e:
            got = [o.token_ids for o in e.generate(PROMPTS, params)]
        res["recovered"] = {"got": got, "expected": hf_greedy(model),
                            "version": http_get(engine.client.url, "/weight_info")["weight_version"]}

        # The server dies (its process group killed): the next switch names it dead, and its log.
        os.killpg(engine.server.pid, signal.SIGKILL)
        try:
            manager.to_infer()
            res["died"] = {"raised": None}
        except EngineProcessError as exc:
            res["died"] = {"raised": type(exc).__name__, "message": str(exc), "fault": exc.fault.value}
        res["died"]["phase"] = manager.phase.name
        manager.close()
    finally:
        engine.close()
    res["server_returncode"] = engine.server.returncode
    return res


def by_hand(out: str, url: str) -> dict:
    """``VLLMServerEngine.connect`` to a ``vllm serve`` the test started with the documented command line."""
    import torch
    import transformers

    from hybridmem import ShardingManager
    from hybridmem.adapters.vllm.server import VLLMServerEngine
    from hybridmem.engines import SamplingParams

    engine = VLLMServerEngine.connect(url)
    model_dir = http_get(url, "/v1/models")["data"][0]["id"]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    manager = ShardingManager(model, engine, optimizer=opt)
    res: dict = {"steps": []}
    for step in range(2):
        lm_step(model, opt, step, model.config.vocab_size)
        with manager.inference() as e:
            got = [o.token_ids
                   for o in e.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]
        res["steps"].append({"got": got, "expected": hf_greedy(model),
                             "version": http_get(url, "/weight_info")["weight_version"]})
    manager.close()
    engine.close()
    with urllib.request.urlopen(url + "/health", timeout=60) as response:
        res["health_after_close"] = response.status  # close() of a connected engine leaves the server running
    return res


def fsdp_tp2(out: str, steps: str = "3") -> dict | None:
    """Two ranks under torchrun: FSDP2 Qwen2 (``from_pretrained``, ``fully_shard``), the server launched by
    rank 0 at TP 2 for the group, 3 training steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hybridmem import Direction, ShardingManager
    from hybridmem.adapters.vllm.server import VLLMServerEngine
    from hybridmem.engines import SamplingParams

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    box = [save_policy(tempfile.mkdtemp(prefix="policy-")) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    model_dir = box[0]
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = time.monotonic()
    engine = VLLMServerEngine.launch(model_dir, tensor_parallel_size=2, group=dist.group.WORLD,
                                     server_args=SERVER_ARGS, bucket_nbytes=BUCKET_NBYTES)
    launch_s = time.monotonic() - start
    manager = ShardingManager(model, engine, optimizer=opt)
    steps_out = []
    mine = ShmSampler(engine.directory, prefix=f"bucket-rank{rank}-")  # this rank's buckets
    everything = ShmSampler(engine.directory)  # the directory: both ranks' buckets, sockets, anything else
    for step in range(int(steps)):
        mine.reset()
        everything.reset()
        manager.to_infer()
        shm = {"rank_peak_nbytes": mine.reset()[0], "directory_peak_nbytes": everything.reset()[0]}
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        got = [o.token_ids for o in engine.generate(PROMPTS, greedy)]
        manager.to_train()
        sync = next(s for s in manager.last_reports[Direction.TO_INFER].steps if s.name == "weight sync")
        full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # a collective
        expected = None
        if rank == 0:
            ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            ref.load_state_dict(full)
            expected = hf_greedy(ref)
        steps_out.append({"got": got, "expected": expected, "sync": dict(sync.extra), **shm,
                          "version": engine.weight_version()})
        x = torch.randint(0, model.config.vocab_size, (4, 12),
                          generator=torch.Generator().manual_seed(1000 + step))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    mine.stop()
    everything.stop()
    manager.close()
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"rank": rank, "steps": steps_out,
                                      "bucket_nbytes": engine.bucket_nbytes})
    server = engine.server
    engine.close()
    res = None
    if rank == 0:
        res = {"launch_s": launch_s, "ranks": per_rank, "argv": server.argv, "server_pid": server.pid,
               "server_returncode": server.returncode}
        with open(out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()
    # FSDP2 keeps its gloo group's threads (gloo_tcp_loop, two pt_gloo_runloop) alive past
    # destroy_process_group (torch 2.13: they are there at exit even after the model is collected, where a
    # plain gloo job has none). A rank once aborted at exit beside them ("terminate called without an
    # active exception", after it had done and written everything): what this scenario checks is done and
    # written, so the ranks leave without finalizing the interpreter, which those threads cannot disturb.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launched(out: str, mode: str) -> dict | None:
    """Launch a server, print its pid and URL, then end as ``mode`` says: ``exit`` (after a line on stdin,
    return without ``close()``: the interpreter exits), ``kill`` (wait to be SIGKILLed), ``term`` (wait for
    SIGTERM, the default action: no Python cleanup)."""
    from hybridmem.adapters.vllm.server import VLLMServerEngine

    model_dir = save_policy(tempfile.mkdtemp(prefix="policy-"))
    engine = VLLMServerEngine.launch(model_dir, server_args=SERVER_ARGS)
    print(json.dumps({"server_pid": engine.server.pid, "url": engine.client.url}), flush=True)
    if mode == "exit":
        sys.stdin.readline()  # the test reads the server's processes, then lets this process end
        return {"server_pid": engine.server.pid}
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        time.sleep(1)


def bad_flag(out: str) -> dict:
    """A server that cannot start: the error shows the end of its log; nothing is left running."""
    from hybridmem.adapters.vllm.server import VLLMServerEngine
    from hybridmem.adapters.vllm.server.process import ServerProcess
    from hybridmem.errors import EngineProcessError

    started = []
    original = ServerProcess.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        started.append(self.pid)

    ServerProcess.__init__ = recording_init
    model_dir = save_policy(tempfile.mkdtemp(prefix="policy-"))
    try:
        VLLMServerEngine.launch(model_dir, server_args=["--max-model-len", "not-a-number"],
                                startup_timeout_s=600)
    except EngineProcessError as exc:
        return {"raised": type(exc).__name__, "message": str(exc), "server_pid": started[0]}
    return {"raised": None, "server_pid": started[0]}


SCENARIOS = {"http_tp1": http_tp1, "by_hand": by_hand, "fsdp_tp2": fsdp_tp2, "launched": launched,
             "bad_flag": bad_flag}

if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # an abort (a C++ thread left running at exit) shows every stack
    os.environ.update(VLLM_ENV)
    # launch sizes the KV cache to the model (the default under test)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
    name, out_path, *rest = sys.argv[1:]
    result = SCENARIOS[name](out_path, *rest)
    if result is not None:
        with open(out_path, "w") as f:
            json.dump(result, f)
