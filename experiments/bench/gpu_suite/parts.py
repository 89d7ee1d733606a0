"""The suite's parts: each takes a `Context` and returns its numbers with a `status`."""

from __future__ import annotations

import functools
import gc
import importlib.metadata
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from experiments.bench import context_parallel, fused_step_bandwidth, gpu_compile, gpu_mfu
from experiments.bench.common import median, timed
from experiments.bench.gpu_suite.runner import ROOT, Context
from experiments.bench.results import goal
from optim import ZeroOptimizer, fused
from optim import quantize as quant
from optim.fused import triton_runs_on
from optim.policies import DTYPES
from research import data, metrics
from research.config import RunConfig
from research.config import parse_args as parse_run_args
from research.costmodel import Layout, num_params, predict_memory
from research.costmodel.memory import RESERVED_BYTES
from research.model import GPT, Block, GPTConfig, compile_blocks
from research.trainer import build_optimizer, one_graph_per_block, weight_decay_groups

MiB = 2**20
GiB = 2**30


def _measured(ctx: Context, key: str) -> float | None:
    """A number the environment part measured (None without it)."""
    return ctx.earlier.get("environment", {}).get(key)


def _single_process_group() -> None:
    """torch.distributed with this process alone (ZeroOptimizer needs a group): nccl for
    CUDA tensors, gloo for CPU ones."""
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)


def _run_config(ctx: Context, micro_batch: int, *flags: str) -> RunConfig:
    """The training command's config of --config (gpu_mfu's tiny model on the CPU smoke run) on
    one process, `micro_batch` sequences per step, then `flags`."""
    mb = str(micro_batch)
    quick = gpu_mfu.QUICK if ctx.smoke else []
    return parse_run_args(
        ["--config", ctx.config, *quick, "--micro-batch-size", mb, "--global-batch-size", mb, *flags], 1
    )


def _model_config(cfg: RunConfig) -> GPTConfig:
    """The run's model with its vocabulary raised to the tokenizer's, as the Trainer does."""
    return cfg.model.with_vocab_of(data.load_tokenizer(cfg.data.tokenizer).vocab_size)


def _describe(cfg: RunConfig) -> str:
    mc = _model_config(cfg)
    return f"{mc.n_layers} layers, d_model {mc.d_model}, {num_params(mc) / 1e6:,.1f}M parameters, {cfg.train.precision}"


def _build_model(cfg: RunConfig, device: torch.device) -> GPT:
    with torch.device(device):
        return GPT(_model_config(cfg))


def _build_ours(cfg: RunConfig, device: torch.device) -> tuple[GPT, ZeroOptimizer]:
    """The GPT and the Trainer's ZeroOptimizer, for one process (one chunk)."""
    model = _build_model(cfg, device)
    return model, build_optimizer(cfg, model)


