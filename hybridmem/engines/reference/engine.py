"""ReferenceEngine: a small tensor-parallel inference engine for Llama/Qwen2 that hybridmem can switch.

It implements :class:`hybridmem.contract.engine.InferenceEngine` for real: weights in vLLM's per-rank
layout ([Note: vLLM per-rank layout] in :mod:`hybridmem.engines.reference.layout`) released by storage resize
and rewritten by the weight sync, a paged KV cache whose pool comes from a :mod:`hybridmem.kv` allocator,
batched prefill + decode, greedy and temperature/top-p sampling with a seed, and per-token log-probs.

>>> engine = ReferenceEngine(hf_config, num_kv_blocks=64)                     # doctest: +SKIP
>>> engine.load_weights(hf_model.state_dict().items())
>>> out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.0))
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybridmem.accel import get_accelerator
from hybridmem.contract.engine import EngineCapabilities, check_tags
from hybridmem.contract.generation import GenerationOutput, SamplingParams
from hybridmem.contract.kinds import KV_CACHE, WEIGHTS
from hybridmem.engines.nn.config import embedded_spec
from hybridmem.engines.nn.tp import group_rank, group_size
from hybridmem.engines.reference.blocks import (
    BlockManager,
    KVBlocksExhaustedError,
    blocks_needed,
)
from hybridmem.engines.reference.layout import (
    place_hf_weight,
    rank_tensors,
    split_fused_hf,
)
from hybridmem.engines.reference.model import Chunk, ReferenceModel
from hybridmem.engines.reference.sampling import make_generator, sample_next
from hybridmem.engines.reference.spec import tp_shard
from hybridmem.engines.torch_copy import EngineMemoryState
from hybridmem.errors import PhaseError
from hybridmem.kv import blocks_for_utilization, get_kv_allocator
from hybridmem.reshard.transforms import Piece, piece_view, src_index

__all__ = ["ReferenceEngine", "DEFAULT_NUM_KV_BLOCKS"]

DEFAULT_NUM_KV_BLOCKS = 64
"""KV blocks taken when neither ``num_kv_blocks`` nor ``kv_utilization`` is given."""


@dataclass
class _Seq:
    index: int
    tokens: list[int]
    prompt_len: int
    generator: torch.Generator | None = None
    num_cached: int = 0
    logprobs: list[float] = field(default_factory=list)


class ReferenceEngine:
    """An embedded inference engine, one instance per tensor-parallel rank.

    Built awake: weights (zeroed) and the KV pool are resident, so the call order is
    ``load_weights`` -> ``generate`` ..., then any number of ``release(tags)`` / ``resume(tags)`` +
    ``load_weights`` (or in-place writes into ``named_parameters()``) cycles. Every rank of ``group``
    must make the same calls with the same arguments (they run collectives).

    Args:
        config: HF ``LlamaConfig``/``Qwen2Config`` or its dict.
        group: Tensor-parallel process group; ``None`` is TP1 in one process, or the default group
            when ``torch.distributed`` is initialised.
        device: Device of weights and KV cache (``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...).
        dtype: Weight, activation and KV dtype.
        block_size: Tokens per KV block.
        num_kv_blocks: KV blocks to allocate. At most one of this and ``kv_utilization``.
        kv_utilization: Size the KV pool as vLLM's ``gpu_memory_utilization`` (fraction of the device's
            total memory this process may use; on the CPU, fraction of the memory free now, see
            :func:`~hybridmem.kv.blocks_for_utilization`); the block count is the minimum over TP ranks.
        kv_allocator: Registered :mod:`hybridmem.kv` allocator name (``"torch"``, ``"cuda-vmm"``).

    Raises:
        ValueError: A bad argument, or a model that ``group``'s size cannot split.
    """

    capabilities = EngineCapabilities(writes_in_place=True, reports_weight_coverage=True,
                                      reports_residency=True, binds_phase=True, describes_decoder=True,
                                      describes_weights=True, reports_layout=True, sizes_kv_by_share=True,
                                      releases_kv_alone=True)
    """See [Note: engine capabilities] in :mod:`hybridmem.contract.engine`."""

    def __init__(
        self,
        config: Any,
        *,
        group: Any = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_utilization: float | None = None,
        kv_allocator: str = "torch",
    ):
        if num_kv_blocks is not None and kv_utilization is not None:
            raise ValueError(
                f"give at most one of num_kv_blocks={num_kv_blocks!r} and kv_utilization={kv_utilization!r}"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive int")
        self.spec = embedded_spec(config)
        self.group = group
        self.tp_size, self.tp_rank = group_size(group), group_rank(group)
        self.shard = tp_shard(self.spec, self.tp_size, self.tp_rank)
        self.accel = get_accelerator(device)
        self.gpu_memory_utilization = kv_utilization
        """The ``kv_utilization`` the KV pool was sized for (``None``: sized by block count)."""
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.model = ReferenceModel(self.shard, group=group, device=self.device, dtype=dtype)
        self._weight_nbytes = {n: t.untyped_storage().nbytes() for n, t in self.model.params.items()}

        # One block: K and V of every layer for block_size tokens (see the cache shape below).
        block_shape = (block_size, self.shard.num_kv_heads, self.spec.head_dim)
        block_nbytes = self.spec.num_hidden_layers * 2 * math.prod(block_shape) * dtype.itemsize
        if kv_utilization is not None:
            figures = self.accel.memory_figures()
            num_kv_blocks = blocks_for_utilization(
                total_nbytes=figures.total_nbytes, free_nbytes=figures.free_nbytes,
                block_nbytes=block_nbytes, utilization=kv_utilization, host_memory=self.accel.memory_is_host,
            )
            num_kv_blocks = self._min_over_group(num_kv_blocks)
            if num_kv_blocks < 1:
                raise ValueError(
                    f"kv_utilization={kv_utilization} leaves no room for one KV block of {block_nbytes} "
                    f"bytes (total_nbytes={figures.total_nbytes}, free_nbytes={figures.free_nbytes})"
                )
        elif num_kv_blocks is None:
            num_kv_blocks = DEFAULT_NUM_KV_BLOCKS
        self.kv_allocator = get_kv_allocator(kv_allocator, self.accel)
        self.num_kv_blocks = self.kv_allocator.allocate(block_nbytes=block_nbytes, num_blocks=num_kv_blocks)
        cache_shape = (self.spec.num_hidden_layers, 2, self.num_kv_blocks, *block_shape)
        self.kv_cache = self.kv_allocator.view(dtype, cache_shape)
        self.blocks = BlockManager(self.num_kv_blocks, block_size)
        self._state = {WEIGHTS: EngineMemoryState.RESIDENT, KV_CACHE: EngineMemoryState.RESIDENT}
        self._written: dict[str, set[Piece]] = {}
        """Pieces of each weight written by :meth:`load_weights` since the weights were resumed."""
        self._phase: Any = None

    @property
    def vocab_size(self) -> int:
        """The vocabulary the engine holds (its config's, before its own padding)."""
        return self.spec.vocab_size

    @property
    def parallel_layout(self) -> dict[str, int]:
        """The inference layout this engine runs (its TP group; no pipeline or expert parallelism), see
        [Note: layouts from the parts] in :mod:`hybridmem.parts`."""
        return {"tp": self.tp_size, "pp": 1, "ep": 1}

    # InferenceEngine ------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-full tensors (HF names) into this rank's shards, as vLLM's ``load_weights`` does.

        Raises:
            PhaseError: The weights are released (``resume(["weights"])`` first).
            KeyError: A name the architecture does not have.
            ValueError: A tensor whose shape is not the HF one.
        """
        self._require(WEIGHTS, "load weights")
        layout = rank_tensors(self.shard)
        for name, local in layout.items():
            if not local.pieces and name not in self._written:  # all padding here (the last TP rank's vocab)
                self.model.params[name].zero_()
                self._written[name] = set()
        for fused_name, fused in weights:
            for name, full in split_fused_hf(self.shard, fused_name, fused):
                for target, piece in place_hf_weight(self.shard, name, full) or ():
                    dst = self.model.params[target]
                    if (target not in self._written
                            and sum(p.numel for p in layout[target].pieces) < dst.numel()):
                        dst.zero_()  # vocab padding rows: zero, as vLLM leaves them
                    piece_view(dst, piece).copy_(full[src_index(piece.src)])
                    self._written.setdefault(target, set()).add(piece)

    def release(self, tags: Sequence[str]) -> None:
        """Give back the memory of ``tags``: weights by storage resize (no host copy), the KV pool
        through its allocator. A released tag is left as it is; see [Note: engine memory tags] in
        :mod:`hybridmem.contract.engine`."""
        for tag in check_tags(tags):
            if tag == WEIGHTS:  # every storage, whatever the state: an interrupted resume may have grown some
                self.accel.synchronize()
                self._resize_weights(resident=False)
                self._written.clear()
            elif self._state[tag] is not EngineMemoryState.RELEASED:
                self.blocks.free_all()
                self.kv_allocator.release()
            self._state[tag] = EngineMemoryState.RELEASED

    def resume(self, tags: Sequence[str]) -> None:
        """Take the memory of ``tags`` back (contents undefined: weights must be loaded again);
        all-or-nothing: if a tag fails, the tags resumed by this call are released again."""
        resumed: list[str] = []
        try:
            for tag in check_tags(tags):
                if self._state[tag] is EngineMemoryState.RESIDENT:
                    continue
                if tag == WEIGHTS:
                    self._resize_weights(resident=True)
                    self._written.clear()
                else:
                    self.kv_allocator.resume()
                self._state[tag] = EngineMemoryState.RESIDENT
                resumed.append(tag)
        except BaseException:
            self.release(resumed)
            raise

    def _resize_weights(self, *, resident: bool) -> None:
        """Resize every weight storage to its size (``resident``) or to 0; a failed grow shrinks all back."""
        try:
            for name, t in self.model.params.items():
                t.untyped_storage().resize_(self._weight_nbytes[name] if resident else 0)
        except BaseException:
            for t in self.model.params.values():
                t.untyped_storage().resize_(0)
            raise

    # Optional protocol methods --------------------------------------------------------------------
    def resident_nbytes(self, tag: str) -> int:
        """Device bytes held under ``tag`` now (the KV figure is the allocator's own accounting)."""
        if check_tags([tag])[0] == WEIGHTS:
            return sum(t.untyped_storage().nbytes() for t in self.model.params.values())
        return self.kv_allocator.resident_nbytes()

    def planned_nbytes(self, tag: str) -> int:
        """Device bytes ``resume([tag])`` allocates."""
        if check_tags([tag])[0] == WEIGHTS:
            return sum(self._weight_nbytes.values())
        return self.kv_allocator.nbytes

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's weight tensors under vLLM's names and per-rank shapes (written in place by the
        resharding engine)."""
        return iter(self.model.params.items())

    def state(self, tag: str) -> EngineMemoryState:
        """Where ``tag``'s memory is."""
        return self._state[check_tags([tag])[0]]

    def unwritten_weights(self) -> list[str]:
        """Weights :meth:`load_weights` has not entirely written since the weights were resumed: a piece
        of the vLLM layout not received (vocab padding rows count as written: they are zeroed, a weight that
        is all padding on this rank too);
        see [Note: weight coverage] in :mod:`hybridmem.weight_sync`."""
        layout = rank_tensors(self.shard)
        return [name for name in self.model.params
                if set(layout[name].pieces) - self._written.get(name, set())]

    def bind_phase(self, phase: Any) -> None:
        """Name ``phase()`` (the owning manager's phase) when refusing work outside INFER."""
        self._phase = phase

    # Inference ------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> list[GenerationOutput]:
        """Continue every prompt; outputs in prompt order.

        Sequences are admitted while the KV blocks for their whole length (prompt + ``max_tokens``)
        are free, run together (new prompts prefill in the same batch as running decodes) and give
        their blocks back when they finish.

        Raises:
            PhaseError: Weights or KV cache are released.
            ValueError: An empty prompt or a token id outside the vocabulary.
            KVBlocksExhaustedError: One sequence needs more blocks than the whole cache has.
        """
        params = SamplingParams() if params is None else params
        seqs = self._new_seqs(prompts)
        for seq in seqs:
            seq.generator = make_generator(params.seed + seq.index, self.device)
        waiting, running = list(seqs), []
        done_tokens: dict[int, list[int]] = {}
        try:
            while waiting or running:
                self._admit(waiting, running, lambda s: len(s.tokens) + params.max_tokens - 1)
                logits = self._step(running, last_only=True)
                still = []
                for seq, row in zip(running, logits, strict=False):
                    token, logprob = sample_next(row, params, seq.generator)
                    seq.tokens.append(token)
                    seq.logprobs.append(logprob)
                    num_new = len(seq.tokens) - seq.prompt_len
                    if num_new >= params.max_tokens or token in params.stop_token_ids:
                        self.blocks.free(seq.index)
                        done_tokens[seq.index] = seq.tokens[seq.prompt_len:]
                    else:
                        still.append(seq)
                running = still
        finally:
            self.blocks.free_all()
        return [
            GenerationOutput(
                prompt_ids=s.tokens[: s.prompt_len],
                token_ids=done_tokens[s.index],
                logprobs=s.logprobs if params.logprobs else None,
            )
            for s in seqs
        ]

    @torch.no_grad()
    def compute_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Score sequences: for each, the log-prob of tokens ``1..n-1`` given the tokens before them,
        under the raw model distribution (one prefill; nothing is sampled)."""
        seqs = self._new_seqs(sequences)
        out: dict[int, list[float]] = {}
        waiting, running = list(seqs), []
        try:
            while waiting:
                running = []
                self._admit(waiting, running, lambda s: len(s.tokens))
                rows = self._step(running, last_only=False)
                lo = 0
                for seq in running:
                    n = len(seq.tokens)
                    logp = torch.log_softmax(rows[lo:lo + n - 1].float(), dim=-1)
                    target = torch.tensor(seq.tokens[1:], device=logp.device)
                    out[seq.index] = logp.gather(1, target[:, None])[:, 0].tolist()
                    lo += n
                    self.blocks.free(seq.index)
        finally:
            self.blocks.free_all()
        return [out[s.index] for s in seqs]

    # Internals ------------------------------------------------------------------------------------
    def _require(self, tag: str, operation: str) -> None:
        if self._state[tag] is not EngineMemoryState.RESIDENT:
            state = self._state[tag]
            if self._phase is not None:
                hint = (f"the engine's {tag!r} are {state.name}; "
                        "use the engine inside `with manager.inference()`")
                raise PhaseError(operation, self._phase(), hint)
            hint = f"the engine's {tag!r} are {state.name}; resume([{tag!r}]) first"
            raise PhaseError(operation, state, hint)

    def _new_seqs(self, prompts: Sequence[Sequence[int]]) -> list[_Seq]:
        self._require(WEIGHTS, "generate")
        self._require(KV_CACHE, "generate")
        seqs = []
        for i, prompt in enumerate(prompts):
            tokens = [int(t) for t in prompt]
            if not tokens:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in tokens if not 0 <= t < self.spec.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i} has token ids {bad[:5]} outside [0, vocab_size={self.spec.vocab_size})"
                )
            seqs.append(_Seq(index=i, tokens=tokens, prompt_len=len(tokens)))
        return seqs

    def _admit(self, waiting: list[_Seq], running: list[_Seq], num_tokens: Any) -> None:
        """Move sequences from ``waiting`` to ``running`` while their blocks fit (FIFO)."""
        while waiting and self.blocks.can_allocate(num_tokens(waiting[0])):
            seq = waiting.pop(0)
            self.blocks.allocate(seq.index, num_tokens(seq))
            running.append(seq)
        if waiting and not running:
            needed = blocks_needed(num_tokens(waiting[0]), self.block_size)
            raise KVBlocksExhaustedError(
                f"sequence {waiting[0].index} needs {needed} KV blocks ({num_tokens(waiting[0])} tokens, "
                f"block_size={self.block_size}) but the cache has only {self.num_kv_blocks} "
                f"({self.blocks.num_free_blocks} free); raise num_kv_blocks or lower max_tokens",
                needed_blocks=needed, free_blocks=self.blocks.num_free_blocks, num_blocks=self.num_kv_blocks,
            )

    def _step(self, running: list[_Seq], *, last_only: bool) -> torch.Tensor:
        """One forward over every running sequence's uncached tokens; full logits of each sequence's
        last token (``last_only``) or of every new token."""
        chunks = []
        for seq in running:
            n = len(seq.tokens)
            slots = self.blocks.slots(seq.index, range(n)).to(self.device)
            chunks.append(Chunk(seq.tokens[seq.num_cached:], seq.num_cached, slots))
            seq.num_cached = n
        hidden = self.model.forward(chunks, self.kv_cache)
        if last_only:
            ends = torch.tensor([len(c.token_ids) for c in chunks]).cumsum(0) - 1
            hidden = hidden[ends.to(self.device)]
        return self.model.logits(hidden)

    def _min_over_group(self, value: int) -> int:
        if self.tp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())
