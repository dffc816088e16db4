"""MegatronLayoutGPT computes HF's Qwen2/Llama function at TP 1 and 2 (independent reference slicing)."""

from __future__ import annotations

import pytest
import torch

from hybridmem.engines.nn.config import embedded_spec, hf_config_dict
from hybridmem.engines.nn.gpt import MegatronLayoutGPT, allreduce_grads, init_hf_weights
from hybridmem.reshard import ModelSpec
from hybridmem.testing.workers import WorkerPool

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "qwen2-gqa-bias": ModelSpec(family="qwen2", hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                head_dim=8, intermediate_size=96, num_hidden_layers=2, vocab_size=61,
                                qkv_bias=True, rope_theta=10000.0, rms_norm_eps=1e-6),
    "llama-tied": ModelSpec(family="llama", hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
                            head_dim=16, intermediate_size=64, num_hidden_layers=2, vocab_size=50,
                            tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5),
}


def megatron_shard(full: dict[str, torch.Tensor], cfg: ModelSpec, tp: int, rank: int,
                   padded_vocab: int) -> dict[str, torch.Tensor]:
    """Reference: slice full HF weights into Megatron's per-rank layout, written out longhand."""
    hd, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    qpg = nq // nkv
    groups = range(rank * nkv // tp, (rank + 1) * nkv // tp)
    I = cfg.intermediate_size // tp  # noqa: E741 - the per-rank intermediate size, its math name

    def vocab(t):
        padded = torch.zeros(padded_vocab, t.shape[1], dtype=t.dtype)
        padded[: t.shape[0]] = t
        n = padded_vocab // tp
        return padded[rank * n:(rank + 1) * n]

    out = {"embedding.word_embeddings.weight": vocab(full["model.embed_tokens.weight"])}
    for i in range(cfg.num_hidden_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            if p + "self_attn.q_proj." + kind not in full:
                continue
            q, k, v = (full[p + f"self_attn.{n}_proj.{kind}"] for n in "qkv")
            rows = []
            for g in groups:
                rows += [q[g * qpg * hd:(g + 1) * qpg * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
            out[m + "self_attention.linear_qkv." + kind] = torch.cat(rows)
        qcols = nq * hd // tp
        out[m + "self_attention.linear_proj.weight"] = full[p + "self_attn.o_proj.weight"][
            :, rank * qcols:(rank + 1) * qcols]
        out[m + "input_layernorm.weight"] = full[p + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = full[p + "post_attention_layernorm.weight"]
        gate, up = full[p + "mlp.gate_proj.weight"], full[p + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate[rank * I:(rank + 1) * I],
                                                      up[rank * I:(rank + 1) * I]])
        out[m + "mlp.linear_fc2.weight"] = full[p + "mlp.down_proj.weight"][:, rank * I:(rank + 1) * I]
    out["decoder.final_layernorm.weight"] = full["model.norm.weight"]
    if "lm_head.weight" in full:
        out["output_layer.weight"] = vocab(full["lm_head.weight"])
    return out


def hf_model(cfg: ModelSpec, full: dict[str, torch.Tensor], model_type: str):
    d = hf_config_dict(cfg)
    assert d.pop("model_type") == model_type
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
    if model_type == "qwen2":
        d.pop("attention_bias")
        hf_cfg = transformers.Qwen2Config(**d)
        model = transformers.Qwen2ForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.LlamaConfig(**d)
        model = transformers.LlamaForCausalLM(hf_cfg)
    model = model.to(torch.float64).eval()
    missing, unexpected = model.load_state_dict({k: v.double() for k, v in full.items()}, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return model


def _tp_logits(ctx, name: str, tokens: torch.Tensor):
    cfg = CONFIGS[name]
    full = {k: v.double() for k, v in init_hf_weights(cfg, seed=3).items()}
    padded = 128 * ctx.world_size
    model = MegatronLayoutGPT(cfg, padded_vocab_size=padded, group=ctx.group, dtype=torch.float64)
    model.load_state_dict(megatron_shard(full, cfg, ctx.world_size, ctx.rank, padded))
    logits = model(tokens)
    lp = model.token_logprobs(tokens)
    return logits.detach(), lp.detach()


def _dp_grads(ctx, name: str, tokens: torch.Tensor):
    """TP1 replicas, one batch row per rank; grads averaged over the group."""
    import torch.distributed as dist

    cfg = CONFIGS[name]
    singletons = [dist.new_group([r]) for r in range(ctx.world_size)]  # collective: every rank creates each
    model = MegatronLayoutGPT(cfg, padded_vocab_size=128, group=singletons[ctx.rank], dtype=torch.float64)
    model.load_state_dict(megatron_shard({k: v.double() for k, v in init_hf_weights(cfg, seed=3).items()},
                                         cfg, 1, 0, 128))
    model.token_logprobs(tokens[ctx.rank: ctx.rank + 1]).sum().backward()
    allreduce_grads(model, ctx.group)
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2) as p:
        yield p


@pytest.mark.parametrize("name,model_type", [("qwen2-gqa-bias", "qwen2"), ("llama-tied", "llama")])
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_equal_hf(pool, name, model_type, tp):
    cfg = CONFIGS[name]
    tokens = torch.randint(0, cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    full = {k: v.double() for k, v in init_hf_weights(cfg, seed=3).items()}
    with torch.no_grad():
        expected = hf_model(cfg, full, model_type)(tokens).logits
    results = pool.run(_tp_logits, name, tokens, world_size=tp)
    for logits, lp in results:
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)
        ref_lp = torch.log_softmax(expected[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        torch.testing.assert_close(lp, ref_lp, rtol=1e-9, atol=1e-9)


def test_allreduce_grads_averages_over_data_parallel_ranks(pool):
    cfg = CONFIGS["qwen2-gqa-bias"]
    tokens = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    per_rank = pool.run(_dp_grads, "qwen2-gqa-bias", tokens, world_size=2)
    model = MegatronLayoutGPT(cfg, padded_vocab_size=128, dtype=torch.float64)
    model.load_state_dict(megatron_shard({k: v.double() for k, v in init_hf_weights(cfg, seed=3).items()},
                                         cfg, 1, 0, 128))
    (model.token_logprobs(tokens).sum() / 2).backward()
    for name, p in model.named_parameters():
        for grads in per_rank:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12)


def test_config_errors():
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by num_key_value_heads=4"):
        ModelSpec(hidden_size=8, num_attention_heads=6, num_key_value_heads=4, head_dim=2,
                  intermediate_size=8, num_hidden_layers=1, vocab_size=8)
    with pytest.raises(ValueError, match="head_dim=3 must be even"):
        embedded_spec(ModelSpec(hidden_size=6, num_attention_heads=2, num_key_value_heads=2, head_dim=3,
                                intermediate_size=8, num_hidden_layers=1, vocab_size=8))
    cfg = CONFIGS["qwen2-gqa-bias"]
    with pytest.raises(ValueError, match="padded_vocab_size=60 is smaller than vocab_size=61"):
        MegatronLayoutGPT(cfg, padded_vocab_size=60)


def test_from_hf_config_reads_transformers_config():
    hf = transformers.Qwen2Config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                  intermediate_size=96, num_hidden_layers=2, vocab_size=61)
    cfg = embedded_spec(hf)
    assert (cfg.family, cfg.head_dim, cfg.qkv_bias, cfg.num_key_value_heads) == ("qwen2", 8, True, 2)
