"""The weight-sync checksum: its figures, its bounded transient, and a fused weight whose rows were
exchanged told from the right one.

The figures are checked against the formula written out here in float64 (``sum(x)`` and
``sum(u(row) * x * v(col))`` over HF-full coordinates), whatever the chunking, the layout of the view and
the thread count. A wrong interleave of a fused ``qkv_proj`` / ``gate_up_proj`` (rows of q, k and v, or
of gate and up, put in each other's places) moves no value in or out of a slice, so the plain sum of every
slice is unchanged; only the position-weighted sum (row weights ``u(row)`` in ``u @ X @ v``) sees it.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybridmem import HybridConfig, Phase, ShardingManager, WeightSyncError
from hybridmem.adapters.vllm.server import packing, receive
from hybridmem.engines import ENGINE_TAGS, ReferenceEngine
from hybridmem.engines.nn.config import hf_config_dict
from hybridmem.engines.nn.gpt import MegatronLayoutGPT, init_hf_weights
from hybridmem.reshard import checksum, fused_checksum, megatron_layout, shard
from hybridmem.reshard.checksum import box_checksum, copy_checksum, range_checksum, tensor_checksum
from hybridmem.reshard.spec import ModelSpec

CFG = ModelSpec(family="qwen2", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=48, num_hidden_layers=2, vocab_size=50, qkv_bias=True,
                    rms_norm_eps=1e-6, rope_theta=10000.0)


def _swap_rows(t: torch.Tensor, i: int, j: int) -> None:
    with torch.no_grad():
        t[[i, j]] = t[[j, i]]


def _reference(x: torch.Tensor, box: tuple[tuple[int, int], ...]) -> tuple[float, float]:
    """The figures by their definition, elementwise in float64 (no chunks, no products of matrices)."""
    x = x.to(torch.float64)
    (r0, r1), *cols = box
    u = 1 + torch.arange(r0, r1, dtype=torch.float64).remainder(61) / 61
    if not cols:
        return x.sum().item(), (x * u).sum().item()
    (c0, c1), = cols
    v = 1 + torch.arange(c0, c1, dtype=torch.float64).remainder(53) / 53
    return x.sum().item(), (x * u[:, None] * v[None, :]).sum().item()


def _agree(got: tuple[float, float], want: tuple[float, float]) -> bool:
    """Equal within the tolerance the sync's comparison allows (float64 rounding)."""
    return not checksum._bad(torch.tensor([got], dtype=torch.float64),
                             torch.tensor([want], dtype=torch.float64))


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1 << 18, 1000, 7])  # one chunk; rows of 1000 // width; parts of one row
def test_box_checksum_matches_its_definition(monkeypatch, dtype, chunk):
    """1-D and 2-D boxes at offsets, contiguous, sliced and transposed views: the figures of the formula."""
    monkeypatch.setattr(checksum, "_CHUNK_NUMEL", chunk)
    full = _randn(300, 260, dtype=dtype)
    cases = [
        (_randn(900, dtype=dtype, seed=1), ((17, 917),)),
        (full[:, 5], ((40, 340),)),  # a strided 1-D view
        (_randn(130, 70, dtype=dtype, seed=2), ((61 * 3 + 5, 61 * 3 + 135), (29, 99))),
        (full[10:200, 20:250], ((10, 200), (20, 250))),
        (full.T[7:107, 3:203], ((107, 207), (3, 203))),  # a transposed piece, as piece_view returns it
        (_randn(2, 3000, dtype=dtype, seed=3), ((1, 3), (60, 3060))),  # rows longer than a chunk
    ]
    for x, box in cases:
        got, want = box_checksum(x, box), _reference(x, box)
        assert _agree(got, want), f"{box}: {got} vs {want}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
                                   torch.uint8, torch.float8_e4m3fn, torch.bool])
