"""GPUs and clusters the planner knows: memory, peak FLOP/s, bandwidths, latencies.

A system (one kind of node and its network) is a YAML file; the built-in ones are
research/costmodel/systems/*.yaml, and `python -m experiments.calibrate` writes one measured
on the machine at hand. Keys (bandwidths in GB/s per device and direction):

    name: h100
    device: h100            # a row of the GPU table (`datasheet`): peak FLOP/s, HBM bandwidth
    memory_mib: 81559       # per device
    devices_per_node: 8
    intra_node: {gbs: 450}  # optional latency_us: µs per step of a ring collective (NCCL's below);
                            # wait_us, wait_growth, wait_reach_ms: a call's wait for the group's
                            # other ranks (`Wait`; 0 when absent; measured where processes share
                            # cores): µs, plus growth × the compute before it, up to reach ms
    inter_node: {gbs: 50}   # optional latency_us, the wait's keys; pair_gbs and pair_wait_us,
                            # pair_wait_growth, pair_wait_reach_ms: two nodes exchanging one
                            # message each way (a 2-rank all-gather across nodes)
    # optional, instead of the device row or measured: peak_tflops: {bf16: .., fp8: ..},
    # hbm_gbs: .., matmul_efficiency: .. (the share of the peak a layer's GEMMs reach),
    # quantize_gbs: {qwz: .., qgz: ..} (the rates at which ZeRO++'s quantized gather and
    # reduction move their kernels' bytes; HBM's for one absent)
    # optional: backend: nccl | gloo (whose collective algorithms; nccl when absent),
    # compute_units: .. (the devices of the whole cluster share this much compute, as the
    # processes of an emulated cluster share a machine's CPU cores; absent: each its own)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from research.costmodel.datasheet import gpu_hbm_bandwidth, gpu_peak_flops

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
    matmul_efficiency: float | None = None  # η measured on this device (None: the planner's fit)
    quantize_bandwidths: tuple[tuple[str, float], ...] = ()  # (quantizer, bytes/s) measured
    pair_bandwidth: float | None = None  # bytes/s of a 2-rank exchange across nodes (None: the network's)

    def kernel_bandwidth(self, quantizer: str) -> float:
        """Bytes/s at which the kernels of ZeRO++'s `quantizer` ("qwz": the gather, "qgz": the
        reduction) move their bytes: measured, else HBM's (the fused GPU kernels are memory-bound)."""
        return dict(self.quantize_bandwidths).get(quantizer) or self.hbm_bandwidth


# Latency per step of a ring collective (the α of alpha-beta), from NCCL's own cost model:
# NVIDIA/nccl src/graph/tuning.cc, `hwLat`, ring algorithm, Simple protocol (the one NCCL picks
# for the megabyte messages of data parallelism): 3.4 µs per step over NVLink, 14 µs per step
# over the network (9.6 µs in NCCL 2.8's table). An assumption: not measured here, and NCCL's
# fixed cost per call (`baseLat`, 8.4 µs) is left out.
NVLINK_STEP_LATENCY = 3.4e-6
NETWORK_STEP_LATENCY = 14e-6


@dataclass(frozen=True)
class Wait:
    """Seconds a collective call waits for the last of its group's ranks to arrive, beyond its
    steps' latency, where the processes of an emulated cluster share a CPU's cores: each rank
    arrives when the scheduler lets it finish its compute, and ranks drift apart the longer
    they compute, so a call after `before` seconds of compute since its group last met waits

        base + growth · min(before, reach)

    (`experiments.calibrate`: calls between blocks of compute up to `reach` seconds long; held
    beyond). 0 on dedicated devices, whose ranks arrive together."""

    base: float = 0.0
    growth: float = 0.0
    reach: float = 0.0

    def seconds(self, calls: float = 1, before: float = 0.0) -> float:
        """`calls` calls in a row after `before` seconds of compute: each waits `base`, the
        first also the drift."""
        return calls * self.base + self.growth * min(before, self.reach) if calls else 0.0


