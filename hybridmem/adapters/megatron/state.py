"""``MegatronTrainingState``: Megatron-core model chunks and optimizer as hybridmem's training side.

>>> state = MegatronTrainingState(model_chunks, optimizer)                      # doctest: +SKIP
>>> manager = ShardingManager(state, engine, config=config)
>>> state.attach(manager)   # release Megatron's workspaces in TRAIN->INFER, show them in residency

Call order: build the chunks (wrapped in ``megatron.core.distributed.DistributedDataParallel``) and
the optimizer (``get_megatron_optimizer``) first, then this object, then the manager, then
:meth:`MegatronTrainingState.attach`. Switch only between optimizer steps (after ``optimizer.step()``,
before the next forward), as for plain PyTorch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hybridmem.accel import Accelerator
from hybridmem.adapters.megatron.offload import (
    MegatronGradOffloader,
    MegatronOptimizerOffloader,
    MegatronParamOffloader,
    ddp_buffers,
)
from hybridmem.adapters.megatron.shards import (
    MegatronSourceLayout,
    ShardSpec,
    megatron_model_spec_dict,
    megatron_named_weights,
    megatron_shard_specs,
    megatron_source_layout,
    unwrap_model,
)
from hybridmem.config import HybridConfig
from hybridmem.contract.kinds import StateKind
from hybridmem.contract.training import TrainingCapabilities
from hybridmem.offload import Offloader
from hybridmem.offload.host_pool import HostBufferPool
from hybridmem.switch.phase import Direction, Phase
from hybridmem.switch.steps import MEGATRON_WORKSPACES, ReleaseBuffersStep

__all__ = ["MegatronTrainingState", "MegatronWorkspaces", "WORKSPACE_OWNER"]

WORKSPACE_OWNER = "megatron workspaces"
"""The residency report's owner name for what :class:`MegatronWorkspaces` counts."""


class MegatronWorkspaces:
    """Device memory Megatron keeps outside the DDP buffers and the optimizer, and how to drop it.

    - Megatron's global memory buffer (``parallel_state.get_global_memory_buffer().buffer``: scratch
      tensors for sequence-parallel all-gathers, keyed by name and dtype). Megatron re-creates an entry
      on its next ``get_tensor``, so dropping the cache is safe between steps.
    - Transformer Engine's cuBLAS workspaces (``transformer_engine.pytorch.module.base``
      ``_cublas_workspace`` and ``_multi_stream_cublas_workspace``) when TE is imported; TE re-creates
      them lazily in ``get_workspace()``. Untested here (TE is not installed on these machines).
    """

    def __init__(self, device_type: str):
        self.device_type = device_type

    @staticmethod
    def _global_buffer() -> Any:
        try:
            from megatron.core import parallel_state  # noqa: PLC0415 - Megatron is optional
        except ImportError:
            return None
        return getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)

    @staticmethod
    def _te_base() -> Any:
        return sys.modules.get("transformer_engine.pytorch.module.base")

    def tensors(self) -> Iterator[torch.Tensor]:
        """The cached tensors (on any device)."""
        buf = self._global_buffer()
        if buf is not None:
            yield from (t for t in getattr(buf, "buffer", {}).values() if isinstance(t, torch.Tensor))
        te = self._te_base()
        if te is not None:
            ws = getattr(te, "_cublas_workspace", None)
            if isinstance(ws, torch.Tensor):
                yield ws
            for t in getattr(te, "_multi_stream_cublas_workspace", None) or []:
                if isinstance(t, torch.Tensor):
                    yield t

    def nbytes(self) -> int:
        """Device bytes the caches hold now (each storage counted once)."""
        seen: dict[int, int] = {}
        for t in self.tensors():
            if t.device.type == self.device_type:
                s = t.untyped_storage()
                seen[s._cdata] = s.nbytes()
        return sum(seen.values())

    def release(self) -> int:
        """Drop every cache; returns the device bytes they held."""
        nbytes = self.nbytes()
        buf = self._global_buffer()
        if buf is not None and isinstance(getattr(buf, "buffer", None), dict):
            buf.buffer.clear()
        te = self._te_base()
        if te is not None:
            if getattr(te, "_cublas_workspace", None) is not None:
                te._cublas_workspace = None
            if getattr(te, "_multi_stream_cublas_workspace", None):
                te._multi_stream_cublas_workspace = []
        return nbytes


