"""Every GPU measurement of the repository in one command, each part failing softly.

Writes gpu_suite.json, gpu_suite.md (tables ready for docs/benchmarks.md) and gpu_suite.log.

    python -m experiments.bench.gpu_suite                  # GPU: at most --budget seconds, into --out
    python -m experiments.bench.gpu_suite --cpu-smoke      # CPU: every part on a tiny model (CI)
    python -m experiments.bench.gpu_suite --parts environment fused_step --out DIR

The parts, in order; each returns a dict with a `status` (ok / failed / skipped, with a
`reason` or an `error`) and its numbers:

environment   device, memory, torch / CUDA / triton / NCCL versions, and the machine's own
              ceilings measured here: the copy bandwidth (a 2 GiB device-to-device copy,
              bytes read + written / median time) and the bf16 matmul rate (8192³: 2n³ /
              median time), next to the datasheet's. On the CPU: a 64 MiB copy, fp32 512³.
cuda_tests    `python -m pytest -m cuda -q` in a subprocess within the part's time limit:
              pass / fail / skip counts and the output's tail (skipped on a CPU).
fused_step    `fused_step_bandwidth.measure` on a 1B-element shard (2e5 on the CPU): our
              fused Adam step backends and AdamW(fused=True), effective GB/s as a fraction of
              the copy bandwidth measured by `environment`. Goal: >= 85 % for the backend
              ZeroOptimizer picks.
quantize      ZeRO++'s block quantizer (`optim.quantize`, blocks of 2048) on 2^28 bf16
              elements (2^16 on the CPU): quantize and dequantize at int8 and int4, GB/s of
              the bytes each moves as a fraction of the copy bandwidth, which the planner
              assumes for them. Goal: >= 50 % for the slowest.
mfu           `gpu_mfu.main`: the ~1.3B GPT of --config in bf16 through the training command
              next to the plain PyTorch loop (`--quick`'s tiny fp32 model on the CPU):
              tokens/s, TFLOP/s, MFU against the datasheet peak and the fraction of the matmul
              rate measured by `environment`. Goals: MFU >= 50 %, step time ours / plain <= 1.03.
memory        the planner (`research.costmodel.predict_memory`) against the model built as
              the Trainer builds it (GPT + ZeroOptimizer at the config's stage, bf16 compute
              copies, fp32 masters; the GPT of --config, micro-batch of one sequence of 1024
              and of 2048 tokens), recompute none / selective / full. Model states: CUDA bytes
              allocated after the first step (which creates Adam's m and v) and the tensors
              of `memory_breakdown()`. Activations: the CUDA peak allocated during one forward
              + backward minus what was allocated before it, and the peak bytes saved for
              backward (`metrics.ActivationMeter`). Each next to the prediction, as measured /
              predicted. On the CPU the CUDA columns stay empty.
zero_stages   ZeroOptimizer stages 0-3 at world size 1 against the plain loop (fp32
              parameters under autocast + AdamW(fused=True)) on the same GPT, one
              micro-batch of 4 sequences per step: median forward + backward and optimizer
              (clip, step, zero_grad) times: the cost of the machinery without communication.
compile       `gpu_compile`: every Triton kernel specialization compiled ahead of time for
              sm_80, sm_90, sm_100, gfx90a and gfx942 (sm_90 and gfx942 on the CPU):
              registers, spills, shared memory and vector widths. Needs no GPU.

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

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments.bench.gpu_suite.parts import (
    compile_kernels,
    cuda_tests,
    environment,
    fused_step,
    memory,
    mfu,
    quantize,
    zero_stages,
)
from experiments.bench.gpu_suite.report import (
    compile_md,
    cuda_tests_md,
    environment_md,
    fused_step_md,
    memory_md,
    mfu_md,
    quantize_md,
    zero_stages_md,
)
from experiments.bench.gpu_suite.runner import GPU_BUDGET_S, SMOKE_BUDGET_S, Context, Part, run_suite
from research.cli import arg, config_from, config_parser

PARTS = [
    Part("environment", environment, 30, environment_md),
    Part("cuda_tests", cuda_tests, 120, cuda_tests_md),
    Part("fused_step", fused_step, 60, fused_step_md),
    Part("quantize", quantize, 20, quantize_md),
    Part("mfu", mfu, 150, mfu_md),
    Part("memory", memory, 60, memory_md),
    Part("zero_stages", zero_stages, 60, zero_stages_md),
    Part("compile", compile_kernels, 20, compile_md),
]


NAMES = tuple(p.name for p in PARTS)


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
    p = config_parser(Options, __doc__)
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
    parts = [part for part in PARTS if part.name in args.parts]
    results = run_suite(parts, ctx, budget, Path(args.out), command)
    print(f"[gpu_suite] {results['seconds']:.0f} s; wrote {args.out}/gpu_suite.json, gpu_suite.md, gpu_suite.log")
    return 1 if any(r["status"] == "failed" for r in results["parts"].values()) else 0
