"""Every GPU measurement of the repository in one command, each part failing softly.

Writes gpu_suite.json, gpu_suite.md (tables ready for docs/benchmarks.md) and gpu_suite.log.

    python -m experiments.bench.gpu_suite                  # GPU: at most --budget seconds, into --out
    python -m experiments.bench.gpu_suite --cpu-smoke      # CPU: every part on a tiny model (CI)
    python -m experiments.bench.gpu_suite --parts environment fused_step --out DIR

The parts, in order (`--help` lists them, each as its function in `parts` describes it);
each returns a dict with a `status` (ok / failed / skipped, with a `reason` or an `error`)
and its numbers.

Each part runs in a fresh process forked from a server that imported torch once, so its
memory peaks are its own, a CUDA error cannot poison the parts after it, and its time limit
is enforced by killing its process group. Its limit is its share of --budget plus what the
parts before it left unused. The parts' own output goes to gpu_suite.log beside the results;
the console gets a line per part. Both result files are rewritten after every part, so a
run cut short keeps what it measured. Exit status 1 if a part failed.

Modules: `runner` (processes, limits, result files), `parts` (the measurements), `report`
(the markdown); this one holds the list of parts and the command line. Results:
docs/benchmarks.md.
"""

from __future__ import annotations

import inspect
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments.bench.gpu_suite import parts, report
from experiments.bench.gpu_suite.runner import GPU_BUDGET_S, SMOKE_BUDGET_S, Context, Part, run_suite
from research.cli import arg, config_from, config_parser

PARTS = [
    Part("environment", parts.environment, 20, report.environment_md),
    Part("cuda_tests", parts.cuda_tests, 100, report.cuda_tests_md),
    Part("fused_step", parts.fused_step, 30, report.fused_step_md),
    Part("quantize", parts.quantize, 20, report.quantize_md),
    Part("mfu", parts.mfu, 130, report.mfu_md),
    Part("memory", parts.memory, 30, report.memory_md),
    Part("zero_stages", parts.zero_stages, 90, report.zero_stages_md),
    Part("compile", parts.compile_kernels, 20, report.compile_md),
    Part("context", parts.context, 40, report.context_md),
    Part("fp8", parts.fp8_block, 40, report.fp8_md),
]
NAMES = tuple(p.name for p in PARTS)


def describe(parts: list[Part]) -> str:
    """Each part's name and its function's docstring."""
    return "\n".join(f"{p.name:<13} " + textwrap.indent(inspect.getdoc(p.run) or "", " " * 14).lstrip() for p in parts)


@dataclass
class Options:
    cpu_smoke: bool = arg(False, "every part on a tiny model on the CPU (CUDA hidden)")
    out: str = arg(
        help="folder of the results ($OUT when set)", factory=lambda: os.environ.get("OUT") or "runs/gpu_suite"
    )
    budget: float | None = arg(
        None, f"seconds for all parts (None: {GPU_BUDGET_S:g}, or {SMOKE_BUDGET_S:g} with --cpu-smoke)"
    )
    config: str = arg("experiments/configs/gpt-1.3b.yaml", "the model of mfu, memory and zero_stages")
    data_cache: str | None = arg(None, "token cache of the training command (None: its own)")
    parts: tuple[str, ...] = arg(NAMES, "the parts to run (in the suite's order)", choices=NAMES)


def main(argv: list[str] | None = None) -> int:
    p = config_parser(Options, f"{__doc__}\nThe parts:\n\n{describe(PARTS)}")
    args = config_from(Options, p.parse_args(argv))
    if args.cpu_smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before the forkserver starts: the parts inherit it
    elif not torch.cuda.is_available():
        p.error("no CUDA device here: run it on a GPU, or with --cpu-smoke")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the GPU machine has no network: never wait for the Hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    budget = args.budget or (SMOKE_BUDGET_S if args.cpu_smoke else GPU_BUDGET_S)
    command = " ".join(["python -m experiments.bench.gpu_suite", *(sys.argv[1:] if argv is None else argv)])
    ctx = Context(smoke=args.cpu_smoke, config=args.config, data_cache=args.data_cache)
    chosen = [part for part in PARTS if part.name in args.parts]
    results = run_suite(chosen, ctx, budget, Path(args.out), command)
    print(f"[gpu_suite] {results['seconds']:.0f} s; wrote {args.out}/gpu_suite.json, gpu_suite.md, gpu_suite.log")
    return 1 if any(r["status"] == "failed" for r in results["parts"].values()) else 0
