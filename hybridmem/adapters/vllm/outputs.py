"""The mapping between hybridmem's generation types and vLLM's.

The adapter takes the embedded engine's :class:`~hybridmem.engines.SamplingParams` (or any object with
its fields) and returns its :class:`~hybridmem.engines.GenerationOutput`, so code written against one
engine runs against the other unchanged (see the engine contract tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridmem.contract.generation import GenerationOutput, SamplingParams

__all__ = ["GREEDY", "to_vllm_sampling_kwargs", "from_request_output"]

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=True)
"""What :meth:`~hybridmem.adapters.vllm.VLLMEngine.generate` uses when given no parameters."""

_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "logprobs")


def to_vllm_sampling_kwargs(params: Any, index: int = 0) -> dict[str, Any]:
    """Keyword arguments for the ``vllm.SamplingParams`` of request ``index`` of a batch, from a
    :class:`~hybridmem.engines.SamplingParams`-like object.

    The embedded engine seeds sequence ``i`` of a batch with ``seed + i``; vLLM seeds per request, so
    request ``index`` gets ``seed + index`` (``seed=None`` leaves vLLM's own generator). ``logprobs=True``
    maps to vLLM's ``logprobs=0``: the sampled token's log-prob and no top-k alternatives.
    ``stop_token_ids`` (optional on ``params``) passes through.

    Raises:
        TypeError: ``params`` lacks one of the fields.
    """
    missing = [f for f in _FIELDS if not hasattr(params, f)]
    if missing:
        raise TypeError(
            f"sampling params {type(params).__name__} lacks fields {missing}; "
            f"expected those of hybridmem.engines.SamplingParams"
        )
    kwargs = {
        "max_tokens": int(params.max_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "seed": None if params.seed is None else int(params.seed) + index,
        "logprobs": 0 if params.logprobs else None,
    }
    stop = tuple(getattr(params, "stop_token_ids", ()) or ())
    if stop:
        kwargs["stop_token_ids"] = [int(t) for t in stop]
    return kwargs


def from_request_output(prompt_ids: Sequence[int], output: Any, *, want_logprobs: bool) -> GenerationOutput:
    """A :class:`~hybridmem.engines.GenerationOutput` from a vLLM ``RequestOutput`` (its first completion).

    vLLM computes log-probs from the raw logits by default (``logprobs_mode="raw_logprobs"``: before
    temperature and top-p), as the embedded engine does.

    Raises:
        ValueError: Log-probs were asked for but a generated token has none.
    """
    completion = output.outputs[0]
    request = getattr(output, "request_id", "?")
    token_ids = [int(t) for t in completion.token_ids]
    logprobs: list[float] | None = None
    if want_logprobs:
        per_token = completion.logprobs
        if per_token is None or len(per_token) != len(token_ids):
            got = None if per_token is None else len(per_token)
            raise ValueError(f"request {request}: {len(token_ids)} tokens but {got} log-prob entries")
        values = []
        for position, (token, entry) in enumerate(zip(token_ids, per_token, strict=True)):
            if token not in entry:
                raise ValueError(f"request {request}: no log-prob for sampled token {token} at {position=}")
            values.append(float(entry[token].logprob))
        logprobs = values
    prompt = [int(t) for t in prompt_ids]
    reason = getattr(completion, "finish_reason", None)
    return GenerationOutput(prompt_ids=prompt, token_ids=token_ids, logprobs=logprobs,
                            finish_reason=None if reason is None else str(reason))
