"""The resharding engine: training layout (Megatron TP/PP/EP) -> inference layout (vLLM TP/PP/EP).

- :class:`ModelSpec`: the shapes sharding depends on (``ModelSpec.from_hf_config``).
- :func:`megatron_layout`, :func:`vllm_layout`, :func:`hf_layout`: layouts as data (see [Note: pieces]
  in :mod:`hybridmem.reshard.transforms`); :func:`hf_source_layout`: transformers-named training
  sources, replicated or FSDP2-sharded (:mod:`hybridmem.reshard.hf_source`); vLLM layouts per release
  (:data:`SUPPORTED_VLLM_VERSIONS`, :func:`resolve_vllm_version`, [Note: vLLM versions] in
  :mod:`hybridmem.reshard.vllm_versions`).
- :func:`build_plan` / :class:`ReshardPlan`: who sends which slices to whom, bucketed; cached.
- :func:`reshard_offline`: the plan run in one process over per-rank state dicts; :func:`iter_shard`: a
  stream of HF-full tensors cut into one rank's tensors of a layout.
- :func:`run_plan`, :func:`iter_layout_tensors` (:func:`iter_full_tensors` for HF destinations): the plan
  run over a ``torch.distributed`` group, into given tensors or as a stream of complete ones.

The weight sync that runs a plan on every switch, ``ReshardSync``, is in :mod:`hybridmem.weight_sync`, above
this package.
"""

from __future__ import annotations

from hybridmem.reshard.checksum import CellChecksums, verify_offline
from hybridmem.reshard.conventions import (
    HFConvention,
    MegatronConvention,
    Side,
    VLLMConvention,
)
from hybridmem.reshard.convert import allocate_local, iter_shard, reshard_offline, shard, unshard
from hybridmem.reshard.execute import (
    TransferStats,
    iter_full_tensors,
    iter_layout_tensors,
    run_plan,
    stream_peak_nbytes,
)
from hybridmem.reshard.hf_source import HFSourceLayout, hf_source_layout
from hybridmem.reshard.layouts import (
    ShardLayout,
    hf_layout,
    megatron_layout,
    vllm_layout,
)
from hybridmem.reshard.plan import (
    DEFAULT_BUCKET_NBYTES,
    ReshardPlan,
    Transfer,
    build_plan,
)
from hybridmem.reshard.spec import ModelSpec
from hybridmem.reshard.stages import megatron_stage_layers, vllm_stage_layers
from hybridmem.reshard.vllm_versions import (
    SUPPORTED_VLLM_VERSIONS,
    resolve_vllm_version,
)

__all__ = [
    "ModelSpec",
    "Side",
    "ShardLayout",
    "MegatronConvention",
    "VLLMConvention",
    "HFConvention",
    "megatron_layout",
    "vllm_layout",
    "hf_layout",
    "megatron_stage_layers",
    "vllm_stage_layers",
    "HFSourceLayout",
    "hf_source_layout",
    "SUPPORTED_VLLM_VERSIONS",
    "resolve_vllm_version",
    "ReshardPlan",
    "Transfer",
    "build_plan",
    "DEFAULT_BUCKET_NBYTES",
    "shard",
    "iter_shard",
    "unshard",
    "allocate_local",
    "reshard_offline",
    "run_plan",
    "iter_layout_tensors",
    "iter_full_tensors",
    "stream_peak_nbytes",
    "TransferStats",
    "CellChecksums",
    "verify_offline",
]
