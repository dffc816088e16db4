"""Hugging Face TRL's own colocate mode against HybridGRPOTrainer: the same model, data, reward and seed.

    python benchmarks/trl_colocate.py --steps 8 --hidden 256

Each trainer runs in a process of its own (vLLM changes the process it runs in). Per step it prints:

- ``gen s``: wall time of the generation, switches included (``hybridmem``) or weight sync and, where
  the backend has one, sleep/wake included (``trl``);
- ``step s``: the whole optimizer step (TRL's ``step_time``);
- ``held MiB``: bytes of trainer state (parameters, grads, optimizer state) on the device while vLLM
  generates, measured the same way for both: the storages of those tensors that hold memory at that
  moment (on a GPU also ``mem_get_info``'s used bytes);
- ``moved MiB``: bytes the step moved for generation: the weights streamed into vLLM (both), plus what
  hybridmem's two switches copied between host and device (params, grads, optimizer state, both ways);
- ``logp gap``: TRL's ``sampling/sampling_logp_difference`` (mean and max): how far vLLM's log-probs of the
  sampled tokens are from the trainer's own, the error the importance ratio carries.

``--sleep`` turns on TRL's ``vllm_enable_sleep_mode`` where the backend has it (not vLLM's CPU build).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
       "TRL_EXPERIMENTAL_SILENCE": "1"}


def _state_nbytes(model, optimizer) -> int:
    """Device bytes of the trainer's parameters, grads and optimizer state (each storage counted once)."""
    import torch

    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in getattr(inner, "state", {}).values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def run(mode: str, args: argparse.Namespace, out: str) -> None:
    """One trainer (``trl`` or ``hybridmem``), writing per-step figures to ``out``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if mode == "hybridmem":  # before TRL's trainer: TRL's vLLM-range warning then prints once (docs/trl.md)
        from hybridmem.integrations.trl import HybridGRPOTrainer
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, os.path.join(HERE, "..", "tests", "integrations"))
    from _trl_tasks import PROMPTS, write_checkpoint

    model_dir = tempfile.mkdtemp(prefix="hybridmem-bench-")
    write_checkpoint(model_dir, hidden_size=args.hidden, layers=args.layers)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    a = tokenizer.convert_tokens_to_ids("a")

    def reward(completions, completion_ids, **kwargs):
        return [sum(t == a for t in ids) / max(1, len(ids)) for ids in completion_ids]

    config = GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=not torch.cuda.is_available(), bf16=False,
                        report_to="none", logging_steps=1, per_device_train_batch_size=8, num_generations=8,
                        max_completion_length=16, learning_rate=1e-2, max_steps=args.steps, seed=0,
                        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,
                        vllm_enable_sleep_mode=args.sleep,
                        vllm_gpu_memory_utilization=args.gpu_memory_utilization)
    dataset = Dataset.from_dict({"prompt": PROMPTS * 16})
    kwargs = dict(model=model, reward_funcs=reward, train_dataset=dataset, processing_class=tokenizer,
                  args=config)
    if mode == "hybridmem":
        trainer = HybridGRPOTrainer(**kwargs)
    else:
        trainer = GRPOTrainer(**kwargs)
    generation = trainer.vllm_generation
    steps: list[dict] = []
    generate, iterate = generation.generate, generation._iter_named_params
    moved = [0]

    def counted_params():  # what TRL's own sync streams into vLLM
        for name, tensor in iterate():
            moved[0] += tensor.numel() * tensor.element_size()
            yield name, tensor

    generation._iter_named_params = counted_params

    def timed_generate(*a, **k):
        held: list[int] = []
        original_vllm_generate = generation.llm.generate

        def measuring(*ga, **gk):
            held.append(_state_nbytes(trainer.model, trainer.optimizer))
            if torch.cuda.is_available():
                free, total = torch.cuda.mem_get_info()
                held.append(total - free)
            return original_vllm_generate(*ga, **gk)

        generation.llm.generate = measuring
        start = time.perf_counter()
        try:
            result = generate(*a, **k)
        finally:
            generation.llm.generate = original_vllm_generate
        record = {"gen_s": time.perf_counter() - start, "held": held, "sync_moved": moved[0]}
        moved[0] = 0
        if mode == "trl":  # its weight sync ran just before generate(): it serves this generation
            record["gen_s"] += generation.sync_weights.seconds
            generation.sync_weights.seconds = 0.0
        if mode == "hybridmem" and trainer.hybrid_reports:
            r = trainer.hybrid_reports[-1]
            record["sync_moved"] = trainer.hybrid_engine.last_load.nbytes  # the weights streamed into vLLM
            record["switch_moved"] = sum(s.copied_nbytes for s in (*r.to_infer.steps, *r.to_train.steps))
            record["to_infer_s"], record["to_train_s"] = r.to_infer.seconds, r.to_train.seconds
        steps.append(record)
        return result

    generation.generate = timed_generate
    if mode == "trl":  # TRL syncs before generate; count that sync with the step it serves
        sync = generation.sync_weights

        def timed_sync():
            start = time.perf_counter()
            sync()
            timed_sync.seconds = time.perf_counter() - start

        timed_sync.seconds = 0.0
        generation.sync_weights = timed_sync
    trainer.train()
    logs = [h for h in trainer.state.log_history if "step_time" in h]
    for record, log in zip(steps, logs):
        record["step_s"] = log["step_time"]
        record["reward"] = log.get("reward")
        record["logp_gap_mean"] = log.get("sampling/sampling_logp_difference/mean")
        record["logp_gap_max"] = log.get("sampling/sampling_logp_difference/max")
    with open(out, "w") as f:
        json.dump({"mode": mode, "steps": steps,
                   "weights_nbytes": sum(p.numel() * p.element_size() for p in model.parameters())}, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sleep", action="store_true",
                   help="TRL's vllm_enable_sleep_mode (not on vLLM's CPU build)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--out", default=None, help="write both runs' figures as JSON here")
    p.add_argument("--mode", choices=("trl", "hybridmem"), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        run(args.mode, args, args.result)
        return
    results = {}
    for mode in ("trl", "hybridmem"):
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "r.json")
            cmd = [sys.executable, __file__, "--mode", mode, "--result", result, "--steps", str(args.steps),
                   "--hidden", str(args.hidden), "--layers", str(args.layers),
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                   *(["--sleep"] if args.sleep else [])]
            proc = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{mode} run failed:\n{proc.stderr[-4000:]}")
            with open(result) as f:
                results[mode] = json.load(f)
    mib = 2**20
    print(f"model: {results['trl']['weights_nbytes'] / mib:.2f} MiB of weights; {args.steps} steps; "
          f"{'sleep mode on' if args.sleep else 'no sleep mode'}")
    print(f"{'step':>4} | {'mode':>9} | {'gen s':>6} | {'step s':>6} | {'held MiB':>8} | {'moved MiB':>9} | "
          f"{'logp gap mean':>13} | {'max':>7} | {'reward':>6}")
    for i in range(args.steps):
        for mode in ("trl", "hybridmem"):
            rows = results[mode]["steps"]
            if i >= len(rows):
                continue
            r = rows[i]
            moved = r.get("switch_moved", 0) + r["sync_moved"]
            held = r["held"][0] if r["held"] else float("nan")
            print(f"{i:>4} | {mode:>9} | {r['gen_s']:6.3f} | {r.get('step_s', float('nan')):6.3f} | "
                  f"{held / mib:8.2f} | {moved / mib:9.2f} | "
                  f"{r.get('logp_gap_mean') or float('nan'):13.2e} | "
                  f"{r.get('logp_gap_max') or float('nan'):7.1e} | {r.get('reward') or 0:6.3f}")
    for mode in ("trl", "hybridmem"):
        rows = results[mode]["steps"][1:]  # after the first (compilation, lazy optimizer state)
        if rows:
            print(f"median after step 0, {mode}: gen {statistics.median(r['gen_s'] for r in rows):.3f} s, "
                  f"step {statistics.median(r.get('step_s', 0) for r in rows):.3f} s, held "
                  f"{statistics.median(r['held'][0] for r in rows if r['held']) / mib:.2f} MiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
