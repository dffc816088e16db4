"""vLLM's own trainer API (``WeightTransferTrainerFactory``) with the ``hybridmem`` backend against a real
AsyncLLM, run in a process of its own by test_vllm_trainer_api.py: ``python _vllm_trainer_api_tasks.py
SCENARIO OUT.json`` writes its findings as JSON. References are transformers' greedy tokens on the trained
weights; vLLM's own refusals are read from its calls here, not through the trainer engine.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from _vllm_server_tasks import (
    BUCKET_NBYTES,
    ENGINE_ARGS,
    MAX_TOKENS,
    PROMPTS,
    VLLM_ENV,
    hf_greedy,
    lm_step,
    save_policy,
)


def _error(fn, *args) -> str | None:
    try:
        fn(*args)
    except Exception as exc:  # the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return None


def async_trainer_api(out: str) -> dict:
    """trainer_init on an AsyncLLMClient; two trained steps, each checked; malformed init and update infos
    sent straight to vLLM; a finish_weight_update refused (the engine never sees it, its session stays
    open); the next send_weights."""
    import torch
    import transformers
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.engine.arg_utils import AsyncEngineArgs

    from hybridmem.adapters.vllm.server.client import AsyncLLMClient
    from hybridmem.adapters.vllm.server.trainer import HybridmemTrainerInitInfo
    from hybridmem.engines import SamplingParams
    from hybridmem.errors import EngineFault, EngineProcessError

    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    model_dir = save_policy(tempfile.mkdtemp(prefix="policy-"))
    client = AsyncLLMClient(AsyncEngineArgs(model=model_dir, weight_transfer_config={"backend": "hybridmem"},
                                            **ENGINE_ARGS))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    res: dict = {"steps": []}

    def served() -> list[list[int]]:
        return [o.token_ids for o in client.generate(PROMPTS, greedy)]

    def sync() -> None:
        client.pause("wait")
        try:
            engine.send_weights()
        finally:
            client.resume_generation()

    engine = WeightTransferTrainerFactory.trainer_init(
        HybridmemTrainerInitInfo(rank=0, hf_config=model.config, bucket_nbytes=BUCKET_NBYTES),
        client=client, source=ModuleSource(model))
    try:
        res["engine_class"] = type(engine).__name__
        for step in range(2):
            lm_step(model, opt, step, model.config.vocab_size)
            sync()
            res["steps"].append({"got": served(), "expected": hf_greedy(model),
                                 "version": client.weight_version(), "last_update": engine.last_update})

        # Malformed infos, straight to vLLM: each refused naming the field, nothing written.
        lm_step(model, opt, 2, model.config.vocab_size)  # the trainer's weights now differ from the served
        before = served()
        run = engine.engine.run
        res["malformed_update"] = {}
        for label, info in (("generation_str", {"run": run, "generation": "7", "verify": True}),
                            ("verify_missing", {"run": run, "generation": 7}),
                            ("unknown_field", {"run": run, "generation": 7, "verify": True, "bytes": 1}),
                            ("run_other", {"run": "another-run", "generation": 7, "verify": True})):
            client.start_weight_update()
            error = _error(client.update_weights, info)
            res["malformed_update"][label] = {"error": error,
                                              "finish_after": _error(client.finish_weight_update, None)}
        res["malformed_init"] = {}
        good_init = {"run": run, "layout_dir": "/nonexistent", "bucket_nbytes": BUCKET_NBYTES, "ranks": []}
        for label, info in (("run_int", {**good_init, "run": 5}),
                            ("ranks_empty", good_init),
                            ("bucket_nbytes_zero", {**good_init, "bucket_nbytes": 0,
                                                    "ranks": [{"channel": "x", "buckets": {}}]})):
            res["malformed_init"][label] = _error(client.init_weight_transfer_engine, info)
        res["after_malformed"] = {"before": before, "after": served()}
        sync()  # the workers' backend is as trainer_init left it: the next update goes through
        res["after_malformed"]["next"] = {"got": served(), "expected": hf_greedy(model),
                                          "version": client.weight_version()}

        # A finish_weight_update refused before it reached vLLM: its update session stays open.
        original = client.finish_weight_update
        refused: list[str | None] = []

        def refusing_finish(weight_version=None):
            if weight_version is not None and not refused:
                refused.append(weight_version)
                raise EngineProcessError("finish_weight_update", where=client.where, deadline_s=1.0,
                                         elapsed_s=0.0, cause="injected: refused", fault=EngineFault.REFUSED)
            return original(weight_version)

        client.finish_weight_update = refusing_finish
        lm_step(model, opt, 3, model.config.vocab_size)
        refused_finish: dict = {"raised": _error(sync)}
        # vLLM's own word that its session is open: it refuses a start (and that refusal changes nothing).
        refused_finish["vllm_start_while_open"] = _error(client.start_weight_update)
        refused_finish["next_raised"] = _error(sync)
        refused_finish.update(got=served(), expected=hf_greedy(model), version=client.weight_version(),
                              refused_version=refused[0] if refused else None)
        res["refused_finish"] = refused_finish
    finally:
        engine.shutdown()
        res["left_in_staging_directory"] = (sorted(os.listdir(engine.engine.directory))
                                            if os.path.exists(engine.engine.directory) else None)
        client.close()
    return res


SCENARIOS = {"async_trainer_api": async_trainer_api}

if __name__ == "__main__":
    os.environ.update(VLLM_ENV)
    name, out_path = sys.argv[1], sys.argv[2]
    result = SCENARIOS[name](out_path, *sys.argv[3:])
    with open(out_path, "w") as f:
        json.dump(result, f)
