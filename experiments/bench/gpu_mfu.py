"""Tokens/s and MFU of a ~1.3B GPT in bf16 on one GPU: the training command against the
same model trained by a plain PyTorch loop, in one call.

    python -m experiments.bench.gpu_mfu                      # GPU: experiments/configs/gpt-1.3b.yaml
    python -m experiments.bench.gpu_mfu --quick              # CPU smoke run (a tiny model, fp32)

ours    `experiments.train.run` with the config (one process, ZeroOptimizer stage 0, bf16
        compute copies of fp32 masters, fused Adam step, `--no-compile`), as a user would run it.
plain   `research.model.GPT` (the same modules, so the same attention kernel:
        F.scaled_dot_product_attention) with fp32 parameters under
        `torch.autocast(bfloat16)` and `torch.optim.AdamW(fused=True)`: the usual
        single-GPU mixed-precision loop, on the same global batches.
ours_compiled   the command with `--compile` (each block compiled on its own).
plain_compiled  the plain loop with `model = torch.compile(model)`: the strongest single-GPU peer.

ours_fp8  the command with `--compile --fp8 tensorwise` (float8 attention and MLP linear
        layers where they gain: on the 1.31B GPT its MLP down projections alone, see
        `parallel.tensor.fp8.pays`; `--fp8` of this bench, on by default), against ours_compiled.

All count model FLOPs as `GPTConfig.flops_per_token` without recompute (3 × forward
matmuls); MFU = FLOP/s / the device's dense bf16 peak (`research.metrics.peak_flops`), for
the fp8 run too (so its MFU can pass 100 %).
Step times are medians after `--warmup` steps. Target: MFU ≥ 50 % on an H100.
Flags other than these are the training command's (`python -m experiments.train --help`).
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from experiments.bench.tables import table
from optim.policies import DTYPES
from research import data, metrics
from research.cli import arg, config_from, config_parser
from research.config import parse_args as parse_run_args
from research.trainer import load_data

QUICK = [
    "--n-layers", "2", "--d-model", "64", "--n-heads", "4", "--max-seq-len", "64", "--seq-len", "64",
    "--precision", "fp32", "--global-batch-size", "4",
    "--fp8-filter", "none",  # the fp8 run's linears are all too small to gain: cast them anyway
]  # fmt: skip
COLUMNS = {
    "": "loop",
    "step s": "step_time_s:.4f",
    "tok/s": "tokens_per_s:.1f",
    "TFLOP/s": "tflops_per_device:.2f",
    "MFU": "mfu:.1%",
}


@dataclass
class Config:
    config: str = arg("experiments/configs/gpt-1.3b.yaml", "the training command's YAML config")
    steps: int = arg(10, "timed steps")
    warmup: int = arg(3, "untimed steps before them")
    fp8: bool = arg(True, "also run the command with --fp8 tensorwise (bf16 compute, float8 linear layers)")
    compile: bool = arg(True, "also the compiled rows (ours_compiled, plain_compiled)")


def plain_loop(argv: list[str], steps: int, warmup: int, compile: bool = False) -> dict[str, float]:
    """The plain PyTorch loop on the command's model and batches (`compile`: under
    `torch.compile(model)`); median step time etc."""
    from research.model import GPT

    cfg = parse_run_args(argv, 1)
    model_cfg, batches = load_data(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    raw = GPT(model_cfg).to(device)
    model = torch.compile(raw) if compile else raw
    opt = torch.optim.AdamW(
        raw.parameters(),
        lr=cfg.train.lr,
        betas=(cfg.train.beta1, cfg.train.beta2),
        weight_decay=cfg.train.weight_decay,
        fused=True,
    )
    dtype = DTYPES[cfg.train.precision]
    m = cfg.train.micro_batches
    times = []
    for step in range(warmup + steps):
        inputs, labels = batches.batch(step)
        micro = data.local_micro_batches(inputs, labels, 0, 1, m)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for ids, targets in micro:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = model(ids.to(device), targets.to(device)) / m
            loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.train.clip_grad or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_time = statistics.median(times[warmup:])
    flops = dataclasses.replace(model_cfg, recompute="none").flops_per_token(cfg.data.seq_len)
    peak = metrics.peak_flops(device, dtype)
    return {
        **metrics.throughput(cfg.train.global_batch_size * cfg.data.seq_len, step_time, flops, 1, peak),
        "step_time_s": step_time,
    }


def ours(argv: list[str], steps: int, warmup: int) -> dict[str, float]:
    """The training command; medians over the steps after warm-up (from metrics.jsonl)."""
    from experiments.train import run

    with tempfile.TemporaryDirectory() as out:
        run([*argv, "--steps", str(warmup + steps), "--out", out, "--wandb", "disabled", "--zero", "0"])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f][warmup:]
    return {
        k: statistics.median(r[k] for r in rows) if rows[0][k] is not None else None
        for k in ("tokens_per_s", "tflops_per_device", "mfu", "step_time_s")
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the loops and print their table; the results: {"config", "rows" (a record per loop),
    "ratio_step_time" (ours / plain), with --compile "ratio_compiled" (ours_compiled /
    plain_compiled) and with --fp8 "fp8_speedup" (tokens/s of ours_fp8 over the bf16 run)}."""
    p = config_parser(Config, __doc__)
    p.add_argument("--quick", action="store_true", help="a tiny fp32 model (CPU smoke run)")
    known, rest = p.parse_known_args(argv)
    args = config_from(Config, known)
    run_argv = ["--config", args.config, *(QUICK if known.quick else []), *rest]
    steps = (args.steps, args.warmup)
    loops = {"ours": ours([*run_argv, "--no-compile"], *steps), "plain": plain_loop(run_argv, *steps)}
    if args.compile:
        loops["ours_compiled"] = ours([*run_argv, "--compile"], *steps)
        loops["plain_compiled"] = plain_loop(run_argv, *steps, compile=True)
    if args.fp8:
        fp8_argv = [*run_argv, "--compile", "--precision", "bf16", "--fp8", "tensorwise"]
        loops["ours_fp8"] = ours(fp8_argv, *steps)
    print(
        f"gpu_mfu: {args.config} {' '.join(rest)}; {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}"
    )
    rows = [{"loop": name, **r} for name, r in loops.items()]
    print(table(rows, COLUMNS, markdown=False))
    results = {"config": asdict(args), "rows": rows}
    results["ratio_step_time"] = loops["ours"]["step_time_s"] / loops["plain"]["step_time_s"]
    print(f"step time ours / plain: {results['ratio_step_time']:.3f}")
    if args.compile:
        results["ratio_compiled"] = loops["ours_compiled"]["step_time_s"] / loops["plain_compiled"]["step_time_s"]
        print(f"step time ours_compiled / plain_compiled: {results['ratio_compiled']:.3f}")
    if args.fp8:  # tokens/s of float8 over bf16, both compiled (eager bf16 without --compile rows)
        bf16 = loops["ours_compiled" if args.compile else "ours"]
        results["fp8_speedup"] = loops["ours_fp8"]["tokens_per_s"] / bf16["tokens_per_s"]
        print(f"tokens/s ours_fp8 / bf16: {results['fp8_speedup']:.3f}")
    return results


if __name__ == "__main__":
    main()
