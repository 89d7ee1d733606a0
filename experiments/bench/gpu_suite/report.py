"""gpu_suite.md: a header, a summary table and one table per part, ready for docs/benchmarks.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from experiments.bench.common import format_table
from research.costmodel.memory import RESERVED_BYTES

MiB = 2**20
GiB = 2**30


def note(result: dict[str, Any]) -> str:
    """A result's error or reason, or nothing."""
    return result.get("error") or result.get("reason") or ""


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:,.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def _verdict(goal: dict[str, Any]) -> str:
    target = _pct(goal["target"]) if goal["target"] < 1 else f"{goal['target']:g}"
    met = {True: "met", False: "missed", None: "n/a"}[goal["met"]]
    return f"{goal['op'].replace('>=', '≥').replace('<=', '≤')} {target}: {met}"


def environment_md(r: dict[str, Any]) -> str:
    rows = [
        [
            "copy bandwidth (read + write), GB/s",
            f"{r['copy_bytes'] / MiB:,.0f} MiB copy",
            _num(r["copy_gbs"], ".0f"),
            _num(r["datasheet_gbs"], ".0f"),
            _ratio(r["copy_gbs"], r["datasheet_gbs"]),
        ],
        [
            f"{r['matmul_dtype']} matmul, TFLOP/s",
            f"{r['matmul_n']}³",
            _num(r["matmul_tflops"], ".3g"),
            _num(r["datasheet_tflops"], ".1f"),
            _ratio(r["matmul_tflops"], r["datasheet_tflops"]),
        ],
    ]
    return format_table(["ceiling", "measured on", "measured", "datasheet", "measured / datasheet"], rows)


def cuda_tests_md(r: dict[str, Any]) -> str:
    keys = ("passed", "failed", "skipped", "deselected", "errors")
    row = [f"`{r['command']}`", *(r[k] for k in keys), r["returncode"]]
    return format_table(["command", *keys, "exit code"], [row])


def fused_step_md(r: dict[str, Any]) -> str:
    rows = [
        [
            x["label"],
            f"{1e3 * x['seconds']:.2f}",
            x["bytes_per_element"],
            f"{x['gbs']:.1f}",
            _pct(x["of_copy"]),
            f"{x['time_vs_adamw']:.3f}",
            _verdict(r["goal"]) if x["backend"] == r["picked_backend"] else "-",
        ]
        for x in r["rows"]
    ]
    headers = ["step", "ms", "B/element", "GB/s", "of copy bandwidth", "time / AdamW(fused)", "goal"]
    return (
        f"{r['numel']:,} elements, bf16 gradients and parameter copies; copy bandwidth "
        f"{_num(r['copy_gbs'], '.0f')} GB/s; ZeroOptimizer picks `{r['picked_backend']}`.\n\n"
        + format_table(headers, rows)
    )


def quantize_md(r: dict[str, Any]) -> str:
    rows = [
        [x["backend"], f"int{x['bits']}", x["op"], f"{1e3 * x['seconds']:.3f}", f"{x['gbs']:.1f}", _pct(x["of_copy"])]
        for x in r["rows"]
    ]
    return (
        f"{r['numel']:,} bf16 elements, blocks of {r['block']}; copy bandwidth {_num(r['copy_gbs'], '.0f')} GB/s; "
        f"goal for the slowest of `{r['picked']}` (picked by default): {_verdict(r['goal'])}.\n\n"
        + format_table(["backend", "bits", "op", "ms", "GB/s", "of copy bandwidth"], rows)
    )


def mfu_md(r: dict[str, Any]) -> str:
    rows = [
        [
            x["loop"],
            f"{x['step_time_s']:.4f}",
            f"{x['tokens_per_s']:,.0f}",
            f"{x['tflops_per_device']:.3g}",
            _pct(x["mfu"]),
            _pct(x["of_matmul"]),
            _verdict(r["goals"]["mfu"]) if x["loop"] == "ours" else "-",
        ]
        for x in r["rows"]
    ]
    ratio = r["goals"]["ours_vs_plain"]
    return (
        format_table(["loop", "step s", "tokens/s", "TFLOP/s", "MFU", "of measured matmul", "goal (MFU)"], rows)
        + f"\n\nStep time ours / plain: {ratio['value']:.3f} (goal {_verdict(ratio)}); "
        + (f"ours / ours_fp8: {r['fp8_speedup']:.3f}; " if r.get("fp8_speedup") else "")
        + f"`python -m experiments.bench.gpu_mfu {' '.join(r['argv'])}`."
    )


