"""Generation inputs and outputs of the vLLM adapter, and their mapping to vLLM's types.

``GenerationOutput`` has the shape ``(prompt_ids, token_ids, logprobs)``; it is defined here because
the embedded engine's own output type was not yet on the main branch when this adapter was written.
Any object with the fields of :class:`GenerationParams` is accepted as sampling parameters, so the
embedded engine's parameters can be passed unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GenerationParams", "GenerationOutput", "to_vllm_sampling_kwargs", "from_request_output"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationParams:
    """Sampling parameters, in the subset hybridmem's engines share."""

    max_tokens: int = 16
    """Tokens to generate per prompt (fewer when EOS is sampled)."""
    temperature: float = 0.0
    """0 samples greedily."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    seed: int | None = None
    """Per-request sampling seed (``None``: the engine's generator)."""
    logprobs: bool = True
    """Return the log-prob of every generated token."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """One prompt's generation."""

    prompt_ids: tuple[int, ...]
    """The prompt's token ids."""
    token_ids: tuple[int, ...]
    """The generated token ids."""
    logprobs: tuple[float, ...] | None
    """Log-prob of each generated token, or ``None`` if not asked for. vLLM computes it from the raw
    logits by default (``logprobs_mode="raw_logprobs"``: before temperature and top-p); build the LLM
    with ``logprobs_mode="processed_logprobs"`` for the log-probs of the sampling distribution."""


def to_vllm_sampling_kwargs(params: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` from a :class:`GenerationParams`-like object.

    ``logprobs=True`` maps to vLLM's ``logprobs=0``: the sampled token's log-prob and no top-k
    alternatives.

    Raises:
        TypeError: ``params`` lacks one of the fields.
    """
    missing = [f for f in GenerationParams.__slots__ if not hasattr(params, f)]
    if missing:
        raise TypeError(
            f"sampling params {type(params).__name__} lacks fields {missing}; "
            f"expected those of GenerationParams"
        )
    return {
        "max_tokens": int(params.max_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "seed": params.seed,
        "logprobs": 0 if params.logprobs else None,
    }


def from_request_output(prompt_ids: Sequence[int], output: Any, *, want_logprobs: bool) -> GenerationOutput:
    """A :class:`GenerationOutput` from a vLLM ``RequestOutput`` (its first completion).

    Raises:
        ValueError: Log-probs were asked for but a generated token has none.
    """
    completion = output.outputs[0]
    request = getattr(output, "request_id", "?")
    token_ids = tuple(int(t) for t in completion.token_ids)
    logprobs: tuple[float, ...] | None = None
    if want_logprobs:
        per_token = completion.logprobs
        if per_token is None or len(per_token) != len(token_ids):
            got = None if per_token is None else len(per_token)
            raise ValueError(f"request {request}: {len(token_ids)} tokens but {got} log-prob entries")
        values = []
        for position, (token, entry) in enumerate(zip(token_ids, per_token)):
            if token not in entry:
                raise ValueError(f"request {request}: no log-prob for sampled token {token} at {position=}")
            values.append(float(entry[token].logprob))
        logprobs = tuple(values)
    prompt = tuple(int(t) for t in prompt_ids)
    return GenerationOutput(prompt_ids=prompt, token_ids=token_ids, logprobs=logprobs)
