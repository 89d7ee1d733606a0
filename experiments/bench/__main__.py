"""Every CPU benchmark against PyTorch's own implementations, in one command, with one
table of ratios measured in this run (ours / theirs: < 1 means ours is faster).

    python -m experiments.bench                      # every benchmark with its defaults
    python -m experiments.bench --json bench.json    # also write every number

Runs `zero_vs_torch` (ZeroOptimizer stages 0-3 against DDP, DDP + ZeroRedundancyOptimizer
and FSDP2 on 2 and 4 gloo ranks), `one_process` (ZeroOptimizer's step on one process against
torch.optim.AdamW(fused=True)) and `pipeline_bubble` (our PipelineExecutor against
torch.distributed.pipelining's 1F1B and interleaved 1F1B on 4 ranks), each with its
default settings (their `--help` describes the method). The machine is assumed noisy:
implementations alternate step by step and ratios are of medians. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

from experiments.bench import one_process, pipeline_bubble, zero_vs_torch
from experiments.bench.results import finish
from experiments.bench.tables import format_table, goal_cell
from research.cli import HelpFormatter


def ratio_rows(zero: dict, pipe: dict, one: dict | None = None) -> list[list[str]]:
    """(benchmark, setting, ours, theirs, ratio of medians, goal) for every pairing."""
    rows = []
    for world, w in zero["worlds"].items():
        for r in w["ratios"]:
            goal = goal_cell(None if r["goal"] is None else r["met"], f"{r['goal']} 1")
            rows.append(["zero_vs_torch", f"dp={world}", r["ours"], r["theirs"], f"{r['ratio']:.3f}", goal])
    for r in one["rows"] if one is not None else []:
        if r["met"] is not None:
            goal = goal_cell(r["met"], f"<= {one_process.GOAL}")
            rows.append(["one_process", "1 process", r["method"], "AdamW(fused=True)", f"{r['ratio']:.3f}", goal])
    for r in pipe["rows"]:
        rows.append(
            [
                "pipeline_bubble",
                f"pp={pipe['config']['pp']} v={r['v']} m={r['m']}",
                f"ours {r['schedule']}",
                "torch.distributed.pipelining",
                f"{r['ratio']:.3f}",
                "-",
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run of every benchmark")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    quick = ["--quick"] if args.quick else []
    zero = zero_vs_torch.main(quick)
    print()
    one = one_process.main(quick)
    print()
    pipe = pipeline_bubble.main(quick)
    print("\n## ratios (ours / theirs, medians measured in this run)\n")
    print(format_table(["benchmark", "setting", "ours", "theirs", "ratio", "goal"], ratio_rows(zero, pipe, one)))
    nonfinite = zero["nonfinite"] + one["nonfinite"] + pipe["nonfinite"]
    return finish({"zero_vs_torch": zero, "one_process": one, "pipeline_bubble": pipe}, nonfinite, args.json)


if __name__ == "__main__":
    main()
