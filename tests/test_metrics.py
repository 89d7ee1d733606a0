"""research/metrics.py: peak FLOP/s table, throughput math, memory, the activation meter,
console lines, metrics.jsonl, comm per step, wandb offline runs."""

from __future__ import annotations

import io
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint

from parallel import accounting, comm
from research.metrics import (
    ActivationMeter,
    Console,
    MetricsFile,
    WandbRun,
    all_ranks,
    comm_per_step,
    over_ranks,
    peak_flops,
    peak_memory_bytes,
    reset_peak_memory,
    run_id_for,
    summarize,
    throughput,
    write_json,
)
from tests.dist_utils import run_distributed

CPU = torch.device("cpu")
CUDA = torch.device("cuda")

# ---------------------------------------------------------------------------
# Peak FLOP/s and throughput
# ---------------------------------------------------------------------------


def test_peak_flops_cpu_unknown_and_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZERO3D_PEAK_TFLOPS", raising=False)
    assert peak_flops(CPU, torch.bfloat16) is None
    monkeypatch.setenv("ZERO3D_PEAK_TFLOPS", "1.5")
    assert peak_flops(CPU, torch.float32) == 1.5e12
    monkeypatch.setenv("ZERO3D_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="ZERO3D_PEAK_TFLOPS='fast' is not a number"):
        peak_flops(CPU, torch.float32)


@pytest.fixture
def matmul_precision() -> Iterator[None]:
    """Restore torch's matmul precision after the test. Not monkeypatch: the setting is a
    property of a module object, and pytest >= 9.2 undoes a setattr there with delattr."""
    before = torch.backends.cuda.matmul.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision = before


@pytest.mark.parametrize(
    "name, dtype, tf32, tflops",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989.4),
        ("NVIDIA H100 PCIe", torch.float16, False, 756.0),
        ("NVIDIA H100 NVL", torch.bfloat16, False, 835.5),
        ("NVIDIA H200", torch.bfloat16, False, 989.4),
        ("NVIDIA GH200 480GB", torch.bfloat16, False, 989.4),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, 312.0),
        ("NVIDIA A100 80GB PCIe", torch.float32, True, 156.0),
        ("NVIDIA A100-SXM4-40GB", torch.float32, False, 19.5),
        ("NVIDIA A10G", torch.bfloat16, False, 70.0),
        ("NVIDIA A10", torch.bfloat16, False, 125.0),
        ("NVIDIA L4", torch.bfloat16, False, 121.0),
        ("NVIDIA L40", torch.bfloat16, False, 181.05),
        ("NVIDIA L40S", torch.bfloat16, False, 362.05),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, False, 165.2),
        ("Tesla V100-SXM2-16GB", torch.float16, False, 125.0),
        ("Tesla V100-SXM2-16GB", torch.float32, True, 15.7),  # no TF32 on Volta
        ("Tesla V100-PCIE-32GB", torch.float16, False, 112.0),
        ("Tesla V100-SXM2-16GB", torch.bfloat16, False, None),  # no bf16 tensor cores
        ("Tesla T4", torch.float16, False, 65.0),
        ("NVIDIA RTX A1000", torch.bfloat16, False, None),  # not an "A10"
        ("NVIDIA H100 80GB HBM3", torch.float64, False, None),
        ("Some Future GPU", torch.bfloat16, False, None),
    ],
)
def test_peak_flops_table(
    monkeypatch: pytest.MonkeyPatch,
    matmul_precision: None,
    name: str,
    dtype: torch.dtype,
    tf32: bool,
    tflops: float | None,
) -> None:
    monkeypatch.delenv("ZERO3D_PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"
    peak = peak_flops(CUDA, dtype)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_throughput_math() -> None:
    # 8192 tokens in 0.5 s, 6e9 FLOPs per token, 4 devices of 100 TFLOP/s peak
    t = throughput(tokens=8192, step_time_s=0.5, flops_per_token=6e9, world_size=4, peak=100e12)
    assert t["tokens_per_s"] == pytest.approx(16384)
    assert t["tflops_per_device"] == pytest.approx(6e9 * 16384 / 4 / 1e12)
    assert t["mfu"] == pytest.approx(t["tflops_per_device"] / 100)
    assert throughput(8192, 0.5, 6e9, 4, None)["mfu"] is None


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def test_cpu_peak_memory_is_rss_and_resets() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("peak RSS cannot be reset here")
    reset_peak_memory(CPU)
    before = peak_memory_bytes(CPU)
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    high = peak_memory_bytes(CPU)
    assert high >= before + 60 * 2**20
    del x  # a block this large goes back to the OS at once
    reset_peak_memory(CPU)
    assert peak_memory_bytes(CPU) < high - 32 * 2**20


def test_helpers_without_torch_distributed() -> None:
    assert not dist.is_initialized()
    assert over_ranks([7.0, 0.5], CPU) == [[7.0, 0.5]]
    assert all_ranks({"a": 1}) == [{"a": 1}]


def _on_two_ranks(out_dir: str) -> dict:
    rank = dist.get_rank()
    with accounting.tracking() as log:
        comm.all_reduce(torch.ones(4))  # 16 B payload, 16 B on the wire at N = 2
        mem = over_ranks([100 + rank, rank / 2], CPU)
        per_rank = all_ranks({"rank": rank})
    wandb_enabled = WandbRun("offline", out_dir=out_dir).enabled if rank == 1 else None
    return {"mem": mem, "per_rank": per_rank, "log": log.as_dict(), "wandb": wandb_enabled}


def test_over_ranks_is_not_counted_as_training_comm(tmp_path: Path) -> None:
    out = run_distributed(_on_two_ranks, 2, str(tmp_path))
    for o in out:
        assert o["mem"] == [[100.0, 0.0], [101.0, 0.5]]
        assert o["per_rank"] == [{"rank": 0}, {"rank": 1}]
        assert o["log"] == {"world": {"all_reduce": {"calls": 1, "bytes": 16, "payload_bytes": 16}}}
    assert out[1]["wandb"] is False  # rank 1 logs nothing
    assert not (tmp_path / "wandb").exists()


# ---------------------------------------------------------------------------
# ActivationMeter
# ---------------------------------------------------------------------------


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 80), nn.GELU(), nn.Linear(80, 8))


