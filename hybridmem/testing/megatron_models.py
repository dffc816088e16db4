"""Test-only builders: tiny Megatron-core GPT models, DDP-wrapped, with Megatron's optimizers.

Everything here runs inside a worker process of :class:`hybridmem.testing.workers.WorkerPool` (one
``torch.distributed`` group over gloo), under :func:`hybridmem.testing.megatron_cpu.megatron_on_cpu` on
a machine without CUDA. Call order inside a worker::

    with megatron_on_cpu():
        init_megatron_parallel(spec)           # parallel_state.initialize_model_parallel + seeds
        try:
            model, opt = build_megatron_gpt(spec)
            loss = train_step(model, opt, make_batch(spec, step=0), spec)
        finally:
            destroy_megatron_parallel()

The model uses the *local* layer spec (Transformer Engine is not installed here), is wrapped in
``megatron.core.distributed.DistributedDataParallel`` with contiguous param and grad buffers, and gets
its optimizer from ``get_megatron_optimizer`` (a ``ChainedOptimizer`` when there are expert params or
several chunks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "TinyGPTSpec",
    "init_megatron_parallel",
    "destroy_megatron_parallel",
    "build_gpt_model",
    "build_megatron_gpt",
    "gpt_from_model_spec",
    "make_batch",
    "train_step",
]

_PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyGPTSpec:
    """A tiny GPT and how it is parallelised and optimised."""

    num_layers: int = 2
    """Transformer layers over all pipeline stages."""
    hidden_size: int = 32
    """Model width."""
    num_attention_heads: int = 4
    """Query heads (divisible by ``tp``)."""
    num_query_groups: int = 2
    """Key/value heads (GQA; divisible by ``tp``)."""
    ffn_hidden_size: int = 64
    """Dense MLP width (per gate/up half when ``gated_linear_unit``)."""
    gated_linear_unit: bool = True
    """SwiGLU-style MLP: ``linear_fc1`` holds gate and up halves."""
    vocab_size: int = 64
    """Vocabulary (divisible by ``tp``)."""
    kv_channels: int | None = None
    """Head dim (``None``: ``hidden_size // num_attention_heads``)."""
    add_qkv_bias: bool = False
    """Biases on q/k/v only (Qwen2)."""
    activation: str = "gelu"
    """``"gelu"`` (Megatron's default; GeGLU when gated) or ``"silu"`` (SwiGLU, Llama/Qwen)."""
    layernorm_epsilon: float = 1e-5
    """RMSNorm epsilon."""
    rotary_base: int = 10000
    """RoPE theta."""
    clip_grad: float = 1.0
    """Gradient-norm clip of the optimizer (0: none)."""
    seq_length: int = 8
    """Tokens per sample."""
    micro_batch_size: int = 2
    """Samples per micro-batch."""
    num_micro_batches: int = 2
    """Micro-batches per step (>= ``pp`` for the 1F1B schedule)."""
    num_moe_experts: int | None = None
    """Routed experts; ``None`` for a dense model."""
    moe_ffn_hidden_size: int | None = None
    """Expert MLP width (defaults to ``ffn_hidden_size``)."""
    precision: str = "fp32"
    """``"fp32"``, or ``"bf16"``/``"fp16"`` model params with fp32 main params in the optimizer."""
    use_distributed_optimizer: bool = False
    """Megatron's ``DistributedOptimizer`` (optimizer state sharded over data-parallel ranks)."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int = 1
    """Expert-parallel size."""
    lr: float = 1e-2
    """Adam learning rate."""
    seed: int = 1234
    """Init and data seed."""

    def __post_init__(self) -> None:
        if self.precision not in _PRECISIONS:
            raise ValueError(f"precision={self.precision!r} must be one of {_PRECISIONS}")
        for name in ("tp", "pp", "ep", "num_layers", "num_micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_layers % self.pp:
            raise ValueError(f"num_layers={self.num_layers} must be divisible by pp={self.pp}")
        if self.ep > 1 and not self.num_moe_experts:
            raise ValueError(f"ep={self.ep} needs num_moe_experts")
        if self.activation not in ("gelu", "silu"):
            raise ValueError(f"activation={self.activation!r}; expected 'gelu' or 'silu'")

    @property
    def params_dtype(self) -> torch.dtype:
        """The model parameters' dtype."""
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.precision]


