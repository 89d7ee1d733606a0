"""GPUs and clusters the planner knows: memory, peak FLOP/s, bandwidths, latencies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from research.metrics import gpu_hbm_bandwidth, gpu_peak_flops

MiB, GiB = 2**20, 2**30


@dataclass(frozen=True)
class GPU:
    """One accelerator. Bandwidths are bytes/s per GPU and direction: NVLink inside a node,
    the GPU's own NIC across nodes."""

    name: str
    memory_bytes: int
    peak_flops: float  # dense 16-bit tensor-core FLOP/s
    hbm_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    fp8_flops: float | None = None  # dense float8 tensor-core FLOP/s (None: no float8 matmuls)


def _gpu(name: str, row: str, memory_bytes: int, intra_node: float, inter_node: float) -> GPU:
    """The planner GPU `name` whose peak and HBM bandwidth come from research.metrics' GPU
    table, its `row` (the one source of both)."""
    peak, hbm = gpu_peak_flops(row, torch.bfloat16), gpu_hbm_bandwidth(row)
    if peak is None or hbm is None:
        raise KeyError(f"{row} is not in research.metrics' GPU table with its bandwidth; add it there")
    fp8 = gpu_peak_flops(row, torch.float8_e4m3fn)
    return GPU(name, memory_bytes, peak, hbm, intra_node, inter_node, fp8)


# Memory as nvidia-smi / rocm-smi report it; link bandwidths per GPU and direction from the
# vendors' datasheets: NVLink (half the bidirectional figure), AMD Infinity Fabric (MI300X:
# 7 links, 448 GB/s; MI250X: a GCD's links to the others in its node, about 100 GB/s);
# networks of DGX and similar nodes: 8 × HDR 200 Gb/s (A100), 8 × NDR 400 Gb/s (H100, H200,
# MI300X), and Frontier's 4 × 200 Gb/s Slingshot NICs for 8 GCDs (MI250X).
GPUS: dict[str, GPU] = {
    "a100-40gb": _gpu("a100-40gb", "a100", 40960 * MiB, 300e9, 25e9),
    "a100-80gb": _gpu("a100-80gb", "a100-sxm4-80gb", 81920 * MiB, 300e9, 25e9),
    "h100": _gpu("h100", "h100", 81559 * MiB, 450e9, 50e9),
    "h200": _gpu("h200", "h200", 143771 * MiB, 450e9, 50e9),
    "mi250x": _gpu("mi250x", "mi250x", 65536 * MiB, 100e9, 12.5e9),
    "mi300x": _gpu("mi300x", "mi300x", 196592 * MiB, 448e9, 50e9),
}


# Latency per step of a ring collective (the α of alpha-beta), from NCCL's own cost model:
# NVIDIA/nccl src/graph/tuning.cc, `hwLat`, ring algorithm, Simple protocol (the one NCCL picks
# for the megabyte messages of data parallelism): 3.4 µs per step over NVLink, 14 µs per step
# over the network (9.6 µs in NCCL 2.8's table). An assumption: not measured here, and NCCL's
# fixed cost per call (`baseLat`, 8.4 µs) is left out.
NVLINK_STEP_LATENCY = 3.4e-6
NETWORK_STEP_LATENCY = 14e-6


def ranks_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """Ranks of a group of `size` ranks `stride` apart in the rank order that share a node."""
    return max(1, min(size, gpus_per_node // stride))


@dataclass(frozen=True)
class Cluster:
    """`gpus` GPUs, `gpus_per_node` to a node. `inter_node_gbps`: a node's network in Gb/s per
    direction, all its NICs together, shared evenly by its GPUs (DGX H100: 8 × 400 = 3200);
    None keeps each GPU's own NIC, `GPU.inter_node_bandwidth`. `intra_node_latency` /
    `inter_node_latency`: seconds per step of a ring collective inside a node / across nodes."""

    gpu: GPU
    gpus: int
    gpus_per_node: int = 8
    inter_node_gbps: float | None = None
    intra_node_latency: float = NVLINK_STEP_LATENCY
    inter_node_latency: float = NETWORK_STEP_LATENCY

    @property
    def inter_node_bandwidth(self) -> float:
        """Bytes/s per GPU and direction across nodes."""
        if self.inter_node_gbps is None:
            return self.gpu.inter_node_bandwidth
        return self.inter_node_gbps * 1e9 / 8 / self.gpus_per_node

    def ring_bytes(self, size: int, stride: int, volume: float) -> tuple[float, float]:
        """(NVLink, network) bytes per rank of a ring collective that sends `volume` bytes per
        rank over `size` ranks `stride` apart (mesh (pp, dp, tp), tp innermost): all NVLink if
        they share a node; else NCCL runs k rings (k of them per node) through k NICs, each
        leaving the node once, so a rank sends volume/k over its NIC and the rest over NVLink."""
        if size * stride <= self.gpus_per_node:
            return volume, 0.0
        k = ranks_per_node(size, stride, self.gpus_per_node)
        return volume * (k - 1) / k, volume / k

    def ring_steps(self, size: int, stride: int, rounds: int = 1) -> tuple[int, int]:
        """(in-node, cross-node) steps of a ring over `size` ranks `stride` apart on n nodes:
        rounds·(size - 1) (all-gather, reduce-scatter: 1 round; all-reduce: 2), rounds·(n - 1)
        of them between nodes, as NCCL's cost model counts them (`ncclTopoTuneModel`)."""
        nodes = (
            1 if size * stride <= self.gpus_per_node else -(-size // ranks_per_node(size, stride, self.gpus_per_node))
        )
        return rounds * (size - nodes), rounds * (nodes - 1)

    def latency(self, intra_steps: int, inter_steps: int) -> float:
        """Seconds of α·steps: `intra_steps` inside a node, `inter_steps` across nodes."""
        return intra_steps * self.intra_node_latency + inter_steps * self.inter_node_latency

    def seconds(self, intra: float, inter: float) -> tuple[float, float]:
        """Seconds of `intra` bytes over NVLink and `inter` bytes over this GPU's network share."""
        return intra / self.gpu.intra_node_bandwidth, inter / self.inter_node_bandwidth

    def ring_bandwidth(self, size: int, stride: int) -> float:
        """Bus bandwidth of a ring collective (`ring_bytes`): volume / the slower of its NVLink
        and network parts, which run at once: NVLink inside a node, about min(intra, k·inter)
        across nodes."""
        return 1 / max(self.seconds(*self.ring_bytes(size, stride, 1.0)))