def _nbytes(*shapes: tuple[int, ...]) -> int:
    return sum(4 * math.prod(s) for s in shapes)


# Saved for backward by mlp(x).pow(2).sum() with x of shape (b, 24): x (first matmul), the
# GELU input, the GELU output (second matmul), the output (pow); weights are parameters.
def _analytic(b: int) -> int:
    return _nbytes((b, 24), (b, 80), (b, 80), (b, 8))


def test_activation_meter_mlp_peak_equals_saved_bytes_and_returns_to_zero() -> None:
    mlp = _mlp()
    x = torch.randn(32, 24)
    with ActivationMeter([mlp]) as meter:
        loss = mlp(x).pow(2).sum()
    assert meter.peak_bytes == meter.current_bytes == _analytic(32)
    loss.backward()
    assert meter.current_bytes == 0
    assert meter.peak_bytes == _analytic(32)

    with ActivationMeter() as unfiltered:  # no modules: the second weight counts too (the first
        mlp(x).pow(2).sum().backward()  # is not saved: x needs no gradient)
    assert unfiltered.peak_bytes == _analytic(32) + _nbytes((8, 80))
    assert unfiltered.current_bytes == 0


def test_activation_meter_checks_parameters_storage_at_pack_time() -> None:
    mlp = _mlp()
    meter = ActivationMeter([mlp])
    for p in mlp.parameters():  # a ZeRO-3 gather re-points parameters after the meter exists
        p.data = p.data.clone()
    with meter:
        loss = mlp(torch.randn(16, 24)).pow(2).sum()
    assert meter.peak_bytes == _analytic(16)
    loss.backward()
    assert meter.current_bytes == 0


