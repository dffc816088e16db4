"""Worker task for test_megatron_names.py: build a real megatron-core GPTModel on CPU (gloo) and list
its parameters. Only building is needed (no forward), which megatron-core 0.16.1 supports on CPU."""

from __future__ import annotations


def gpt_parameters(ctx, spec, tp: int, pp: int, padded_vocab: int):
    from megatron.core import parallel_state

    from hybridmem.testing.megatron_cpu import megatron_on_cpu

    # The CPU harness: with tied embeddings and pp > 1 LanguageModule moves the output weight with .cuda(),
    # and MLA's rotary embedding asks for torch.cuda.current_device().
    with megatron_on_cpu():
        parallel_state.initialize_model_parallel(tp, pp)
        try:
            return _parameters(spec, padded_vocab, tp, pp)
        finally:
            parallel_state.destroy_model_parallel()


def _parameters(spec, padded_vocab: int, tp: int, pp: int) -> dict:
    from hybridmem.testing.megatron_models import gpt_from_model_spec

    model = gpt_from_model_spec(spec, tp=tp, pp=pp, padded_vocab=padded_vocab)
    out = {name: tuple(p.shape) for name, p in model.named_parameters()}
    # DeepSeek's router bias is a persistent buffer, not a parameter, and the weight sync carries it.
    out.update({name: tuple(b.shape) for name, b in model.named_buffers()
                if name.endswith("router.expert_bias")})
    return out