def _tokens(cfg: RunConfig, batch: int, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (ids, labels) [batch, seq] (what the numbers are does not change time or memory)."""
    x = torch.randint(
        0,
        _model_config(cfg).vocab_size,
        (batch, seq + 1),
        device=device,
        generator=torch.Generator(device).manual_seed(0),
    )
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
    """Device, memory, torch / CUDA / triton / NCCL versions, and the machine's own ceilings
    measured here: the copy bandwidth (a 2 GiB device-to-device copy, bytes read + written /
    median time) and the bf16 matmul rate (8192³: 2n³ / median time), next to the datasheet's.
    On the CPU: a 64 MiB copy, fp32 512³."""
    device = ctx.device
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cpu_cores": os.cpu_count(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        nccl = torch.cuda.nccl.version()
        info.update(
            device=props.name,
            memory_gib=props.total_memory / GiB,
            sms=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            hip=torch.version.hip,  # a ROCm build: its collectives are RCCL's, answering to "nccl"
            nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        )
        copy_bytes, n, dtype = 2 * GiB, 8192, torch.bfloat16
    else:
        info.update(device=_cpu_name(), memory_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB)
        copy_bytes, n, dtype = 64 * MiB, 512, torch.float32
    src = torch.ones(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(functools.partial(dst.copy_, src), device, 20)
    del src, dst
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    matmul_s = timed(lambda: a @ b, device, 20)
    peak = metrics.peak_flops(device, dtype)
    return {
        "status": "ok",
        **info,
        "copy_bytes": copy_bytes,
        "copy_gbs": 2 * copy_bytes / copy_s / 1e9,
        "datasheet_gbs": fused_step_bandwidth.hbm_peak(device),
        "matmul_n": n,
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "matmul_tflops": 2 * n**3 / matmul_s / 1e12,
        "datasheet_tflops": peak / 1e12 if peak else None,
    }


PYTEST = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"]
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b")


def _pytest_counts(output: str) -> dict[str, Any]:
    """The counts of pytest's last summary line ("3 passed, 2 skipped in 4.1s")."""
    lines = [line for line in output.splitlines() if _COUNT.search(line) and re.search(r" in [\d.]+s", line)]
    summary = lines[-1].strip(" =") if lines else ""
    counts = dict.fromkeys(("passed", "failed", "skipped", "deselected", "errors", "xfailed", "xpassed"), 0)
    for number, kind in _COUNT.findall(summary):
        counts["errors" if kind.startswith("error") else kind] = int(number)
    return {**counts, "summary": summary}


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def cuda_tests(ctx: Context) -> dict[str, Any]:
    """`python -m pytest -m cuda -q` in a subprocess stopped 10 s before the part's limit:
    pass / fail / skip counts and the output's tail (skipped on a CPU; the CPU smoke run runs
    tests/test_cuda.py alone, where every test skips, to check the part, not the tests)."""
    timeout = max(1.0, ctx.limit_s - 10)
    command = [*PYTEST, "tests/test_cuda.py"] if ctx.smoke else PYTEST
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = _text(e.stdout) + _text(e.stderr), None
    print(output)
    counts = _pytest_counts(output)
    result = {
        "command": " ".join(["python", *command[1:]]),
        "returncode": rc,
        **counts,
        "tail": output.strip().splitlines()[-40:],
    }
    if rc is None:
        return {**result, "status": "failed", "reason": f"pytest did not finish within {timeout:.0f} s"}
    if rc not in (0, 5) or counts["failed"] or counts["errors"]:  # 5: no test selected
        return {**result, "status": "failed", "reason": f"exit code {rc}: {counts['summary']}"}
    if not counts["passed"]:
        return {**result, "status": "skipped", "reason": f"no CUDA test ran: {counts['summary'] or 'no summary'}"}
    return {**result, "status": "ok"}


def fused_step(ctx: Context) -> dict[str, Any]:
    """`fused_step_bandwidth.measure` on a 1B-element shard (2e5 on the CPU): our fused Adam
    step backends and AdamW(fused=True), effective GB/s as a fraction of the copy bandwidth
    `environment` measured. Goal: >= 85 % for the backend ZeroOptimizer picks."""
    device = ctx.device
    n = 2 * 10**5 if ctx.smoke else 10**9
    rows = fused_step_bandwidth.measure(n, torch.bfloat16, device, 5 if ctx.smoke else 20)
    copy = _measured(ctx, "copy_gbs")
    for r in rows:
        r["of_copy"] = r["gbs"] / copy if copy else None
    picked = fused.pick_backend(device)
    of_copy = next(r["of_copy"] for r in rows if r["backend"] == picked)
    return {
        "status": "ok",
        "numel": n,
        "copy_gbs": copy,
        "picked_backend": picked,
        "rows": rows,
        "goal": goal(of_copy, ">=", 0.85),
    }


QUANT_BLOCK = 2048  # ZeRO++'s block, the one the planner costs


def quantize(ctx: Context) -> dict[str, Any]:
    """ZeRO++'s block quantizer (`optim.quantize`, blocks of 2048) on 2^28 bf16 elements (2^16
    on the CPU), by each backend that runs on the device (the one-pass Triton kernels that
    ZeroOptimizer picks on GPUs, and the torch reference): median times of quantize and
    dequantize at int8 and int4, as GB/s of the bytes each must move (bf16 in and q-bit values
    + fp32 scales out, or the reverse) and as a fraction of the copy bandwidth `environment`
    measured: the planner costs them as passes at that bandwidth. Goal: >= 50 % for the
    slowest of the backend picked by default."""
    device = ctx.device
    n = 2**16 if ctx.smoke else 2**28
    x = torch.randn(n, device=device).to(torch.bfloat16)
    copy = _measured(ctx, "copy_gbs")
    picked = quant.pick_backend(device)
    backends = [b for b in quant.BACKENDS if b == "torch" or triton_runs_on(device)]
    rows = []
    for backend in backends:
        for bits in quant.BITS:
            q = quant.quantize(x, QUANT_BLOCK, bits, backend)
            moved = 2 * n + q.nbytes  # the bf16 tensor and its quantized form
            for op, fn in (
                ("quantize", lambda b=bits, k=backend: quant.quantize(x, QUANT_BLOCK, b, k)),
                ("dequantize", lambda q=q, k=backend: quant.dequantize(q, k)),
            ):
                seconds = timed(fn, device, 5 if ctx.smoke else 20)
                gbs = moved / seconds / 1e9
                rows.append(
                    {
                        "backend": backend,
                        "bits": bits,
                        "op": op,
                        "seconds": seconds,
                        "gbs": gbs,
                        "of_copy": gbs / copy if copy else None,
                    }
                )
    picked_rows = [r["of_copy"] for r in rows if r["backend"] == picked]
    worst = min(picked_rows, default=None) if copy else None
    return {
        "status": "ok",
        "numel": n,
        "block": QUANT_BLOCK,
        "copy_gbs": copy,
        "picked": picked,
        "rows": rows,
        "goal": goal(worst, ">=", 0.5),
    }


def mfu(ctx: Context) -> dict[str, Any]:
    """`gpu_mfu.main`: the ~1.3B GPT of --config in bf16 through the training command, eager
    and compiled (and compiled with float8 linear layers), next to the plain PyTorch loop eager
    and under torch.compile (`--quick`'s tiny fp32 model on the CPU): tokens/s, TFLOP/s, MFU
    against the datasheet peak and the fraction of the matmul rate `environment` measured.
    Goals: eager MFU >= 50 %, compiled MFU >= 60 %, step time ours / plain <= 1.03 eager and
    <= 1.0 compiled, float8 / bf16 tokens/s >= 1.0."""
    steps = ["--quick", "--steps", "2", "--warmup", "1"] if ctx.smoke else ["--steps", "10", "--warmup", "3"]
    argv = ["--config", ctx.config, *steps, *(["--data-cache", ctx.data_cache] if ctx.data_cache else [])]
    r = gpu_mfu.main(argv)
    matmul = _measured(ctx, "matmul_tflops")
    rows = [{**row, "of_matmul": row["tflops_per_device"] / matmul if matmul else None} for row in r["rows"]]
    mfu_of = {row["loop"]: row["mfu"] for row in rows}
    return {
        "status": "ok",
        "argv": argv,
        "rows": rows,
        "fp8_speedup": r.get("fp8_speedup"),
        "matmul_tflops": matmul,
        "goals": {
            "mfu": goal(mfu_of["ours"], ">=", 0.5),
            "mfu_compiled": goal(mfu_of.get("ours_compiled"), ">=", 0.6),
            "ours_vs_plain": goal(r["ratio_step_time"], "<=", 1.03),
            "compiled_vs_plain_compiled": goal(r.get("ratio_compiled"), "<=", 1.0),
            "fp8_over_bf16": goal(r.get("fp8_speedup"), ">=", 1.0),
        },
    }


RECOMPUTE = ("none", "selective", "full")


def _forward_backward_bytes(
    model: GPT, opt: ZeroOptimizer, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device
) -> tuple[int | None, int]:
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
    """The planner (`research.costmodel.predict_memory`) against the model built as the
    Trainer builds it (GPT + ZeroOptimizer at the config's stage, bf16 compute copies, fp32
    masters; the GPT of --config, micro-batch of one sequence of 1024 and of 2048 tokens),
    recompute none / selective / full. Model states: CUDA bytes allocated after the first step
    (which creates Adam's m and v) and the tensors of `memory_breakdown()`. Activations: the
    CUDA peak allocated during one forward + backward minus what was allocated before it, and
    the peak bytes saved for backward (`metrics.ActivationMeter`). Each next to the prediction,
    as measured / predicted. On the CPU the CUDA columns stay empty."""
    device = ctx.device
    seq_lens = (32, 64) if ctx.smoke else (1024, 2048)
    _single_process_group()
    rows = []
    for recompute in RECOMPUTE:
        cfg = _run_config(ctx, 1, "--recompute", recompute)
        baseline = _allocated(device)
        model, opt = _build_ours(cfg, device)
        opt.backward(model(*_tokens(cfg, 1, seq_lens[0], device)))  # the first step creates Adam's m and v
        opt.step()
        opt.zero_grad()
        states_cuda = None if baseline is None else _allocated(device) - baseline
        states_tensors = sum(opt.memory_breakdown().values())
        for seq in seq_lens:
            cfg_s = _run_config(ctx, 1, "--recompute", recompute, "--seq-len", str(seq))
            predicted = predict_memory(_model_config(cfg_s), Layout.from_run_config(cfg_s), seq)
            acts_cuda, acts_saved = _forward_backward_bytes(model, opt, _tokens(cfg, 1, seq, device), device)
            rows.append(
                {
                    "seq_len": seq,
                    "recompute": recompute,
                    "states_cuda": states_cuda,
                    "states_tensors": states_tensors,
                    "states_predicted": predicted.model_states.total,
                    "activations_cuda": acts_cuda,
                    "activations_saved": acts_saved,
                    "activations_predicted": predicted.activations,
                    "peak_cuda": None if acts_cuda is None else states_cuda + acts_cuda,
                    "peak_predicted": predicted.total - RESERVED_BYTES,
                }
            )
        del model, opt
        _free(device)
    return {"status": "ok", "model": f"{_describe(cfg)}, ZeRO stage {cfg.parallel.zero}, micro-batch 1", "rows": rows}


def _step_fns(
    method: str, cfg: RunConfig, device: torch.device, compiled: bool = False
) -> tuple[Callable[..., None], Callable[[], None]]:
    """(forward_backward(ids, labels), optimizer_step()) of "plain" or "zero<stage>";
    `compiled`: the plain model under torch.compile(model), ours with its blocks compiled as
    the training command's --compile does."""
    tr = cfg.train
    clip = tr.clip_grad or math.inf
    if method == "plain":
        model = _build_model(cfg, device)
        opt = torch.optim.AdamW(
            weight_decay_groups(model, tr.weight_decay), lr=tr.lr, betas=(tr.beta1, tr.beta2), eps=tr.eps, fused=True
        )
        dtype = DTYPES[tr.precision]
        run = torch.compile(model) if compiled else model

        def forward_backward(ids: torch.Tensor, labels: torch.Tensor) -> None:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = run(ids, labels)
            loss.backward()

        def step() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return forward_backward, step

    model, zero = _build_ours(cfg, device)
    if compiled:
        compile_blocks([model], fullgraph=one_graph_per_block(cfg))

    def forward_backward(ids: torch.Tensor, labels: torch.Tensor) -> None:
        zero.backward(model(ids, labels))

    def step() -> None:
        zero.clip_grad_norm_(clip)
        zero.step()
        zero.zero_grad()

    return forward_backward, step


def zero_stages(ctx: Context) -> dict[str, Any]:
    """ZeroOptimizer stages 0-3 at world size 1 against the plain loop (fp32 parameters under
    autocast + AdamW(fused=True)) on the same GPT, one micro-batch of 4 sequences per step:
    median forward + backward and optimizer (clip, step, zero_grad) times, the cost of the
    machinery without communication; eager, then compiled (ours: each block, as --compile;
    plain: torch.compile(model)) against the plain compiled loop. Goal: every stage compiled
    <= 1.05 x the plain compiled loop."""
    device = ctx.device
    warmup, steps = (1, 2) if ctx.smoke else (2, 5)
    _single_process_group()
    rows = []
    for method in [m + kind for kind in ("", "_compiled") for m in ("plain", "zero0", "zero1", "zero2", "zero3")]:
        base = method.removesuffix("_compiled")
        cfg = _run_config(ctx, 4, *([] if base == "plain" else ["--zero", base[4:]]))
        forward_backward, step = _step_fns(base, cfg, device, compiled=base != method)
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
        rows.append(
            {
                "method": method,
                "fwd_bwd_ms": 1e3 * median(fb_s),
                "step_ms": 1e3 * median(step_s),
                "total_ms": 1e3 * median([a + b for a, b in zip(fb_s, step_s)]),
            }
        )
        del forward_backward, step
        _free(device)
    plain = {r["method"]: r for r in rows if r["method"].startswith("plain")}
    for r in rows:
        peer = plain["plain_compiled" if r["method"].endswith("_compiled") else "plain"]
        r["total_vs_plain"] = r["total_ms"] / peer["total_ms"]
        r["step_vs_plain"] = r["step_ms"] / peer["step_ms"]
    compiled = [
        r["total_vs_plain"] for r in rows if r["method"].startswith("zero") and r["method"].endswith("_compiled")
    ]
    return {
        "status": "ok",
        "model": f"{_describe(cfg)}, 4 x {cfg.data.seq_len} tokens per step",
        "warmup": warmup,
        "steps": steps,
        "rows": rows,
        "goal": goal(max(compiled), "<=", 1.05),
    }


def compile_kernels(ctx: Context) -> dict[str, Any]:
    """`gpu_compile`: every Triton kernel specialization compiled ahead of time for sm_80,
    sm_90, sm_100, gfx90a and gfx942 (GPUs the suite does not run on; only sm_90 and gfx942 on
    the CPU smoke run), one process per core (at most 8): registers, spills, shared memory and
    vector widths. Needs no GPU. Failed if a specialization does not compile."""
    targets = ("sm_90", "gfx942") if ctx.smoke else tuple(gpu_compile.TARGETS)
    jobs = min(os.cpu_count() or 1, 8)
    start = time.perf_counter()
    rows = gpu_compile.compile_table(gpu_compile.kernel_names(), targets, jobs)
    failed = [r for r in rows if not r.ok]
    cuda = {name for name, target in gpu_compile.TARGETS.items() if target[0] == "cuda"}
    result = {
        "status": "failed" if failed else "ok",
        "targets": targets,
        "seconds_compiling": time.perf_counter() - start,
        "jobs": jobs,
        "spilled": sum(bool(r.spills) for r in rows),
        "narrow_on_cuda": sum(  # n a multiple of 16, yet a block-wide access under 128 bits
            r.target in cuda and r.signature.endswith(gpu_compile.ALIGNED[True]) and (r.vector_width_bits or 0) < 128
            for r in rows
        ),
        "summary": gpu_compile.summary(rows),
        "rows": [r.as_json() for r in rows],
        "errors": {f"{r.kernel} {r.signature} {r.target}": r.error for r in failed},
    }
    if failed:
        result["reason"] = f"{len(failed)} of {len(rows)} did not compile; first: {failed[0].error}"
    return result


CONTEXT_GOAL = 1.15


def _ring_against_fused(
    device: torch.device, shape: tuple[int, ...], dtype: torch.dtype, cp: int, repeats: int
) -> tuple[float, list[float]]:
    """(seconds of one causal SDPA forward + backward on q, k, v of `shape`, each ring
    member's seconds for its share of the same work)."""
    gen = torch.Generator(device).manual_seed(0)
    q, k, v, dout = (torch.randn(shape, device=device, generator=gen, dtype=dtype) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    whole = timed(
        lambda: torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout),
        device,
        repeats,
    )
    members = []
    for g in range(cp):
        held = context_parallel.zigzag_inputs(q, k, v, dout, cp, g)
        members.append(timed(lambda g=g, held=held: context_parallel.zigzag_member(held, g), device, repeats))
    return whole, members


def context(ctx: Context) -> dict[str, Any]:
    """Context parallelism's ring on one GPU: every member's work at cp 8 (its two zigzag query
    chunks against each key chunk in turn, merged by log-sum-exp, forward + backward, on the
    fused kernels; `context_parallel.zigzag_member`, no communication) against one fused causal
    SDPA call over the whole sequence, for the 1.31B GPT's heads (16 × 128) in bf16 at 32K and
    128K tokens (1K and 2K, 2 heads of 16, fp32 on the CPU). Per length: the members' mean time
    over the fused call's / 8 (goal ≤ 1.15 at each length) and the slowest member over the mean."""
    device, cp = ctx.device, 8
    heads, head_dim, dtype = (2, 16, torch.float32) if ctx.smoke else (16, 128, torch.bfloat16)
    repeats = 2 if ctx.smoke else 5
    rows = []
    for seq in (1024, 2048) if ctx.smoke else (32 * 1024, 128 * 1024):
        whole, members = _ring_against_fused(device, (1, heads, seq, head_dim), dtype, cp, repeats)
        mean = sum(members) / cp
        rows.append(
            {
                "seq": seq,
                "fused_s": whole,
                "member_mean_s": mean,
                "slowest_over_mean": max(members) / mean,
                "ratio": mean / (whole / cp),
            }
        )
        _free(device)
    worst = max(r["ratio"] for r in rows)
    return {
        "status": "ok",
        "cp": cp,
        "heads": heads,
        "head_dim": head_dim,
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
        "goal": goal(worst, "<=", CONTEXT_GOAL),
    }


FP8_BLOCK_GOAL = 1.2


def fp8_block(ctx: Context) -> dict[str, Any]:
    """Float8 where it pays: one 8B-shaped block (d_model 4096, 32 heads, SwiGLU d_ff 14336,
    8192 tokens; d 64, 4 heads, 128 tokens on the CPU) in bf16, compiled as --compile does,
    with its attention and MLP linears in bf16 and in tensorwise float8 (all four pay at this
    shape; the CPU's tiny one casts them by --fp8-filter none): forward + backward time and
    tokens/s. Goal: float8 / bf16 tokens/s >= 1.2."""
    device = ctx.device
    shape = (
        {"d_model": 64, "n_heads": 4, "d_ff": 128, "seq": 128}
        if ctx.smoke
        else {"d_model": 4096, "n_heads": 32, "d_ff": 14336, "seq": 8192}
    )
    seq = shape.pop("seq")
    rows = []
    for recipe in ("none", "tensorwise"):
        config = GPTConfig(
            n_layers=1, max_seq_len=seq, activation="swiglu", bias=False, fp8=recipe,
            fp8_filter="none" if ctx.smoke else "auto", **shape,
        )  # fmt: skip
        block = Block(config, None, False).to(device, torch.bfloat16)
        block.compile_computation()
        x = torch.randn(seq, 1, config.d_model, device=device, dtype=torch.bfloat16, requires_grad=True)

        def step(block: Block = block, x: torch.Tensor = x) -> None:
            y, _ = block(x)
            y.backward(torch.ones_like(y))

        seconds = timed(step, device, 3 if ctx.smoke else 10)
        rows.append(
            {
                "linears": "bf16" if recipe == "none" else "float8 " + ",".join(sorted(config.float8_linears(1))),
                "seconds": seconds,
                "tokens_per_s": seq / seconds,
            }
        )
        del block, x
        _free(device)
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    return {
        "status": "ok",
        "shape": {**shape, "seq": seq},
        "rows": rows,
        "ratio": ratio,
        "goal": goal(ratio, ">=", FP8_BLOCK_GOAL),
    }
