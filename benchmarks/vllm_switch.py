"""Switch times with a real vLLM: a transformers Qwen2 trained with AdamW, switched through
ShardingManager into a co-located vLLM (one in-process worker), weights streamed through vLLM's
``reload_weights`` (the only way into vLLM's CPU backend; GPU backends can also write in place).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/vllm_switch.py --hidden 512

Prints the median TRAIN->INFER and INFER->TRAIN times, the weight-sync step and its rate, over
``--switches`` switches after one warm-up switch.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--switches", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()

    import torch
    import transformers

    from hybridmem import Direction, ShardingManager
    from hybridmem.adapters.vllm import VLLMEngine
    from hybridmem.engines import SamplingParams
    from hybridmem.weight_sync import LoadWeightsSync

    dtype = getattr(torch, args.dtype)
    cfg = transformers.Qwen2Config(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                   num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    engine = VLLMEngine.create(cfg, distributed_executor_backend=None, dtype=args.dtype, enforce_eager=True,
                               max_model_len=256, seed=0)
    create_s = time.perf_counter() - t0
    manager = ShardingManager(model, engine, optimizer=opt,
                              weight_sync=LoadWeightsSync(model.named_parameters, engine))
    nbytes = sum(t.numel() * t.element_size() for t in model.parameters())
    to_infer, to_train, sync = [], [], []
    for i in range(args.switches + 1):
        batch = torch.randint(0, args.vocab, (2, 16))
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        manager.to_infer()
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
        manager.to_train()
        if i == 0:
            continue  # warm-up
        r_in, r_out = manager.last_reports[Direction.TO_INFER], manager.last_reports[Direction.TO_TRAIN]
        to_infer.append(r_in.seconds)
        to_train.append(r_out.seconds)
        sync.append(next(s.seconds for s in r_in.steps if s.name == "weight sync"))
    med = statistics.median
    print(f"model: {nbytes / 2**20:.1f} MiB of weights ({args.dtype}), LLM created in {create_s:.1f} s")
    print(f"TRAIN->INFER median {med(to_infer) * 1e3:.1f} ms, INFER->TRAIN median "
          f"{med(to_train) * 1e3:.1f} ms")
    print(f"weight sync (reload_weights) median {med(sync) * 1e3:.1f} ms = "
          f"{nbytes / med(sync) / 1e9:.2f} GB/s")
    print(f"release/resume: {engine.memory_note}")
    engine.close()


if __name__ == "__main__":
    main()