@pytest.mark.parametrize("shape", [(), (7,), (5, 9), (4, 6, 10), (3, 1, 4, 2)])
def test_tensor_checksum_is_the_box_checksum_of_its_2d_view(dtype, shape):
    t = (_randn(*shape) * 4).to(dtype)
    view = t.reshape(-1) if t.dim() <= 1 else t.reshape(-1, t.shape[-1])
    box = ((0, view.shape[0]),) if view.dim() == 1 else ((0, view.shape[0]), (0, view.shape[1]))
    got = tensor_checksum(t)
    assert _agree(got, _reference(view, box)), f"{shape} {dtype}: {got} vs {_reference(view, box)}"
    assert _agree(got, box_checksum(view, box))  # the CPU kernel where it serves, else this same read
    # one implementation: the engine-process transport's both ends take these figures
    assert receive.tensor_checksum is tensor_checksum and packing.tensor_checksum is tensor_checksum
    assert receive.copy_checksum is copy_checksum and packing.copy_checksum is copy_checksum


def _ranges(numel: int, seed: int) -> list[tuple[int, int]]:
    """Cuts of ``range(numel)`` at random places (inside rows, on row ends, a range of whole rows)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted({0, numel, *torch.randint(0, max(numel, 1), (4,), generator=g).tolist()})
    return list(zip(cuts, cuts[1:], strict=False))


@pytest.mark.parametrize("fused", [True, False], ids=["one-pass", "copy-then-read"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.float8_e4m3fn, torch.float8_e5m2, torch.int32])
@pytest.mark.parametrize("shape", [(), (5000,), (300, 37), (3, 40, 129)])
def test_copy_checksum_of_ranges_adds_up_to_the_definition(monkeypatch, fused, dtype, shape):
    """A tensor copied range by range (as the buckets split it): the bytes land, and the ranges' figures add
    up to the whole tensor's by the formula, with and without the one-pass kernel."""
    if fused:
        pytest.importorskip("numba")
    else:
        monkeypatch.setattr(fused_checksum, "_kernel", lambda: None)
    t = (_randn(*shape, seed=5) * 8).to(dtype)
    flat, dst = t.reshape(-1), torch.empty(t.numel(), dtype=dtype)
    view = t.reshape(-1) if t.dim() <= 1 else t.reshape(-1, t.shape[-1])
    box = ((0, view.shape[0]),) if view.dim() == 1 else ((0, view.shape[0]), (0, view.shape[1]))
    total = weighted = 0.0
    for a, b in _ranges(flat.numel(), seed=len(shape)):
        part = copy_checksum(dst[a:b], flat[a:b], a, shape)
        total, weighted = total + part[0], weighted + part[1]
        assert _agree(range_checksum(dst[a:b], a, shape), part)
    assert torch.equal(dst.view(torch.uint8), flat.view(torch.uint8))
    assert _agree((total, weighted), _reference(view, box)), f"{(total, weighted)} vs {_reference(view, box)}"
    one_pass = fused_checksum.fused_figures(flat[:4], dst[:4], 0, 4, 1, 61)
    assert (one_pass is not None) == (fused and dtype != torch.int32)


def test_a_kernel_that_cannot_take_a_dtype_leaves_it_to_torch(monkeypatch, caplog):
    """A numba that fails to type or build the kernel for a dtype (before any write): the copy and its figures
    are torch's, the dtype is read with torch from then on, and a warning names it once."""
    calls = []

    def refusing(*args):
        calls.append(args)
        raise TypeError("no implementation for these arguments")

    monkeypatch.setattr(fused_checksum, "_kernel", lambda: refusing)
    monkeypatch.setattr(fused_checksum, "_REFUSED", set())
    t = _randn(30, 40, dtype=torch.bfloat16)
    for _ in range(2):
        dst = torch.empty(1200, dtype=torch.bfloat16)
        got = copy_checksum(dst, t.reshape(-1), 0, (30, 40))
        assert torch.equal(dst, t.reshape(-1)) and _agree(got, _reference(t, ((0, 30), (0, 40))))
    assert len(calls) == 1 and fused_checksum._REFUSED == {torch.bfloat16}
    assert [r.getMessage() for r in caplog.records if "cannot take torch.bfloat16" in r.getMessage()]


