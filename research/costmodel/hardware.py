"""GPUs and clusters the planner knows: memory, peak FLOP/s, bandwidths, latencies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from research.metrics import gpu_peak_flops

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


# Memory as nvidia-smi reports it; bandwidths from NVIDIA's datasheets (NVLink:
# half the bidirectional figure); networks of DGX nodes: 8 × HDR 200 Gb/s (A100),
# 8 × NDR 400 Gb/s (H100, H200).
def _bf16_peak(name: str) -> float:
    """The bf16 peak from research.metrics' GPU table (the one source of peak FLOP/s)."""
    peak = gpu_peak_flops(name, torch.bfloat16)
    if peak is None:
        raise KeyError(f"{name} is not in research.metrics' GPU table; add it there")
    return peak


GPUS: dict[str, GPU] = {
    "a100-40gb": GPU("a100-40gb", 40960 * MiB, _bf16_peak("a100"), 1.555e12, 300e9, 25e9),
    "a100-80gb": GPU("a100-80gb", 81920 * MiB, _bf16_peak("a100"), 2.039e12, 300e9, 25e9),
    "h100": GPU("h100", 81559 * MiB, _bf16_peak("h100"), 3.35e12, 450e9, 50e9),
    "h200": GPU("h200", 143771 * MiB, _bf16_peak("h200"), 4.8e12, 450e9, 50e9),
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
