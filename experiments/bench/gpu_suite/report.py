"""gpu_suite.md: a header, a summary table and one table per part, ready for docs/benchmarks.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from experiments.bench.tables import Cell, format_table, millis, table
from research.costmodel.memory import RESERVED_BYTES

MiB = 2**20
GiB = 2**30


def note(result: dict[str, Any]) -> str:
    """A result's error or reason, or nothing."""
    return result.get("error") or result.get("reason") or ""


SUMMARY: dict[str, Cell] = {
    "part": "part",
    "status": "status",
    "seconds": lambda r: f"{r.get('seconds', 0):.1f}",
    "limit s": "limit_s",
    "note": note,
}


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def _mib(key: str) -> Cell:
    """The cell of a record's bytes under `key` in MiB."""
    return lambda x: "-" if x[key] is None else f"{x[key] / MiB:,.1f}"


def _ratio_of(a: str, b: str) -> Cell:
    return lambda x: _ratio(x[a], x[b])


def _verdict(goal: dict[str, Any]) -> str:
    target = f"{goal['target']:.1%}" if goal["target"] < 1 else f"{goal['target']:g}"
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
    counts: dict[str, Cell] = {k: k for k in ("passed", "failed", "skipped", "deselected", "errors")}
    return table([r], {"command": lambda x: f"`{x['command']}`", **counts, "exit code": "returncode"})


def fused_step_md(r: dict[str, Any]) -> str:
    columns: dict[str, Cell] = {
        "step": "label",
        "ms": millis(".2f"),
        "B/element": "bytes_per_element",
        "GB/s": "gbs:.1f",
        "of copy bandwidth": "of_copy:.1%",
        "time / AdamW(fused)": "time_vs_adamw:.3f",
        "goal": lambda x: _verdict(r["goal"]) if x["backend"] == r["picked_backend"] else "-",
    }
    return (
        f"{r['numel']:,} elements, bf16 gradients and parameter copies; copy bandwidth "
        f"{_num(r['copy_gbs'], '.0f')} GB/s; ZeroOptimizer picks `{r['picked_backend']}`.\n\n"
        + table(r["rows"], columns)
    )


QUANTIZE: dict[str, Cell] = {
    "backend": "backend",
    "bits": lambda x: f"int{x['bits']}",
    "op": "op",
    "ms": millis(".3f"),
    "GB/s": "gbs:.1f",
    "of copy bandwidth": "of_copy:.1%",
}


def quantize_md(r: dict[str, Any]) -> str:
    return (
        f"{r['numel']:,} bf16 elements, blocks of {r['block']}; copy bandwidth {_num(r['copy_gbs'], '.0f')} GB/s; "
        f"goal for the slowest of `{r['picked']}` (picked by default): {_verdict(r['goal'])}.\n\n"
        + table(r["rows"], QUANTIZE)
    )


def mfu_md(r: dict[str, Any]) -> str:
    columns: dict[str, Cell] = {
        "loop": "loop",
        "step s": "step_time_s:.4f",
        "tokens/s": "tokens_per_s:,.0f",
        "TFLOP/s": "tflops_per_device:.3g",
        "MFU": "mfu:.1%",
        "of measured matmul": "of_matmul:.1%",
        "goal (MFU)": lambda x: {
            "ours": _verdict(r["goals"]["mfu"]),
            "ours_compiled": _verdict(r["goals"]["mfu_compiled"]),
        }.get(x["loop"], "-"),
    }
    goals = r["goals"]
    lines = [
        f"step time ours / plain: {_num(goals['ours_vs_plain']['value'], '.3f')} ({_verdict(goals['ours_vs_plain'])})",
        "ours_compiled / plain_compiled: "
        f"{_num(goals['compiled_vs_plain_compiled']['value'], '.3f')} ({_verdict(goals['compiled_vs_plain_compiled'])})",
        f"tokens/s fp8 / bf16: {_num(goals['fp8_over_bf16']['value'], '.3f')} ({_verdict(goals['fp8_over_bf16'])})",
    ]
    return (
        table(r["rows"], columns)
        + "\n\n"
        + "; ".join(lines)
        + f"; `python -m experiments.bench.gpu_mfu {' '.join(r['argv'])}`."
    )