def test_activation_meter_counts_each_storage_once() -> None:
    x = torch.randn(100, requires_grad=True)
    with ActivationMeter() as meter:
        y = (x * x).sum()  # mul saves x twice
        z = (x[:10] * 3).sum() + (x[:10] ** 2).sum()  # pow saves a view of x: same storage
    assert meter.peak_bytes == 400
    y.backward()
    assert meter.current_bytes == 400  # still saved by z's graph
    z.backward()
    assert meter.current_bytes == 0


def test_activation_meter_pipeline_two_graphs_in_flight() -> None:
    mlp = _mlp()
    xs = [torch.randn(32, 24), torch.randn(32, 24)]
    with ActivationMeter([mlp]) as meter:
        losses = [mlp(x).pow(2).sum() for x in xs]  # two micro-batches' forwards, like 1F1B warm-up
        assert meter.peak_bytes == 2 * _analytic(32)
        losses[0].backward()
        assert meter.current_bytes == _analytic(32)
        loss = mlp(xs[0]).pow(2).sum()  # steady state: one forward after one backward
        assert meter.peak_bytes == 2 * _analytic(32)
    loss.backward()
    losses[1].backward()
    assert meter.current_bytes == 0
    del losses, loss  # a freed graph releases its saves too
    with ActivationMeter([mlp]) as meter:
        loss = mlp(xs[0]).pow(2).sum()
    del loss
    assert meter.current_bytes == 0 and meter.peak_bytes == _analytic(32)


def test_activation_meter_releases_a_graph_kept_by_retain_graph() -> None:
    """A saved output (softmax, exp) held by the meter must not keep its own graph alive:
    zero-bubble B runs backward with retain_graph=True and then drops the graph."""
    from research.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, n_layers=2, n_heads=2, d_model=32, max_seq_len=16)
    chunk = GPT(cfg, layers=range(1, 2), pre=False, post=True)
    with ActivationMeter([chunk]) as meter:
        for _ in range(3):
            x = torch.randn(16, 1, 32, requires_grad=True)
            out = chunk(x, torch.randint(0, 64, (1, 16)))
            torch.autograd.grad(out, x, retain_graph=True)
            del out, x
        assert meter.current_bytes == 0


def test_activation_meter_under_checkpointing_sees_what_the_checkpoint_keeps() -> None:
    mlp = _mlp()
    x = torch.randn(32, 24)
    with ActivationMeter([mlp]) as meter:
        loss = torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False).pow(2).sum()
    assert meter.peak_bytes == _nbytes((32, 24), (32, 8))  # the region's input, pow's input
    loss.backward()  # recomputes the region's activations, unseen
    assert meter.current_bytes == 0 and meter.peak_bytes == _nbytes((32, 24), (32, 8))


# ---------------------------------------------------------------------------
# Console, files, summaries
# ---------------------------------------------------------------------------

_STEP = {
    "loss": 3.21449,
    "tokens_per_s": 12345.6,
    "tflops_per_device": 0.8,
    "mfu": 0.4123,
    "mem_peak_bytes": int(1.3 * 2**30),
}


def test_console_plain_lines_every_log_every_and_last() -> None:
    stream = io.StringIO()
    console = Console(total_steps=5, start_step=0, log_every=2, stream=stream)
    for step in range(1, 6):
        console.update(step, {**_STEP, "mfu": None} if step == 5 else _STEP)
    summary = summarize([_STEP, {**_STEP, "loss": 3.0, "tokens_per_s": 2e4}])
    console.close({**summary, "wall_time_s": 70.4})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4
    assert re.fullmatch(
        r"step 2/5 \| loss 3\.214 \| 1\.2e4 tok/s \| 0\.800 TFLOP/s/dev \| MFU 41\.2% \| "
        r"mem 1\.3 GiB \| ETA \d+:\d\d:\d\d",
        lines[0],
    ), lines[0]
    assert lines[1].startswith("step 4/5 ")
    assert lines[2].startswith("step 5/5 | loss 3.214 | 1.2e4 tok/s | 0.800 TFLOP/s/dev | mem 1.3 GiB | ETA ")
    assert lines[3] == (
        "done 2 steps | final loss 3.000 | mean of the last 10 3.107 | median 1.6e4 tok/s | "
        "median 0.800 TFLOP/s/dev | median MFU 41.2% | peak mem 1.3 GiB | wall 0:01:10"
    )


