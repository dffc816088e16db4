"""Weight sync into vLLM with its engine in its own process against the engine in the trainer's process.

The same transformers Qwen2 (saved once, loaded with ``from_pretrained``), AdamW, a ``ShardingManager``
with its defaults, one training step before every TRAIN->INFER switch, on three engines, one after the
other, each in a child process of its own (an in-process vLLM takes over the process's threads, seeds
and environment):

- ``in-process``: ``VLLMEngine.create`` (vLLM's worker in the trainer's process; weights through
  ``reload_weights`` on vLLM's CPU build);
- ``AsyncLLM``: ``VLLMServerEngine.start_async`` (engine core and worker in processes of their own; the
  trainer streams the vLLM layout through two reused buckets in ``/dev/shm`` and the worker copies it out
  in one update transaction);
- ``HTTP``: ``VLLMServerEngine.launch`` (``vllm serve``; the same buckets, the transaction over HTTP).

    python benchmarks/engine_process.py --hidden 512 --layers 4 --vocab 8192 --switches 10

Prints, per engine, the median TRAIN->INFER switch, its weight-sync step (for the engines in their own
process: of which the streaming through the buckets, the trainer's figures read apart from a copy, the
worker's copies out of the buckets that take its figures, and figures it read apart), the control
calls of both directions (start, update's answer, finish, prefix-cache reset; pause, resume, sleep and
wake where made), INFER->TRAIN, and the bytes each rank moves into the engine per switch. The greedy
tokens of every switch are checked equal across the three engines. With ``--sizes small,large`` (30.5 MiB
and about 600 MiB) it runs both and fits, per engine, the fixed cost of a switch and the per-byte cost of
its sync:

    python benchmarks/engine_process.py --sizes small,large --switches 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ENGINES = ("in-process", "AsyncLLM", "HTTP")
PROMPTS = [[1, 2, 3, 4], [9, 8, 7]]
ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1800"}


def save_model(directory: str, args: argparse.Namespace) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                   num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(directory)


def make_engine(kind: str, model_dir: str):
    if kind == "in-process":
        from hybridmem.adapters.vllm import VLLMEngine

        return VLLMEngine.create(model_dir, dtype="float32", max_model_len=256, skip_tokenizer_init=True,
                                 enforce_eager=True, seed=0)
    from hybridmem.adapters.vllm.server import VLLMServerEngine

    if kind == "AsyncLLM":
        return VLLMServerEngine.start_async(model_dir, skip_tokenizer_init=True, dtype="float32",
                                            max_model_len=256, enforce_eager=True, seed=0)
    return VLLMServerEngine.launch(model_dir, server_args=["--dtype", "float32", "--max-model-len", "256",
                                                           "--enforce-eager", "--seed", "0"])


def child(kind: str, model_dir: str, switches: int) -> dict:
    """One engine's run; returns its figures (the last line of stdout, as JSON)."""
    import torch
    import transformers

    from hybridmem import Direction, ShardingManager
    from hybridmem.engines import SamplingParams

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    engine = make_engine(kind, model_dir)
    start_s = time.perf_counter() - start
    manager = ShardingManager(model, engine, optimizer=opt)
    runs, tokens = [], []
    vocab = model.config.vocab_size
    weights_nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log = getattr(engine, "control_log", None)  # the engines in their own process: (call, seconds)

    def control_s(since: int) -> float | None:
        return None if log is None else sum(t for _, t in list(log)[since:])

    try:
        for i in range(switches + 1):
            batch = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(i))
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if log is not None:
                log.clear()
            manager.to_infer()
            control_in = control_s(0)
            tokens.append([o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=4,
                                                                                        temperature=0.0))])
            mark = 0 if log is None else len(log)  # generation's own calls are not the switch's
            manager.to_train()
            control_out = control_s(mark)
            r_in, r_out = manager.last_reports[Direction.TO_INFER], manager.last_reports[Direction.TO_TRAIN]
            sync = next(s for s in r_in.steps if s.name == "weight sync")
            runs.append({"to_infer_s": r_in.seconds, "to_train_s": r_out.seconds, "sync_s": sync.seconds,
                         "update_s": sync.extra.get("engine_update_s"),
                         "received_nbytes": sync.extra.get("received_nbytes", 0),
                         # in process, the sync streams every HF tensor of the rank into reload_weights
                         "engine_nbytes": sync.extra.get("engine_update_nbytes", weights_nbytes),
                         "stream_s": sync.extra.get("engine_stream_s"),
                         "checksum_s": sync.extra.get("engine_checksum_s"),
                         "worker_checksum_s": sync.extra.get("engine_worker_checksum_s"),
                         "worker_copy_s": sync.extra.get("engine_worker_copy_s"),
                         "control_in_s": control_in, "control_out_s": control_out})
        manager.close()
    finally:
        engine.close()
    return {"engine": kind, "start_s": start_s, "runs": runs[1:], "tokens": tokens,
            "weights_nbytes": weights_nbytes}