def init_megatron_parallel(spec: TinyGPTSpec) -> None:
    """``parallel_state.initialize_model_parallel`` for ``spec`` plus Megatron's RNG seeds.

    ``torch.distributed`` must already be initialised (the worker pool does it); on CPU call it inside
    :func:`~hybridmem.testing.megatron_cpu.megatron_on_cpu`.
    """
    from megatron.core import parallel_state  # noqa: PLC0415 - Megatron is optional
    from megatron.core.tensor_parallel import (  # noqa: PLC0415 - Megatron is optional
        model_parallel_cuda_manual_seed,
    )

    _GROUPS_BEFORE[:] = list(dist.distributed_c10d._world.pg_map)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        expert_model_parallel_size=spec.ep,
    )
    torch.manual_seed(spec.seed)
    model_parallel_cuda_manual_seed(spec.seed)


_GROUPS_BEFORE: list[Any] = []
"""The process groups that existed before :func:`init_megatron_parallel` (the worker pool's own)."""


def destroy_megatron_parallel() -> None:
    """Undo :func:`init_megatron_parallel` (a worker is reused by the next test), and destroy the groups it
    and the task made: Megatron's ``destroy_model_parallel`` forgets its groups without destroying them
    (0.16.1 destroys only the gloo data-parallel ones), and each gloo group keeps its threads, so a worker
    serving many tasks held hundreds of groups whose threads took a fifth of a core while idle."""
    from megatron.core import parallel_state  # noqa: PLC0415 - Megatron is optional

    parallel_state.destroy_model_parallel()
    if not _GROUPS_BEFORE:  # nothing recorded: not after init_megatron_parallel, or undone already
        return
    keep = {id(g) for g in _GROUPS_BEFORE}
    for group in list(dist.distributed_c10d._world.pg_map):
        if id(group) not in keep and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)
    _GROUPS_BEFORE.clear()


def transformer_config(spec: TinyGPTSpec) -> Any:
    """The ``TransformerConfig`` for ``spec`` (CPU initialisation, no dropout, deterministic)."""
    from megatron.core.transformer import TransformerConfig  # noqa: PLC0415 - Megatron is optional

    extra: dict[str, Any] = {}
    if spec.num_moe_experts:
        extra.update(
            num_moe_experts=spec.num_moe_experts,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size,
            moe_router_topk=2,
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.0,
            expert_model_parallel_size=spec.ep,
        )
    if spec.activation == "silu":
        extra["activation_func"] = torch.nn.functional.silu
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=spec.gated_linear_unit,
        add_qkv_bias=spec.add_qkv_bias,
        layernorm_epsilon=spec.layernorm_epsilon,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        pipeline_dtype=spec.params_dtype,
        params_dtype=spec.params_dtype,
        bf16=spec.precision == "bf16",
        fp16=spec.precision == "fp16",
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        normalization="RMSNorm",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **extra,
    )


def build_gpt_model(spec: TinyGPTSpec, *, config: Any = None, device: str = "cpu") -> Any:
    """This rank's pipeline stage of a ``GPTModel`` (local layer spec, RoPE, untied), not wrapped.

    Args:
        spec: The model and its parallelism.
        config: Its ``TransformerConfig`` (``None``: :func:`transformer_config` of ``spec``).
        device: ``"cpu"`` (under :func:`~hybridmem.testing.megatron_cpu.megatron_on_cpu`) or ``"cuda"``
            (moved to the current GPU).
    """
    from megatron.core import parallel_state  # noqa: PLC0415 - Megatron is optional
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415 - Megatron is optional
    from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: PLC0415 - Megatron is optional
        get_gpt_layer_local_spec,
    )

    model = GPTModel(
        config=config if config is not None else transformer_config(spec),
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=spec.num_moe_experts,
                                                        normalization="RMSNorm"),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=spec.rotary_base,
    )
    return model if device == "cpu" else model.to(device=torch.cuda.current_device())