def test_console_shows_its_bar_on_a_pseudo_terminal_nobody_sized() -> None:
    """A pseudo-terminal of 0 × 0 (`script`, an IDE's runner) still gets the bar: tqdm alone
    prints nothing there."""
    import pty

    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as stream:
        assert os.get_terminal_size(follower) == (0, 0)
        console = Console(total_steps=3, stream=stream)
        for step in (1, 2, 3):
            console.update(step, _STEP)
        console.close(summarize([_STEP]))
    text = os.read(leader, 1 << 16).decode()
    os.close(leader)
    assert "3/3" in text and "loss 3.214" in text, text


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_tqdm_on_a_terminal_and_disabled_elsewhere() -> None:
    stream = _Terminal()
    console = Console(total_steps=3, start_step=1, stream=stream)
    for step in (2, 3):
        console.update(step, _STEP)
    console.close(summarize([_STEP, _STEP]))
    text = stream.getvalue()
    assert "3/3" in text and "loss 3.214 | 1.2e4 tok/s" in text
    assert text.rstrip().splitlines()[-1].startswith("done 2 steps | final loss 3.214")

    quiet = io.StringIO()
    off = Console(total_steps=3, enabled=False, stream=quiet)
    off.update(3, _STEP)
    off.close(summarize([_STEP]))
    assert quiet.getvalue() == ""


def _strict(text: str) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_metrics_file_appends_strict_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "out" / "metrics.jsonl"
    with MetricsFile(path) as f:
        f.write({"step": 1, "loss": torch.tensor(2.5), "grad_norm": float("inf"), "mfu": None})
        assert len(path.read_text().splitlines()) == 1  # flushed per write
    with MetricsFile(path) as f:  # a resumed run appends
        f.write({"step": 2, "loss": float("nan"), "lr": 1e-3, "dtype": torch.bfloat16})
    rows = [_strict(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"step": 1, "loss": 2.5, "grad_norm": None, "mfu": None},
        {"step": 2, "loss": None, "lr": 1e-3, "dtype": "torch.bfloat16"},
    ]

    write_json(
        tmp_path / "summary.json", {"config": {"out": tmp_path, "betas": (0.9, 0.95)}, "final_loss": float("-inf")}
    )
    assert _strict((tmp_path / "summary.json").read_text()) == {
        "config": {"out": str(tmp_path), "betas": [0.9, 0.95]},
        "final_loss": None,
    }


def test_summarize_medians_final_loss_and_peak() -> None:
    records = [
        {
            "loss": 4.0,
            "tokens_per_s": 10.0,
            "tflops_per_device": 1.0,
            "mfu": None,
            "step_time_s": 9.0,
            "mem_peak_bytes": 5,
        },
        {
            "loss": 3.0,
            "tokens_per_s": 30.0,
            "tflops_per_device": 3.0,
            "mfu": None,
            "step_time_s": 1.0,
            "mem_peak_bytes": 7,
        },
        {
            "loss": 2.0,
            "tokens_per_s": 40.0,
            "tflops_per_device": 4.0,
            "mfu": None,
            "step_time_s": 1.0,
            "mem_peak_bytes": 6,
        },
    ]
    assert summarize(records) == {
        "steps": 3,
        "final_loss": 2.0,
        "final_loss_mean": 3.0,
        "final_loss_mean_steps": 3,
        "median_step_time_s": 1.0,
        "median_tokens_per_s": 30.0,
        "tokens_per_s_spread": None,  # under 4 steps
        "median_tflops_per_device": 3.0,
        "median_mfu": None,
        "mem_peak_bytes": 7,
    }


