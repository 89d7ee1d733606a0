"""GPUs and clusters the planner knows: memory, peak FLOP/s, bandwidths."""

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


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus: int
    gpus_per_node: int = 8

    def ring_bandwidth(self, size: int, stride: int) -> float:
        """Bus bandwidth of a collective over `size` ranks `stride` apart in the rank order
        (mesh (pp, dp, tp), tp innermost): NVLink if they share a node, else min(intra,
        k·inter) with k of them per node."""
        if size * stride <= self.gpus_per_node:
            return self.gpu.intra_node_bandwidth
        per_node = max(1, min(size, self.gpus_per_node // stride))
        return min(self.gpu.intra_node_bandwidth, per_node * self.gpu.inter_node_bandwidth)
