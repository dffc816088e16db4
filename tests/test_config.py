from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from hybridmem import ConfigError, HybridConfig, ParallelLayout

DATA = Path(__file__).parent / "data"


def test_defaults_offload_everything_on_one_rank():
    cfg = HybridConfig()
    assert (cfg.offload_train_param, cfg.offload_train_grad, cfg.offload_train_optimizer) == (True, True, True)
    assert cfg.train_layout == ParallelLayout() == cfg.infer_layout


def test_layouts_from_mindspeed_keys():
    cfg = HybridConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2, expert_model_parallel_size=1,
                       infer_tensor_parallel_size=2, infer_expert_parallel_size=4)
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


def test_from_dict_warns_on_unknown_keys_and_keeps_known():
    with pytest.warns(UserWarning, match="infer_tensor_paralel_size"):
        cfg = HybridConfig.from_dict({"infer_tensor_parallel_size": 2, "infer_tensor_paralel_size": 4})
    assert cfg.infer_tensor_parallel_size == 2


def test_from_yaml_reads_mindspeed_sections():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the sample holds only keys MindSpeed-RL users have: no warning
        cfg = HybridConfig.from_yaml(DATA / "grpo_qwen25_7b_A3.yaml")
    assert cfg.train_layout == ParallelLayout(tp=4, pp=2, ep=1)
    assert cfg.infer_layout == ParallelLayout(tp=2, pp=1, ep=1)
    assert (cfg.offload_train_param, cfg.offload_train_grad, cfg.offload_train_optimizer) == (True, False, True)
    assert cfg.gpu_memory_utilization == 0.4
    assert (cfg.actor_forward_micro_batch_size, cfg.ref_forward_micro_batch_size) == (2, 4)


def test_from_yaml_unknown_key_warns(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("generate_config:\n  infer_tensor_parallel_size: 2\n  offload_train_parm: true\n")
    with pytest.warns(UserWarning, match=r"offload_train_parm"):
        cfg = HybridConfig.from_yaml(path)
    assert cfg.infer_tensor_parallel_size == 2


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


@pytest.mark.parametrize("text, needle", [("- a\n- b\n", "mapping of sections"), ("generate_config: 3\n", "generate_config=3")])
def test_from_yaml_wrong_shapes(tmp_path, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        HybridConfig.from_yaml(path)


def test_from_yaml_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        HybridConfig.from_yaml(tmp_path / "nope.yaml")