QUANTIZERS = ("qwz", "qgz")  # ZeRO++'s quantized gather and quantized gradient reduction
SYSTEM_KEYS = {"name", "device", "memory_mib", "devices_per_node", "intra_node", "inter_node"}
OPTIONAL_KEYS = {"peak_tflops", "hbm_gbs", "matmul_efficiency", "quantize_gbs", "backend", "compute_units"}
BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class System:
    """A node of `gpus_per_node` devices `gpu`, its network's step latencies (seconds), the
    backend whose collectives it runs and the compute its devices share (`Cluster`): what a
    hardware file describes. `cluster(n)`: n such devices."""

    gpu: GPU
    gpus_per_node: int
    intra_node_latency: float
    inter_node_latency: float
    backend: str = "nccl"
    compute_units: float | None = None
    waits: tuple[Wait, Wait, Wait | None] = (Wait(), Wait(), None)  # `Cluster.wait`: intra, inter, pair

    def cluster(self, gpus: int, **overrides: Any) -> Cluster:
        fields = {
            "gpus_per_node": self.gpus_per_node,
            "intra_node_latency": self.intra_node_latency,
            "inter_node_latency": self.inter_node_latency,
            "backend": self.backend,
            "compute_units": self.compute_units,
            "waits": self.waits,
        }
        return Cluster(self.gpu, gpus, **{**fields, **overrides})


def _quantizers(rates: Any) -> tuple[tuple[str, float], ...]:
    """`quantize_gbs`'s {qwz: GB/s, qgz: GB/s} as (quantizer, bytes/s) pairs, each positive."""
    if not isinstance(rates, dict) or set(rates) - set(QUANTIZERS):
        raise ValueError(f"quantize_gbs is a mapping of {' and '.join(QUANTIZERS)} to GB/s, got {rates!r}")
    out = tuple((k, float(v) * 1e9) for k, v in rates.items())
    if any(v <= 0 for _, v in out):
        raise ValueError(f"quantize_gbs must be positive, got {rates!r}")
    return out


def _wait(part: dict, prefix: str = "") -> Wait | None:
    """The `Wait` of a link's `{prefix}wait_us`, `{prefix}wait_growth` and
    `{prefix}wait_reach_ms`; None where it gives no wait."""
    base, growth, reach = (part.get(f"{prefix}wait_{key}") for key in ("us", "growth", "reach_ms"))
    if (growth is None) != (reach is None):
        raise ValueError(
            f"{prefix}wait_growth and {prefix}wait_reach_ms go together (the blocks the growth was measured over)"
        )
    if base is None and growth is None:
        return None
    wait = Wait(float(base or 0.0) * 1e-6, float(growth or 0.0), float(reach or 0.0) * 1e-3)
    if min(wait.base, wait.growth, wait.reach) < 0:
        raise ValueError(f"{prefix}wait_us, {prefix}wait_growth and {prefix}wait_reach_ms must be zero or more")
    return wait


def _link_times(intra: dict, inter: dict) -> tuple[list[float], tuple[Wait, Wait, Wait | None]]:
    """Seconds of (α per ring step inside a node, across nodes; NCCL's where not given) and
    the waits per call (`Cluster.wait`: inside, across, a pair of nodes) of a file's links."""
    latency = [
        part["latency_us"] * 1e-6 if "latency_us" in part else default
        for part, default in ((intra, NVLINK_STEP_LATENCY), (inter, NETWORK_STEP_LATENCY))
    ]
    return latency, (_wait(intra) or Wait(), _wait(inter) or Wait(), _wait(inter, "pair_"))


