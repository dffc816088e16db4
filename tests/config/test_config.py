from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from hybridmem import ConfigError, HybridConfig, ParallelLayout

DATA = Path(__file__).parents[1] / "data"


def test_defaults_offload_everything_on_one_rank():
    cfg = HybridConfig()
    assert (cfg.offload_train_param, cfg.offload_train_grad, cfg.offload_train_optimizer) == (
        True, True, True)
    assert cfg.train_layout == ParallelLayout() == cfg.infer_layout


def test_layouts_from_mindspeed_keys():
    cfg = HybridConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
                       expert_model_parallel_size=1, infer_tensor_parallel_size=2,
                       infer_expert_parallel_size=4)
    assert cfg.train_layout == ParallelLayout(tp=4, pp=2, ep=1)
    assert cfg.infer_layout == ParallelLayout(tp=2, pp=1, ep=4)
    assert str(cfg.train_layout) == "TP4xPP2xEP1"


def test_config_is_frozen():
    cfg = HybridConfig()
    with pytest.raises(AttributeError):
        cfg.offload_train_param = False  # type: ignore[misc]
    assert cfg.replace(offload_train_param=False).offload_train_param is False


@pytest.mark.parametrize(
    "key, value",
    [
        ("tensor_model_parallel_size", 0),
        ("infer_tensor_parallel_size", -2),
        ("pipeline_model_parallel_size", 1.5),
        ("infer_expert_parallel_size", "4"),
        ("expert_model_parallel_size", True),
        ("offload_train_param", "yes"),
        ("offload_train_grad", 1),
        ("host_memory_budget_bytes", 0),
        ("reshard_bucket_bytes", -1),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("device", "tpu"),
        ("device_memory_budget_bytes", 0),
        ("device_memory_budget_bytes", -1),
        ("host_memory_budget_bytes", -5),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(key, value):
    with pytest.raises(ConfigError) as info:
        HybridConfig(**{key: value})
    msg = str(info.value)
    assert key in msg and repr(value) in msg and "expected" in msg
    assert isinstance(info.value, ValueError) and info.value.key == key


def test_parallel_layout_checks():
    with pytest.raises(ValueError, match="tp=0"):
        ParallelLayout(tp=0)
    assert ParallelLayout(tp=2, pp=2).data_parallel_size(8) == 2
    with pytest.raises(ValueError, match=r"world_size=6 is not divisible by tp\*pp=2\*2=4"):
        ParallelLayout(tp=2, pp=2).data_parallel_size(6)
    with pytest.raises(ValueError, match="ep=3"):
        ParallelLayout(tp=1, ep=3).data_parallel_size(4)


def test_from_dict_unknown_key_is_an_error_that_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"unknown key 'infer_tensor_paralel_size'.*"
                                          r"did you mean 'infer_tensor_parallel_size'") as info:
        HybridConfig.from_dict({"infer_tensor_parallel_size": 2, "infer_tensor_paralel_size": 4})
    assert (info.value.key == "infer_tensor_paralel_size"
            and info.value.suggestions[0] == "infer_tensor_parallel_size")


def test_from_dict_lenient_warning_points_at_the_caller():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = HybridConfig.from_dict({"infer_tensor_parallel_size": 2, "lr": 1e-6}, strict=False)
    assert cfg.infer_tensor_parallel_size == 2
    assert len(caught) == 1 and "lr" in str(caught[0].message)
    assert caught[0].filename == __file__, f"warning attributed to {caught[0].filename}, not the caller"


def test_from_yaml_reads_mindspeed_sections():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the sample holds only keys MindSpeed-RL users have: no warning
        cfg = HybridConfig.from_yaml(DATA / "grpo_qwen25_7b_A3.yaml")
    assert cfg.train_layout == ParallelLayout(tp=4, pp=2, ep=1)
    assert cfg.infer_layout == ParallelLayout(tp=2, pp=1, ep=1)
    assert (cfg.offload_train_param, cfg.offload_train_grad, cfg.offload_train_optimizer) == (
        True, False, True)
    assert cfg.gpu_memory_utilization == 0.4


def test_a_typo_in_a_section_name_is_an_error_naming_it(tmp_path):
    text = (DATA / "grpo_qwen25_7b_A3.yaml").read_text().replace("generate_config:", "generate_confg:")
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError,
                       match=r"unknown section 'generate_confg'.*c\.yaml: did you mean 'generate_config'"):
        HybridConfig.from_yaml(path)


