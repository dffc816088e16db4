"""Scenarios against a real vLLM (the CPU build), each run in its own process by test_vllm_real.py.

``python _vllm_real_tasks.py SCENARIO OUT.json`` runs one scenario and writes its findings as JSON; the
test module asserts on them. A process of its own per scenario because ``vllm.LLM`` changes the caller's
environment, thread count and global seed. References are transformers' models on the same weights.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile

VLLM_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
LLM_KWARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 128, "seed": 0, "block_size": 32}
# The last prompt spans full KV blocks, which vLLM's prefix cache keeps across requests: a weight update
# without a prefix-cache reset would reuse KV computed with the old weights.
PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [5, 17, 33, 2, 11], [(7 * i + 3) % 200 + 1 for i in range(40)]]
MAX_TOKENS = 8


def rss_nbytes() -> int:
    """Resident set size of this process, from the kernel (/proc/self/status VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def hf_greedy(model, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                 min_new_tokens=max_tokens, pad_token_id=0, eos_token_id=None)
            out.append(ids[0, len(p):].tolist())
    return out


def vllm_greedy(engine, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    from hybridmem.engines import SamplingParams

    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=False))
    return [o.token_ids for o in outs]


def lm_step(model, optimizer, step: int, vocab: int) -> float:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    batch = torch.randint(0, vocab, (4, 12), generator=g)
    loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss)


def _report_summary(manager) -> dict:
    from hybridmem import Direction

    out = {}
    for d in (Direction.TO_INFER, Direction.TO_TRAIN):
        r = manager.last_reports.get(d)
        if r is None:
            continue
        out[d.name] = {"seconds": r.seconds, "text": str(r),
                       "steps": {s.name: {"seconds": s.seconds, "zero_nbytes": s.zero_nbytes,
                                          "extra": s.extra}
                                 for s in r.steps}}
    return out


def torch_tp1(num_switches: int) -> dict:
    """A transformers Qwen2 trained with AdamW, switched through ShardingManager into vLLM TP1."""
    import time

    import torch
    import transformers

    from hybridmem import ShardingManager
    from hybridmem.adapters.vllm import VLLMEngine
    from hybridmem.weight_sync import LoadWeightsSync

    cfg = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                   max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).float()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    t0 = time.perf_counter()
    engine = VLLMEngine.create(cfg, distributed_executor_backend=None, **LLM_KWARGS)
    create_s = time.perf_counter() - t0
    # The HF checkpoint's tensors are the parameters (named_weights would add the RoPE buffers).
    manager = ShardingManager(model, engine, optimizer=opt,
                              weight_sync=LoadWeightsSync(model.named_parameters, engine))
    weights_nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    res = {"create_s": create_s, "weights_nbytes": weights_nbytes,
           "num_engine_params": len(engine.worker_info.params),
           "repacked": list(engine.worker_info.repacked), "in_place": engine.capabilities.writes_in_place,
           "frees_memory": engine.frees_memory, "steps": [], "rss": [], "to_infer_s": [], "to_train_s": [],
           "sync_s": [], "load": []}
    # The attach-time check must reject a layout that names one tensor differently (a swapped name).
    from hybridmem.adapters.vllm.names import engine_layout_shapes

    config = engine.llm.llm_engine.vllm_config
    expected, _ = engine_layout_shapes(config.model_config.hf_config, config.parallel_config, 0)
    wrong = {("model.layers.0.mlp.gate_proj.weight" if n == "model.layers.0.mlp.gate_up_proj.weight"
              else n): t
             for n, t in expected.items()}
    try:
        engine.check_weights(wrong, what="a renamed layout")
        res["renamed_check"] = "accepted"
    except ValueError as exc:
        res["renamed_check"] = str(exc)
    shapes = {n: (t.shape[0] + 1, *t.shape[1:]) if n == "model.embed_tokens.weight" else t.shape
              for n, t in expected.items()}
    try:
        engine.check_weights(shapes, what="a layout with a wrong embedding shape")
        res["shape_check"] = "accepted"
    except ValueError as exc:
        res["shape_check"] = str(exc)
    for i in range(num_switches):
        lm_step(model, opt, i, cfg.vocab_size)
        check = i < 3 or i == num_switches - 1
        expected = hf_greedy(model) if check else None
        manager.to_infer()
        got = vllm_greedy(engine)
        summary = _report_summary(manager)
        manager.to_train()
        summary.update({k: v for k, v in _report_summary(manager).items() if k == "TO_TRAIN"})
        res["rss"].append(rss_nbytes())
        res["to_infer_s"].append(summary["TO_INFER"]["seconds"])
        res["to_train_s"].append(summary["TO_TRAIN"]["seconds"])
        res["sync_s"].append(summary["TO_INFER"]["steps"]["weight sync"]["seconds"])
        res["load"].append([engine.last_load.num_tensors, engine.last_load.nbytes])
        if check:
            res["steps"].append({"switch": i, "expected": expected, "got": got})
        if i == 0:
            res["report"] = summary
    return res


