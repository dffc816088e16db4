"""LoRA into a real vLLM: the adapter-only sync against the merged sync, bytes and seconds per switch.

    python benchmarks/lora_switch.py --json lora_switch.json
    python benchmarks/lora_switch.py --hidden 1024 --layers 8 --rank 16

A small Qwen2 checkpoint (fp32, ``save_pretrained``) is served by one in-process vLLM with LoRA
(``enable_lora``, ``max_loras=1``). A PEFT LoRA model of the same checkpoint (adapters on q/k/v/o and
gate/up/down) then runs ``--steps`` cycles of one optimizer step and one TRAIN->INFER / INFER->TRAIN switch
under a ShardingManager, twice on the same engine, each route with a fresh PEFT model of the same seed:

(a) ``adapters``: the default sync (``LoraSync``): the base once, then the adapters as a new vLLM LoRA
    request on every switch;
(b) ``merged``: ``LoadWeightsSync(lambda: merged_lora_weights(model), engine)``: the adapters merged into
    the base and the whole model streamed through ``reload_weights`` on every switch (the engine's adapter
    dropped first, as ``LoraSync``'s merged route does, so it is not applied twice).

For each route it prints the first switch and the steady state (median of the others): the bytes and
seconds of the weight-sync step and the seconds of the whole TRAIN->INFER switch, and the ratio
merged / adapters. After the last switch of each route it checks that vLLM's greedy tokens equal PEFT's.
Figures are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1"}
PROMPTS = [[2, 3, 4, 5], [(7 * i + 3) % 60 + 1 for i in range(40)]]
MAX_TOKENS = 6
ROUTES = ("adapters", "merged")


def refusal(args: argparse.Namespace) -> str | None:
    """Why these options cannot run, or ``None``."""
    if args.hidden < 64 or args.hidden % 64:
        return (f"--hidden {args.hidden}: must be a multiple of 64 (heads of 32 or 64, as vLLM's CPU "
                "attention needs)")
    if args.layers < 1:
        return f"--layers {args.layers}: must be at least 1"
    if args.rank < 1:
        return f"--rank {args.rank}: must be at least 1"
    if args.steps < 2:
        return f"--steps {args.steps}: must be at least 2 (the first switch and a steady state)"
    if args.vocab < 128:
        return f"--vocab {args.vocab}: must be at least 128 (the prompts' token ids)"
    return None


def write_checkpoint(path: str, args: argparse.Namespace) -> dict:
    """A Qwen2 of the given size, saved as users save it; its config."""
    import torch
    import transformers

    head_dim = 32 if args.hidden < 256 else 64
    config = {"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
              "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // head_dim,
              "num_key_value_heads": max(1, args.hidden // (4 * head_dim)), "head_dim": head_dim,
              "vocab_size": args.vocab, "max_position_embeddings": 256, "tie_word_embeddings": False}
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config)).save_pretrained(path)
    return config


def peft_model(path: str, rank: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(1)
    return get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))


def train_step(model, opt, step: int, vocab: int) -> None:
    import torch

    batch = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(1000 + step))
    opt.zero_grad()
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()


def hf_greedy(model) -> list[list[int]]:
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(ids[0, len(p):].tolist())
    model.train()
    return out


def vllm_greedy(engine) -> list[list[int]]:
    from hybridmem.engines import SamplingParams

    return [o.token_ids
            for o in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                             logprobs=False))]


def merged_sync(model, engine):
    """The merged route: the whole model, adapters merged in, through ``reload_weights``; the engine's
    adapter dropped first (``LoraSync``'s merged route does the same)."""
    from hybridmem.weight_sync import LoadWeightsSync
    from hybridmem.weight_sync.lora import merged_lora_weights

    class MergedLoraSync(LoadWeightsSync):
        def sync(self):
            if self.engine.lora_request is not None:  # an adapter over merged weights would apply it twice
                self.engine.drop_lora()
            return super().sync()

    return MergedLoraSync(lambda: merged_lora_weights(model), engine)


def run_route(path: str, engine, route: str, args: argparse.Namespace) -> dict:
    """``--steps`` cycles of a training step and a switch on one route; the figures of each switch."""
    import torch

    from hybridmem import Direction, ShardingManager
    from hybridmem.weight_sync import LoraSync

    model = peft_model(path, args.rank)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sync = LoraSync(model, engine) if route == "adapters" else merged_sync(model, engine)
    manager = ShardingManager(model, engine, optimizer=opt, weight_sync=sync)
    out = {"route": route, "sync_route": getattr(getattr(sync, "route", None), "value", route),
           "adapter_nbytes": sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                                 if ".lora_" in n),
           "base_nbytes": sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                              if ".lora_" not in n),
           "switches": []}
    for step in range(args.steps):
        train_step(model, opt, step, args.vocab)
        last = step == args.steps - 1
        expected = hf_greedy(model) if last else None
        manager.to_infer()
        report = manager.last_reports[Direction.TO_INFER]
        (sync_step,) = [s for s in report.steps if s.name == "weight sync"]
        got = vllm_greedy(engine) if last else None
        manager.to_train()
        out["switches"].append({"sync_nbytes": sync_step.copied_nbytes, "sync_s": sync_step.seconds,
                                "to_infer_s": report.seconds,
                                "to_train_s": manager.last_reports[Direction.TO_TRAIN].seconds})
        if last:
            out["greedy_equal"] = got == expected
    manager.close()
    return out


