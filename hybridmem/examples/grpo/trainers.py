"""The demo's two actor trainers behind one small interface: plain PyTorch and Megatron-core.

Both hold the actor in Megatron-core's training layout (names, fused QKV per query group, [gate; up]
fc1, row/column splits over the training TP group) so the same resharding plan serves both; both build
the actor and a frozen reference with the same initial weights, cut from full HF-named weights drawn
from the seed by :func:`hybridmem.reshard.shard`.

- :class:`TorchTrainer`: :class:`~hybridmem.engines.nn.gpt.MegatronLayoutGPT` with ``torch.optim.AdamW`` and a
  flat gradient all-reduce over the data-parallel group.
- :class:`MegatronTrainer`: megatron-core's ``GPTModel`` (local layer spec) wrapped in its
  ``DistributedDataParallel`` (contiguous grad buffer) with the optimizer from
  ``get_megatron_optimizer``, handed to ShardingManager as a
  :class:`~hybridmem.adapters.megatron.MegatronTrainingState`. On CPU it runs under the CPU harness
  :func:`hybridmem.testing.megatron_cpu.megatron_on_cpu` for the whole run (see that module's warning:
  it changes process-wide torch behaviour, which is acceptable in the demo's own processes only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hybridmem.engines.nn.gpt import MegatronLayoutGPT, allreduce_grads, init_hf_weights
from hybridmem.examples.grpo.topology import Topology
from hybridmem.reshard.spec import ModelSpec

__all__ = ["TorchTrainer", "MegatronTrainer", "build_trainer"]

MAX_SEQ_LEN = 512
"""The Megatron GPTModel's ``max_sequence_length`` (prompt + completion must fit)."""


def _local_weights(model: ModelSpec, topo: Topology, *, seed: int, dtype: torch.dtype,
                   padded_vocab: int | None) -> dict[str, torch.Tensor]:
    """This rank's Megatron-layout shard of the full weights drawn from ``seed``."""
    from hybridmem.reshard import MegatronConvention, megatron_layout, shard  # noqa: PLC0415

    layout = megatron_layout(model, topo.train, topo.world_size,
                             convention=MegatronConvention(padded_vocab_size=padded_vocab))
    return shard(init_hf_weights(model, seed=seed, dtype=dtype), layout, topo.rank)


class TorchTrainer:
    """Actor and reference as :class:`MegatronLayoutGPT`, trained with AdamW.

    Attributes:
        training: What ShardingManager takes as its model (the actor module).
        optimizer: The AdamW optimizer.
        actor: The module whose log-probs are trained.
        reference: The frozen reference policy (a module to register as a co-resident).
    """

    def __init__(self, model: ModelSpec, topo: Topology, *, seed: int, lr: float, dtype: torch.dtype,
                 device: torch.device):
        self.topo = topo
        local = _local_weights(model, topo, seed=seed, dtype=dtype, padded_vocab=None)
        self.padded_vocab = local["embedding.word_embeddings.weight"].shape[0] * topo.train.tp
        pair = []
        for _ in range(2):
            m = MegatronLayoutGPT(model, padded_vocab_size=self.padded_vocab, group=topo.train_tp_group,
                                  dtype=dtype, device=device)
            m.load_state_dict({k: v.to(device) for k, v in local.items()})
            pair.append(m)
        self.actor, self.reference = pair
        self.reference.requires_grad_(False)
        self.training = self.actor
        self.optimizer = torch.optim.AdamW(self.actor.parameters(), lr=lr, weight_decay=0.0)

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The actor's weights by Megatron name (the resharding source)."""
        return self.actor.named_parameters()

    def megatron_convention(self) -> Any:
        """The resharding engine's Megatron convention (vocab padded as built)."""
        from hybridmem.reshard import MegatronConvention  # noqa: PLC0415

        return MegatronConvention(padded_vocab_size=self.padded_vocab)

    def token_logprobs(self, model: Any, batch: torch.Tensor, *, temperature: float) -> torch.Tensor:
        """``[batch, seq - 1]`` log-probs of tokens ``1..`` under ``model`` (the actor or the reference)."""
        return model.token_logprobs(batch, temperature=temperature)

    def step(self, loss_fn: Callable[[], torch.Tensor]) -> None:
        """One optimizer step on ``loss_fn()``, gradients averaged over the data-parallel group."""
        self.optimizer.zero_grad(set_to_none=False)
        loss_fn().backward()
        allreduce_grads(self.actor, self.topo.train_dp_group)
        self.optimizer.step()

    def attach(self, manager: Any) -> None:
        """Nothing to register beyond the manager's defaults."""

    def close(self) -> None:
        """Nothing to tear down."""


