"""The GPU datasheet table: each GPU's dense peak FLOP/s per dtype and HBM bandwidth, looked
up by device name (`torch.cuda.get_device_name`) or by a key of the table. The one GPU
table: the planner's GPUs (`hardware`), the training run's MFU (`research.metrics.peak_flops`)
and the benchmarks take their peaks and bandwidths from it."""

from __future__ import annotations

import re
from typing import NamedTuple

import torch


class _Peak(NamedTuple):
    """Dense TFLOP/s per device (no 2:4 sparsity; tensor / matrix cores with fp32 accumulate)
    and HBM GB/s. None: the dtype has no tensor-core path on that device (or the bandwidth is
    not listed). An AMD MI250X / MI250 is two GCDs, each its own torch device: per GCD here."""

    bf16: float | None
    fp16: float
    tf32: float | None
    fp32: float  # non-tensor FP32 (AMD: matrix FP32)
    hbm: float | None = None  # GB/s, read + write
    fp8: float | None = None  # float8 (e4m3 / e5m2) tensor cores


# The first key found as whole words in the lower-cased device name wins, so longer names
# come first ("h100 nvl" before "h100"). Vendor datasheets / architecture whitepapers. ROCm
# builds of torch name AMD GPUs "AMD Instinct MI300X", "AMD Instinct MI250X/MI250".
_PEAKS: tuple[tuple[str, _Peak], ...] = (
    ("gb200", _Peak(2500.0, 2500.0, 1250.0, 80.0, 8000.0, 5000.0)),  # per GPU of a GB200 superchip
    ("b200", _Peak(2250.0, 2250.0, 1100.0, 75.0, 8000.0, 4500.0)),  # HGX / DGX B200, 1000 W
    ("h200 nvl", _Peak(835.5, 835.5, 417.5, 60.0, 4800.0, 1671.0)),
    ("h200", _Peak(989.4, 989.4, 494.7, 66.9, 4800.0, 1978.9)),
    ("gh200", _Peak(989.4, 989.4, 494.7, 66.9, 4000.0, 1978.9)),
    ("h100 nvl", _Peak(835.5, 835.5, 417.5, 60.0, 3900.0, 1671.0)),
    ("h100 pcie", _Peak(756.0, 756.0, 378.0, 51.2, 2000.0, 1513.0)),
    ("h100", _Peak(989.4, 989.4, 494.7, 66.9, 3350.0, 1978.9)),  # SXM: "NVIDIA H100 80GB HBM3"
    ("a100-sxm4-80gb", _Peak(312.0, 312.0, 156.0, 19.5, 2039.0)),
    ("a100 80gb pcie", _Peak(312.0, 312.0, 156.0, 19.5, 1935.0)),
    ("a100", _Peak(312.0, 312.0, 156.0, 19.5, 1555.0)),  # the 40 GB SXM and PCIe
    ("a10g", _Peak(70.0, 70.0, 35.0, 35.0, 600.0)),  # AWS's A10: 80 SMs, half-rate fp32-accumulate MMA
    ("a10", _Peak(125.0, 125.0, 62.5, 31.2, 600.0)),
    ("a30", _Peak(165.0, 165.0, 82.0, 10.3, 933.0)),
    ("a40", _Peak(149.7, 149.7, 74.8, 37.4, 696.0)),
    ("rtx a6000", _Peak(154.8, 154.8, 77.4, 38.7, 768.0)),
    ("rtx 6000 ada", _Peak(364.2, 364.2, 182.1, 91.1, 960.0, 728.5)),
    ("l40s", _Peak(362.05, 362.05, 183.0, 91.6, 864.0, 733.0)),
    ("l40", _Peak(181.05, 181.05, 90.5, 90.5, 864.0)),
    ("l4", _Peak(121.0, 121.0, 60.0, 30.3, 300.0, 242.5)),
    ("rtx 4090", _Peak(165.2, 165.2, 82.6, 82.6, 1008.0)),
    ("rtx 3090", _Peak(71.0, 71.0, 35.6, 35.6, 936.0)),
    ("v100s", _Peak(None, 130.0, None, 16.4, 1134.0)),
    ("v100-pcie", _Peak(None, 112.0, None, 14.0, 900.0)),
    ("v100", _Peak(None, 125.0, None, 15.7, 900.0)),  # SXM2
    ("t4", _Peak(None, 65.0, None, 8.1, 320.0)),
    ("mi325x", _Peak(1307.4, 1307.4, 653.7, 163.4, 6000.0, 2614.9)),
    ("mi300x", _Peak(1307.4, 1307.4, 653.7, 163.4, 5300.0, 2614.9)),
    ("mi250x", _Peak(191.5, 191.5, None, 47.9, 1638.4)),  # per GCD (Frontier's GPU)
    ("mi250", _Peak(181.0, 181.0, None, 45.3, 1638.4)),  # per GCD
    ("mi210", _Peak(181.0, 181.0, None, 45.3, 1638.4)),
)


def _gpu(name: str) -> _Peak | None:
    """The table's row for the GPU called `name` (a device name or a key of the table)."""
    name = name.lower()
    return next((p for key, p in _PEAKS if re.search(rf"\b{re.escape(key)}\b", name)), None)


def gpu_hbm_bandwidth(name: str) -> float | None:
    """HBM bandwidth in bytes/s (read + write) of the GPU called `name`; None if unlisted."""
    row = _gpu(name)
    return None if row is None or row.hbm is None else row.hbm * 1e9


def gpu_peak_flops(name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of the GPU called `name` (a device name, or a key of the table)
    for matmuls in `dtype` (fp32 as TF32 when `tf32`); None if unlisted."""
    peak = _gpu(name)
    if peak is None:
        return None
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        tflops = peak.fp8
    elif dtype is torch.bfloat16:
        tflops = peak.bf16
    elif dtype is torch.float16:
        tflops = peak.fp16
    elif dtype is torch.float32:
        tflops = peak.tf32 if tf32 and peak.tf32 is not None else peak.fp32
    else:
        return None
    return None if tflops is None else tflops * 1e12
