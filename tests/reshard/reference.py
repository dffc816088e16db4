"""Independent references: Megatron and vLLM shards computed straight from HF-full tensors with torch ops.

Written without hybridmem.reshard's pieces or tables (the way HF<->Megatron converters and vLLM's weight
loaders do it), so the property tests compare two independent derivations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _pad_chunk(w: torch.Tensor, multiple: int, tp: int, r: int) -> torch.Tensor:
    v = w.shape[0]
    padded = (v + multiple - 1) // multiple * multiple
    return F.pad(w, (0, 0, 0, padded - v)).chunk(tp)[r].clone()


def vllm_stage_layers(n: int, pp: int, pp_rank: int) -> list[int]:
    """vLLM get_pp_indices, re-derived: the stages before the last take one extra layer each, from the
    second-to-last stage backwards, until the remainder is used up."""
    sizes = []
    rem = n % pp
    for s in range(pp):
        extra = 1 if (pp - 2 - s) >= 0 and (pp - 2 - s) < rem else 0
        sizes.append(n // pp + extra)
    start = sum(sizes[:pp_rank])
    return list(range(start, start + sizes[pp_rank]))


def megatron_shard(full: dict, spec, *, tp: int, pp: int, ep: int, world: int, rank: int,
                   divisible_by: int = 128, te: bool = False) -> dict:
    dp = world // (tp * pp)
    r, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    ep_rank = dp_rank % ep
    n_local = spec.num_hidden_layers // pp
    ng, hd, nq = spec.num_key_value_heads, spec.head_dim, spec.num_attention_heads
    per = nq // ng
    out = {}
    tied = spec.tie_word_embeddings
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = _pad_chunk(full["model.embed_tokens.weight"],
                                                             divisible_by * tp, tp, r)
    for local in range(n_local):
        i = pp_rank * n_local + local
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        ln1 = m + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight")
        out[ln1] = full[h + "input_layernorm.weight"].clone()
        if spec.is_mla:
            _megatron_mla(out, full, spec, h, m, tp, r)
        for kind in ("weight", "bias") if spec.qkv_bias else (() if spec.is_mla else ("weight",)):
            q, k, v = (full[h + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
            tail = q.shape[1:]
            grouped = torch.cat([q.reshape(ng, per * hd, *tail), k.reshape(ng, hd, *tail),
                                 v.reshape(ng, hd, *tail)], 1)
            out[m + f"self_attention.linear_qkv.{kind}"] = grouped.chunk(tp)[r].reshape(-1, *tail).clone()
        if spec.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = full[h + "self_attn.q_norm.weight"].clone()
            out[m + "self_attention.k_layernorm.weight"] = full[h + "self_attn.k_norm.weight"].clone()
        out[m + "self_attention.linear_proj.weight"] = (
            full[h + "self_attn.o_proj.weight"].chunk(tp, 1)[r].clone())
        moe_layer = spec.is_moe and i >= spec.first_k_dense_replace
        ln2 = m + ("mlp.linear_fc1.layer_norm_weight" if te and not moe_layer else "pre_mlp_layernorm.weight")
        out[ln2] = full[h + "post_attention_layernorm.weight"].clone()
        if not moe_layer:
            out[m + "mlp.linear_fc1.weight"] = torch.cat(
                [full[h + "mlp.gate_proj.weight"].chunk(tp)[r], full[h + "mlp.up_proj.weight"].chunk(tp)[r]])
            out[m + "mlp.linear_fc2.weight"] = full[h + "mlp.down_proj.weight"].chunk(tp, 1)[r].clone()
            continue
        out[m + "mlp.router.weight"] = full[h + "mlp.gate.weight"].clone()
        if spec.family == "deepseek_v3":
            out[m + "mlp.router.expert_bias"] = full[h + "mlp.gate.e_score_correction_bias"].clone()
        e_local = spec.num_experts // ep
        for j in range(e_local):
            e = ep_rank * e_local + j
            x = h + f"mlp.experts.{e}."
            out[m + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = torch.cat(
                [full[x + "gate_proj.weight"].chunk(tp)[r], full[x + "up_proj.weight"].chunk(tp)[r]])
            out[m + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = (
                full[x + "down_proj.weight"].chunk(tp, 1)[r].clone())
        if spec.shared_expert_intermediate_size:
            x = h + ("mlp.shared_experts." if spec.family == "deepseek_v3" else "mlp.shared_expert.")
            out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                [full[x + "gate_proj.weight"].chunk(tp)[r], full[x + "up_proj.weight"].chunk(tp)[r]])
            out[m + "mlp.shared_experts.linear_fc2.weight"] = (
                full[x + "down_proj.weight"].chunk(tp, 1)[r].clone())
            if spec.family == "qwen2_moe":
                out[m + "mlp.shared_experts.gate_weight"] = full[h + "mlp.shared_expert_gate.weight"].clone()
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = full["model.norm.weight"].clone()
        if not tied:
            out["output_layer.weight"] = _pad_chunk(full["lm_head.weight"], divisible_by * tp, tp, r)
        elif pp > 1:
            out["output_layer.weight"] = _pad_chunk(full["model.embed_tokens.weight"],
                                                    divisible_by * tp, tp, r)
    return out


def split_fused(full: dict, spec) -> dict:
    """Phi-3-style checkpoints: ``qkv_proj`` rows [q; k; v] and ``gate_up_proj`` rows [gate; up] as separate
    tensors (plain row slicing); other tensors unchanged."""
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    out = {}
    for name, t in full.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            p = name[: -len("qkv_proj.weight")]
            (out[p + "q_proj.weight"], out[p + "k_proj.weight"],
             out[p + "v_proj.weight"]) = t[:q], t[q:q + kv], t[q + kv:]
        elif name.endswith("mlp.gate_up_proj.weight"):
            p, half = name[: -len("gate_up_proj.weight")], t.shape[0] // 2
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = t[:half], t[half:]
        else:
            out[name] = t
    return out


def vllm_shard(full: dict, spec, *, tp: int, pp: int, ep: int, world: int, rank: int,
               padding: int = 64) -> dict:
    full = split_fused(full, spec)
    replica, r, pp_rank = rank // (tp * pp), rank % tp, (rank // tp) % pp
    moe_tp, moe_r = (1, 0) if ep > 1 else (tp, r)
    ep_rank = (replica * tp + r) % ep if ep > 1 else 0
    nkv, hd = spec.num_key_value_heads, spec.head_dim
    tied = spec.tie_word_embeddings
    # vLLM 0.32/0.33 build Qwen-MoE's embedding, final norm and head on every pipeline stage.
    every_stage = spec.family in ("qwen2_moe", "qwen3_moe")
    out = {}
    if pp_rank == 0 or (tied and pp_rank == pp - 1) or every_stage:
        out["model.embed_tokens.weight"] = _pad_chunk(full["model.embed_tokens.weight"], padding, tp, r)
    for i in vllm_stage_layers(spec.num_hidden_layers, pp, pp_rank):
        h = f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = full[h + "input_layernorm.weight"].clone()
        if spec.is_mla:
            _vllm_mla(out, full, spec, h, tp, r)
        for kind in ("weight", "bias") if spec.qkv_bias else (() if spec.is_mla else ("weight",)):
            q, k, v = (full[h + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
            if tp >= nkv:
                head = r // (tp // nkv)
                k_r, v_r = k[head * hd:(head + 1) * hd], v[head * hd:(head + 1) * hd]
            else:
                k_r, v_r = k.chunk(tp)[r], v.chunk(tp)[r]
            out[h + f"self_attn.qkv_proj.{kind}"] = torch.cat([q.chunk(tp)[r], k_r, v_r])
        if spec.qk_norm:
            out[h + "self_attn.q_norm.weight"] = full[h + "self_attn.q_norm.weight"].clone()
            out[h + "self_attn.k_norm.weight"] = full[h + "self_attn.k_norm.weight"].clone()
        out[h + "self_attn.o_proj.weight"] = full[h + "self_attn.o_proj.weight"].chunk(tp, 1)[r].clone()
        out[h + "post_attention_layernorm.weight"] = full[h + "post_attention_layernorm.weight"].clone()
        if not (spec.is_moe and i >= spec.first_k_dense_replace):
            out[h + "mlp.gate_up_proj.weight"] = torch.cat(
                [full[h + "mlp.gate_proj.weight"].chunk(tp)[r], full[h + "mlp.up_proj.weight"].chunk(tp)[r]])
            out[h + "mlp.down_proj.weight"] = full[h + "mlp.down_proj.weight"].chunk(tp, 1)[r].clone()
            continue
        out[h + "mlp.gate.weight"] = full[h + "mlp.gate.weight"].clone()
        if spec.family == "deepseek_v3" and spec.topk_method == "noaux_tc":
            out[h + "mlp.gate.e_score_correction_bias"] = full[h + "mlp.gate.e_score_correction_bias"].clone()
        # vLLM determine_expert_map, "linear": the first (E % ep) ranks hold one extra expert.
        sizes = [spec.num_experts // ep + (1 if k < spec.num_experts % ep else 0) for k in range(ep)]
        first = sum(sizes[:ep_rank])
        experts = range(first, first + sizes[ep_rank])
        out[h + "mlp.experts.routed_experts.w13_weight"] = torch.stack([
            torch.cat([full[h + f"mlp.experts.{e}.gate_proj.weight"].chunk(moe_tp)[moe_r],
                       full[h + f"mlp.experts.{e}.up_proj.weight"].chunk(moe_tp)[moe_r]]) for e in experts])
        out[h + "mlp.experts.routed_experts.w2_weight"] = torch.stack(
            [full[h + f"mlp.experts.{e}.down_proj.weight"].chunk(moe_tp, 1)[moe_r] for e in experts])
        if spec.shared_expert_intermediate_size:
            x = h + ("mlp.shared_experts." if spec.family == "deepseek_v3" else "mlp.shared_expert.")
            out[x + "gate_up_proj.weight"] = torch.cat(
                [full[x + "gate_proj.weight"].chunk(tp)[r], full[x + "up_proj.weight"].chunk(tp)[r]])
            out[x + "down_proj.weight"] = full[x + "down_proj.weight"].chunk(tp, 1)[r].clone()
            if spec.family == "qwen2_moe":
                out[h + "mlp.shared_expert_gate.weight"] = full[h + "mlp.shared_expert_gate.weight"].clone()
    if pp_rank == pp - 1 or every_stage:
        out["model.norm.weight"] = full["model.norm.weight"].clone()
        if not tied:
            out["lm_head.weight"] = _pad_chunk(full["lm_head.weight"], padding, tp, r)
    return out


def _megatron_mla(out: dict, full: dict, spec, h: str, m: str, tp: int, r: int) -> None:
    """Megatron's local MLA spec: every projection but linear_proj is column-parallel (rows chunked)."""
    a, ma = h + "self_attn.", m + "self_attention."
    if spec.q_lora_rank:
        out[ma + "linear_q_down_proj.weight"] = full[a + "q_a_proj.weight"].chunk(tp)[r].clone()
        out[ma + "q_layernorm.weight"] = full[a + "q_a_layernorm.weight"].clone()
        out[ma + "linear_q_up_proj.weight"] = full[a + "q_b_proj.weight"].chunk(tp)[r].clone()
    else:
        out[ma + "linear_q_proj.weight"] = full[a + "q_proj.weight"].chunk(tp)[r].clone()
    out[ma + "linear_kv_down_proj.weight"] = full[a + "kv_a_proj_with_mqa.weight"].chunk(tp)[r].clone()
    out[ma + "kv_layernorm.weight"] = full[a + "kv_a_layernorm.weight"].clone()
    # Heads are contiguous row blocks of kv_b_proj ([k_nope; v] per head), so chunking rows splits heads.
    heads = full[a + "kv_b_proj.weight"].reshape(spec.num_attention_heads, -1, spec.kv_lora_rank)
    out[ma + "linear_kv_up_proj.weight"] = heads.chunk(tp)[r].reshape(-1, spec.kv_lora_rank).clone()


