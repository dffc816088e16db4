"""What the server adapter (VLLMServerEngine) stages and its workers write: the worker's tensors a weight sync
writes by the adapter's one rule (``synced_tensors``, as the in-process adapter's name check): its parameters
but those no sync writes (a multimodal model's vision tower), and the persistent buffers the layout names
(Gemma 4's ``layer_scalar``, which vLLM's loader fills).

The vLLM case builds vLLM's own Gemma 4 model (``Gemma4ForCausalLM`` of the Hub's multimodal checkpoint form)
on two workers at TP 2, processes it after loading as vLLM's loader does (the CPU backend repacks its linear
weights), and runs hybridmem's weight-transfer backend in it as a server's worker does: its layout is the vLLM
layout of the spec, buffers included, and one update writes the layout's values, ``layer_scalar`` too.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridmem.adapters.vllm.names import check_weight_names, sync_rule, synced_tensors
from hybridmem.adapters.vllm.worker import WorkerInfo, persistent_buffers
from tests.adapters.test_vllm_weight_buffers import _Layer

_KIMI_TEXT = dict(model_type="kimi_k2", hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=48, num_hidden_layers=2, vocab_size=100, n_routed_experts=4,
                  n_shared_experts=1, moe_intermediate_size=8, first_k_dense_replace=1, q_lora_rank=8,
                  kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                  topk_method="noaux_tc")




def test_the_server_workers_layout_is_the_name_checks_rule():
    """The worker's layout (``weight_layout``) and the in-process check take the same tensors: the parameters
    but a not-synced prefix's, and the persistent buffers the layout names."""
    pytest.importorskip("vllm")
    from hybridmem.adapters.vllm.server.transfer import weight_layout  # imports vLLM

    model = torch.nn.ModuleDict({"vision_tower": _Layer(), "text": _Layer()})
    params = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    names = ["text.proj.weight", "text.layer_scalar"]
    got = weight_layout(model, params, names, ["vision_tower."])
    assert list(got) == ["text.proj.weight", "text.layer_scalar"]
    assert got["text.layer_scalar"] == ((1,), torch.float32)
    # Without the trainer's word: every parameter, no buffer (what the worker reported before).
    assert list(weight_layout(model, params, None, [])) == ["vision_tower.proj.weight", "text.proj.weight"]
    info = WorkerInfo(rank=0, has_reload_weights=True, params=tuple((n, s) for n, (s, _) in params.items()),
                      buffers=tuple((n, tuple(b.shape)) for n, b in persistent_buffers(model)))
    check_weight_names(info, {n: s for n, (s, _) in got.items()}, what="the layout",
                       not_synced=("vision_tower.",))
    assert synced_tensors(info.params, info.buffers, names, ("vision_tower.",)).keys() == got.keys()


def test_the_rule_the_server_adapter_sends():
    names, not_synced = sync_rule({"model_type": "kimi_k25", "text_config": _KIMI_TEXT}, 2)
    assert not_synced == ["vision_tower.", "mm_projector."]
    assert ("language_model.model.norm.weight" in names
            and not any(n.startswith("vision_tower.") for n in names))
    assert sync_rule({"model_type": "no_such_model"}, 1) == (None, [])
    assert sync_rule(None, 1) == (None, [])


@pytest.mark.slow
def test_a_server_worker_stages_and_writes_gemma4s_layer_scalar(tmp_path):
    """Dense Gemma 4 only: on vLLM's CPU build the routed experts are prepacked into the CPU kernel's own
    layout after loading, which vLLM's layerwise reload (and so the backend's write) cannot put back in
    place."""
    pytest.importorskip("vllm")
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from hybridmem.config import ParallelLayout
    from hybridmem.reshard import ModelSpec, shard, vllm_layout
    from hybridmem.testing.workers import WorkerPool
    from tests.reshard import _vllm_tasks
    from tests.reshard.families import COMMON, MODELS

    tp = 2
    kw = MODELS["gemma4"][1]
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, position_embedding_size=16)
    cfg = transformers.AutoConfig.for_model("gemma4", text_config={**COMMON, **kw}, vision_config=vision,
                                            tie_word_embeddings=kw.get("tie_word_embeddings", True))
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(cfg).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["Gemma4ForCausalLM"]  # the text model, reading the multimodal checkpoint
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = ModelSpec.from_hf_config(config)
    saved = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        saved.update(safetensors_torch.load_file(f))
        f.unlink()
    safetensors_torch.save_file(saved, tmp_path / "model.safetensors")
    prefix = "model.language_model."
    text = {"model." + n[len(prefix):]: t for n, t in saved.items() if n.startswith(prefix)}
    text.update((n, t) for n, t in saved.items() if n.startswith("lm_head."))
    # The update: every value a distinct number, each layer_scalar another than the checkpoint's 1.
    total = sum(t.numel() for t in text.values())
    ids = (torch.randperm(total, generator=torch.Generator().manual_seed(1)) + 2).float() / total
    new, start = {}, 0
    for n, t in sorted(text.items()):
        new[n] = ids[start:start + t.numel()].reshape(t.shape).clone()
        start += t.numel()
    layout = vllm_layout(spec, ParallelLayout(tp=tp), tp)
    want = [shard(new, layout, rank) for rank in range(tp)]
    staged = {f"{rank}/{n}": t.contiguous() for rank in range(tp) for n, t in want[rank].items()}
    safetensors_torch.save_file(staged, tmp_path / "staged.safetensors")
    with WorkerPool(tp, timeout_s=300) as pool:
        got = pool.run(_vllm_tasks.server_worker_update, str(tmp_path), tp,
                       str(tmp_path / "staged.safetensors"), world_size=tp)
    for rank in range(tp):
        reported = {n: tuple(shape) for n, shape, _ in got[rank]["layout"]}
        assert reported == {n: tuple(t.shape) for n, t in layout.tensors(rank).items()}, rank
        scalars = [n for n in reported if n.endswith(".layer_scalar")]
        assert scalars == [f"model.layers.{i}.layer_scalar" for i in range(COMMON["num_hidden_layers"])]
        after = got[rank]["after"]
        for name in scalars + [n for n in reported if n.endswith("norm.weight")]:
            assert torch.equal(after[name], want[rank][name]), (rank, name)
        assert not torch.equal(after[scalars[0]], torch.ones(1))