class MegatronTrainer:
    """Actor as megatron-core's DDP-wrapped ``GPTModel`` with its Adam optimizer; reference as a second,
    frozen ``GPTModel``.

    Megatron's ``parallel_state`` is initialised here with the training TP (data parallel over the rest),
    over the already initialised default group; :meth:`close` destroys it.

    Raises:
        ImportError: megatron-core is not installed (``pip install 'hybridmem[megatron]'``).
        ValueError: The vocab does not divide by the training TP (Megatron would pad it, and the padding
            logits would change the actor's log-probs against the engine's).
    """

    def __init__(self, model: ModelSpec, topo: Topology, *, seed: int, lr: float, dtype: torch.dtype,
                 device: torch.device):
        try:
            from megatron.core import parallel_state  # noqa: PLC0415
        except ImportError as exc:
            raise ImportError("--trainer megatron needs megatron-core: pip install "
                              "'hybridmem[megatron]'") from exc
        if model.vocab_size % topo.train.tp:
            raise ValueError(f"--trainer megatron needs vocab_size={model.vocab_size} divisible by the "
                             f"training tp={topo.train.tp}")
        if model.tie_word_embeddings:
            raise ValueError("--trainer megatron builds an untied GPTModel; the model has "
                             "tie_word_embeddings=True")
        self.topo = topo
        self._stack = contextlib.ExitStack()
        if device.type == "cpu":
            from hybridmem.testing.megatron_cpu import megatron_on_cpu  # noqa: PLC0415

            self._stack.enter_context(megatron_on_cpu())
        try:
            self._build(parallel_state, model, seed=seed, lr=lr, dtype=dtype, device=device)
        except BaseException:
            self.close()
            raise

    def _build(self, parallel_state: Any, model: ModelSpec, *, seed: int, lr: float, dtype: torch.dtype,
               device: torch.device) -> None:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: PLC0415

        from hybridmem.adapters.megatron import MegatronTrainingState  # noqa: PLC0415
        from hybridmem.testing import megatron_models as mm  # noqa: PLC0415

        spec = mm.TinyGPTSpec(
            num_layers=model.num_hidden_layers, hidden_size=model.hidden_size,
            num_attention_heads=model.num_attention_heads, num_query_groups=model.num_key_value_heads,
            kv_channels=model.head_dim, ffn_hidden_size=model.intermediate_size, vocab_size=model.vocab_size,
            add_qkv_bias=model.qkv_bias, activation="silu", layernorm_epsilon=model.rms_norm_eps,
            rotary_base=int(model.rope_theta), seq_length=MAX_SEQ_LEN, clip_grad=0.0, lr=lr, seed=seed,
            tp=self.topo.train.tp,
            precision={torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
        )
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=spec.tp)
        self._initialised = True
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        [self.ddp], self.optimizer = mm.build_megatron_gpt(spec, device=device.type)
        self.actor = self.ddp
        self.state = MegatronTrainingState([self.ddp], self.optimizer, vocab_size=model.vocab_size)
        local = _local_weights(model, self.topo, seed=seed, dtype=dtype,
                               padded_vocab=self.state.padded_vocab_size)
        self.reference = mm.build_gpt_model(spec, device=device.type)
        self.reference.requires_grad_(False)
        with torch.no_grad():
            for named in (self.state.named_weights(), self.reference.named_parameters()):
                for name, p in named:
                    p.copy_(local[name].to(p.device))
        self.training = self.state

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The actor's weights by Megatron name (the resharding source)."""
        return self.state.named_weights()

    def megatron_convention(self) -> Any:
        """The resharding engine's Megatron convention of the actor."""
        return self.state.megatron_convention()

    def token_logprobs(self, model: Any, batch: torch.Tensor, *, temperature: float) -> torch.Tensor:
        """``[batch, seq - 1]`` log-probs of tokens ``1..``: Megatron's vocab-parallel cross entropy of
        the TP-split logits, negated (no rank ever holds the full vocab)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: PLC0415

        tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens).contiguous()
        logits = model(tokens, positions, None)  # [batch, seq, vocab / tp]
        return -vocab_parallel_cross_entropy(logits.float() / temperature, labels)

    def step(self, loss_fn: Callable[[], torch.Tensor]) -> None:
        """One Megatron optimizer step: zero the grad buffer, backward, data-parallel grad sync, step."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_fn().backward()
        self.ddp.finish_grad_sync()
        self.optimizer.step()

    def attach(self, manager: Any) -> None:
        """Register the Megatron workspace release step and residency owner."""
        self.state.attach(manager)

    def close(self) -> None:
        """Destroy Megatron's parallel state and leave the CPU harness."""
        if getattr(self, "_initialised", False):
            from megatron.core import parallel_state  # noqa: PLC0415

            parallel_state.destroy_model_parallel()
            self._initialised = False
        self._stack.close()


def build_trainer(kind: str, model: ModelSpec, topo: Topology, *, seed: int, lr: float, dtype: torch.dtype,
                  device: torch.device) -> Any:
    """``kind`` is ``"torch"``, ``"megatron"`` or ``"fsdp"``."""
    from hybridmem.examples.grpo.fsdp_trainer import FSDPTrainer  # noqa: PLC0415

    cls = {"torch": TorchTrainer, "megatron": MegatronTrainer, "fsdp": FSDPTrainer}.get(kind)
    if cls is None:
        raise ValueError(f"trainer={kind!r}; expected 'torch', 'megatron' or 'fsdp'")
    return cls(model, topo, seed=seed, lr=lr, dtype=dtype, device=device)