MEMORY: list[tuple[str, Cell]] = [
    ("seq", "seq_len"),
    ("recompute", "recompute"),
    ("states CUDA", _mib("states_cuda")),
    ("states tensors", _mib("states_tensors")),
    ("states planner", _mib("states_predicted")),
    ("ratio", lambda x: _ratio(x["states_cuda"] or x["states_tensors"], x["states_predicted"])),
    ("acts CUDA peak", _mib("activations_cuda")),
    ("acts saved", _mib("activations_saved")),
    ("acts planner", _mib("activations_predicted")),
    ("ratio CUDA", _ratio_of("activations_cuda", "activations_predicted")),
    ("ratio saved", _ratio_of("activations_saved", "activations_predicted")),
    ("peak CUDA", _mib("peak_cuda")),
    ("peak planner", _mib("peak_predicted")),
    ("ratio", _ratio_of("peak_cuda", "peak_predicted")),
]


def memory_md(r: dict[str, Any]) -> str:
    return (
        f'{r["model"]}. MiB; ratios are measured / planner (states: CUDA, else tensors). "acts saved": '
        "the bytes saved for backward, which under full recompute leave out the layer recomputed in backward "
        f"(the planner counts it); the planner's peak leaves out its {RESERVED_BYTES / GiB:g} GiB reserve for "
        "the CUDA context and workspaces.\n\n" + table(r["rows"], MEMORY)
    )


ZERO_STAGES: dict[str, Cell] = {
    "optimizer": "method",
    "fwd+bwd ms": "fwd_bwd_ms:.2f",
    "clip+step+zero_grad ms": "step_ms:.2f",
    "total ms": "total_ms:.2f",
    "total / plain": "total_vs_plain:.3f",
    "step / plain": "step_vs_plain:.3f",
}


def zero_stages_md(r: dict[str, Any]) -> str:
    return (
        f"{r['model']}; medians of {r['steps']} steps after {r['warmup']}; each row against the plain loop of its "
        f"kind (eager or compiled); goal for the slowest compiled stage: {_verdict(r['goal'])}.\n\n"
        + table(r["rows"], ZERO_STAGES)
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
    summary = [{"part": name, **r} for name in tables if (r := results["parts"].get(name))]
    lines = [*_header(results), "", table(summary, SUMMARY)]
    for name, part_md in tables.items():
        r = results["parts"].get(name)
        if r is None:
            continue
        lines += ["", f"#### {name}", ""]
        if r["status"] == "ok":
            lines.append(part_md(r))
        else:
            lines.append(f"**{r['status']}**: {note(r)}")
            if r.get("traceback"):
                lines += ["", "```", *r["traceback"], "```"]
    return "\n".join(lines) + "\n"


CONTEXT: dict[str, Cell] = {
    "tokens": "seq:,",
    "fused causal SDPA ms": lambda x: f"{1e3 * x['fused_s']:.2f}",
    "ring member ms (mean)": lambda x: f"{1e3 * x['member_mean_s']:.2f}",
    "member / (fused / cp)": "ratio:.3f",
    "slowest / mean member": "slowest_over_mean:.3f",
}


def context_md(r: dict[str, Any]) -> str:
    return (
        f"cp {r['cp']}, {r['heads']} heads of {r['head_dim']}, {r['dtype']}, forward + backward; goal for the "
        f"worst length: {_verdict(r['goal'])}.\n\n" + table(r["rows"], CONTEXT)
    )


def fp8_md(r: dict[str, Any]) -> str:
    shape = r["shape"]
    columns: dict[str, Cell] = {"linears": "linears", "fwd+bwd ms": millis(".2f"), "tokens/s": "tokens_per_s:,.0f"}
    return (
        f"One block, d_model {shape['d_model']}, {shape['n_heads']} heads, SwiGLU d_ff {shape['d_ff']}, "
        f"{shape['seq']} tokens, bf16, compiled; float8 / bf16 tokens/s {r['ratio']:.3f} ({_verdict(r['goal'])}).\n\n"
        + table(r["rows"], columns)
    )