def run_child(kind: str, model_dir: str, switches: int, timeout_s: float) -> dict:
    env = {**os.environ, **{k: v for k, v in ENV.items() if k not in os.environ}}
    proc = subprocess.Popen([sys.executable, __file__, "--child", kind, "--model-dir", model_dir,
                             "--switches", str(switches)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(f"{kind}: no result within {timeout_s} s") from None
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed (status {proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _ms(values: list, scale: float = 1e3) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values) * scale:.0f}" if values else "-"


def _control_s(runs: list[dict]) -> list[float | None]:
    """Per switch, the control calls of both directions (``None`` for the in-process engine)."""
    return [None if x["control_in_s"] is None else x["control_in_s"] + x["control_out_s"] for x in runs]


def table(results: list[dict]) -> str:
    """Per engine, medians over the switches."""
    med = statistics.median
    head = ("| engine | start s | TRAIN->INFER ms | weight sync ms | of which streaming ms | "
            "of which figures read apart ms (trainer) | worker's copies with figures ms | "
            "worker's figures read apart ms | "
            "control calls ms (TRAIN->INFER + INFER->TRAIN) | bytes per rank into the engine | sync GB/s | "
            "INFER->TRAIN ms |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        runs = r["runs"]
        sync_s = med(x["sync_s"] for x in runs)
        nbytes = runs[-1]["engine_nbytes"]
        control = _control_s(runs)
        lines.append(f"| {r['engine']} | {r['start_s']:.1f} | "
                     f"{med(x['to_infer_s'] for x in runs) * 1e3:.0f} | {sync_s * 1e3:.0f} | "
                     f"{_ms([x['stream_s'] for x in runs])} | {_ms([x['checksum_s'] for x in runs])} | "
                     f"{_ms([x['worker_copy_s'] for x in runs])} | "
                     f"{_ms([x['worker_checksum_s'] for x in runs])} | {_ms(control)} | {nbytes:,} | "
                     f"{nbytes / sync_s / 1e9:.2f} | {med(x['to_train_s'] for x in runs) * 1e3:.0f} |")
    return "\n".join(lines)


def fit(by_size: list[list[dict]]) -> str:
    """Per engine, from the smallest and the largest model: the fixed cost of a switch (both directions'
    switch time at zero bytes, the line through the two sizes) and the per-byte cost of the sync."""
    med = statistics.median
    lines = ["| engine | fixed cost per switch ms (both directions, fitted) | control calls ms (measured, "
             "largest model) | sync ns per byte | sync GB/s (largest) | vs in-process GB/s |",
             "|---|---:|---:|---:|---:|---:|"]
    small, large = by_size[0], by_size[-1]
    base = None
    for a, b in zip(small, large):
        na, nb = a["runs"][-1]["engine_nbytes"], b["runs"][-1]["engine_nbytes"]
        sync_a, sync_b = med(x["sync_s"] for x in a["runs"]), med(x["sync_s"] for x in b["runs"])
        both_a = med(x["to_infer_s"] + x["to_train_s"] for x in a["runs"])
        both_b = med(x["to_infer_s"] + x["to_train_s"] for x in b["runs"])
        slope = (both_b - both_a) / (nb - na)
        control = _control_s(b["runs"])
        gbps = nb / sync_b / 1e9
        base = gbps if base is None else base
        lines.append(f"| {b['engine']} | {(both_a - slope * na) * 1e3:.0f} | {_ms(control)} | "
                     f"{(sync_b - sync_a) / (nb - na) * 1e9:.2f} | {gbps:.2f} | {gbps / base:.2f}x |")
    return "\n".join(lines)


SIZES = {"small": (256, 4, 8192), "large": (1024, 6, 32768)}
"""``--sizes`` presets: (hidden, layers, vocab) of a Qwen2: 30.5 MiB and about 600 MiB in fp32."""


def run_size(args: argparse.Namespace, engines: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="engine-process-") as model_dir:
        save_model(model_dir, args)
        results = []
        for kind in engines:
            print(f"running {kind} ...", flush=True)
            results.append(run_child(kind, model_dir, args.switches, args.timeout_s))
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    print(f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
          f"{results[0]['weights_nbytes'] / 2**20:.1f} MiB fp32; medians of {args.switches} "
          f"switches after one warm-up; greedy tokens equal across engines every switch: {same}")
    print(table(results), flush=True)
    if not same:
        raise SystemExit("the engines generated different tokens")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--sizes", help=f"comma-separated presets of {sorted(SIZES)} run one after the other "
                   "(instead of --hidden/--layers/--vocab), then the fixed and per-byte costs fitted")
    p.add_argument("--switches", type=int, default=10)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {ENGINES}")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per engine")
    p.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model_dir, args.switches)), flush=True)
        return
    engines = [e.strip() for e in args.engines.split(",")]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"--engines: {unknown} unknown; expected some of {ENGINES}")
    if not args.sizes:
        run_size(args, engines)
        return
    sizes = [x.strip() for x in args.sizes.split(",")]
    bad = [x for x in sizes if x not in SIZES]
    if bad or len(sizes) < 2:
        raise SystemExit(f"--sizes: {args.sizes!r}; expected two or more of {sorted(SIZES)}")
    by_size = []
    for size in sizes:
        args.hidden, args.layers, args.vocab = SIZES[size]
        by_size.append(run_size(args, engines))
    print(fit(by_size))


if __name__ == "__main__":
    main()