def load_system(path: str | Path) -> System:
    """The system described by the YAML file at `path` (module docstring); a ValueError
    naming the file and the key when it is not one."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    where = str(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a hardware file is a mapping of {', '.join(sorted(SYSTEM_KEYS))}")
    missing, unknown = SYSTEM_KEYS - set(raw) - {"device"}, set(raw) - SYSTEM_KEYS - OPTIONAL_KEYS
    if missing or unknown:
        raise ValueError(
            f"{where}: missing {sorted(missing)} / unknown {sorted(unknown)} keys (see research/costmodel/hardware.py)"
        )
    try:
        peaks = {k: float(v) * 1e12 for k, v in (raw.get("peak_tflops") or {}).items()}
        row = raw.get("device")
        bf16 = peaks.get("bf16") or (row and gpu_peak_flops(row, torch.bfloat16))
        fp8 = peaks.get("fp8") or (row and gpu_peak_flops(row, torch.float8_e4m3fn))
        hbm = float(raw["hbm_gbs"]) * 1e9 if "hbm_gbs" in raw else row and gpu_hbm_bandwidth(row)
        if not bf16 or not hbm:
            raise ValueError(
                f"device {row!r} is not in research.costmodel.datasheet's GPU table: give peak_tflops.bf16 and hbm_gbs"
            )
        intra, inter = raw["intra_node"], raw["inter_node"]
        eta, pair = raw.get("matmul_efficiency"), inter.get("pair_gbs")
        gpu = GPU(
            str(raw["name"]), int(raw["memory_mib"]) * MiB, bf16, hbm, float(intra["gbs"]) * 1e9,
            float(inter["gbs"]) * 1e9, fp8 or None, None if eta is None else float(eta),
            _quantizers(raw.get("quantize_gbs", {})), None if pair is None else float(pair) * 1e9,
        )  # fmt: skip
        backend = str(raw.get("backend", "nccl"))
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        units = raw.get("compute_units")
        latency, waits = _link_times(intra, inter)
        system = System(
            gpu, int(raw["devices_per_node"]), *latency, backend, None if units is None else float(units), waits
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    bandwidths = (gpu.intra_node_bandwidth, gpu.inter_node_bandwidth, gpu.pair_bandwidth)
    if system.gpus_per_node < 1 or min(b for b in bandwidths if b is not None) <= 0:
        raise ValueError(f"{where}: devices_per_node and every bandwidth must be positive")
    if system.compute_units is not None and system.compute_units <= 0:
        raise ValueError(f"{where}: compute_units must be positive (or absent: every device computes on its own)")
    return system


SYSTEMS_DIR = Path(__file__).parent / "systems"
# The built-in systems, by name (`--gpu NAME`): one file each, datasheet figures.
SYSTEMS: dict[str, System] = {p.stem: load_system(p) for p in sorted(SYSTEMS_DIR.glob("*.yaml"))}
GPUS: dict[str, GPU] = {name: system.gpu for name, system in SYSTEMS.items()}


def ranks_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """Ranks of a group of `size` ranks `stride` apart in the rank order that share a node."""
    return max(1, min(size, gpus_per_node // stride))


@dataclass(frozen=True)
class Cluster:
    """`gpus` GPUs, `gpus_per_node` to a node. `inter_node_gbps`: a node's network in Gb/s per
    direction, all its NICs together, shared evenly by its GPUs (DGX H100: 8 × 400 = 3200);
    None keeps each GPU's own NIC, `GPU.inter_node_bandwidth`. `intra_node_latency` /
    `inter_node_latency`: seconds per step of a ring collective inside a node / across nodes.
    `backend`: whose collective algorithms move the bytes (`reduce_scatter_rounds`).
    `compute_units`: the compute all the devices share (`compute_share`); None: each its own.
    `waits`: what a collective call waits for its group's other ranks (`wait`)."""

    gpu: GPU
    gpus: int
    gpus_per_node: int = 8
    inter_node_gbps: float | None = None
    intra_node_latency: float = NVLINK_STEP_LATENCY
    inter_node_latency: float = NETWORK_STEP_LATENCY
    backend: str = "nccl"
    compute_units: float | None = None
    waits: tuple[Wait, Wait, Wait | None] = (Wait(), Wait(), None)

    @property
    def inter_node_bandwidth(self) -> float:
        """Bytes/s per GPU and direction across nodes."""
        if self.inter_node_gbps is None:
            return self.gpu.inter_node_bandwidth
        return self.inter_node_gbps * 1e9 / 8 / self.gpus_per_node

    @property
    def pair_bandwidth(self) -> float:
        """Bytes/s per GPU and direction of a 2-rank exchange across nodes (each sends the other
        one message, as a 2-rank all-gather does): the network's, times the measured
        `GPU.pair_bandwidth` / `GPU.inter_node_bandwidth` where the hardware file gives one (on
        gloo over TCP such an exchange of megabytes ran both ways at once or one way after the
        other, by chance per call: `experiments.calibrate` takes the mean)."""
        pair = self.gpu.pair_bandwidth
        return self.inter_node_bandwidth * (1.0 if pair is None else pair / self.gpu.inter_node_bandwidth)

    def ring_bytes(self, size: int, stride: int, volume: float) -> tuple[float, float]:
        """(NVLink, network) bytes per rank of a ring collective that sends `volume` bytes per
        rank over `size` ranks `stride` apart (mesh (pp, dp, tp), tp innermost): all NVLink if
        they share a node; else NCCL runs k rings (k of them per node) through k NICs, each
        leaving the node once, so a rank sends volume/k over its NIC and the rest over NVLink."""
        if size * stride <= self.gpus_per_node:
            return volume, 0.0
        k = ranks_per_node(size, stride, self.gpus_per_node)
        return volume * (k - 1) / k, volume / k

    def reduce_scatter_rounds(self) -> int:
        """Ring rounds of a reduce-scatter: 1 on NCCL; 2 on gloo, whose reduce-scatter is an
        all-reduce (twice the bytes: 2(N-1)/N of the input per rank, counted on a shaped link)."""
        return 2 if self.backend == "gloo" else 1

    @property
    def compute_share(self) -> float:
        """How much slower each device computes while all of them compute than one alone:
        max(1, gpus / compute_units); 1 where every device has its own compute."""
        return self.group_share(self.gpus)

    def group_share(self, devices: int) -> float:
        """How much slower each of `devices` computes while they compute together, the rest
        idle: max(1, devices / compute_units); 1 where every device has its own compute."""
        return 1.0 if self.compute_units is None else max(1.0, min(devices, self.gpus) / self.compute_units)

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

    def wait(self, across: bool, pair: bool = False, calls: float = 1, before: float = 0.0) -> float:
        """Seconds `calls` collective calls in a row, after `before` seconds of compute, wait for
        the last of their group's ranks (`Wait`): a group inside a node, across nodes, or of two
        ranks on two nodes (`pair`; the cross-node wait where not measured)."""
        intra, inter, pair_wait = self.waits
        wait = inter if across else intra
        if across and pair and pair_wait is not None:
            wait = pair_wait
        return wait.seconds(calls, before)

    def seconds(self, intra: float, inter: float, exchange: bool = False) -> tuple[float, float]:
        """Seconds of `intra` bytes over NVLink and `inter` bytes over this GPU's network share
        (`exchange`: as two nodes exchanging one message each way, `pair_bandwidth`)."""
        network = self.pair_bandwidth if exchange else self.inter_node_bandwidth
        return intra / self.gpu.intra_node_bandwidth, inter / network

    def ring_bandwidth(self, size: int, stride: int) -> float:
        """Bus bandwidth of a ring collective (`ring_bytes`): volume / the slower of its NVLink
        and network parts, which run at once: NVLink inside a node, about min(intra, k·inter)
        across nodes."""
        return 1 / max(self.seconds(*self.ring_bytes(size, stride, 1.0)))
