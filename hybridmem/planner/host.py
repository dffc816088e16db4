"""Host memory of a cluster plan: what each rank keeps in host memory through the switches, and its sum
over the ranks of each node (``hybridmem plan``'s host peak per node).

[Note: host plan]
Co-located RL jobs run out of host memory before device memory: every rank of a node offloads into
host arenas of its own, and an engine's sleep may copy its weights to host as well. Per rank, a plan
counts, at the rank's host peak (every rank reaches it at once, since they switch together):

- the buffer pool's arenas (:mod:`hybridmem.offload.host_pool`): one per offloaded kind and dtype, sized by
  what the kind's offloader copies, i.e. the kind's state on the rank, the figures of the device side
  ([Note: cluster plan] in :mod:`hybridmem.planner.cluster`). Arenas are allocated once (prewarmed before
  the first switch by default) and never shrink, so they are held in both phases. Where arenas are
  pinned through torch's ``CachingHostAllocator`` (CUDA), each takes its size rounded up to a power of
  two (``AcceleratorFigures.pinned_rounds_up``);
- the engine's sleep copy: a level-1 vLLM sleep copies the weights pool to pinned host memory until the
  next wake; level 2 discards it, and is what hybridmem's vLLM adapter does by default
  (``KVOnlyRelease.DISCARD_WEIGHTS``; ``OFFLOAD_WEIGHTS`` is level 1). Held through TRAIN, so together
  with the arenas. Counted as the engine's weight bytes of the rank, a lower bound: vLLM pins each
  allocation of the pool apart, each rounded up;
- the training framework's own host buffers: none known for Megatron-core or FSDP2 without their CPU
  offload options, so 0 unless given per rank (``TrainingSetup.host_buffer_nbytes``).

Not counted: what each process holds anyway (libraries, the CUDA context: a few GB per rank), and host
peaks outside the switches (a checkpoint loaded onto the CPU by every rank, a checkpoint saved). A
node's figure is the sum over its ranks (``rank // devices_per_node``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridmem.contract.kinds import StateKind

__all__ = ["SLEEP_LEVELS", "HOST_SOURCES", "NodeHost", "pinned_nbytes", "rank_host_nbytes", "node_hosts"]

SLEEP_LEVELS = (1, 2)
"""vLLM's sleep levels: 1 keeps the weights in host memory, 2 discards them."""

ARENA_SOURCES = {StateKind.PARAM: "param arenas", StateKind.GRAD: "grad arenas",
                 StateKind.OPTIMIZER: "optimizer arenas"}
HOST_SOURCES = (*ARENA_SOURCES.values(), "engine sleep copy", "training framework")
"""What a rank's host figure is made of, in the order plans print them."""


def pinned_nbytes(nbytes: int, *, rounds_up: bool) -> int:
    """Host bytes an arena of ``nbytes`` takes: rounded up to a power of two where the pinned allocator
    does so (torch's ``CachingHostAllocator``), else ``nbytes``."""
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    return 1 << (nbytes - 1).bit_length() if rounds_up and nbytes > 0 else nbytes


def rank_host_nbytes(arenas: Mapping[StateKind, Sequence[int]], *, offload: Mapping[StateKind, bool],
                     weights_nbytes: int, sleep_level: int, framework_nbytes: int,
                     rounds_up: bool) -> dict[str, int]:
    """One rank's host bytes at its host peak, by source ([Note: host plan]).

    Args:
        arenas: Per kind, the bytes of each arena its offloader fills (one per dtype).
        offload: Which kinds are offloaded (the others hold no arena).
        weights_nbytes: The engine's weight bytes on the rank.
        sleep_level: vLLM's sleep level, 1 or 2.
        framework_nbytes: The training framework's own host buffers.
        rounds_up: Whether pinned arenas are rounded up to a power of two.

    Raises:
        ValueError: ``sleep_level`` is not 1 or 2.
    """
    if sleep_level not in SLEEP_LEVELS:
        raise ValueError(f"sleep_level={sleep_level!r}; expected one of {SLEEP_LEVELS}")
    out = {name: sum(pinned_nbytes(n, rounds_up=rounds_up) for n in arenas.get(kind, ()))
           if offload.get(kind) else 0
           for kind, name in ARENA_SOURCES.items()}
    out["engine sleep copy"] = weights_nbytes if sleep_level == 1 else 0
    out["training framework"] = framework_nbytes
    return out


@dataclass(frozen=True)
class NodeHost:
    """The host bytes of one node: its ranks' figures summed."""

    node: int
    ranks: tuple[int, ...]
    nbytes: dict[str, int]
    """By source (:data:`HOST_SOURCES`), summed over the node's ranks."""

    @property
    def peak_nbytes(self) -> int:
        """The node's host peak."""
        return sum(self.nbytes.values())


def node_hosts(per_rank: Sequence[Mapping[str, int]], devices_per_node: int) -> tuple[NodeHost, ...]:
    """Every node's host bytes, from every rank's (rank ``r`` on node ``r // devices_per_node``)."""
    if devices_per_node < 1:
        raise ValueError(f"devices_per_node={devices_per_node} must be >= 1")
    nodes = []
    for first in range(0, len(per_rank), devices_per_node):
        ranks = tuple(range(first, min(first + devices_per_node, len(per_rank))))
        nodes.append(NodeHost(first // devices_per_node, ranks,
                              {s: sum(per_rank[r].get(s, 0) for r in ranks) for s in HOST_SOURCES}))
    return tuple(nodes)
