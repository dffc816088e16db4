"""What a cluster plan knows of an accelerator and its node: memory, links, host memory (``hybridmem plan
--accelerator``). Every figure can be overridden on the command line; each preset says where its
figures come from.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GB", "AcceleratorFigures", "ACCELERATORS"]

GB = 10**9


@dataclass(frozen=True, kw_only=True)
class AcceleratorFigures:
    """What a switch's time and fit depend on, per device and per node."""

    name: str
    memory_nbytes: int
    """Device memory a process may use (the budget of a switch's peak)."""
    host_link_bps: float
    """Host <-> device copy bandwidth from pinned memory, bytes/s."""
    intra_node_bps: float
    """Device <-> device bandwidth to a peer in the same NVLink (HCCS) domain, bytes/s, one direction."""
    inter_node_bps: float
    """Device <-> device bandwidth to a peer outside it, bytes/s, one direction."""
    devices_per_node: int
    """Devices sharing one host's memory (a server, or a GB200/GB300 compute tray)."""
    device_copy_bps: float
    """Device-local copy bandwidth (half the memory bandwidth: a copy reads and writes), bytes/s."""
    host_memory_nbytes: int
    """Host memory of one node (the budget of the node's host peak)."""
    devices_per_nvlink_domain: int | None = None
    """Devices reached over the intra-node link; ``None``: the node's. A GB200/GB300 NVL72 rack is one
    NVLink domain of 72 GPUs over 18 trays of 4."""
    pinned_rounds_up: bool = True
    """Whether the host allocator rounds each pinned arena up to a power of two: torch's
    ``CachingHostAllocator`` does on CUDA unless ``pinned_max_round_threshold_mb`` (``PYTORCH_ALLOC_CONF``)
    is set below the arena's size (read from torch 2.13's ``ATen/core/CachingHostAllocator.h``)."""
    step_latency_s: float = 50e-6
    """Fixed cost of one resharding step (posting, launching)."""
    device_type: str = "cuda"
    """The torch device type (``"cuda"``, ``"npu"``): an engine in its own process has a bucket path on CUDA
    only ([Note: vllm buckets] in :mod:`hybridmem.adapters.vllm.server.buckets`)."""

    def __post_init__(self) -> None:
        for name in ("memory_nbytes", "host_link_bps", "intra_node_bps", "inter_node_bps", "devices_per_node",
                     "device_copy_bps", "host_memory_nbytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.name}: {name}={getattr(self, name)} must be > 0")
        if (self.devices_per_nvlink_domain is not None
                and self.devices_per_nvlink_domain < self.devices_per_node):
            raise ValueError(f"{self.name}: devices_per_nvlink_domain={self.devices_per_nvlink_domain} "
                             f"must be >= devices_per_node={self.devices_per_node} (or None: the node)")

    @property
    def nvlink_domain(self) -> int:
        """Devices reached over the intra-node link."""
        return self.devices_per_nvlink_domain or self.devices_per_node


ACCELERATORS: dict[str, AcceleratorFigures] = {
    # H100 SXM 80 GB: pinned host<->device measured at 52-54 GB/s on an H100 box (docs/benchmarks.md);
    # NVLink 4: 450 GB/s each way; one 400 Gb/s NIC per GPU; HBM3 at 3.35 TB/s. Host: 2 TB per node
    # (NVIDIA DGX H100 datasheet, "System Memory 2TB"; other HGX servers vary: give --host-memory-gb).
    "h100": AcceleratorFigures(name="h100", memory_nbytes=80 * GB, host_link_bps=53 * GB,
                               intra_node_bps=450 * GB, inter_node_bps=50 * GB, devices_per_node=8,
                               device_copy_bps=1675 * GB, host_memory_nbytes=2000 * GB),
    # H200 141 GB: the H100's links, HBM3e at 4.8 TB/s. Host: 2 TB (NVIDIA DGX H200 datasheet).
    "h200": AcceleratorFigures(name="h200", memory_nbytes=141 * GB, host_link_bps=53 * GB,
                               intra_node_bps=450 * GB, inter_node_bps=50 * GB, devices_per_node=8,
                               device_copy_bps=2400 * GB, host_memory_nbytes=2000 * GB),
    # Ascend 910B (64 GB HBM): PCIe 4.0 x16 to the host, HCCS within the node, 200 Gb/s RoCE per NPU.
    # Host: 1.5 TB, a typical 8-NPU server's (vendor figure; configurations vary: give --host-memory-gb).
    # torch_npu's pinned allocator was not read here: arenas counted at their size.
    "910b": AcceleratorFigures(name="910b", memory_nbytes=64 * 2**30, host_link_bps=25 * GB,
                               intra_node_bps=196 * GB, inter_node_bps=25 * GB, devices_per_node=8,
                               device_copy_bps=800 * GB, host_memory_nbytes=1500 * GB,
                               pinned_rounds_up=False, device_type="npu"),
    # GB200 NVL72, one compute tray per node: 2 Grace CPUs + 4 B200 (NVIDIA GB200 NVL72 and DGX GB200
    # pages). Per GPU up to 186 GB HBM3e (13.4 TB over 72 GPUs) at 8 TB/s (576 TB/s over 72). Host: up to
    # 480 GB LPDDR5X per Grace (17 TB over 36), 960 GB per tray; the OS sees somewhat less (firmware and
    # driver reservations): give MemTotal as --host-memory-gb for a tight plan. Host link: NVLink-C2C,
    # 900 GB/s both ways per Grace, shared by its two GPUs: 225 GB/s per GPU each way when all copy at
    # once (vendor figure, not measured). NVLink 5: 1.8 TB/s per GPU both ways (900 GB/s each way) across
    # the whole 72-GPU rack. Network: one 400 Gb/s ConnectX-7 per GPU.
    "gb200": AcceleratorFigures(name="gb200", memory_nbytes=186 * GB, host_link_bps=225 * GB,
                                intra_node_bps=900 * GB, inter_node_bps=50 * GB, devices_per_node=4,
                                device_copy_bps=4000 * GB, host_memory_nbytes=960 * GB,
                                devices_per_nvlink_domain=72),
    # GB300 NVL72: the GB200 tray with B300 GPUs of 288 GB HBM3e (NVIDIA GB300 NVL72 page) at 8 TB/s,
    # the same Grace CPUs (up to 17 TB LPDDR5X over 36: 960 GB per tray), NVLink-C2C and NVLink 5, and
    # one 800 Gb/s ConnectX-8 per GPU.
    "gb300": AcceleratorFigures(name="gb300", memory_nbytes=288 * GB, host_link_bps=225 * GB,
                                intra_node_bps=900 * GB, inter_node_bps=100 * GB, devices_per_node=4,
                                device_copy_bps=4000 * GB, host_memory_nbytes=960 * GB,
                                devices_per_nvlink_domain=72),
}
"""Defaults per known accelerator (vendor figures where not measured here); every field can be overridden."""