def summary(res: dict) -> dict:
    """First switch and steady state (median of the others) of each figure."""
    first, rest = res["switches"][0], res["switches"][1:]
    return {k: {"first": first[k], "steady": statistics.median(s[k] for s in rest)}
            for k in ("sync_nbytes", "sync_s", "to_infer_s", "to_train_s")}


def table(fig: dict) -> Table:
    out = Table(title=f"LoRA switch into vLLM: base {fig['base_nbytes']:,} B, adapters "
                      f"{fig['adapter_nbytes']:,} B")
    for col in ("figure", *ROUTES, "merged / adapters"):
        out.add_column(col, justify="left" if col == "figure" else "right")
    rows = (("weight sync bytes", "sync_nbytes", lambda v: f"{int(v):,}"),
            ("weight sync ms", "sync_s", lambda v: f"{1e3 * v:.1f}"),
            ("TRAIN->INFER ms", "to_infer_s", lambda v: f"{1e3 * v:.1f}"),
            ("INFER->TRAIN ms", "to_train_s", lambda v: f"{1e3 * v:.1f}"))
    for label, key, fmt in rows:
        for when in ("first", "steady"):
            a, m = (fig["summary"][r][key][when] for r in ROUTES)
            out.add_row(f"{label}, {when}", fmt(a), fmt(m), f"{m / a:.2f}x" if a else "-")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (vLLM's max_lora_rank)")
    parser.add_argument("--steps", type=int, default=5, help="switches per route (>= 2)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    refused = refusal(args)
    if refused:
        parser.error(refused)
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, str(ROOT))
    import torch
    import vllm

    from hybridmem.adapters.vllm import VLLMEngine

    path = tempfile.mkdtemp(prefix="hybridmem-lora-switch-")
    config = write_checkpoint(path, args)
    start = time.perf_counter()
    engine = VLLMEngine.create(path, distributed_executor_backend=None, skip_tokenizer_init=True,
                               enable_lora=True, max_lora_rank=args.rank, max_loras=1, dtype="float32",
                               enforce_eager=True, max_model_len=128, seed=0, block_size=32)
    fig = {"vllm": vllm.__version__, "torch": torch.__version__,
           "machine": f"{platform.node()} {os.cpu_count()} CPUs", "load_average": os.getloadavg(),
           "config": config, "rank": args.rank, "steps": args.steps,
           "engine_build_s": time.perf_counter() - start, "routes": {}}
    for route in ROUTES:
        fig["routes"][route] = run_route(path, engine, route, args)
    engine.close()
    fig["adapter_nbytes"] = fig["routes"]["adapters"]["adapter_nbytes"]
    fig["base_nbytes"] = fig["routes"]["adapters"]["base_nbytes"]
    fig["summary"] = {r: summary(fig["routes"][r]) for r in ROUTES}
    console = Console(width=120)
    console.print(f"vLLM {fig['vllm']}, torch {fig['torch']}, {fig['machine']}, load average "
                  f"{' '.join(f'{x:.1f}' for x in fig['load_average'])}; engine start "
                  f"{fig['engine_build_s']:.1f} s")
    console.print(f"Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, LoRA rank "
                  f"{args.rank}, {args.steps} switches per route")
    console.print(table(fig))
    console.print("greedy tokens equal to PEFT's after the last switch: "
                  + ", ".join(f"{r}: {fig['routes'][r]['greedy_equal']}" for r in ROUTES))
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