def test_figures_of_a_tensor_off_the_cpu_never_load_the_cpu_kernel():
    """The one-pass kernel is numba's, for CPU tensors: a process whose tensors lie elsewhere (a GPU worker;
    here torch's ``meta`` device) must not import numba to learn that (about a second on first use, paid by
    each side of an engine-process sync). Run in a fresh interpreter, where nothing imported numba yet."""
    probe = ("import sys, torch\n"
             "from hybridmem.reshard.fused_checksum import fused_figures\n"
             "x = torch.empty(64, device='meta')\n"
             "assert fused_figures(x, None, 0, 8, 61, 53) is None\n"
             "assert fused_figures(x, torch.empty(64, device='meta'), 0, 8, 61, 53) is None\n"
             "print('numba' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split() == ["False"], out.stderr[-2000:]


def test_copy_checksum_sees_a_range_written_at_another_place():
    """The figures belong to the place a range is written at: the same bytes one row further read
    otherwise, and two rows exchanged while copying change the weighted figure."""
    t = torch.randint(-50, 50, (6, 40), generator=torch.Generator().manual_seed(2)).to(torch.float32)
    flat, dst = t.reshape(-1), torch.empty(240)
    right = copy_checksum(dst[40:80], flat[40:80], 40, (6, 40))
    shifted = copy_checksum(dst[80:120], flat[40:80], 80, (6, 40))
    assert right[0] == shifted[0] and not _agree(right, shifted)
    swapped = t.clone()
    _swap_rows(swapped, 1, 2)
    whole = copy_checksum(dst, swapped.reshape(-1), 0, (6, 40))
    assert whole[0] == tensor_checksum(t)[0] and not _agree(whole, tensor_checksum(t))


def test_tensor_checksum_of_views_no_reshape_can_merge(monkeypatch):
    """A permuted 3-D tensor cannot be viewed as 2-D: its rows are read per leading index, never copied."""
    monkeypatch.setattr(checksum, "_CHUNK_NUMEL", 50)
    t = _randn(6, 5, 8).permute(1, 0, 2)  # (5, 6, 8), no view as (30, 8)
    with pytest.raises(RuntimeError):
        t.view(-1, 8)
    assert _agree(tensor_checksum(t), _reference(t.reshape(-1, 8), ((0, 30), (0, 8))))
    assert tensor_checksum(torch.empty(0, 4)) == (0.0, 0.0)
    with pytest.raises(TypeError, match="complex64"):
        tensor_checksum(torch.zeros(2, 2, dtype=torch.complex64))


def test_tensor_checksum_sees_swapped_rows_and_columns():
    # Whole numbers: the plain sums then agree to the last bit.
    t = torch.randint(-50, 50, (4, 70, 90), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    total, weighted = tensor_checksum(t)
    rows, cols = t.clone(), t.clone()
    _swap_rows(rows[2], 3, 40)  # rows 143 and 180 of the (280, 90) view (rows 61 apart weigh the same)
    cols[..., [5, 40]] = cols[..., [40, 5]]
    for changed in (rows, cols):
        assert tensor_checksum(changed)[0] == total
        assert not _agree(tensor_checksum(changed), (total, weighted)), "the weighted sum must see the swap"


class _Float64Allocations(TorchDispatchMode):
    """Records the size in elements of every float64 tensor an op returns in new storage."""

    def __init__(self):
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor)}
        self.numels += [o.numel() for o in tree_leaves(out) if isinstance(o, torch.Tensor)
                        and o.dtype == torch.float64 and o.untyped_storage().data_ptr() not in given]
        return out


@pytest.mark.parametrize(("shape", "box"), [
    ((200_000,), ((3, 200_003),)),
    ((500, 400), ((61, 561), (0, 400))),
    ((3, 70_000), ((0, 3), (1, 70_001))),
])
def test_checksum_transient_is_bounded_by_the_chunk(monkeypatch, shape, box):
    """A tensor of 200 chunks allocates a few chunks of float64 in all (the buffer, the accumulators and
    the cached weights), none per chunk, and none the size of the tensor."""
    chunk = 1000
    monkeypatch.setattr(checksum, "_CHUNK_NUMEL", chunk)
    checksum._periodic.cache_clear()
    x = _randn(*shape, dtype=torch.bfloat16)
    with _Float64Allocations() as spy:
        got = box_checksum(x, box)
    assert _agree(got, _reference(x, box))
    assert max(spy.numels) <= 2 * (chunk + 61), f"an allocation of {max(spy.numels)} float64 elements"
    assert sum(spy.numels) <= 8 * chunk, f"{sum(spy.numels)} float64 elements in {len(spy.numels)} tensors"


