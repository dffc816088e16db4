"""The demo's FSDP2 actor: a transformers ``Qwen2ForCausalLM`` with ``fully_shard`` over every rank.

The user-facing path of :mod:`hybridmem.adapters.fsdp`: the actor keeps transformers' names, each
decoder layer and the root are ``fully_shard``-ed over all ranks (data parallel only), and
``ShardingManager`` is given the module, its AdamW optimizer and ``model_spec=`` (the default weight
sync reshards the FSDP2 shards straight into the engine's TP layout). The frozen reference is the same
transformers model, unsharded, registered as a co-resident.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from hybridmem.engines.nn.config import hf_config_dict
from hybridmem.engines.nn.gpt import init_hf_weights
from hybridmem.examples.grpo.topology import Topology
from hybridmem.reshard.spec import ModelSpec

__all__ = ["FSDPTrainer"]


def _hf_model(model: ModelSpec, weights: dict[str, torch.Tensor], device: torch.device) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415 - only for this trainer

    hf = Qwen2ForCausalLM(Qwen2Config(**hf_config_dict(model))).to(device)
    missing, unexpected = hf.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF weights do not fit Qwen2ForCausalLM: missing {missing}, "
                           f"unexpected {unexpected}")
    return hf


class FSDPTrainer:
    """Actor as an FSDP2 ``Qwen2ForCausalLM`` trained with AdamW; reference as a plain copy.

    Raises:
        ValueError: The training layout is not tp = pp = 1 (FSDP2 shards over all ranks).
    """

    def __init__(self, model: ModelSpec, topo: Topology, *, seed: int, lr: float, dtype: torch.dtype,
                 device: torch.device):
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        if topo.train.tp != 1:
            raise ValueError(f"--trainer fsdp shards over all ranks; it needs --train-tp 1, "
                             f"got {topo.train.tp}")
        self.topo = topo
        self.hf_config = hf_config_dict(model)
        weights = init_hf_weights(model, seed=seed, dtype=dtype)
        self.actor = _hf_model(model, weights, device).to(dtype)
        for layer in self.actor.model.layers:
            fully_shard(layer)
        fully_shard(self.actor)
        self.reference = _hf_model(model, weights, device).to(dtype)
        self.reference.requires_grad_(False)
        self.training = self.actor
        self.optimizer = torch.optim.AdamW(self.actor.parameters(), lr=lr, weight_decay=0.0)

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Not used: the manager's default weight sync reads the FSDP2 shards itself."""
        return self.actor.named_parameters()

    def token_logprobs(self, model: Any, batch: torch.Tensor, *, temperature: float) -> torch.Tensor:
        """``[batch, seq - 1]`` log-probs of tokens ``1..`` under ``model`` (the actor or the reference)."""
        logits = model(input_ids=batch).logits[:, :-1]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, batch[:, 1:, None]).squeeze(-1)

    def step(self, loss_fn: Callable[[], torch.Tensor]) -> None:
        """One AdamW step; FSDP2 reduce-scatters (averages) the gradients over all ranks in backward."""
        self.optimizer.zero_grad()
        loss_fn().backward()
        self.optimizer.step()

    def attach(self, manager: Any) -> None:
        """Nothing: the manager attaches the FSDP2 training state itself."""

    def close(self) -> None:
        """Nothing to tear down."""