def build_megatron_gpt(spec: TinyGPTSpec, *, device: str = "cpu") -> tuple[list[Any], Any]:
    """A ``GPTModel`` for this rank's pipeline stage, DDP-wrapped, and its Megatron optimizer.

    Args:
        spec: The model and its parallelism.
        device: ``"cpu"`` (under :func:`~hybridmem.testing.megatron_cpu.megatron_on_cpu`) or ``"cuda"``
            (the model is moved to the current GPU before DDP wraps it).

    Returns:
        ``([ddp_model_chunk], optimizer)``.
    """
    from megatron.core.distributed import (  # noqa: PLC0415 - Megatron is optional
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer import (  # noqa: PLC0415 - Megatron is optional
        OptimizerConfig,
        get_megatron_optimizer,
    )

    config = transformer_config(spec)
    model = build_gpt_model(spec, config=config, device=device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=spec.precision != "fp32",
        overlap_grad_reduce=False,
        use_distributed_optimizer=spec.use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=spec.lr,
        weight_decay=0.0,
        bf16=spec.precision == "bf16",
        fp16=spec.precision == "fp16",
        params_dtype=spec.params_dtype,
        use_distributed_optimizer=spec.use_distributed_optimizer,
        clip_grad=spec.clip_grad,
        initial_loss_scale=2.0**8 if spec.precision == "fp16" else None,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    return [ddp], optimizer


def make_batch(spec: TinyGPTSpec, step: int, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """``num_micro_batches`` micro-batches of (tokens, labels, position_ids), the same on every rank."""
    g = torch.Generator().manual_seed(spec.seed * 1000 + step)
    out = []
    for _ in range(spec.num_micro_batches):
        tokens = torch.randint(0, spec.vocab_size, (spec.micro_batch_size, spec.seq_length + 1), generator=g)
        out.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "position_ids": torch.arange(spec.seq_length).expand(spec.micro_batch_size, -1).contiguous(),
            }
        )
        out[-1] = {k: v.to(device) for k, v in out[-1].items()}
    return out


def train_step(model_chunks: list[Any], optimizer: Any, batch: list[dict[str, torch.Tensor]],
               spec: TinyGPTSpec) -> float:
    """One optimizer step with Megatron's pipeline schedule; returns the mean loss (on every rank).

    The loss is broadcast from the last pipeline stage so that every rank returns the same value.
    """
    from megatron.core import parallel_state  # noqa: PLC0415 - Megatron is optional
    from megatron.core.pipeline_parallel import (  # noqa: PLC0415 - Megatron is optional
        get_forward_backward_func,
    )

    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    data = iter(batch)

    def loss_func(output: torch.Tensor):
        loss = output.float().mean()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])
        return output, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=model_chunks,
        num_microbatches=spec.num_micro_batches,
        seq_length=spec.seq_length,
        micro_batch_size=spec.micro_batch_size,
        forward_only=False,
    )
    optimizer.step()
    on_gloo = torch.distributed.get_backend() == "gloo"
    value = torch.zeros(1, dtype=torch.float64, device="cpu" if on_gloo else torch.cuda.current_device())
    if parallel_state.is_pipeline_last_stage():
        value[0] = sum(float(d["loss"]) for d in losses) / len(losses)
    if spec.pp > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        torch.distributed.broadcast(value, src=last, group=group)
    return float(value[0])


