"""MindSpeed-RL's own training YAML files, from each release in ``mindspeed.RELEASES``, load.

``tests/data/mindspeed/<release>/`` holds files copied verbatim from MindSpeed-RL at the commit
``RELEASES[<release>]`` names, under their paths in that repository. They were picked for the keys that
differ between releases: ``rl_config.shuffle_minibatch`` (2.0.0), the ``*_micro_batch_size`` keys of
2.0.0's system-test file, ``actor_config.cp_attention_mask_type`` (v2.2.0 only), a file that sets its
training layout in ``megatron_training`` only (dpo), expert parallelism on both sides, and the LoRA
(``rl_config.share_backbone``) and multi-turn keys of the latest sources. The layout each file states
is read independently with ``yaml.safe_load``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from hybridmem import ConfigError, HybridConfig
from hybridmem.config import mindspeed

MINDSPEED = Path(__file__).parents[1] / "data" / "mindspeed"
FILES = sorted(MINDSPEED.rglob("*.yaml"))
_TRAIN = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")
_INFER = ("infer_tensor_parallel_size", "infer_pipeline_parallel_size", "infer_expert_parallel_size")
_OFFLOAD = ("offload_train_param", "offload_train_grad", "offload_train_optimizer")
_ST_2_0_0 = "2.0.0/tests/st/configs/test_grpo_trainer_qwen25_7b_integrated.yaml"


def _file_id(path: Path) -> str:
    return path.relative_to(MINDSPEED).as_posix()


def _stated(path: Path) -> dict[str, object]:
    """What ``path`` says for hybridmem's keys (``actor_config`` over ``megatron_training``)."""
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    megatron, actor = doc.get("megatron_training") or {}, doc.get("actor_config") or {}
    generate = doc.get("generate_config") or {}
    defaults = HybridConfig()
    stated: dict[str, object] = {k: actor.get(k, megatron.get(k, getattr(defaults, k))) for k in _TRAIN}
    for key in (*_INFER, *_OFFLOAD, "gpu_memory_utilization"):
        stated[key] = generate.get(key, getattr(defaults, key))
    return stated


def test_every_release_has_sample_files():
    releases = {path.relative_to(MINDSPEED).parts[0] for path in FILES}
    expected = set(mindspeed.RELEASES)
    assert releases == expected, f"sample files for {sorted(releases)}, releases {sorted(expected)}"


@pytest.mark.parametrize("path", FILES, ids=_file_id)
def test_release_file_loads_with_the_layout_it_states(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = HybridConfig.from_yaml(path)
    got = {key: getattr(cfg, key) for key in _stated(path)}
    assert got == _stated(path), f"{_file_id(path)}: read {got}, the file states {_stated(path)}"


@pytest.mark.parametrize(
    "path, section, key",
    [
        ("2.0.0/configs/grpo_qwen25_7b_A3.yaml", "rl_config", "shuffle_minibatch"),
        (_ST_2_0_0, "rl_config", "update_micro_batch_size"),
        (_ST_2_0_0, "generate_config", "gen_micro_batch_size"),
        ("v2.2.0/configs/dapo_qwen25_32b_A3_32k.yaml", "actor_config", "cp_attention_mask_type"),
        ("master/configs/grpo_lora_qwen25_32b_A2.yaml", "rl_config", "share_backbone"),
        ("master/configs/dapo_qwen25_7b_A2_multi_turn.yaml", "rl_config", "tool_config_path"),
    ],
)
def test_samples_hold_keys_that_differ_between_releases(path, section, key):
    # Guards the sample set: each key here is missing from some release's config classes, so the loads
    # above only pass because the key lists cover every release.
    doc = yaml.safe_load((MINDSPEED / path).read_text(encoding="utf-8"))
    assert key in doc[section], f"{path} has no {section}.{key}"


@pytest.mark.parametrize(
    "section, key",
    [
        ("actor_config", "use_deter_comp"),  # 2.0.0 to v2.2.0
        ("actor_config", "variable_seq_length"),  # v2.3.0
        ("actor_config", "variable_seq_lengths"),  # latest sources
        ("rl_config", "enable_sharding_validate"),  # 2.0.0 and v2.1.0
        ("rl_config", "td_status_log"),  # v2.1.0
        ("rl_config", "shuffle_mini_batch"),  # every release
        ("rl_config", "experience_count"),  # 2.0.0's files
    ],
)
def test_keys_of_each_release_are_accepted(tmp_path, section, key):
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {key}: 1\n")
    assert HybridConfig.from_yaml(path) == HybridConfig()


@pytest.mark.parametrize(
    "section, key, typo, suggestion",
    [
        ("actor_config", "moe_tp_extend_ep", "moe_tp_extnd_ep", "moe_tp_extend_ep"),
        ("rl_config", "use_dynamic_bsz", "use_dynamic_bs", "use_dynamic_bsz"),
        # A key MindSpeed-RL's sources had between releases (March 2025), in no release.
        ("rl_config", "use_dynamic_bsz", "colocate_actor_ref", "colocate_actor_and_vit"),
        ("generate_config", "torchair_graph", "torchair_grap", "torchair_graph"),
    ],
)
def test_a_key_no_release_defines_is_refused_with_a_suggestion(tmp_path, section, key, typo, suggestion):
    # The v2.1.0 sample sets each ``key`` to true in ``section``; ``typo`` takes its place.
    text = (MINDSPEED / "v2.1.0/configs/grpo_deepseek_r1_671b_A3_24nodes.yaml").read_text(encoding="utf-8")
    line = f"\n  {key}: true\n"
    assert line in text, f"the sample file lost {section}.{key}"
    path = tmp_path / "c.yaml"
    path.write_text(text.replace(line, f"\n  {typo}: true\n", 1), encoding="utf-8")
    expected = rf"unknown key '{typo}' in {section} of .*c\.yaml: did you mean '{suggestion}'"
    with pytest.raises(ConfigError, match=expected) as info:
        HybridConfig.from_yaml(path)
    assert info.value.key == typo and info.value.suggestions[0] == suggestion
