"""Watch what a documented program does with ShardingManager, and check it against transformers.

Installed by the docs runner (``_docs.py``, ``_docs_launch.py``) when ``HYBRIDMEM_DOCS_CHECK`` names a
directory; the program itself is the reader's code, unchanged. For every switch it records:

- whether the training state (every tensor of every offloader: parameters, buffers, grads, optimizer
  state) after INFER->TRAIN is byte for byte what it was before TRAIN->INFER;
- for every greedy ``generate`` call of a ``ReferenceEngine``, ``VLLMEngine`` or ``VLLMServerEngine``
  inside INFER: the prompts, the tokens the engine returned, and the training weights of that switch as
  a transformers checkpoint names them (a transformers model's ``state_dict()``; for Megatron-core, the
  weights of every rank mapped to transformers' names by the independent sharder in
  tests/reshard/reference.py).

At exit, transformers checks every recorded call on those weights: a forward over each prompt and the
engine's tokens gives, at every position, transformers' greedy token (the argmax of its logits; where the
engine's token is within ``TIE`` of the maximum, the two are a tie and the engine's counts), so the
engine's greedy sequence equals transformers' exactly when every token matches. (``model.generate``
would compute the same argmaxes, incrementally with a KV cache, whose rounding can flip exact near-ties.)
Each process writes ``check-<pid>.json`` into the directory: ``{"switches": [bool, ...], "greedy":
[{"expected": [...], "got": [...], "max_logprob_gap": float}, ...]}``.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["install", "teacher_forced_greedy", "TIE"]

TIE = 1e-5
"""Log-probabilities closer than this are a tie (the engine's token then counts as transformers' choice)."""


class _Checker:
    def __init__(self, out_dir: Path):
        self.out = out_dir / f"check-{os.getpid()}.json"
        self.switches: list[bool] = []
        self.calls: list[dict[str, Any]] = []
        self._open: dict[int, tuple[list[torch.Tensor], Any]] = {}
        self._weights: Any = None

    # Hooks ------------------------------------------------------------------------------------------
    def before_infer(self, manager: Any) -> None:
        self._open[id(manager)] = (_state(manager), None)
        self._weights = _reference_weights(manager)

    def after_train(self, manager: Any) -> None:
        before, _ = self._open.pop(id(manager))
        after = _state(manager)
        same = len(before) == len(after) and all(_bytes_equal(a, b) for a, b in zip(before, after))
        self.switches.append(same)
        self._weights = None

    def on_generate(self, prompts: Any, params: Any, outputs: Any) -> None:
        if self._weights is None or params is None or float(getattr(params, "temperature", 1.0)) != 0.0:
            return
        self.calls.append({"prompts": [list(map(int, p)) for p in prompts],
                           "max_tokens": int(params.max_tokens),
                           "got": [list(map(int, o.token_ids)) for o in outputs], "weights": self._weights})

    # Exit -------------------------------------------------------------------------------------------
    def finish(self) -> None:
        greedy = []
        for call in self.calls:
            config, weights = call["weights"]
            expected, gap = teacher_forced_greedy(_hf_model(config, weights), call["prompts"], call["got"])
            greedy.append({"expected": expected, "got": call["got"], "max_logprob_gap": gap})
        self.out.write_text(json.dumps({"switches": self.switches, "greedy": greedy}))


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _state(manager: Any) -> list[torch.Tensor]:
    return [t.detach().cpu().clone().contiguous()
            for off in manager.offloaders.values() for t in off.tensors()
            if t is not None and t.untyped_storage().nbytes() > 0]


def _reference_weights(manager: Any) -> Any:
    """``(transformers config, {HF name: tensor})`` of the training weights now, or ``None``."""
    training = manager.training
    capabilities = manager.training_capabilities
    config = training.hf_config if capabilities.has_hf_config else None
    if config is not None and hasattr(training.modules[0], "peft_config"):
        # A PEFT model: its state dict is not a checkpoint of the base model (checked by its caller).
        return None
    if config is not None:
        return config, {k: v.detach().cpu().clone() for k, v in training.modules[0].state_dict().items()}
    if capabilities.describes_model and capabilities.megatron_names:
        return _megatron_to_hf(training)
    return None


def _megatron_to_hf(training: Any) -> Any:
    """Every rank's Megatron weights, mapped to transformers' names through the reference sharder run on
    index tensors (each HF element numbered, then sharded as Megatron shards it)."""
    import torch.distributed as dist
    import transformers

    from hybridmem.reshard import ModelSpec
    from tests.reshard.reference import megatron_shard

    spec_dict = training.model_spec_dict()
    spec = ModelSpec.from_hf_config(spec_dict)
    config = transformers.AutoConfig.for_model(**spec_dict)
    shapes = {n: tuple(t.shape)
              for n, t in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()}
    index, offset = {}, 1
    for name, shape in shapes.items():
        n = int(torch.tensor(shape).prod())
        index[name] = torch.arange(offset, offset + n, dtype=torch.float64).reshape(shape)
        offset += n
    layout = training.source_layout()
    world = dist.get_world_size()
    mine = {n: t.detach().cpu().double().clone() for n, t in training.named_weights()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    flat = torch.zeros(offset, dtype=torch.float64)
    for r in range(world):
        shard = megatron_shard(index, spec, tp=layout.tp, pp=layout.pp, ep=layout.ep, world=world, rank=r,
                               divisible_by=training.padded_vocab_size // layout.tp)
        for name, idx in shard.items():
            keep = idx > 0
            flat[idx[keep].long()] = gathered[r][name][keep]
    return config, {name: flat[index[name].long()].float() for name in shapes}


def _hf_model(config: Any, weights: dict[str, torch.Tensor]) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.to(next(iter(weights.values())).dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m or m == "lm_head.weight" for m in missing), (
        missing, unexpected)
    return model


def teacher_forced_greedy(model: Any, prompts: list[list[int]],
                          got: list[list[int]]) -> tuple[list[list[int]], float]:
    """Transformers' greedy token at every position of each prompt followed by the engine's tokens (see the
    module docstring), and the largest log-probability gap between transformers' best token and the
    engine's."""
    expected, worst = [], 0.0
    with torch.no_grad():
        for prompt, tokens in zip(prompts, got):
            ids = torch.tensor([list(prompt) + list(tokens)])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            row = []
            for i, token in enumerate(tokens):
                at = logprobs[len(prompt) - 1 + i]
                gap = float(at.max() - at[token])
                worst = max(worst, gap)
                row.append(int(token) if gap <= TIE else int(at.argmax()))
            expected.append(row)
    return expected, worst


