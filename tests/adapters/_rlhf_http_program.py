"""RLHF weight syncing against a ``vllm serve`` HTTP server through vLLM's own trainer API, with hybridmem's
``hybridmem`` weight-transfer backend for the data plane (the shape of vLLM's ``examples/rl/rlhf_http_*.py``).

  * OpenAI-compatible API for inference requests (``/v1/completions``, temperature 0)
  * HTTP endpoints for the weight-transfer control plane (vLLM's ``HTTPVLLMWeightSyncClient``)
  * hybridmem's buckets for the weights: each worker takes its own shards of the vLLM layout

The program starts the server itself (``--weight-transfer-config '{"backend": "hybridmem"}'``), builds the
trainer engine with ``WeightTransferTrainerFactory.trainer_init``, then trains a tiny Qwen2 three steps;
after each it pauses generation, ``send_weights()``, resumes, and checks that the server's greedy tokens
equal transformers' greedy tokens of the trained weights. Exit status 0: every step matched.

Run:
    $ python tests/adapters/_rlhf_http_program.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from _vllm_serve_tasks import SERVER_ARGS  # noqa: E402 - found through the sys.path set above
from _vllm_server_tasks import (  # noqa: E402
    BUCKET_NBYTES,
    MAX_TOKENS,
    PROMPTS,
    VLLM_ENV,
    hf_greedy,
    lm_step,
    save_policy,
)

STEPS = 3


def completions(base_url: str, model: str, prompts: list[list[int]]) -> list[list[int]]:
    """The server's greedy tokens for token-id prompts, over the OpenAI-compatible API."""
    import requests

    out = []
    for prompt in prompts:
        response = requests.post(f"{base_url}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True})
        response.raise_for_status()
        out.append(response.json()["choices"][0]["token_ids"])
    return out


def pause_generation(base_url: str) -> None:
    import requests

    requests.post(f"{base_url}/pause", timeout=60).raise_for_status()


def resume_generation(base_url: str) -> None:
    import requests

    requests.post(f"{base_url}/resume", timeout=60).raise_for_status()


def main() -> int:
    os.environ.update(VLLM_ENV)
    import torch
    import transformers
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from hybridmem.adapters.vllm.server.process import launch_server
    from hybridmem.adapters.vllm.server.trainer import HybridmemTrainerInitInfo

    model_dir = save_policy(tempfile.mkdtemp(prefix="policy-"))
    base_url, server = launch_server(model_dir, server_args=SERVER_ARGS)  # vllm serve, backend hybridmem
    print(f"[server] ready at {base_url}: {' '.join(server.argv)}", flush=True)
    engine = None
    try:
        train_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        optimizer = torch.optim.AdamW(train_model.parameters(), lr=3e-3)

        engine = WeightTransferTrainerFactory.trainer_init(
            init_info=HybridmemTrainerInitInfo(rank=0, hf_config=train_model.config,
                                               bucket_nbytes=BUCKET_NBYTES),  # rank 0 = sender
            client=HTTPVLLMWeightSyncClient(base_url),
            source=ModuleSource(train_model),
        )
        print(f"[transfer] {type(engine).__name__} ready", flush=True)

        for step in range(STEPS):
            loss = lm_step(train_model, optimizer, step, train_model.config.vocab_size)
            pause_generation(base_url)
            engine.send_weights()  # start_weight_update / update_weights / finish_weight_update
            resume_generation(base_url)

            served = completions(base_url, model_dir, PROMPTS)
            expected = hf_greedy(train_model)
            if served != expected:
                print(f"[check] step {step}: FAILED, the server gave {served}, transformers {expected}",
                      flush=True)
                return 1
            print(f"[check] step {step}: loss {loss:.4f}, {engine.last_update['engine_update_nbytes']} bytes "
                  f"sent, version {engine.last_update['weight_version']}: the server's greedy tokens equal "
                  f"transformers'", flush=True)
        return 0
    finally:
        if engine is not None:
            engine.shutdown()
        print("[server] Shutting down...", flush=True)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
