"""HybridGRPOTrainer runs, each in its own process (test_trl.py): real TRL, real vLLM (CPU build).

``python _trl_tasks.py SCENARIO OUT.json`` trains a tiny Qwen2 with a character tokenizer, both written
with ``save_pretrained`` and loaded with ``from_pretrained``, the way a TRL user's script does, and writes
what it saw. The switch checker of ``tests/_docs_check.py`` records, for every switch, whether the
training state came back byte for byte (set ``HYBRIDMEM_DOCS_CHECK``).

Scenarios:

- ``learn``: defaults; the switch of the third generation fails once inside vLLM's wake-up (an injected
  error) and is rolled back and retried;
- ``options``: ``beta > 0`` (TRL's reference model, co-resident), gradient accumulation and
  ``steps_per_generation`` above it;
- ``lora``: ``peft_config`` with LoRA adapters (synced as adapters into vLLM's LoRA, the default).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LETTERS = list("abcdefghijklmnopqrstuvwxyz") + list("ABCD")
PROMPTS = ["abc", "hello", "xyz", "tea", "moon", "quiz", "lamp", "river"]


def write_checkpoint(path: str, *, hidden_size: int = 64, layers: int = 2) -> None:
    """A character tokenizer and a tiny Qwen2 (head_dim 32 for vLLM's CPU attention), saved as users save."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(LETTERS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                         eos_token="<eos>").save_pretrained(path)
    heads = hidden_size // 32
    config = transformers.Qwen2Config(hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=min(heads, 2), head_dim=32, vocab_size=32,
                                      max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
                                      bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)


def inject_one_wake_failure(at_call: int) -> list[int]:
    """Make the ``at_call``-th ``VLLMEngine.resume`` raise once (as a failed vLLM wake-up would)."""
    from hybridmem.adapters.vllm import VLLMEngine

    calls = [0]
    resume = VLLMEngine.resume

    def failing(self, tags):
        calls[0] += 1
        if calls[0] == at_call:
            raise RuntimeError("injected: vLLM wake-up failed")
        return resume(self, tags)

    VLLMEngine.resume = failing
    return calls


def watch_lora_requests() -> list[list]:
    """Record, for every ``vllm.LLM.generate`` call, the adapter id it asked for and the ids vLLM holds."""
    import vllm

    seen: list[list] = []
    generate = vllm.LLM.generate

    def watched(self, *args, **kwargs):
        request = kwargs.get("lora_request")
        held = sorted(self.llm_engine.list_loras()) if self.llm_engine.vllm_config.lora_config else []
        seen.append([getattr(request, "lora_int_id", None), held])
        return generate(self, *args, **kwargs)

    vllm.LLM.generate = watched
    return seen


def main(scenario: str, out_path: str) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    if os.environ.get("HYBRIDMEM_DOCS_CHECK"):
        from _docs_check import install

        install()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from hybridmem.engines import SamplingParams
    from hybridmem.integrations.trl import REFERENCE_OWNER, HybridGRPOTrainer

    model_dir = tempfile.mkdtemp(prefix="hybridmem-trl-")
    write_checkpoint(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    a = tokenizer.convert_tokens_to_ids("a")

    def reward(completions, completion_ids, **kwargs):  # the share of "a" in the completion
        return [sum(t == a for t in ids) / max(1, len(ids)) for ids in completion_ids]

    options = dict(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none", logging_steps=1,
                   per_device_train_batch_size=8, num_generations=8, max_completion_length=8,
                   learning_rate=3e-2, max_steps=8, seed=0, use_vllm=True, vllm_mode="colocate",
                   vllm_max_model_length=64)
    extra = {}
    if scenario == "options":
        options.update(beta=0.05, num_generations=4, gradient_accumulation_steps=2, steps_per_generation=4,
                       max_steps=6)
    elif scenario == "lora":
        from peft import LoraConfig

        options.update(learning_rate=5e-2, max_steps=6)
        extra["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    # at_call=5: generation 3's weights wake-up.
    resumes = inject_one_wake_failure(at_call=5) if scenario == "learn" else None
    served = watch_lora_requests() if scenario == "lora" else None
    dataset = Dataset.from_dict({"prompt": PROMPTS * 8})
    trainer = HybridGRPOTrainer(model=model, reward_funcs=reward, train_dataset=dataset,
                                processing_class=tokenizer, args=GRPOConfig(**options), **extra)
    trainer.train()

    manager = trainer.hybrid_manager
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:4]]
    with manager.inference() as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, logprobs=True))
        residency = manager.residency()
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    from _docs_check import teacher_forced_greedy

    got = [o.token_ids for o in outs]
    expected, gap = teacher_forced_greedy(trained, prompts, got)
    base_expected = None
    if scenario == "lora":  # transformers' greedy without the adapter: what a stale or missing adapter serves
        with trained.disable_adapter():
            base_expected, _ = teacher_forced_greedy(trained, prompts, got)
    with torch.no_grad():  # transformers' log-probs of the engine's tokens
        hf_logprobs = []
        for p, o in zip(prompts, outs):
            lp = torch.log_softmax(trained(input_ids=torch.tensor([p + o.token_ids])).logits[0].float(), -1)
            hf_logprobs.append([lp[len(p) - 1 + i, t].item() for i, t in enumerate(o.token_ids)])
    result = {
        "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
        "global_step": trainer.state.global_step,
        "generations": [{"step": r.global_step, "retried": r.retried, "offloaded": r.offloaded_nbytes,
                         "synced": r.synced_nbytes, "route": r.sync_route,
                         "leftovers": list(r.to_infer.residency.leftovers) if r.to_infer.residency else None,
                         "caption": str(r.to_infer).splitlines()[-1]} for r in trainer.hybrid_reports],
        "greedy": {"got": got, "expected": expected, "max_gap": gap, "base_expected": base_expected},
        "logprobs": {"vllm": [o.logprobs for o in outs], "hf": hf_logprobs},
        "residency_in_infer": residency.by_owner,
        "leftovers_in_infer": list(residency.leftovers),
        "coresidents": sorted(manager.coresidents),
        "reference_nbytes_in_train": manager.coresidents[REFERENCE_OWNER].resident_nbytes()
        if REFERENCE_OWNER in manager.coresidents else None,
        "trainable_param_nbytes": sum(p.numel() * p.element_size()
                                      for p in trained.parameters() if p.requires_grad),
        "lora_nbytes": sum(p.numel() * p.element_size()
                           for n, p in trained.named_parameters() if ".lora_" in n),
        "base_nbytes": sum(p.numel() * p.element_size()
                           for n, p in trained.named_parameters() if ".lora_" not in n),
        "resume_calls": resumes[0] if resumes else None,
        "lora_requests": served,
        "logged_metrics": sorted({k for h in trainer.state.log_history
                                  for k in h if k.startswith("hybridmem/")}),
        "logged_synced": [h["hybridmem/synced_bytes"] for h in trainer.state.log_history
                          if "hybridmem/synced_bytes" in h],
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
