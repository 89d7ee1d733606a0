"""Effective memory bandwidth of the fused mixed-precision Adam step (optim/fused.py).

    python -m experiments.bench.fused_step_bandwidth                 # GPU: a 1B-parameter shard
    python -m experiments.bench.fused_step_bandwidth --numel 4e6     # CPU smoke run

One step over an n-element shard reads grad, master, m, v and writes master, m, v and the
low-precision parameter copy: n·(g + 4·2·3 + p) bytes (28 per element with bf16 grad and
bf16 params). Effective bandwidth = bytes / median step time, next to
`torch.optim.AdamW(fused=True)` on an fp32 parameter of the same size (28 bytes per element:
p, g, m, v read, p, m, v written) in the same run, and to the card's HBM peak where known.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from experiments.bench.common import timed
from experiments.bench.tables import Cell, millis, table
from optim import fused
from optim.policies import DTYPES
from research.cli import arg, config_from, config_parser
from research.costmodel.datasheet import gpu_hbm_bandwidth


@dataclass
class Config:
    numel: float | None = arg(None, "shard elements (None: 1e9 on a GPU, 4e6 on the CPU)")
    grad_dtype: Literal["bf16", "fp32"] = arg("bf16", "dtype of the gradient read by the step")
    repeats: int = arg(20, "timed steps (the median is reported)")


def hbm_peak(device: torch.device) -> float | None:
    """The datasheet HBM bandwidth of `device` in GB/s (`research.costmodel.datasheet`'s GPU table)."""
    if device.type != "cuda":
        return None
    bandwidth = gpu_hbm_bandwidth(torch.cuda.get_device_name(device))
    return None if bandwidth is None else bandwidth / 1e9


def ours(
    backend: str, n: int, grad_dtype: torch.dtype, param_dtype: torch.dtype, device: torch.device, repeats: int
) -> tuple[float, int]:
    master = torch.randn(n, device=device)
    grad = torch.randn(n, device=device).to(grad_dtype)
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    out = torch.empty(n, dtype=param_dtype, device=device)
    step = [0]

    def run() -> None:
        step[0] += 1
        fused.adam_step_(
            backend,
            [master],
            [grad],
            [m],
            [v],
            [out],
            lr=1e-4,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            adamw=True,
            step=step[0],
        )

    seconds = timed(run, device, repeats)
    return seconds, n * (grad.element_size() + 24 + out.element_size())


def torch_fused_adamw(n: int, device: torch.device, repeats: int) -> tuple[float, int]:
    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device)
    opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return timed(opt.step, device, repeats), n * 28


def measure(n: int, grad_dtype: torch.dtype, device: torch.device, repeats: int) -> list[dict[str, Any]]:
    """`torch.optim.AdamW(fused=True)` first, then each of our backends that runs on
    `device`, on an n-element shard (bf16 parameter copies out): per row the label, the
    backend (None for torch's), median seconds, bytes moved, effective GB/s and the time
    relative to AdamW(fused=True)'s."""
    rows = []

    def add(label: str, backend: str | None, seconds: float, nbytes: int) -> None:
        rows.append(
            {
                "label": label,
                "backend": backend,
                "seconds": seconds,
                "bytes": nbytes,
                "bytes_per_element": nbytes // n,
                "gbs": nbytes / seconds / 1e9,
            }
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()

    add("torch.optim.AdamW(fused=True), fp32", None, *torch_fused_adamw(n, device, repeats))
    for backend in fused.available_backends(device):
        add(f"zero3d {backend}", backend, *ours(backend, n, grad_dtype, torch.bfloat16, device, repeats))
    for r in rows:
        r["time_vs_adamw"] = r["seconds"] / rows[0]["seconds"]
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure and print the table; the results: {"config", "numel", "hbm_peak_gbs", "rows"}."""
    args = config_from(Config, config_parser(Config, __doc__).parse_args(argv))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = int(args.numel or (1e9 if device.type == "cuda" else 4e6))
    grad_dtype = DTYPES[args.grad_dtype]
    peak = hbm_peak(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"device: {name}; shard: {n:,} elements; grad {args.grad_dtype}, params out bf16; "
        f"HBM peak {peak or 'unknown'} GB/s; median of {args.repeats}"
    )
    columns: dict[str, Cell] = {
        "step": "label",
        "ms": millis(".2f"),
        "B/elem": "bytes_per_element",
        "GB/s": "gbs:.1f",
        "% peak": lambda r: f"{100 * r['gbs'] / peak:.1f}%" if peak else "n/a",
        "time vs AdamW(fused)": "time_vs_adamw:.3f",
    }
    rows = measure(n, grad_dtype, device, args.repeats)
    print(table(rows, columns, markdown=False))
    return {"config": asdict(args), "numel": n, "hbm_peak_gbs": peak, "rows": rows}


if __name__ == "__main__":
    main()