def gpt_from_model_spec(spec: Any, *, tp: int, pp: int, padded_vocab: int, dtype: torch.dtype = torch.float32,
                        pg_collection: Any = None) -> Any:
    """This rank's stage of a ``GPTModel`` (local spec) shaped as a resharding
    :class:`~hybridmem.reshard.ModelSpec` says: any of its families, MoE on the layers ``spec.is_moe_layer``
    names, DeepSeek's MLA.

    For building and holding weights only, never a forward: megatron-core 0.16.1's local MLA spec passes
    ``k_channels`` to ``DotProductAttention``, which does not take it (MLA runs there only with Transformer
    Engine), so MLA layers get a parameter-free stand-in core attention; names and shapes are unchanged.
    Weights are initialised (see [Note: Megatron refit needs initialised embeddings] in
    :mod:`hybridmem.testing.megatron_refit`).

    Args:
        spec: The model.
        tp, pp: Its tensor and pipeline parallel sizes.
        padded_vocab: The vocab rows over all TP ranks (a GPTModel takes the padded size).
        dtype: Parameter dtype.
        pg_collection: The model's process groups (``None``: Megatron's ``parallel_state``); its ``pp``
            group decides this rank's stage.
    """
    from megatron.core import parallel_state  # noqa: PLC0415 - Megatron is optional
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415 - Megatron is optional
    from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: PLC0415 - Megatron is optional
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer import TransformerConfig  # noqa: PLC0415 - Megatron is optional
    from megatron.core.transformer.transformer_config import (  # noqa: PLC0415 - Megatron is optional
        MLATransformerConfig,
    )

    num_moe_layers = sum(spec.is_moe_layer(i) for i in range(spec.num_hidden_layers))
    extra: dict[str, Any] = {}
    if num_moe_layers:
        extra.update(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_intermediate_size,
                     moe_router_topk=2)
        if spec.shared_expert_intermediate_size:
            extra.update(moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                         moe_shared_expert_gate=spec.has_shared_expert_gate)
        if spec.has_router_bias:
            extra.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
        if num_moe_layers < spec.num_hidden_layers:
            extra["moe_layer_freq"] = [int(spec.is_moe_layer(i)) for i in range(spec.num_hidden_layers)]
    if spec.is_mla:
        extra.update(multi_latent_attention=True, q_lora_rank=spec.q_lora_rank or None,
                     kv_lora_rank=spec.kv_lora_rank, qk_head_dim=spec.qk_nope_head_dim,
                     qk_pos_emb_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rope_type="rope")
    qk_layernorm = spec.qk_norm or spec.is_mla
    cfg = (MLATransformerConfig if spec.is_mla else TransformerConfig)(
        num_layers=spec.num_hidden_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim, ffn_hidden_size=spec.intermediate_size or spec.moe_intermediate_size,
        gated_linear_unit=True, add_bias_linear=False, add_qkv_bias=spec.qkv_bias, normalization="RMSNorm",
        qk_layernorm=qk_layernorm, use_cpu_initialization=True, perform_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, **extra)
    if 0 < num_moe_layers < spec.num_hidden_layers:
        # Dense and MoE layers mixed: Megatron's block spec picks each layer's MLP from moe_layer_freq.
        layer_spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    else:
        layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts if num_moe_layers else None,
                                              moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
                                              normalization="RMSNorm", multi_latent_attention=spec.is_mla)
    if spec.is_mla:
        for one in getattr(layer_spec, "layer_specs", None) or [layer_spec]:
            one.submodules.self_attention.submodules.core_attention = _NoParameterAttention
    if pg_collection is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    else:
        pp_rank = dist.get_group_rank(pg_collection.pp, dist.get_rank())
    return GPTModel(cfg, layer_spec, vocab_size=padded_vocab, max_sequence_length=32,
                    pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                    share_embeddings_and_output_weights=spec.tie_word_embeddings,
                    position_embedding_type="rope", pg_collection=pg_collection)


class _NoParameterAttention(torch.nn.Module):
    """Stand-in core attention for building MLA layers on megatron-core 0.16.1 without Transformer Engine
    (see :func:`gpt_from_model_spec`); it holds no parameters and must never run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a GPTModel from gpt_from_model_spec with MLA cannot run forward (no core "
                           "attention)")
