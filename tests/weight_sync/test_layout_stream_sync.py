"""An engine that takes its own layout as a stream (``streams_layout``): ShardingManager's resharding sync
hands it, on every switch, the vLLM-layout shard of the weights training left (derived here independently,
tests/reshard/reference.py), in its dtype; a tensor it did not take fails the switch, rolled back."""

from __future__ import annotations

import pytest
import torch

from hybridmem import HybridConfig, Phase, ShardingManager, SwitchError, WeightCoverageError
from hybridmem.config import ParallelLayout
from hybridmem.contract.engine import EngineCapabilities
from hybridmem.reshard import ModelSpec, shard, vllm_layout
from hybridmem.testing.tiny import assert_bitwise_equal, snapshot
from hybridmem.weight_sync import ReshardRoute, ReshardSync
from tests.reshard.reference import vllm_shard

transformers = pytest.importorskip("transformers")

BATCH = torch.tensor([[3, 17, 42, 99, 5, 8], [1, 2, 3, 4, 5, 6]])
DOWN = "model.layers.1.mlp.down_proj.weight"


class _LayoutSink:
    """Takes its tensors of vLLM's layout at TP 1 as a stream and records a copy of each; holds no weights.

    Its layout (names, shapes) is the reference's, and it proves coverage as an engine does: every tensor of
    its layout taken once since the weights were resumed.
    """

    capabilities = EngineCapabilities(streams_layout=True, reports_weight_coverage=True,
                                      describes_weights=True, reports_layout=True)
    parallel_layout = ParallelLayout()

    def __init__(self, shapes: dict[str, tuple[int, ...]], vocab_size: int, dtype: torch.dtype,
                 skip: str | None = None):
        self.shapes, self.vocab_size, self.dtype, self.skip = shapes, vocab_size, dtype, skip
        self.received: dict[str, torch.Tensor] = {}
        self.num_streams = 0

    def load_layout_weights(self, weights):
        self.num_streams += 1
        for name, tensor in weights:
            assert name not in self.received and tuple(tensor.shape) == self.shapes[name], name
            if name != self.skip:
                self.received[name] = tensor.clone()

    def unwritten_weights(self) -> list[str]:
        return [name for name in self.shapes if name not in self.received]

    def load_weights(self, weights):
        raise AssertionError("an engine that streams its own layout is not handed HF tensors")

    def release(self, tags):
        if "weights" in tags:
            self.received = {}

    def resume(self, tags):
        if "weights" in tags:
            self.received = {}


def _qwen2():
    config = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, num_hidden_layers=2, vocab_size=100,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    return model, ModelSpec.from_hf_config(config)


def _expected(model, spec) -> dict[str, torch.Tensor]:
    """The vLLM-layout shard (TP 1, vocab padded to 128 rows) of the weights as training left them."""
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref = vllm_shard(full, spec, tp=1, pp=1, ep=1, world=1, rank=0)
    ours = shard(full, vllm_layout(spec, ParallelLayout(), 1), 0)
    assert ours.keys() == ref.keys() and all(torch.equal(ours[n], t) for n, t in ref.items())
    return ref


def _manager(dtype: torch.dtype, skip: str | None = None):
    model, spec = _qwen2()
    shapes = {n: tuple(t.shape) for n, t in _expected(model, spec).items()}
    engine = _LayoutSink(shapes, spec.vocab_size, dtype, skip=skip)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = ShardingManager(model, engine, optimizer=opt, config=HybridConfig(device="cpu"))
    return manager, model, spec, engine, opt


def _train_a_step(model, opt) -> None:
    model.train()
    model(BATCH, labels=BATCH).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_switch_streams_the_trained_weights_in_the_engines_layout(dtype):
    manager, model, spec, engine, opt = _manager(dtype)
    assert isinstance(manager.weight_sync, ReshardSync)
    assert manager.weight_sync.route is ReshardRoute.LAYOUT_STREAM
    for step in range(3):
        _train_a_step(model, opt)
        expected = _expected(model, spec)
        report = manager.to_infer()
        assert engine.num_streams == step + 1
        assert engine.received.keys() == expected.keys()
        for name, tensor in expected.items():
            got = engine.received[name]
            assert got.dtype == dtype and torch.equal(got, tensor.to(dtype)), (step, name)
        sync = next(s for s in report.steps if s.name == "weight sync")
        assert sync.extra["coverage_checked"] is True and sync.extra["num_tensors"] == len(expected)
        # a bf16 engine's cast is named, an fp32 one's weights are bit for bit ([Note: no silent dtype
        # change] in :mod:`hybridmem.weight_sync.base`)
        assert ("weights cast: trainer float32 -> engine bfloat16" in sync.extra.get("note", "")) == (
            dtype == torch.bfloat16)
        manager.to_train()
    manager.close()


def test_a_tensor_the_engine_did_not_take_fails_the_switch_rolled_back():
    manager, model, _, engine, opt = _manager(torch.float32, skip=DOWN)
    _train_a_step(model, opt)
    before = snapshot(model, opt)
    with pytest.raises(SwitchError) as info:
        manager.to_infer()
    err = info.value
    assert err.step == "weight sync" and err.phase_after is Phase.TRAIN
    assert isinstance(err.__cause__, WeightCoverageError) and list(err.__cause__.unwritten) == [DOWN]
    assert manager.phase is Phase.TRAIN
    assert_bitwise_equal(before, snapshot(model, opt))
    manager.close()
