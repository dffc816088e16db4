"""``hybridmem plan`` predicts what a run does: at 4 and 8 gloo ranks (a ``from_pretrained`` model under
FSDP2, the embedded engine at inference TP 2, a manager with defaults), every step of both switches on
every rank, with the bytes it allocates, frees and needs transiently, equals the runtime's own memory plan
(built from the real offloaders, engine and weight sync), the bytes the command says each step moves
over the host link and the network equal what the switch reports it moved, and the host bytes it
predicts per rank and per node (2 ranks a node) equal what the pools of those ranks hold. Bad options
are named; a cluster that does not fit, the device or a node's host memory, gets advice that, applied,
fits.

See [Note: cluster plan] in :mod:`hybridmem.planner.cluster`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridmem.testing.workers import WorkerPool
from tests._full import full_only
from tests.distributed.fsdp_job import save_tiny_qwen2
from tests.planner import _tasks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"), vocab_size=250)  # uneven FSDP2 shards


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridmem", "plan", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, pytest.param(8, marks=full_only(
    "the same 2-rank nodes and plan as 4 ranks, twice the processes"))])
def test_the_plan_equals_a_gloo_run(model_dir, world):
    with WorkerPool(world, timeout_s=120) as pool:
        runs = pool.run(_tasks.switch_task, model_dir, infer_tp=2, kv_blocks=8)
    # The gloo run's host arenas are not pinned (CPU): no power-of-two rounding.
    out = _plan(model_dir, "--world", str(world), "--train", "fsdp2", "--infer", "2/1/1",
                "--param-dtype", "fp32", "--infer-dtype", "fp32", "--kv-cache-bytes",
                str(runs[0]["kv_nbytes"]), "--ranks", "all", "--json", "-", "--devices-per-node", "2",
                "--no-pinned-rounding")
    assert out.returncode == 0, out.stderr[-3000:]
    predicted = json.loads(out.stdout)
    assert predicted["fits"] and [p["rank"] for p in predicted["ranks"]] == list(range(world))
    # Host memory: per rank, each kind's arenas equal the pool's arenas of that owner; per node, the sum of
    # what the pools of its two ranks hold.
    for ours, run in zip(predicted["ranks"], runs, strict=False):
        arenas = {k.split()[0]: v for k, v in ours["host_nbytes"].items() if k.endswith("arenas")}
        assert arenas == run["arenas"], (ours, run)
        assert sum(ours["host_nbytes"].values()) == run["pool_nbytes"], (ours, run)
    nodes = [n["peak_nbytes"] for n in predicted["nodes"]]
    assert nodes == [runs[r]["pool_nbytes"] + runs[r + 1]["pool_nbytes"] for r in range(0, world, 2)], nodes
    assert predicted["host_peak_nbytes"] == max(nodes) and predicted["host_fits"]
    for rank, (ours, run) in enumerate(zip(predicted["ranks"], runs, strict=False)):
        for direction in ("to_infer", "to_train"):
            mine = [(s["name"], s["alloc_nbytes"], s["free_nbytes"], s["transient_nbytes"])
                    for s in ours[direction]]
            real = [(s["name"], s["alloc"], s["free"], s["transient"]) for s in run[direction]]
            assert mine == real, (rank, direction, mine, real)
            # The runtime's own host plan: the arenas prewarmed before the switch, none grown by it.
            assert not any(s["host_alloc"] for s in run[direction]), run[direction]
            for step in ours[direction]:
                moved = run["moved"][step["name"]]
                if step["name"].startswith(("offload ", "onload ")):
                    assert step["host_link_nbytes"] == moved["copied"], (rank, step, moved)
                elif step["name"] == "weight sync":
                    extra = moved["extra"]
                    assert step["network_nbytes"] == extra["sent_nbytes"] + extra["received_nbytes"], \
                        (rank, extra)
                else:
                    assert step["host_link_nbytes"] == step["network_nbytes"] == 0
        assert ours["sent_nbytes"] == run["moved"]["weight sync"]["extra"]["sent_nbytes"] > 0
        assert run["host_start"] == run["pool_nbytes"], run


QWEN25_7B = ["--family", "qwen2", "--set", "hidden_size=3584", "--set", "intermediate_size=18944", "--set",
             "num_hidden_layers=28", "--set", "num_attention_heads=28", "--set", "num_key_value_heads=4",
             "--set", "vocab_size=152064", "--set", "tie_word_embeddings=false"]


def test_a_cluster_that_does_not_fit_gets_advice_that_fits(tmp_path, capsys):
    """Qwen2.5-7B on 8 devices of 40 GB, Megatron TP2: with nothing offloaded the switch does not fit (exit 1)
    and the command names a change; applied as the options it gives, the plan fits (exit 0). With the
    optimizer offloaded, a smaller KV cache alone is named, and fits. The command runs as its own process;
    the advice is checked in this one (the same ``main``)."""
    from hybridmem.planner.command import main

    small = [*QWEN25_7B, "--world", "8", "--train", "2/1/1", "--infer", "2/1/1", "--device-memory-gb", "40"]
    for offload in ("none", "grad,optimizer"):
        out = _plan(*small, "--offload", offload, "--json", str(tmp_path / "plan.json"))
        assert out.returncode == 1 and "DOES NOT FIT" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
        advice = json.loads((tmp_path / "plan.json").read_text())["advice"]
        assert advice and all(a["options"] for a in advice), advice
        for a in advice:
            options = a["options"] if "--offload" in a["options"] else [*a["options"], "--offload", offload]
            assert main([*small, *options]) == 0, (a, capsys.readouterr().out[-1500:])
    assert any(a["options"][0] == "--kv-cache-bytes" for a in advice), advice


def test_a_training_state_larger_than_the_device_is_said_so():
    """Megatron TP2, 4 data-parallel ranks: per rank half of every split tensor and every norm whole, bf16
    weights, fp32 main grads, 12 bytes of Adam state per parameter divided over the 4 ranks."""
    h, f, v, kv, layers = 3584, 18944, 152064, 512, 28
    split = 2 * v * h + layers * (2 * h * h + h + 2 * (kv * h + kv) + 3 * h * f)
    norms = (2 * layers + 1) * h
    per_rank = split // 2 + norms
    expected = per_rank * (2 + 4) + per_rank * 12 // 4
    out = _plan(*QWEN25_7B, "--world", "8", "--train", "2/1/1", "--infer", "2/1/1",
                "--device-memory-gb", "24")
    assert out.returncode == 1, out.stdout[-2000:]
    assert f"the training state alone needs {expected / 1e9:.1f} GB of 24.0 GB" in out.stdout, \
        (expected, out.stdout[-800:])
    assert "engine's weights" not in out.stdout  # half of the bf16 weights per rank fit: 7.6 GB
    # vLLM TP1 replicas: every rank's engine holds all the weights in bf16, which a 12 GB device cannot hold
    # either; the advice names both.
    weights = (split + norms) * 2
    out = _plan(*QWEN25_7B, "--world", "8", "--train", "2/1/1", "--infer", "1/1/1",
                "--device-memory-gb", "12")
    assert out.returncode == 1, out.stdout[-2000:]
    line = next(x for x in out.stdout.splitlines() if "would fit with" in x)
    assert (f"the training state alone needs {expected / 1e9:.1f} GB of 12.0 GB on rank 0, and the engine's "
            f"weights alone need {weights / 1e9:.1f} GB of 12.0 GB on rank 0; use more ranks or more "
            "training parallelism, and a larger inference tp/ep") in " ".join(out.stdout.split()), \
        (weights, line)


def test_engine_weights_larger_than_the_device_are_said_so():
    """FSDP2 over 8 ranks holds an eighth of the model per rank (bf16 weights, grads and AdamW's two moments:
    7.6 GB), but each vLLM TP1 replica holds the whole model in bf16: no offload, bucket or KV cache helps."""
    h, f, v, kv, layers = 3584, 18944, 152064, 512, 28
    elements = 2 * v * h + layers * (2 * h * h + h + 2 * (kv * h + kv) + 3 * h * f) + (2 * layers + 1) * h
    weights = 2 * elements
    out = _plan(*QWEN25_7B, "--world", "8", "--train", "fsdp2", "--infer", "1/1/1",
                "--device-memory-gb", "12")
    assert out.returncode == 1, out.stdout[-2000:]
    assert (f"would fit with: none: the engine's weights alone need {weights / 1e9:.1f} GB of 12.0 GB on "
            "rank 0; use more ranks or a larger inference tp/ep") in " ".join(out.stdout.split()), \
        out.stdout[-800:]


def test_the_table_json_and_plot(tmp_path):
    out = _plan(*QWEN25_7B, "--world", "8", "--train", "2/1/1", "--infer", "1/1/1", "--json",
                str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png"))
    assert out.returncode == 0, out.stderr[-2000:]
    for words in ("TRAIN->INFER", "INFER->TRAIN", "weight sync", "offload optimizer", "fits"):
        assert words in out.stdout, words
    data = json.loads((tmp_path / "p.json").read_text())
    worst = next(p for p in data["ranks"] if p["rank"] == data["worst_rank"])
    # Megatron TP2 of Qwen2.5-7B in bf16: half the 7.6e9 parameters per rank, 2 bytes each.
    assert 7.0e9 < worst["state_nbytes"]["param"] < 7.8e9, worst["state_nbytes"]
    assert (tmp_path / "p.png").stat().st_size > 10_000


@pytest.mark.parametrize("args,message", [
    (["--train", "3/1/1"], "world_size=8 is not divisible by tp*pp=3*1"),
    (["--train", "8/1/1"], "training tp=8 must divide the query groups num_key_value_heads=4"),
    (["--train", "2x1"], "--train='2x1': expected tp/pp/ep"),
    (["--offload", "params"], "--offload 'params': unknown ['params']"),
    (["--train", "fsdp2", "--train-stages", "14,14"], "--train-stages is for a Megatron training layout"),
    # The command line's own words, not the Python API's (MegatronConvention(stage_layers=...)).
    (["--train", "1/8/1"], "--train 1/8/1: pp=8 does not divide the model's 28 layers; give each pipeline "
                           "stage's layer count, first to last, with --train-stages (e.g. --train-stages "
                           "3,3,3,4,4,4,4,3)"),
    (["--train", "1/8/1", "--train-stages", "4,4,4"],
     "--train-stages 4,4,4: expected pp=8 positive layer counts (--train 1/8/1) summing to the model's 28 "
     "layers"),
    (["--train", "1/2/1", "--train-stages", "14;14"],
     "--train-stages '14;14': expected comma-separated layer counts (e.g. --train-stages 14,14)"),
])
def test_bad_options_are_named(args, message):
    out = _plan(*QWEN25_7B, "--world", "8", *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]


def test_the_accelerator_option_says_what_it_sets_and_its_default():
    out = subprocess.run([sys.executable, "-m", "hybridmem", "plan", "--help"], capture_output=True,
                         text=True, timeout=300)
    text = " ".join(out.stdout.split())
    assert out.returncode == 0 and "--accelerator {910b,gb200,gb300,h100,h200}" in text, out.stdout
    assert "the preset of device memory, bandwidths, devices and host memory per node (default h100;" in text


def _pow2(nbytes: int) -> int:
    """What torch's pinned host allocator takes for ``nbytes``: the next power of two."""
    size = 1
    while size < nbytes:
        size *= 2
    return size


