"""Every GPU measurement of the repository in one command, each part failing softly.

Writes gpu_suite.json, gpu_suite.md (tables ready for docs/benchmarks.md) and gpu_suite.log.

    python -m experiments.bench.gpu_suite                  # GPU: at most --budget (480 s), into $OUT or runs/gpu_suite
    python -m experiments.bench.gpu_suite --cpu-smoke      # CPU: every part on a tiny model (CI, well under a minute)
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

Each part runs in a fresh process forked from a server that imported torch once, so its
memory peaks are its own, a CUDA error cannot poison the parts after it, and its time limit
is enforced by killing its process group. Its limit is its share of --budget plus what the
parts before it left unused. The parts' own output goes to gpu_suite.log beside the results;
the console gets a line per part. Both result files are rewritten after every part, so a
run cut short keeps what it measured. Exit status 1 if a part failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import math
import multiprocessing as mp
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from experiments.bench import fused_step_bandwidth, gpu_mfu
from experiments.bench.common import format_table, median, timed
from optim import ZeroOptimizer, fused
from research import data, metrics
from research.config import RunConfig
from research.config import parse_args as parse_run_args
from research.costmodel import Layout, predict_memory
from research.costmodel.memory import RESERVED_BYTES
from research.model import GPT, GPTConfig
from research.trainer import DTYPES, weight_decay_groups

ROOT = Path(__file__).resolve().parents[2]
GPU_BUDGET_S = 480.0  # the parts' budgets below add up to this; --budget scales them
MIN_PART_S = 5.0  # a part left less than this is skipped
MiB = 2**20
GiB = 2**30
_CTX = mp.get_context("forkserver")


# ---------------------------------------------------------------------------------------
# Running the parts
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Context:
    """What a part is given: the mode, the model config, the training command's token
    cache, its time limit and the results of the parts before it."""

    smoke: bool
    config: str
    data_cache: str | None
    limit_s: float = 0.0
    earlier: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    run: Callable[[Context], dict[str, Any]]
    budget_s: float  # seconds of GPU_BUDGET_S
    table: Callable[[dict[str, Any]], str]  # the markdown of an `ok` result


def _failure(e: BaseException) -> dict[str, Any]:
    """A failed part: the exception in one line, the traceback's tail (also printed to the log)."""
    lines = traceback.format_exc().rstrip().splitlines()
    print("\n".join(lines), file=sys.stderr)
    message = str(e).strip().splitlines()
    return {"status": "failed", "error": f"{type(e).__name__}: {message[0] if message else ''}",
            "traceback": lines[-15:]}


def _child(run: Callable[[Context], dict[str, Any]], ctx: Context, log: str, conn: Connection) -> None:
    """One part in its own process group, output appended to `log`; sends its result."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    print(f"\n===== {run.__name__} (limit {ctx.limit_s:.0f} s) =====", flush=True)
    try:
        result = run(ctx)
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - every failure is the part's result
        result = _failure(e)
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(result)


def _kill(proc: mp.process.BaseProcess) -> None:
    """Kill the part's process group (it and the subprocesses it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        proc.kill()


def run_part(part: Part, ctx: Context, log: Path) -> dict[str, Any]:
    """`part.run(ctx)` in a fresh process, killed after ctx.limit_s; its result with the
    wall seconds it took."""
    reader, writer = _CTX.Pipe(duplex=False)
    proc = _CTX.Process(target=_child, args=(part.run, ctx, str(log), writer), name=part.name)
    t0 = time.monotonic()
    proc.start()
    writer.close()
    result = None
    if reader.poll(ctx.limit_s):
        try:
            result = reader.recv()
        except EOFError:  # it died without a result
            pass
    if result is None and proc.is_alive():
        _kill(proc)
        result = {"status": "failed", "error": f"timed out after {ctx.limit_s:.0f} s (killed)"}
    proc.join(30)
    if proc.is_alive():
        _kill(proc)
        proc.join()
    if result is None:
        result = {"status": "failed", "error": f"the process died (exit code {proc.exitcode}) without a result"}
    reader.close()
    return {**result, "seconds": round(time.monotonic() - t0, 1), "limit_s": round(ctx.limit_s)}