@pytest.mark.parametrize(
    "section, key, suggestion",
    [
        ("generate_config", "offload_train_parm", "offload_train_param"),
        ("actor_config", "tensor_model_paralel_size", "tensor_model_parallel_size"),
        ("rl_config", "use_integrated_workr", "use_integrated_worker"),
        ("hybridmem", "host_memory_budget", "host_memory_budget_bytes"),
    ],
)
def test_a_typo_in_a_key_is_an_error_with_a_suggestion(tmp_path, section, key, suggestion):
    path = tmp_path / "c.yaml"
    path.write_text(f"generate_config:\n  infer_tensor_parallel_size: 2\n{section}:\n  {key}: 1\n"
                    if section != "generate_config" else f"generate_config:\n  {key}: true\n")
    with pytest.raises(ConfigError,
                       match=rf"unknown key '{key}' in {section} of .*c\.yaml: did you mean '{suggestion}'"):
        HybridConfig.from_yaml(path)


def test_a_hybridmem_key_outside_its_section_says_where_it_goes(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("generate_config:\n  reshard_bucket_bytes: 1024\n")
    with pytest.raises(ConfigError, match=r"generate_config\.reshard_bucket_bytes.*under hybridmem"):
        HybridConfig.from_yaml(path)


def test_other_mindspeed_keys_and_sections_are_accepted(tmp_path):
    # Keys of MindSpeed-RL's own config classes, in sections hybridmem does and does not read, and the
    # nested integrated_mode_config MindSpeed-RL reads under rl_config.
    path = tmp_path / "c.yaml"
    path.write_text(
        "megatron_training:\n  min-lr: 0\n  seq_length: 2048\n"
        "actor_config:\n  swap_optimizer: true\n  recompute_granularity: full\n"
        "ref_config:\n  anything_goes_here: 1\n"
        "rl_config:\n  use_dynamic_bsz: true\n  integrated_mode_config:\n    ref_model_load_path: ./ref\n"
        "generate_config:\n  enforce_eager: true\n  torchair_graph: false\n"
        "profiler_config:\n  integrated:\n    profile: false\n"
    )
    assert HybridConfig.from_yaml(path) == HybridConfig()


def test_section_precedence(tmp_path):
    # megatron_training < actor_config < hybridmem for the training layout; generate_config < hybridmem.
    path = tmp_path / "c.yaml"
    path.write_text(
        "megatron_training:\n  tensor_model_parallel_size: 8\n  pipeline_model_parallel_size: 4\n"
        "actor_config:\n  tensor_model_parallel_size: 2\n"
        "generate_config:\n  infer_tensor_parallel_size: 2\n  offload_train_grad: false\n"
        "hybridmem:\n  infer_tensor_parallel_size: 4\n"
    )
    cfg = HybridConfig.from_yaml(path)
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 4)
    assert cfg.infer_tensor_parallel_size == 4 and cfg.offload_train_grad is False


def test_from_yaml_bad_value_names_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor_config:\n  tensor_model_parallel_size: three\n")
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size='three' in .*c\.yaml"):
        HybridConfig.from_yaml(path)


def test_from_yaml_syntax_error_names_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("generate_config:\n  infer_tensor_parallel_size: 2\n    offload_train_param: [true\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:3"):
        HybridConfig.from_yaml(path)


@pytest.mark.parametrize("text, needle", [("- a\n- b\n", "mapping of sections"),
                                          ("generate_config: 3\n", "generate_config=3"),
                                          ("hybridmem: [1]\n", r"hybridmem=\[1\]")])
def test_from_yaml_wrong_shapes(tmp_path, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        HybridConfig.from_yaml(path)


def test_from_yaml_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        HybridConfig.from_yaml(tmp_path / "nope.yaml")