def test_a_node_whose_host_memory_cannot_hold_it_gets_advice_that_fits(tmp_path, capsys):
    """Qwen2.5-7B on one node of 8 H100s with 400 GB of host memory, Megatron TP2 -> vLLM TP1, every kind
    offloaded, the engine's sleep at level 1: the node's host peak (8 ranks' pinned arenas, each the next
    power of two of a kind's bytes, and 8 copies of the engine's weights) does not fit (exit 1); each
    change the command names, applied as its options, fits (exit 0)."""
    from hybridmem.planner.command import main

    h, f, v, kv, layers = 3584, 18944, 152064, 512, 28
    split = 2 * v * h + layers * (2 * h * h + h + 2 * (kv * h + kv) + 3 * h * f)
    norms = (2 * layers + 1) * h
    per_rank = split // 2 + norms  # TP2: half of every split tensor, every norm whole
    # bf16, fp32 grads, Adam / dp 4
    arenas = _pow2(per_rank * 2) + _pow2(per_rank * 4) + _pow2(per_rank * 12 // 4)
    sleep_copy = (split + norms) * 2  # TP1: the whole model in bf16 on every rank
    small = [*QWEN25_7B, "--world", "8", "--train", "2/1/1", "--infer", "1/1/1", "--kv-cache-gb", "20",
             "--host-memory-gb", "400"]
    out = _plan(*small, "--sleep-level", "1", "--json", str(tmp_path / "plan.json"))
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    expected = 8 * (arenas + sleep_copy)
    assert f"host peak {expected / 1e9:.1f} GB of 400.0 GB per node: DOES NOT FIT" in out.stdout, \
        (expected, out.stdout)
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["device_fits"] and not data["host_fits"] and data["host_peak_nbytes"] == expected
    advice = data["advice"]
    assert any(a["options"] == ["--sleep-level", "2"] for a in advice), advice
    assert any("--offload" in a["options"] for a in advice), advice
    for a in advice:
        options = a["options"] if "--sleep-level" in a["options"] else [*a["options"], "--sleep-level", "1"]
        assert main([*small, *options]) == 0, (a, capsys.readouterr().out[-1500:])
        assert "per node: fits" in capsys.readouterr().out


def test_a_host_too_small_for_any_knob_is_said_so(capsys):
    """50 GB of host memory for 8 ranks whose optimizer arenas alone take 137 GB, on 40 GB devices that cannot
    keep the training state beside the engine's weights."""
    from hybridmem.planner.command import main

    assert main([*QWEN25_7B, "--world", "8", "--train", "2/1/1", "--infer", "1/1/1", "--host-memory-gb", "50",
                 "--device-memory-gb", "40"]) == 1
    text = capsys.readouterr().out
    assert ("none of unrounded pinned arenas, the engine's sleep level 2 or offloading fewer kinds"
            in text), text
    assert "more host memory" in text, text


def test_gb200_and_gb300_presets_are_compute_trays():
    """4 GPUs and 2 Grace CPUs of 480 GB each per tray; the NVLink domain is the 72-GPU rack."""
    from hybridmem.planner.presets import ACCELERATORS

    for name, hbm in (("gb200", 186e9), ("gb300", 288e9)):
        a = ACCELERATORS[name]
        assert (a.devices_per_node, a.host_memory_nbytes,
                a.nvlink_domain, a.memory_nbytes) == (4, 2 * 480e9, 72, hbm)
    assert all(a.host_memory_nbytes >= 960e9 for a in ACCELERATORS.values())


def test_a_yaml_file_given_as_the_model_config_is_one_line_naming_it(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("actor_config:\n  tensor_model_parallel_size: 4\n")
    out = _plan(str(job), "--world", "8")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    for words in (str(job), "is not JSON", "looks like YAML", "Hugging Face config.json", "--family"):
        assert words in out.stderr, (words, out.stderr)


def test_host_advice_that_keeps_state_on_the_device_names_a_kv_cache_that_fits(capsys):
    """100 GB of host memory: only keeping grads and optimizer state on the device fits it, and then vLLM's
    default KV cache does not fit beside them; the advice names the smaller one, and applied, it fits."""
    from hybridmem.planner.command import main

    small = [*QWEN25_7B, "--world", "8", "--train", "2/1/1", "--infer", "1/1/1", "--host-memory-gb", "100"]
    assert main([*small, "--json", "-"]) == 1
    advice = json.loads(capsys.readouterr().out)["advice"]
    assert advice and all("--kv-cache-bytes" in a["options"] and a["options"][:2] == ["--offload", "param"]
                          for a in advice), advice
    for a in advice:
        assert main([*small, *a["options"]]) == 0, (a, capsys.readouterr().out[-1500:])
        capsys.readouterr()


def test_megatrons_expert_optimizer_state_is_divided_over_the_expert_data_parallel_ranks():
    """A tiny GLM-4.5 MoE, Megatron TP1 EP2 on 4 ranks: the distributed optimizer divides the dense part's
    Adam state (12 bytes per parameter) over the 4 data-parallel ranks and the experts' over the 2 ranks
    holding each expert shard. The parameters are counted on transformers' model of the config (meta
    device); Megatron keeps the routers' score-correction bias, a buffer there, as a parameter."""
    import torch
    import transformers

    from hybridmem import ParallelLayout
    from hybridmem.planner.cluster import TrainingSetup, rank_states
    from hybridmem.reshard import ModelSpec

    config = dict(model_type="glm4_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, n_routed_experts=4, n_shared_experts=1,
                  moe_intermediate_size=32, first_k_dense_replace=1, num_experts_per_tok=2, n_group=1,
                  topk_group=1, attention_bias=True, tie_word_embeddings=False, num_hidden_layers=3,
                  vocab_size=256)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    dense += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    states = rank_states(ModelSpec.from_hf_config(config), TrainingSetup(parallel=ParallelLayout(tp=1, ep=2)),
                         ParallelLayout(tp=1), 4, infer_bytes=2)
    for state in states:
        assert state.nbytes["param"] == (dense + experts // 2) * 2, state
        assert state.nbytes["optimizer"] == dense * 12 // 4 + experts // 2 * 12 // 2, state