def _note(result: dict[str, Any]) -> str:
    return result.get("error") or result.get("reason") or ""


def run_suite(parts: list[Part], ctx: Context, budget_s: float, out: Path, command: str) -> dict[str, Any]:
    """Run the parts in order within `budget_s`, rewriting the result files after each."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu_suite.log"
    log.write_text("")
    _CTX.set_forkserver_preload(["torch"])
    results: dict[str, Any] = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": _commit(), "smoke": ctx.smoke, "budget_s": budget_s, "parts": {}}
    start = time.monotonic()
    scale = budget_s / GPU_BUDGET_S
    for i, part in enumerate(parts):
        reserved = scale * sum(p.budget_s for p in parts[i + 1:])  # what the later parts are promised
        limit = budget_s - (time.monotonic() - start) - reserved
        if limit < MIN_PART_S:
            result = {"status": "skipped", "reason": f"the suite's budget is spent ({limit:.0f} s left for this part)"}
        else:
            result = run_part(part, dataclasses.replace(ctx, limit_s=limit, earlier=dict(results["parts"])), log)
        results["parts"][part.name] = result
        results["seconds"] = round(time.monotonic() - start, 1)
        print(f"[gpu_suite] {part.name}: {result['status']} ({result.get('seconds', 0):.1f} s) {_note(result)}",
              flush=True)
        write_results(results, parts, out)
    return results


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------------------------------
# Shared by the parts
# ---------------------------------------------------------------------------------------


def _goal(value: float | None, op: str, target: float) -> dict[str, Any]:
    """A goal `value op target` (op ">=" or "<="); met is None when value is unknown."""
    met = None if value is None else (value >= target if op == ">=" else value <= target)
    return {"value": value, "op": op, "target": target, "met": met}


def _single_process_group() -> None:
    """torch.distributed with this process alone (ZeroOptimizer needs a group): nccl for
    CUDA tensors, gloo for CPU ones."""
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)


def _model_config(cfg: RunConfig) -> GPTConfig:
    """The run's model with its vocabulary raised to the tokenizer's, as the Trainer does."""
    tokenizer = data.load_tokenizer(cfg.data.tokenizer)
    return dataclasses.replace(cfg.model, vocab_size=max(cfg.model.vocab_size, tokenizer.vocab_size))


def _describe(cfg: RunConfig) -> str:
    mc = _model_config(cfg)
    return (f"{mc.n_layers} layers, d_model {mc.d_model}, {mc.num_params() / 1e6:,.1f}M parameters, "
            f"{cfg.train.precision}")


def _build_model(cfg: RunConfig, device: torch.device) -> GPT:
    with torch.device(device):
        return GPT(_model_config(cfg))


def _build_ours(cfg: RunConfig, device: torch.device) -> tuple[GPT, ZeroOptimizer]:
    """The GPT and ZeroOptimizer with the Trainer's arguments, for one process (one chunk)."""
    model = _build_model(cfg, device)
    par, tr = cfg.parallel, cfg.train
    opt = ZeroOptimizer(
        model, torch.optim.AdamW, stage=par.zero, param_groups=weight_decay_groups(model, tr.weight_decay),
        param_dtype=DTYPES[tr.precision], reduce_dtype=torch.bfloat16 if tr.reduce_dtype == "bf16" else torch.float32,
        bucket_numel=par.bucket_numel, unit_numel=par.unit_numel, lr=tr.lr, betas=(tr.beta1, tr.beta2), eps=tr.eps)
    return model, opt