def install() -> None:
    """Wrap ShardingManager's switches and the engines' ``generate`` (see the module docstring)."""
    from hybridmem import ShardingManager
    from hybridmem.engines import ReferenceEngine

    checker = _Checker(Path(os.environ["HYBRIDMEM_DOCS_CHECK"]))
    to_infer, to_train = ShardingManager.to_infer, ShardingManager.to_train

    @functools.wraps(to_infer)
    def watched_to_infer(self: Any) -> Any:
        checker.before_infer(self)
        return to_infer(self)

    @functools.wraps(to_train)
    def watched_to_train(self: Any) -> Any:
        report = to_train(self)
        checker.after_train(self)
        return report

    ShardingManager.to_infer, ShardingManager.to_train = watched_to_infer, watched_to_train
    engines = [ReferenceEngine]
    try:
        from hybridmem.adapters.vllm import VLLMEngine  # never imports vLLM itself
        from hybridmem.adapters.vllm.server import VLLMServerEngine  # nor does this

        engines += [VLLMEngine, VLLMServerEngine]
    except ImportError:
        pass
    for cls in engines:
        generate = cls.generate

        def watched_generate(self: Any, prompts: Any, params: Any = None, *, _generate=generate) -> Any:
            outputs = _generate(self, prompts, params)
            checker.on_generate(prompts, params, outputs)
            return outputs

        cls.generate = watched_generate
    atexit.register(checker.finish)