def memory_md(r: dict[str, Any]) -> str:
    rows = [
        [
            x["seq_len"],
            x["recompute"],
            _mib(x["states_cuda"]),
            _mib(x["states_tensors"]),
            _mib(x["states_predicted"]),
            _ratio(x["states_cuda"] or x["states_tensors"], x["states_predicted"]),
            _mib(x["activations_cuda"]),
            _mib(x["activations_saved"]),
            _mib(x["activations_predicted"]),
            _ratio(x["activations_cuda"], x["activations_predicted"]),
            _ratio(x["activations_saved"], x["activations_predicted"]),
            _mib(x["peak_cuda"]),
            _mib(x["peak_predicted"]),
            _ratio(x["peak_cuda"], x["peak_predicted"]),
        ]
        for x in r["rows"]
    ]
    headers = [
        "seq",
        "recompute",
        "states CUDA",
        "states tensors",
        "states planner",
        "ratio",
        "acts CUDA peak",
        "acts saved",
        "acts planner",
        "ratio CUDA",
        "ratio saved",
        "peak CUDA",
        "peak planner",
        "ratio",
    ]
    return (
        f'{r["model"]}. MiB; ratios are measured / planner (states: CUDA, else tensors). "acts saved": '
        "the bytes saved for backward, which under full recompute leave out the layer recomputed in backward "
        f"(the planner counts it); the planner's peak leaves out its {RESERVED_BYTES / GiB:g} GiB reserve for "
        "the CUDA context and workspaces.\n\n" + format_table(headers, rows)
    )


def zero_stages_md(r: dict[str, Any]) -> str:
    rows = [
        [
            x["method"],
            f"{x['fwd_bwd_ms']:.2f}",
            f"{x['step_ms']:.2f}",
            f"{x['total_ms']:.2f}",
            f"{x['total_vs_plain']:.3f}",
            f"{x['step_vs_plain']:.3f}",
        ]
        for x in r["rows"]
    ]
    return f"{r['model']}; medians of {r['steps']} steps after {r['warmup']}.\n\n" + format_table(
        ["optimizer", "fwd+bwd ms", "clip+step+zero_grad ms", "total ms", "total / plain", "step / plain"], rows
    )


def compile_md(r: dict[str, Any]) -> str:
    return (
        f"{len(r['rows'])} kernel specializations × targets compiled in {r['seconds_compiling']:.0f} s by "
        f"{r['jobs']} processes (`python -m experiments.bench.gpu_compile`); rows with spills: {r['spilled']}; "
        f"with n a multiple of 16 and a block-wide access under 128 bits on CUDA: {r['narrow_on_cuda']}.\n\n"
        + r["summary"]
    )


def _toolkit(env: dict[str, Any]) -> str:
    """ " (CUDA c, NCCL n)", or " (ROCm h, RCCL n)" on a ROCm build of torch; "" on the CPU."""
    if env.get("hip"):
        return f" (ROCm {env['hip']}, RCCL {env['nccl']})"
    return f" (CUDA {env['cuda']}, NCCL {env['nccl']})" if "cuda" in env else ""


def _header(results: dict[str, Any]) -> list[str]:
    env = results["parts"].get("environment", {})
    if env.get("status") == "ok":
        machine = f"{env['device']}, {env['memory_gib']:.1f} GiB"
        if "sms" in env:
            machine += f", {env['sms']} SMs, compute capability {env['capability']}"
        software = f"torch {env['torch']}" + _toolkit(env) + f", triton {env['triton'] or '-'}, Python {env['python']}"
        machine += f"; {env['cpu_cores']} CPU cores"
    else:
        machine, software = "unknown (the environment part did not run)", f"torch {torch.__version__}"
    lines = [
        f"### GPU suite, {results['date'][:10]}: {machine.split(',')[0]}",
        "",
        f"- command: `{results['command']}`",
        f"- machine: {machine}",
        f"- software: {software}",
    ]
    if results.get("commit"):
        lines.append(f"- commit: {results['commit']}")
    lines.append(
        f"- time: {results.get('seconds', 0):.0f} s of a {results['budget_s']:.0f} s budget"
        + (" (--cpu-smoke: tiny models on the CPU)" if results["smoke"] else "")
    )
    return lines


def markdown(results: dict[str, Any], tables: dict[str, Callable[[dict[str, Any]], str]]) -> str:
    """The header, a summary table, then one section per part, in the order of `tables` (part
    name -> the markdown of its `ok` result), with that table when ok."""
    summary = [
        [name, r["status"], f"{r.get('seconds', 0):.1f}", r.get("limit_s", "-"), note(r)]
        for name in tables
        if (r := results["parts"].get(name))
    ]
    lines = [*_header(results), "", format_table(["part", "status", "seconds", "limit s", "note"], summary)]
    for name, table in tables.items():
        r = results["parts"].get(name)
        if r is None:
            continue
        lines += ["", f"#### {name}", ""]
        if r["status"] == "ok":
            lines.append(table(r))
        else:
            lines.append(f"**{r['status']}**: {note(r)}")
            if r.get("traceback"):
                lines += ["", "```", *r["traceback"], "```"]
    return "\n".join(lines) + "\n"
