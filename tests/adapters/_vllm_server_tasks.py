"""Scenarios with vLLM's engine in its own process (an AsyncLLM, or ``vllm serve``), each run in a process of
its own by test_vllm_server.py: ``python _vllm_server_tasks.py SCENARIO OUT.json [ARGS]`` writes its
findings as JSON. References are transformers' models on the trained weights.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time

VLLM_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1800",  # a loaded 2-core machine can take minutes for a step
}
ENGINE_ARGS = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 256, "max_num_seqs": 16,
               "enforce_eager": True, "seed": 0}
# The last prompt spans full KV blocks, which vLLM's prefix cache keeps across requests: an update without a
# prefix-cache reset would reuse KV computed with the old weights.
PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [5, 17, 33, 2, 11], [(7 * i + 3) % 200 + 1 for i in range(40)]]
MAX_TOKENS = 8
BUCKET_NBYTES = 96 << 10
"""Smaller than the policy's largest tensor (``gate_up_proj``, 512 x 128 fp32: 256 KiB), so a tensor is split
across buckets, and a fifteenth of its vLLM layout (1.4 MB), so a sync reuses each bucket several times."""


class ShmSampler:
    """Samples, every ``every_s`` on a thread of its own, the bytes the files in ``directory`` hold in memory
    (``st_blocks``: the pages allocated, which is what a file in ``/dev/shm`` takes of RAM), and keeps the
    largest figure since :meth:`reset` (of the files whose names start with ``prefix``)."""

    def __init__(self, directory: str, every_s: float = 0.002, prefix: str = ""):
        self.directory = directory
        self.every_s = every_s
        self.prefix = prefix
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def held(self) -> int:
        total = 0
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return 0
        for entry in entries:
            if not entry.name.startswith(self.prefix):
                continue
            try:
                total += entry.stat(follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:
                continue
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.held())
            self.samples += 1
            time.sleep(self.every_s)

    def reset(self) -> tuple[int, int]:
        """The peak and the number of samples since the last reset."""
        out = (max(self.peak, self.held()), self.samples)
        self.peak, self.samples = 0, 0
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def save_policy(directory: str) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(directory)
    return directory


def hf_greedy(model) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(ids[0, len(p):].tolist())
    return out


def lm_step(model, optimizer, step: int, vocab: int) -> float:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    batch = torch.randint(0, vocab, (4, 12), generator=g)
    loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss)


def layout_nbytes(engine) -> int:
    """Bytes of this rank's vLLM layout, from the worker's report (the shapes the tests write out)."""
    import math

    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in engine.layout.values())


def train_and_switch(engine, model_dir: str, steps: int) -> dict:
    """The user's loop: ``from_pretrained``, AdamW, a manager with defaults; per step a switch, greedy tokens,
    the engine's weight version, a training step. A thread samples what the engine's shared directory holds
    in ``/dev/shm`` during every switch."""
    import torch
    import transformers

    from hybridmem import Direction, ShardingManager
    from hybridmem.engines import SamplingParams

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    manager = ShardingManager(model, engine, optimizer=opt)
    res = {"steps": [], "vllm_layout_nbytes": layout_nbytes(engine), "bucket_nbytes": engine.bucket_nbytes,
           "largest_tensor_nbytes": max(p.numel() * p.element_size() for p in model.parameters())}
    sampler = ShmSampler(engine.directory)
    try:
        for step in range(steps):
            sampler.reset()
            manager.to_infer()
            shm_peak, samples = sampler.reset()
            got = [o.token_ids
                   for o in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]
            version = engine.weight_version()
            manager.to_train()
            sync = next(s for s in manager.last_reports[Direction.TO_INFER].steps if s.name == "weight sync")
            res["steps"].append({"got": got, "expected": hf_greedy(model), "version": version,
                                 "sync": dict(sync.extra), "shm_peak_nbytes": shm_peak,
                                 "shm_samples": samples})
            lm_step(model, opt, step, model.config.vocab_size)
    finally:
        sampler.stop()
    res["bad_buckets"] = bad_bucket_sizes(engine, manager, model, opt)
    manager.close()
    return res


def bad_bucket_sizes(engine, manager, model, opt) -> dict:
    """A second engine built on the same client with a bucket size of 0, and of more than ``/dev/shm`` holds:
    each one named error before the engine is asked anything; the training state bitwise as before, and the
    first engine still serves the trained weights (a second engine's construction re-initialises the
    workers: it must not have got that far)."""
    import shutil

    from hybridmem.adapters.vllm.server import VLLMServerEngine
    from hybridmem.engines import SamplingParams
    from hybridmem.testing.tiny import assert_bitwise_equal, snapshot

    before = snapshot(model, opt)
    out = {}
    too_large = shutil.disk_usage("/dev/shm").free // 2 + 4096
    for label, value in (("zero", 0), ("negative", -4096), ("too_large", too_large)):
        try:
            VLLMServerEngine(engine.client, hf_config=engine.hf_config, bucket_nbytes=value)
            out[label] = {"raised": None}
        except Exception as exc:  # the test checks the class and the message
            out[label] = {"raised": type(exc).__name__, "message": str(exc), "value": value}
    try:
        assert_bitwise_equal(before, snapshot(model, opt))
        out["state_intact"] = True
    except AssertionError as exc:
        out["state_intact"] = str(exc)
    expected = hf_greedy(model)
    with manager.inference() as e:
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        got = [o.token_ids for o in e.generate(PROMPTS, greedy)]
    out["after"] = {"got": got, "expected": expected, "version": engine.weight_version()}
    return out


def async_tp1(out: str, steps: str = "3") -> dict:
    """An AsyncLLM (engine core and worker in processes of their own) with hybridmem's backend."""
    from hybridmem.adapters.vllm.server import VLLMServerEngine

    model_dir = save_policy(tempfile.mkdtemp(prefix="policy-"))
    engine = VLLMServerEngine.start_async(model_dir, engine_kwargs={"bucket_nbytes": BUCKET_NBYTES},
                                          **ENGINE_ARGS)
    try:
        res = train_and_switch(engine, model_dir, int(steps))
    finally:
        engine.close()
    res["left_in_staging_directory"] = (sorted(os.listdir(engine.directory))
                                        if os.path.exists(engine.directory) else None)
    return res


SCENARIOS = {"async_tp1": async_tp1}

if __name__ == "__main__":
    os.environ.update(VLLM_ENV)
    name, out_path, *rest = sys.argv[1:]
    result = SCENARIOS[name](out_path, *rest)
    with open(out_path, "w") as f:
        json.dump(result, f)