def _vllm_mla(out: dict, full: dict, spec, h: str, tp: int, r: int) -> None:
    """vLLM's DeepseekV2MLAAttention: q_a and kv_a fused and replicated; q_b/q_proj and kv_b
    column-parallel."""
    a = h + "self_attn."
    if spec.q_lora_rank:
        out[a + "fused_qkv_a_proj.weight"] = torch.cat([full[a + "q_a_proj.weight"],
                                                        full[a + "kv_a_proj_with_mqa.weight"]])
        out[a + "q_a_layernorm.weight"] = full[a + "q_a_layernorm.weight"].clone()
        q = full[a + "q_b_proj.weight"]
        out[a + "q_b_proj.weight"] = q.reshape(spec.num_attention_heads, -1, q.shape[1]).chunk(tp)[r].reshape(
            -1, q.shape[1]).clone()
    else:
        out[a + "kv_a_proj_with_mqa.weight"] = full[a + "kv_a_proj_with_mqa.weight"].clone()
        out[a + "q_proj.weight"] = full[a + "q_proj.weight"].chunk(tp)[r].clone()
    out[a + "kv_a_layernorm.weight"] = full[a + "kv_a_layernorm.weight"].clone()
    out[a + "kv_b_proj.weight"] = full[a + "kv_b_proj.weight"].chunk(tp)[r].clone()


def random_full(spec, seed: int = 0, dtype=torch.float32) -> dict:
    """Random HF-full tensors; integer-valued so every element is distinct-ish and exact in any dtype."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randint(-1000, 1000, shape, generator=g).to(dtype)
            for name, shape in spec.full_shapes().items()}