def test_checksum_does_not_depend_on_the_thread_count():
    x = _randn(700, 3000) * torch.logspace(-6, 6, 3000)  # wide range of magnitudes: rounding shows
    box = ((100, 800), (40, 3040))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = box_checksum(x, box), tensor_checksum(x)
        torch.set_num_threads(2)
        two = box_checksum(x, box), tensor_checksum(x)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two, strict=True):
        assert _agree(a, b), f"1 thread {a} vs 2 threads {b}"


def test_box_checksum_weights_rows():
    # Whole numbers: the plain sums of the two tensors are then equal to the last bit.
    x = torch.randint(-50, 50, (24, 16), generator=torch.Generator().manual_seed(0)).to(torch.float32)
    swapped = x.clone()
    _swap_rows(swapped, 3, 17)
    box = ((8, 32), (0, 16))  # a slice of an HF-full tensor starting at row 8
    total, weighted = box_checksum(x, box)
    swapped_total, swapped_weighted = box_checksum(swapped, box)
    assert swapped_total == total, "a row swap moves no value: the plain sums agree"
    assert swapped_weighted != pytest.approx(weighted, rel=1e-9), "the weighted sum must see the swap"


def _megatron_layout_model() -> MegatronLayoutGPT:
    spec = CFG
    full = init_hf_weights(CFG, seed=3, dtype=torch.float32)
    local = shard(full, megatron_layout(spec, HybridConfig().train_layout, 1), 0)
    model = MegatronLayoutGPT(CFG, padded_vocab_size=local["embedding.word_embeddings.weight"].shape[0],
                              group=None, dtype=torch.float32, device="cpu")
    model.load_state_dict(local)
    return model


@pytest.mark.parametrize(("name", "hf_name"), [
    ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
    ("model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.gate_proj.weight"),
])
def test_sync_that_exchanges_two_rows_of_a_fused_weight_fails_verification(monkeypatch, name, hf_name):
    """A resharding executor that writes two rows of a fused engine weight in each other's places (both
    inside the q rows, or the gate rows, so no value leaves its slice) is caught by the manager's
    ``verify_weight_sync``, and the switch rolls back."""
    import hybridmem.weight_sync.resharding as reshard_sync  # the module whose executor is wrapped

    real_run_plan = reshard_sync.run_plan

    def run_plan_exchanging_rows(*args, **kwargs):
        dst, stats = real_run_plan(*args, **kwargs)
        assert not torch.equal(dst[name][0], dst[name][1]), "rows to exchange must differ"
        _swap_rows(dst[name], 0, 1)
        return dst, stats

    model = _megatron_layout_model()
    engine = ReferenceEngine(hf_config_dict(CFG), num_kv_blocks=8, block_size=8)
    engine.release(list(ENGINE_TAGS))
    config = HybridConfig(device="cpu", verify_weight_sync=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ShardingManager(model, engine, optimizer=opt, config=config, model_spec=hf_config_dict(CFG))
    try:
        with manager.inference():  # the right sync passes verification
            pass
        monkeypatch.setattr(reshard_sync, "run_plan", run_plan_exchanging_rows)
        with pytest.raises(WeightSyncError, match=re.escape(f"{hf_name} slice")) as info:
            manager.to_infer()
        assert f"into {name}" in str(info.value), str(info.value)
        assert manager.phase is Phase.TRAIN
    finally:
        monkeypatch.undo()
        if manager.phase is Phase.INFER:  # the corruption went unseen: leave INFER so close() can run
            manager.to_train()
        manager.close()