def _tokens(cfg: RunConfig, batch: int, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (ids, labels) [batch, seq] (what the numbers are does not change time or memory)."""
    x = torch.randint(0, _model_config(cfg).vocab_size, (batch, seq + 1), device=device,
                      generator=torch.Generator(device).manual_seed(0))
    return x[:, :-1], x[:, 1:]


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ---------------------------------------------------------------------------------------
# The parts
# ---------------------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def environment(ctx: Context) -> dict[str, Any]:
    """The machine, its software, and its copy bandwidth and matmul rate measured here."""
    device = ctx.device
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "triton": _version("triton"), "cpu_cores": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        nccl = torch.cuda.nccl.version()
        info.update(device=props.name, memory_gib=props.total_memory / GiB, sms=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
        copy_bytes, n, dtype = 2 * GiB, 8192, torch.bfloat16
    else:
        info.update(device=_cpu_name(), memory_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB)
        copy_bytes, n, dtype = 64 * MiB, 512, torch.float32
    src = torch.ones(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, 20)
    del src, dst
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    matmul_s = timed(lambda: a @ b, device, 20)
    peak = metrics.peak_flops(device, dtype)
    return {"status": "ok", **info, "copy_bytes": copy_bytes, "copy_gbs": 2 * copy_bytes / copy_s / 1e9,
            "datasheet_gbs": fused_step_bandwidth.hbm_peak(device), "matmul_n": n,
            "matmul_dtype": str(dtype).removeprefix("torch."), "matmul_tflops": 2 * n**3 / matmul_s / 1e12,
            "datasheet_tflops": peak / 1e12 if peak else None}


PYTEST = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"]
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b")


def _pytest_counts(output: str) -> dict[str, Any]:
    """The counts of pytest's last summary line ("3 passed, 2 skipped in 4.1s")."""
    lines = [line for line in output.splitlines() if _COUNT.search(line) and re.search(r" in [\d.]+s", line)]
    summary = lines[-1].strip(" =") if lines else ""
    counts = {k: 0 for k in ("passed", "failed", "skipped", "deselected", "errors", "xfailed", "xpassed")}
    for number, kind in _COUNT.findall(summary):
        counts["errors" if kind.startswith("error") else kind] = int(number)
    return {**counts, "summary": summary}


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def cuda_tests(ctx: Context) -> dict[str, Any]:
    """`pytest -m cuda` in a subprocess stopped 10 s before the part's limit."""
    timeout = max(1.0, ctx.limit_s - 10)
    try:
        proc = subprocess.run(PYTEST, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = _text(e.stdout) + _text(e.stderr), None
    print(output)
    counts = _pytest_counts(output)
    result = {"command": " ".join(["python", *PYTEST[1:]]), "returncode": rc, **counts,
              "tail": output.strip().splitlines()[-40:]}
    if rc is None:
        return {**result, "status": "failed", "reason": f"pytest did not finish within {timeout:.0f} s"}
    if rc not in (0, 5) or counts["failed"] or counts["errors"]:  # 5: no test selected
        return {**result, "status": "failed", "reason": f"exit code {rc}: {counts['summary']}"}
    if not counts["passed"]:
        return {**result, "status": "skipped", "reason": f"no CUDA test ran: {counts['summary'] or 'no summary'}"}
    return {**result, "status": "ok"}


def fused_step(ctx: Context) -> dict[str, Any]:
    """Effective bandwidth of the fused Adam step backends and AdamW(fused=True), against
    the copy bandwidth `environment` measured."""
    device = ctx.device
    n = 2 * 10**5 if ctx.smoke else 10**9
    rows = fused_step_bandwidth.measure(n, torch.bfloat16, device, 5 if ctx.smoke else 20)
    copy = ctx.earlier.get("environment", {}).get("copy_gbs")
    for r in rows:
        r["of_copy"] = r["gbs"] / copy if copy else None
        r["time_vs_adamw"] = r["seconds"] / rows[0]["seconds"]
    picked = fused.pick_backend(device)
    of_copy = next(r["of_copy"] for r in rows if r["backend"] == picked)
    return {"status": "ok", "numel": n, "copy_gbs": copy, "picked_backend": picked, "rows": rows,
            "goal": _goal(of_copy, ">=", 0.85)}


def mfu(ctx: Context) -> dict[str, Any]:
    """The training command and the plain loop through `gpu_mfu.main`."""
    argv = ["--config", ctx.config, *(["--quick", "--steps", "2", "--warmup", "1"] if ctx.smoke else
                                      ["--steps", "10", "--warmup", "3"])]
    if ctx.data_cache:
        argv += ["--data-cache", ctx.data_cache]
    r = gpu_mfu.main(argv)
    matmul = ctx.earlier.get("environment", {}).get("matmul_tflops")
    rows = [{"loop": name, **r[name], "of_matmul": r[name]["tflops_per_device"] / matmul if matmul else None}
            for name in ("ours", "plain")]
    return {"status": "ok", "argv": argv, "rows": rows, "matmul_tflops": matmul,
            "goals": {"mfu": _goal(r["ours"]["mfu"], ">=", 0.5),
                      "ours_vs_plain": _goal(r["ratio_step_time"], "<=", 1.03)}}


RECOMPUTE = ("none", "selective", "full")


def _forward_backward_bytes(model: GPT, opt: ZeroOptimizer, batch: tuple[torch.Tensor, torch.Tensor],
                            device: torch.device) -> tuple[int | None, int]:
    """(CUDA peak allocated during one forward + backward minus what was allocated before
    it, None on the CPU; peak bytes saved for backward)."""
    before = _allocated(device)
    if before is not None:
        torch.cuda.reset_peak_memory_stats(device)
    with metrics.ActivationMeter([model]) as meter:
        opt.backward(model(*batch))
    peak = None
    if before is not None:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    opt.zero_grad()
    return peak, meter.peak_bytes


def memory(ctx: Context) -> dict[str, Any]:
    """Measured model states and activations next to the planner's prediction."""
    device = ctx.device
    base = ["--config", ctx.config, *(gpu_mfu.QUICK if ctx.smoke else []), "--micro-batch-size", "1",
            "--global-batch-size", "1"]
    seq_lens = (32, 64) if ctx.smoke else (1024, 2048)
    _single_process_group()
    rows = []
    for recompute in RECOMPUTE:
        argv = [*base, "--recompute", recompute]
        cfg = parse_run_args(argv, 1)
        baseline = _allocated(device)
        model, opt = _build_ours(cfg, device)
        opt.backward(model(*_tokens(cfg, 1, seq_lens[0], device)))  # the first step creates Adam's m and v
        opt.step()
        opt.zero_grad()
        states_cuda = None if baseline is None else _allocated(device) - baseline
        states_tensors = sum(opt.memory_breakdown().values())
        for seq in seq_lens:
            cfg_s = parse_run_args([*argv, "--seq-len", str(seq)], 1)
            predicted = predict_memory(_model_config(cfg_s), Layout.from_run_config(cfg_s), seq)
            acts_cuda, acts_saved = _forward_backward_bytes(model, opt, _tokens(cfg, 1, seq, device), device)
            rows.append({
                "seq_len": seq, "recompute": recompute,
                "states_cuda": states_cuda, "states_tensors": states_tensors,
                "states_predicted": predicted.model_states.total,
                "activations_cuda": acts_cuda, "activations_saved": acts_saved,
                "activations_predicted": predicted.activations,
                "peak_cuda": None if acts_cuda is None else states_cuda + acts_cuda,
                "peak_predicted": predicted.total - RESERVED_BYTES,
            })
        del model, opt
        _free(device)
    return {"status": "ok", "model": f"{_describe(cfg)}, ZeRO stage {cfg.parallel.zero}, micro-batch 1", "rows": rows}


def _step_fns(method: str, cfg: RunConfig, device: torch.device) -> tuple[Callable[..., None], Callable[[], None]]:
    """(forward_backward(ids, labels), optimizer_step()) of "plain" or "zero<stage>"."""
    tr = cfg.train
    clip = tr.clip_grad or math.inf
    if method == "plain":
        model = _build_model(cfg, device)
        opt = torch.optim.AdamW(weight_decay_groups(model, tr.weight_decay), lr=tr.lr, betas=(tr.beta1, tr.beta2),
                                eps=tr.eps, fused=True)
        dtype = DTYPES[tr.precision]

        def forward_backward(ids: torch.Tensor, labels: torch.Tensor) -> None:
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = model(ids, labels)
            loss.backward()

        def step() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return forward_backward, step

    model, zero = _build_ours(cfg, device)

    def forward_backward(ids: torch.Tensor, labels: torch.Tensor) -> None:
        zero.backward(model(ids, labels))

    def step() -> None:
        zero.clip_grad_norm_(clip)
        zero.step()
        zero.zero_grad()
    return forward_backward, step


def zero_stages(ctx: Context) -> dict[str, Any]:
    """Step times of ZeroOptimizer stages 0-3 and of the plain loop at world size 1."""
    device = ctx.device
    argv = ["--config", ctx.config, *(gpu_mfu.QUICK if ctx.smoke else []), "--micro-batch-size", "4",
            "--global-batch-size", "4"]
    warmup, steps = (1, 2) if ctx.smoke else (2, 5)
    _single_process_group()
    rows = []
    for method in ("plain", "zero0", "zero1", "zero2", "zero3"):
        cfg = parse_run_args(argv + ([] if method == "plain" else ["--zero", method[4:]]), 1)
        forward_backward, step = _step_fns(method, cfg, device)
        batch = _tokens(cfg, cfg.train.micro_batch_size, cfg.data.seq_len, device)
        fb_s, step_s = [], []
        for i in range(warmup + steps):
            t0 = _clock(device)
            forward_backward(*batch)
            t1 = _clock(device)
            step()
            t2 = _clock(device)
            if i >= warmup:
                fb_s.append(t1 - t0)
                step_s.append(t2 - t1)
        rows.append({"method": method, "fwd_bwd_ms": 1e3 * median(fb_s), "step_ms": 1e3 * median(step_s),
                     "total_ms": 1e3 * median([a + b for a, b in zip(fb_s, step_s)])})
        del forward_backward, step
        _free(device)
    for r in rows:
        r["total_vs_plain"] = r["total_ms"] / rows[0]["total_ms"]
        r["step_vs_plain"] = r["step_ms"] / rows[0]["step_ms"]
    return {"status": "ok", "model": f"{_describe(cfg)}, 4 x {cfg.data.seq_len} tokens per step", "warmup": warmup,
            "steps": steps, "rows": rows}


# ---------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------


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


def _environment_md(r: dict[str, Any]) -> str:
    rows = [["copy bandwidth (read + write), GB/s", f"{r['copy_bytes'] / MiB:,.0f} MiB copy",
             _num(r["copy_gbs"], ".0f"), _num(r["datasheet_gbs"], ".0f"), _ratio(r["copy_gbs"], r["datasheet_gbs"])],
            [f"{r['matmul_dtype']} matmul, TFLOP/s", f"{r['matmul_n']}³", _num(r["matmul_tflops"], ".3g"),
             _num(r["datasheet_tflops"], ".1f"), _ratio(r["matmul_tflops"], r["datasheet_tflops"])]]
    return format_table(["ceiling", "measured on", "measured", "datasheet", "measured / datasheet"], rows)


def _cuda_tests_md(r: dict[str, Any]) -> str:
    keys = ("passed", "failed", "skipped", "deselected", "errors")
    row = [f"`{r['command']}`", *(r[k] for k in keys), r["returncode"]]
    return format_table(["command", *keys, "exit code"], [row])


def _fused_step_md(r: dict[str, Any]) -> str:
    rows = [[x["label"], f"{1e3 * x['seconds']:.2f}", x["bytes_per_element"], f"{x['gbs']:.1f}", _pct(x["of_copy"]),
             f"{x['time_vs_adamw']:.3f}", _verdict(r["goal"]) if x["backend"] == r["picked_backend"] else "-"]
            for x in r["rows"]]
    headers = ["step", "ms", "B/element", "GB/s", "of copy bandwidth", "time / AdamW(fused)", "goal"]
    return (f"{r['numel']:,} elements, bf16 gradients and parameter copies; copy bandwidth "
            f"{_num(r['copy_gbs'], '.0f')} GB/s; ZeroOptimizer picks `{r['picked_backend']}`.\n\n"
            + format_table(headers, rows))


def _mfu_md(r: dict[str, Any]) -> str:
    rows = [[x["loop"], f"{x['step_time_s']:.4f}", f"{x['tokens_per_s']:,.0f}", f"{x['tflops_per_device']:.3g}",
             _pct(x["mfu"]), _pct(x["of_matmul"]), _verdict(r["goals"]["mfu"]) if x["loop"] == "ours" else "-"]
            for x in r["rows"]]
    ratio = r["goals"]["ours_vs_plain"]
    return (format_table(["loop", "step s", "tokens/s", "TFLOP/s", "MFU", "of measured matmul", "goal (MFU)"], rows)
            + f"\n\nStep time ours / plain: {ratio['value']:.3f} (goal {_verdict(ratio)}); "
            f"`python -m experiments.bench.gpu_mfu {' '.join(r['argv'])}`.")


def _memory_md(r: dict[str, Any]) -> str:
    rows = [[x["seq_len"], x["recompute"],
             _mib(x["states_cuda"]), _mib(x["states_tensors"]), _mib(x["states_predicted"]),
             _ratio(x["states_cuda"] or x["states_tensors"], x["states_predicted"]),
             _mib(x["activations_cuda"]), _mib(x["activations_saved"]), _mib(x["activations_predicted"]),
             _ratio(x["activations_cuda"], x["activations_predicted"]),
             _ratio(x["activations_saved"], x["activations_predicted"]),
             _mib(x["peak_cuda"]), _mib(x["peak_predicted"]), _ratio(x["peak_cuda"], x["peak_predicted"])]
            for x in r["rows"]]
    headers = ["seq", "recompute", "states CUDA", "states tensors", "states planner", "ratio", "acts CUDA peak",
               "acts saved", "acts planner", "ratio CUDA", "ratio saved", "peak CUDA", "peak planner", "ratio"]
    return (f"{r['model']}. MiB; ratios are measured / planner (states: CUDA, else tensors). \"acts saved\": "
            "the bytes saved for backward, which under full recompute leave out the layer recomputed in backward "
            f"(the planner counts it); the planner's peak leaves out its {RESERVED_BYTES / GiB:g} GiB reserve for "
            "the CUDA context and workspaces.\n\n"
            + format_table(headers, rows))


def _zero_stages_md(r: dict[str, Any]) -> str:
    rows = [[x["method"], f"{x['fwd_bwd_ms']:.2f}", f"{x['step_ms']:.2f}", f"{x['total_ms']:.2f}",
             f"{x['total_vs_plain']:.3f}", f"{x['step_vs_plain']:.3f}"] for x in r["rows"]]
    return (f"{r['model']}; medians of {r['steps']} steps after {r['warmup']}.\n\n"
            + format_table(["optimizer", "fwd+bwd ms", "clip+step+zero_grad ms", "total ms", "total / plain",
                            "step / plain"], rows))


def _header(results: dict[str, Any]) -> list[str]:
    env = results["parts"].get("environment", {})
    if env.get("status") == "ok":
        machine = f"{env['device']}, {env['memory_gib']:.1f} GiB"
        if "sms" in env:
            machine += f", {env['sms']} SMs, compute capability {env['capability']}"
        software = (f"torch {env['torch']}" + (f" (CUDA {env['cuda']}, NCCL {env['nccl']})" if "cuda" in env else "")
                    + f", triton {env['triton'] or '-'}, Python {env['python']}")
        machine += f"; {env['cpu_cores']} CPU cores"
    else:
        machine, software = "unknown (the environment part did not run)", f"torch {torch.__version__}"
    lines = [f"### GPU suite, {results['date'][:10]}: {machine.split(',')[0]}", "",
             f"- command: `{results['command']}`", f"- machine: {machine}", f"- software: {software}"]
    if results.get("commit"):
        lines.append(f"- commit: {results['commit']}")
    lines.append(f"- time: {results.get('seconds', 0):.0f} s of a {results['budget_s']:.0f} s budget"
                 + (" (--cpu-smoke: tiny models on the CPU)" if results["smoke"] else ""))
    return lines


def markdown(results: dict[str, Any], parts: list[Part]) -> str:
    """The header, a summary table, then one section per part (its table when ok)."""
    summary = [[p.name, r["status"], f"{r.get('seconds', 0):.1f}", r.get("limit_s", "-"), _note(r)]
               for p in parts if (r := results["parts"].get(p.name))]
    lines = [*_header(results), "", format_table(["part", "status", "seconds", "limit s", "note"], summary)]
    for p in parts:
        r = results["parts"].get(p.name)
        if r is None:
            continue
        lines += ["", f"#### {p.name}", ""]
        if r["status"] == "ok":
            lines.append(p.table(r))
        else:
            lines.append(f"**{r['status']}**: {_note(r)}")
            if r.get("traceback"):
                lines += ["", "```", *r["traceback"], "```"]
    return "\n".join(lines) + "\n"


def write_results(results: dict[str, Any], parts: list[Part], out: Path) -> None:
    (out / "gpu_suite.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "gpu_suite.md").write_text(markdown(results, parts))


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

PARTS = [
    Part("environment", environment, 30, _environment_md),
    Part("cuda_tests", cuda_tests, 120, _cuda_tests_md),
    Part("fused_step", fused_step, 60, _fused_step_md),
    Part("mfu", mfu, 150, _mfu_md),
    Part("memory", memory, 60, _memory_md),
    Part("zero_stages", zero_stages, 60, _zero_stages_md),
]


def main(argv: list[str] | None = None) -> int:
    names = [p.name for p in PARTS]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="every part on a tiny model on the CPU (CUDA hidden)")
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_suite",
                   help="folder of the results (default: $OUT if set)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all parts (default {GPU_BUDGET_S:g}; 240 with --cpu-smoke)")
    p.add_argument("--config", default="experiments/configs/gpt-1.3b.yaml",
                   help="the model of mfu, memory and zero_stages")
    p.add_argument("--data-cache", default=None, help="token cache of the training command (default: its own)")
    p.add_argument("--parts", nargs="+", choices=names, default=names, help="the parts to run (in the suite's order)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before the forkserver starts: the parts inherit it
    elif not torch.cuda.is_available():
        p.error("no CUDA device here: run it on a GPU, or with --cpu-smoke")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the GPU machine has no network: never wait for the Hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    budget = args.budget or (240.0 if args.cpu_smoke else GPU_BUDGET_S)
    command = " ".join(["python -m experiments.bench.gpu_suite", *(sys.argv[1:] if argv is None else argv)])
    ctx = Context(smoke=args.cpu_smoke, config=args.config, data_cache=args.data_cache)
    parts = [part for part in PARTS if part.name in args.parts]
    results = run_suite(parts, ctx, budget, Path(args.out), command)
    print(f"[gpu_suite] {results['seconds']:.0f} s; wrote {args.out}/gpu_suite.json, gpu_suite.md, gpu_suite.log")
    return 1 if any(r["status"] == "failed" for r in results["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
