"""Config readers shared by several families: grouped-query attention and routed experts."""

from __future__ import annotations

from typing import Any

from hybridmem.models.family import ConfigGetter

__all__ = ["require", "gqa_fields", "llama_bias_fields", "moe_fields"]


def require(get: ConfigGetter, *keys: str) -> None:
    """Raise ``ValueError`` naming the keys of ``keys`` the config lacks."""
    missing = [k for k in keys if get(k) is None]
    if missing:
        raise ValueError(f"HF config lacks {missing}")


def gqa_fields(get: ConfigGetter, *, qkv_bias: bool, qk_norm: bool = False, o_bias: bool = False,
               mlp_bias: bool = False) -> dict[str, Any]:
    """ModelSpec fields of a grouped-query-attention decoder: sizes, biases (q/k/v, the output projection,
    the dense MLP's projections), tied embeddings."""
    require(get, "hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
    heads = int(get("num_attention_heads"))
    return dict(
        hidden_size=int(get("hidden_size")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or int(get("hidden_size")) // heads),
        intermediate_size=int(get("intermediate_size") or 0),
        num_hidden_layers=int(get("num_hidden_layers")),
        vocab_size=int(get("vocab_size")),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
    )


def llama_bias_fields(get: ConfigGetter) -> dict[str, Any]:
    """ModelSpec fields of a Llama-style decoder (Llama, Mistral, Granite): ``attention_bias`` gives q, k, v
    and o a bias and ``mlp_bias`` gate, up and down, as transformers builds them and vLLM's Llama and
    Granite read them."""
    attention_bias = bool(get("attention_bias", False))
    return gqa_fields(get, qkv_bias=attention_bias, o_bias=attention_bias,
                      mlp_bias=bool(get("mlp_bias", False)))


def moe_fields(get: ConfigGetter, *, experts_keys: tuple[str, ...],
               expert_width_key: str = "moe_intermediate_size", shared_width: int = 0,
               first_dense_key: str | None = None) -> dict[str, Any]:
    """ModelSpec fields of routed experts: the count (first of ``experts_keys`` the config sets), one
    expert's width, the shared expert's width and the leading dense layers."""
    experts = next((get(k) for k in experts_keys if get(k)), None)
    if experts is None:
        raise ValueError(f"HF config lacks the expert count (one of {list(experts_keys)})")
    out = dict(num_experts=int(experts), moe_intermediate_size=int(get(expert_width_key) or 0),
               shared_expert_intermediate_size=int(shared_width))
    if first_dense_key is not None:
        out["first_k_dense_replace"] = int(get(first_dense_key, 0) or 0)
    return out
