"""What a generation call takes and gives, the same for every engine: :class:`SamplingParams` (a subset
of vLLM's) and :class:`GenerationOutput`, so code written against one engine runs against another."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SamplingParams", "GenerationOutput"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How to sample one request's continuation (a subset of vLLM's ``SamplingParams``)."""

    max_tokens: int = 16
    """Tokens to generate at most."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of most likely tokens whose probability reaches ``top_p``."""
    seed: int = 0
    """Seed of the sampling generator; sequence ``i`` of a batch uses ``seed + i``."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a sequence stops after it emits one of these (the stop token is kept)."""
    logprobs: bool = False
    """Whether to return the log-prob of each sampled token."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be a positive int")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.seed, int):
            raise TypeError(f"seed={self.seed!r} must be an int")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """One request's result.

    Attributes:
        prompt_ids: The prompt.
        token_ids: Generated tokens (a stop token included).
        logprobs: Log-prob of each generated token under the raw model distribution, or ``None`` when
            ``SamplingParams.logprobs`` is false.
        finish_reason: Why the request ended, as the engine says (vLLM: ``"length"``, ``"stop"``, or
            ``"abort"`` for a request a switch aborted); ``None`` where the engine does not say. Not
            compared: two engines' outputs with the same tokens are equal.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None = field(default=None, compare=False)