def test_comm_per_step_averages_per_group_and_op() -> None:
    log = {
        "dp": {
            "reduce_scatter_tensor": {"calls": 8, "bytes": 800, "payload_bytes": 1600},
            "all_gather_into_tensor": {"calls": 4, "bytes": 400, "payload_bytes": 800},
        },
        "tp": {"all_reduce": {"calls": 16, "bytes": 3200, "payload_bytes": 3200}},
    }
    out = comm_per_step(log, steps=4, groups=("tp", "pp", "dp"))
    assert list(out) == ["dp", "tp", "pp"]
    assert out["dp"]["ops"]["reduce_scatter_tensor"] == {"calls": 2, "bytes": 200, "payload_bytes": 400}
    assert out["dp"]["total"] == {"calls": 3, "bytes": 300, "payload_bytes": 600}
    assert out["tp"]["total"] == {"calls": 4, "bytes": 800, "payload_bytes": 800}
    assert out["pp"] == {"ops": {}, "total": {"calls": 0, "bytes": 0, "payload_bytes": 0}}
    with pytest.raises(ValueError, match="steps=0 must be positive"):
        comm_per_step(log, steps=0)


# ---------------------------------------------------------------------------
# wandb
# ---------------------------------------------------------------------------


def test_wandb_disabled_and_non_zero_ranks_never_import_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` would raise
    run = WandbRun("disabled", out_dir=tmp_path)
    monkeypatch.setenv("RANK", "3")
    other = WandbRun("offline", out_dir=tmp_path)
    for r in (run, other):
        assert not r.enabled
        r.log({"loss": 1.0}, step=1)
        r.summary({"final_loss": 1.0})
        r.finish()
    assert not (tmp_path / "wandb").exists()
    with pytest.raises(ValueError, match="wandb mode 'dryrun' is not one of offline, online, disabled"):
        WandbRun("dryrun")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_wandb_offline_run_under_out_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("RANK", "WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    with WandbRun(
        "offline",
        project="zero3d-test",
        group="grp-ablation-7",
        name="run-tp2",
        out_dir=out,
        config={"model": {"n_layers": 2}, "dtype": torch.bfloat16},
    ) as run:
        assert run.enabled
        for step in (1, 2, 3):
            run.log({"loss": 1.0 + 0.123456789 * step, "tokens_per_s": 1e4, "mfu": None}, step=step)
        run.summary({"final_loss_marker": 4.321})
    assert not run.enabled
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list(out.rglob("*"))
    data = files[0].read_bytes()
    for needle in (
        b"grp-ablation-7",
        b"run-tp2",
        b"tokens_per_s",
        b"1.370370367",
        b"n_layers",
        b"torch.bfloat16",
        b"final_loss_marker",
    ):
        assert needle in data, needle


def test_a_resumed_job_continues_its_wandb_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The run id is kept in OUT/wandb_id: a resumed job logs into the same wandb run (offline:
    run folders of that one id, which `wandb sync` appends); a fresh job gets a new id."""
    for var in ("RANK", "WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    first = run_id_for(out, resuming=False)
    for steps, run_id in (((1, 2), first), ((3, 4), run_id_for(out, resuming=True))):  # the job, then resumed
        with WandbRun("offline", project="zero3d-test", out_dir=out, run_id=run_id) as run:
            for step in steps:
                run.log({"loss": float(step)}, step=step)
    folders = [p.name for p in (out / "wandb").glob("offline-run-*")]
    assert len(folders) == 2 and all(f"-{first}" in name for name in folders), folders
    assert run_id_for(out, resuming=False) != first  # a fresh start is a new run
