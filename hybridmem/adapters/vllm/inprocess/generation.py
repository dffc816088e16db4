"""Generation from token-id prompts with an in-process ``vllm.LLM``, in hybridmem's generation types."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridmem.adapters.vllm.compat import import_vllm
from hybridmem.adapters.vllm.inprocess.state import EngineState
from hybridmem.adapters.vllm.inprocess.weights import settle_update
from hybridmem.adapters.vllm.outputs import GREEDY, from_request_output, to_vllm_sampling_kwargs
from hybridmem.contract.generation import GenerationOutput

__all__ = ["generate"]


def generate(llm: Any, state: EngineState, prompt_ids: Sequence[Sequence[int]], params: Any, *,
             reprocess_after_update: bool) -> list[GenerationOutput]:
    """:meth:`VLLMEngine.generate`: refused unless the engine serves; what an in-place update owes is paid
    first (:func:`~hybridmem.adapters.vllm.inprocess.weights.settle_update`).

    Raises:
        PhaseError: A tag is not resident, or the weights were discarded and not loaded since.
    """
    state.check_serving("generate with vLLM")
    params = GREEDY if params is None else params
    vllm_params = import_vllm("vllm").SamplingParams
    sampling_params = [vllm_params(**to_vllm_sampling_kwargs(params, i)) for i in range(len(prompt_ids))]
    settle_update(llm, state, reprocess_after_update=reprocess_after_update)
    prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompt_ids]
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)  # the latest adapter, if any
    if len(outputs) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    want = bool(params.logprobs)
    return [from_request_output(p, o, want_logprobs=want) for p, o in zip(prompt_ids, outputs, strict=True)]