def qwen2_moe() -> dict:
    """A Qwen2-MoE from transformers, served by vLLM from its checkpoint through the adapter."""
    import torch
    import transformers
    import vllm
    from safetensors.torch import load_file

    from hybridmem.adapters.vllm import VLLMEngine
    from hybridmem.adapters.vllm.names import engine_layout_shapes

    cfg = transformers.Qwen2MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
        decoder_sparse_step=1,
        norm_topk_prob=False, mlp_only_layers=[], rms_norm_eps=1e-6, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(cfg).float().eval()
    ckpt = tempfile.mkdtemp()
    model.save_pretrained(ckpt, safe_serialization=True)
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))  # the checkpoint's own names
    engine = VLLMEngine(vllm.LLM(model=ckpt, skip_tokenizer_init=True, **LLM_KWARGS))
    config = engine.llm.llm_engine.vllm_config
    expected, what = engine_layout_shapes(config.model_config.hf_config, config.parallel_config, 0)
    try:
        engine.check_weights(expected, what=what)
        name_check = "ok"
    except ValueError as exc:
        name_check = str(exc)
    engine.resume(["weights", "kv_cache"])
    res = {"expected": hf_greedy(model), "got": vllm_greedy(engine), "name_check": name_check,
           "engine_params": [n for n, _ in engine.worker_info.params],
           "device_type": engine.worker_info.device_type,
           "fused_experts": list(engine.worker_info.fused_experts)}
    try:
        engine.load_weights(iter(tensors.items()))
        res["load_error"] = None
    except NotImplementedError as exc:
        res["load_error"] = str(exc)
    # What the adapter refuses: vLLM's own reload_weights of the very same tensors changes the outputs.
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors.items())})
    engine.llm.reset_prefix_cache()
    res["got_after_raw_reload"] = vllm_greedy(engine)
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _megatron_rank(rank: int, world: int, port: int, num_steps: int, out_path: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    import transformers

    from hybridmem import HybridConfig, ShardingManager
    from hybridmem.adapters.vllm import VLLMEngine
    from hybridmem.config import ParallelLayout
    from hybridmem.engines.nn.config import hf_config_dict
    from hybridmem.examples.grpo.topology import build_topology
    from hybridmem.examples.grpo.trainers import build_trainer
    from hybridmem.reshard import ModelSpec
    from hybridmem.weight_sync import ReshardSync

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reshard"))
    from reference import megatron_shard

    dec = ModelSpec(family="qwen2", hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                    intermediate_size=128, num_hidden_layers=2, vocab_size=256, qkv_bias=True,
                    rms_norm_eps=1e-6, rope_theta=10000.0)
    hf = hf_config_dict(dec)
    hf_cfg = transformers.Qwen2Config(**{**hf, "max_position_embeddings": 128, "tie_word_embeddings": False})
    train = infer = ParallelLayout(tp=2)
    topo = build_topology(train, infer)
    trainer = build_trainer("megatron", dec, topo, seed=0, lr=3e-3, dtype=torch.float32,
                            device=torch.device("cpu"))
    engine = VLLMEngine.create(hf_cfg, tensor_parallel_size=2,
                               distributed_executor_backend="external_launcher", **LLM_KWARGS)
    spec = ModelSpec.from_hf_config(hf)
    config = HybridConfig(device="cpu", tensor_model_parallel_size=2, infer_tensor_parallel_size=2)
    sync = ReshardSync(spec, config.train_layout, config.infer_layout, None, trainer.named_weights, engine,
                       dtype=torch.float32, megatron=trainer.megatron_convention())
    try:  # a sync planned for another inference layout than the engine's is refused before any move
        ReshardSync(spec, config.train_layout, ParallelLayout(tp=1), None, trainer.named_weights, engine,
                    dtype=torch.float32, megatron=trainer.megatron_convention())
        wrong_layout = "accepted"
    except ValueError as exc:
        wrong_layout = str(exc)
    manager = ShardingManager(trainer.training, engine, config=config, weight_sync=sync)
    trainer.attach(manager)
    # Megatron names -> HF names by the independent reference sharder run on index tensors.
    index, offset = {}, 1
    shapes = {n: tuple(t.shape) for n, t in transformers.Qwen2ForCausalLM(hf_cfg).state_dict().items()}
    for name, shape in shapes.items():
        n = int(torch.tensor(shape).prod())
        index[name] = torch.arange(offset, offset + n, dtype=torch.float64).reshape(shape)
        offset += n
    shards = [megatron_shard(index, spec, tp=2, pp=1, ep=1, world=world, rank=r,
                             divisible_by=trainer.state.padded_vocab_size // 2) for r in range(world)]
    steps = []
    for step in range(num_steps):
        g = torch.Generator().manual_seed(1000 + step)
        batch = torch.randint(0, dec.vocab_size, (4, 12), generator=g)
        trainer.step(lambda: -trainer.token_logprobs(
            trainer.actor, batch, temperature=1.0).mean())  # noqa: B023 - step calls it in this iteration
        mine = {n: t.detach().double().clone() for n, t in trainer.named_weights()}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        flat = torch.zeros(offset, dtype=torch.float64)
        for r in range(world):
            for name, idx in shards[r].items():
                keep = idx > 0
                flat[idx[keep].long()] = gathered[r][name][keep]
        reference = transformers.Qwen2ForCausalLM(hf_cfg).float().eval()
        with torch.no_grad():
            for name, p in reference.state_dict().items():
                p.copy_(flat[index[name].long()].float())
        expected = hf_greedy(reference)
        manager.to_infer()
        got = vllm_greedy(engine)
        manager.to_train()
        steps.append({"expected": expected, "got": got})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"steps": steps, "in_place": sync.in_place, "wrong_layout": wrong_layout,
                       "num_tensors": engine.last_load.num_tensors, "rank": engine.worker_info.rank}, f)
    trainer.close()
    engine.close()  # destroys the default process group too
    if dist.is_initialized():
        dist.destroy_process_group()


def megatron_tp2(num_steps: int, out_path: str) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_megatron_rank, args=(2, _free_port(), num_steps, out_path), nprocs=2, join=True)


def main() -> None:
    scenario, out_path = sys.argv[1], sys.argv[2]
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    if scenario == "megatron_tp2":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        megatron_tp2(int(sys.argv[3]), out_path)
        return
    result = torch_tp1(int(sys.argv[3])) if scenario == "torch_tp1" else qwen2_moe()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