class MegatronTrainingState:
    """Megatron-core DDP model chunks and their optimizer, as a
    :class:`~hybridmem.contract.training.TrainingState`.

    Args:
        model_chunks: The DDP-wrapped chunks of this rank (one per virtual pipeline stage), or one chunk.
        optimizer: The optimizer from ``get_megatron_optimizer`` (``DistributedOptimizer``,
            ``Float16OptimizerWithFloat16Params``, ``FP32Optimizer`` or a ``ChainedOptimizer`` of
            them), or ``None``.
        vocab_size: The tokenizer's vocab before Megatron's padding (what the inference engine holds,
            padded its own way); ``None``: the model's padded vocab, right only when the two are equal.

    Raises:
        TypeError: A chunk is not wrapped in Megatron's ``DistributedDataParallel``.
        ValueError: ``vocab_size`` exceeds the model's padded vocab.
    """

    def __init__(self, model_chunks: Any, optimizer: Any, *, vocab_size: int | None = None):
        self.model_chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        ddp_buffers(self.model_chunks)  # validates the wrapping early, naming the bad chunk
        self.optimizer = optimizer
        if vocab_size is not None and not 1 <= vocab_size <= self.padded_vocab_size:
            raise ValueError(f"vocab_size={vocab_size} must be in [1, the model's padded vocab "
                             f"{self.padded_vocab_size}]")
        self._vocab_size = vocab_size
        self.workspaces: MegatronWorkspaces | None = None
        self._attached: set[int] = set()

    @property
    def capabilities(self) -> TrainingCapabilities:
        """Misuse guards; :meth:`attach` (the manager calls it when it is built); the model's HF-style
        config, taking the engine's vocab when the unpadded one was not given, and the engine's family: a
        GPTModel does not say which HF family it is, so the manager passes the engine's ``model_type`` to
        :meth:`model_spec_dict`, which checks the model has that family's tensors; its TP/PP/EP and Megatron
        naming."""
        return TrainingCapabilities(guards_misuse=True, attaches_itself=True, describes_model=True,
                                    vocab_from_engine=not self.vocab_size_known, family_from_engine=True,
                                    reports_source_layout=True, megatron_names=True, reports_layout=True)

    @property
    def vocab_size(self) -> int:
        """The unpadded vocab (the padded one when none was given)."""
        return self.padded_vocab_size if self._vocab_size is None else int(self._vocab_size)

    @property
    def vocab_size_known(self) -> bool:
        """Whether the unpadded vocab was given (else :attr:`vocab_size` is the padded one, and the manager
        takes the engine's vocab when the engine says it)."""
        return self._vocab_size is not None

    @property
    def config(self) -> Any:
        """The ``TransformerConfig`` of the first chunk."""
        return unwrap_model(self.model_chunks[0]).config

    def build_offloaders(self, accel: Accelerator,
                         pool: HostBufferPool, config: HybridConfig) -> dict[StateKind, Offloader]:
        """``PARAM``: every buffer's ``param_data``; ``GRAD``: every ``grad_data`` (all-zero ones skipped
        when ``config.skip_zero_grads``); ``OPTIMIZER``: fp32 main params and optimizer state."""
        self.workspaces = MegatronWorkspaces(accel.device.type)
        offloaders: dict[StateKind, Offloader] = {
            StateKind.PARAM: MegatronParamOffloader(self.model_chunks, accel, pool),
            StateKind.GRAD: MegatronGradOffloader(
                self.model_chunks, self.optimizer, accel, pool, skip_zero=config.skip_zero_grads
            ),
        }
        if self.optimizer is not None:
            offloaders[StateKind.OPTIMIZER] = MegatronOptimizerOffloader(self.optimizer,
                                                                         self.model_chunks, accel, pool)
        return offloaders

    def attach(self, manager: Any) -> None:
        """Register the workspace release step (just before ``empty_cache`` in TRAIN->INFER) and the
        workspaces' residency owner (expected empty in INFER) with ``manager``. The manager does this when
        it is built; a second call for the same manager does nothing."""
        if id(manager) in self._attached:
            return
        self._attached.add(id(manager))
        if self.workspaces is None:
            self.workspaces = MegatronWorkspaces(manager.accel.device.type)
        manager.register_step(Direction.TO_INFER, ReleaseBuffersStep(self.workspaces, MEGATRON_WORKSPACES),
                              MEGATRON_WORKSPACES.order)
        manager.register_owner(WORKSPACE_OWNER, self.workspaces.nbytes, empty_in=(Phase.INFER,))

    def guard_targets(self) -> tuple[list[Any], list[Any]]:
        """The DDP-wrapped chunks and the Megatron optimizer (see [Note: misuse guards] in
        :mod:`hybridmem.switch.guards`)."""
        return list(self.model_chunks), [] if self.optimizer is None else [self.optimizer]

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """This rank's parameters by Megatron name (no DDP ``module.`` prefix, local layer numbers;
        chunks prefixed ``model{i}.`` when there are several)."""
        return megatron_named_weights(self.model_chunks)

    def shard_specs(self) -> dict[str, ShardSpec]:
        """See :func:`~hybridmem.adapters.megatron.shards.megatron_shard_specs`."""
        return megatron_shard_specs(self.model_chunks)

    @property
    def parallel_layout(self) -> dict[str, int]:
        """The TP/PP/EP sizes ``parallel_state`` was initialised with (see [Note: layouts from the parts]
        in :mod:`hybridmem.parts`)."""
        layout = self.source_layout()
        return {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep}

    def source_layout(self) -> MegatronSourceLayout:
        """See :func:`~hybridmem.adapters.megatron.shards.megatron_source_layout`."""
        return megatron_source_layout()

    @property
    def padded_vocab_size(self) -> int:
        """The vocab the GPTModel was built with (Megatron's ``args.padded_vocab_size``, over all TP
        ranks)."""
        return int(unwrap_model(self.model_chunks[0]).vocab_size)

    def model_spec_dict(self, *, vocab_size: int | None = None,
                        model_type: str | None = None) -> dict[str, Any]:
        """The HF-style dict of the model (see :func:`megatron_model_spec_dict`), with ``vocab_size``
        the unpadded vocab given at construction, else ``vocab_size`` (the engine's, as the manager passes
        it), else the padded one; ``model_type``: the family the engine serves (the manager passes the
        engine's), checked against the model's config.

        Raises:
            ValueError: ``vocab_size`` exceeds the model's padded vocab.
        """
        model = unwrap_model(self.model_chunks[0])
        if vocab_size is not None and not 1 <= vocab_size <= self.padded_vocab_size:
            raise ValueError(
                f"the engine's vocab_size={vocab_size} exceeds the Megatron model's padded vocab "
                f"{self.padded_vocab_size}"
            )
        return megatron_model_spec_dict(
            self.config,
            vocab_size=self.vocab_size if self.vocab_size_known or vocab_size is None else vocab_size,
            tie_word_embeddings=bool(getattr(model, "share_embeddings_and_output_weights", False)),
            model_type=model_type,
        )

    def megatron_convention(self) -> Any:
        """The resharding engine's :class:`~hybridmem.reshard.MegatronConvention` of this model: its
        padded vocab, its norm naming (``"te"`` when the norms are fused into ``linear_qkv``), and its
        stages' layer counts when the first or last stage has its own (``num_layers_in_first_pipeline_stage``
        / ``num_layers_in_last_pipeline_stage``, see [Note: uneven stages] in
        :mod:`hybridmem.reshard.stages`)."""
        from hybridmem.reshard import MegatronConvention, megatron_stage_layers  # noqa: PLC0415 - optional here

        te = any(name.endswith("linear_qkv.layer_norm_weight") for name, _ in self.named_weights())
        config = self.config
        first = getattr(config, "num_layers_in_first_pipeline_stage", None)
        last = getattr(config, "num_layers_in_last_pipeline_stage", None)
        pp = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
        stages = (None if first is None and last is None
                  else megatron_stage_layers(config.num_layers, pp, first=first, last=last))
        return MegatronConvention(padded_vocab_size=self.padded_vocab_size,
                                  norm_style="te" if te else "local", stage_layers=stages)
