"""The training command end to end (`experiments.train.run`, the function behind
`python -m experiments.train`): loss-curve parity of parallel layouts with the
single-process run, exact resume, resume under another layout, export, outputs.

Each launch runs several trainings in one set of processes (a Trainer builds fresh
groups each time), so the 8-process start-up is paid once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from research.checkpoint import CheckpointError
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

STEPS = 8
HALF = STEPS // 2  # where runs save and others resume
MODEL = ["--n-layers", "4", "--n-heads", "4", "--d-model", "32", "--max-seq-len", "32", "--vocab-multiple", "128"]
TRAIN = [
    "--seq-len",
    "32",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--warmup-steps",
    "5",
    "--eps",
    "1e-6",
    "--seed",
    "0",
    "--wandb",
    "disabled",
    "--log-every",
    "1000",
]
# ZeRO-3 units small enough that each block is one and its parameters are freed between uses
# (under the default unit size this model would be one resident unit, and stage 3 untested)
UNITS = ("--unit-numel", "2000")
LAYOUTS = {
    "tp2": ["--tp", "2"],
    "pp2-1f1b": ["--pp", "2", "--schedule", "1f1b", "--micro-batches", "4"],
    "pp2-interleaved-v2": [
        "--pp",
        "2",
        "--schedule",
        "interleaved-1f1b",
        "--virtual-stages",
        "2",
        "--micro-batches",
        "4",
    ],
    "tp2-pp2-dp2-zero1": ["--tp", "2", "--pp", "2", "--zero", "1", "--micro-batches", "2", "--overlap-param-gather"],
    "tp2-pp2-dp2-zero3": ["--tp", "2", "--pp", "2", "--zero", "3", "--micro-batches", "2", *UNITS],
    "dp4-zero3": ["--zero", "3", *UNITS],
    "dp4-hybrid2x2-zero3": ["--zero", "3", "--dp-shard", "2", *UNITS],
    "tp2-pp2-dp2-hybrid2x1-zero3": [
        *("--tp", "2", "--pp", "2", "--zero", "3", "--dp-shard", "1", "--micro-batches", "2", *UNITS)
    ],
}
DP4_ZERO1 = ["--zero", "1"]
# pp2 × dp2, m = 4: gradients reduced after the last backward or after every micro-batch
PP2_DP2 = {
    "zero2-interleaved": [
        "--schedule",
        "interleaved-1f1b",
        "--virtual-stages",
        "2",
        "--zero",
        "2",
        "--bucket-numel",
        "3000",
    ],
    "zero3-1f1b": ["--schedule", "1f1b", "--zero", "3", "--unit-numel", "3000"],
}
GRAD_SYNC = {
    f"pp2-dp2-{name}-{sync}": ["--pp", "2", "--micro-batches", "4", *argv, "--grad-sync", sync]
    for name, argv in PP2_DP2.items()
    for sync in ("last", "every")
}
GRAD_SYNC["pp2-dp2-zero2-zb-h1-every"] = [
    "--pp",
    "2",
    "--micro-batches",
    "4",
    "--schedule",
    "zb-h1",
    "--zero",
    "2",
    "--grad-sync",
    "every",
]
LOW_PRECISION = {
    "tp2-sp-selective-bf16": ["--tp", "2", "--sequence-parallel", "--recompute", "selective", "--precision", "bf16"],
    "pp2-zb-h1-full-fp16": [
        "--pp",
        "2",
        "--schedule",
        "zb-h1",
        "--micro-batches",
        "2",
        "--recompute",
        "full",
        "--precision",
        "fp16",
        "--zero",
        "2",
    ],
}
# ZeRO++ qwZ (int8 parameter all-gathers), hpZ (their secondary partition) and qgZ (int8
# gradient all-to-alls) composed with tp, SP and the pipeline schedules
ZEROPP = {
    "tp2-pp2-dp2-sp-interleaved-zero3-zeropp": [
        *("--tp", "2", "--pp", "2", "--zero", "3", "--sequence-parallel", *UNITS),
        *("--qwz-block", "64", "--hpz", "--qgz-bits", "8"),
        *("--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--micro-batches", "4"),
    ],
    # on 4 ranks: pp 2 × dp 2 with the zero-bubble, 1F1B and GPipe schedules
    "pp2-dp2-zb-h1-zero2-qwz-qgz": [
        *("--pp", "2", "--zero", "2", "--schedule", "zb-h1", "--micro-batches", "4"),
        *("--qwz-block", "64", "--qgz-bits", "8"),
    ],
    "pp2-dp2-1f1b-zero3-zeropp-every": [
        *("--pp", "2", "--zero", "3", "--schedule", "1f1b", "--micro-batches", "4", "--grad-sync", "every", *UNITS),
        *("--qwz-block", "64", "--hpz", "--qgz-bits", "8"),
    ],
    "pp2-dp2-gpipe-zero3-zeropp": [
        *("--pp", "2", "--zero", "3", "--schedule", "gpipe", "--micro-batches", "4", *UNITS),
        *("--qwz-block", "64", "--hpz", "--qgz-bits", "8"),
    ],
}
ZEROPP_ON_EIGHT = ["tp2-pp2-dp2-sp-interleaved-zero3-zeropp"]


def train(base: str, name: str, *extra: str) -> list[float]:
    """One run through the command's code path; its per-step losses from metrics.jsonl."""
    from experiments.train import run

    out = os.path.join(base, name)
    run([*MODEL, *TRAIN, "--data-cache", os.path.join(base, "cache"), "--out", out, *extra])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def launch_single(base: str) -> dict[str, list[float]]:
    return {
        "single": train(
            base,
            "single",
            "--steps",
            str(STEPS),
            "--save",
            os.path.join(base, "single", "ckpt"),
            "--export",
            os.path.join(base, "single.safetensors"),
        )
    }


def launch_two(base: str) -> dict[str, list[float]]:
    """tp2, pp2 (1F1B, interleaved); bf16 / fp16 variants; pp2 1F1B again as HALF steps +
    resume for the rest."""
    out = {
        name: train(base, name, "--steps", str(STEPS), *LAYOUTS[name])
        for name in ("tp2", "pp2-1f1b", "pp2-interleaved-v2")
    }
    out.update({name: train(base, name, "--steps", str(STEPS), *argv) for name, argv in LOW_PRECISION.items()})
    ckpt = os.path.join(base, "resume", "ckpt")
    first = train(
        base, "resume", "--steps", str(HALF), "--lr-decay-steps", str(STEPS), "--save", ckpt, *LAYOUTS["pp2-1f1b"]
    )
    out["resume-exact"] = (
        first + train(base, "resume", "--steps", str(STEPS), "--load", ckpt, *LAYOUTS["pp2-1f1b"])[HALF:]
    )
    # ZeRO-3 with units small enough that parameters are really freed between uses, run as a
    # restartable job: the same --resume command starts it fresh, then continues it
    zero3 = ["--zero", "3", *UNITS]
    out["dp2-zero3-units"] = train(base, "dp2-zero3-units", "--steps", str(STEPS), *zero3)
    job = ["--resume", os.path.join(base, "resume-zero3", "ckpt"), "--save-every", str(HALF // 2), *zero3]
    first3 = train(base, "resume-zero3", "--steps", str(HALF), "--lr-decay-steps", str(STEPS), *job)
    out["resume-zero3"] = first3 + train(base, "resume-zero3", "--steps", str(STEPS), *job)[HALF:]
    return out


def launch_four_first(base: str) -> dict[str, list[float]]:
    """dp4 zero3 parity, plain and hybrid (2 replicas × 2 shards); pp2 × dp2 with both gradient-sync policies; dp4 zero1 saves after
    HALF steps (for the 8-rank resume)."""
    out = {
        name: train(base, name, "--steps", str(STEPS), *LAYOUTS[name]) for name in ("dp4-zero3", "dp4-hybrid2x2-zero3")
    }
    out.update({name: train(base, name, "--steps", str(STEPS), *argv) for name, argv in GRAD_SYNC.items()})
    out.update(
        {
            name: train(base, name, "--steps", str(STEPS), *ZEROPP[name])
            for name in ZEROPP
            if name not in ZEROPP_ON_EIGHT
        }
    )
    train(
        base,
        "dp4-zero1",
        "--steps",
        str(HALF),
        "--lr-decay-steps",
        str(STEPS),
        "--save",
        os.path.join(base, "dp4-zero1", "ckpt"),
        *DP4_ZERO1,
    )
    return out


def launch_eight(base: str) -> dict[str, list[float]]:
    """tp2×pp2×dp2 at stages 1 (overlapped parameter gathers) and 3 (saves at HALF and STEPS, and
    exports; tests/test_pipeline.py checks this layout at every stage, weights and norms
    included, without the trainer) and as 2 replicas of 1 shard at zero3; then the dp4 zero1
    checkpoint resumed as tp2×pp2×dp2 zero3."""
    out = {}
    for stage in (1, 3):
        name = f"tp2-pp2-dp2-zero{stage}"
        extra = (
            [
                "--save",
                os.path.join(base, name, "ckpt"),
                "--save-every",
                str(HALF),
                "--export",
                os.path.join(base, "3d.safetensors"),
            ]
            if stage == 3
            else []
        )
        out[name] = train(base, name, "--steps", str(STEPS), *LAYOUTS[name], *extra)
    name = "tp2-pp2-dp2-hybrid2x1-zero3"
    out[name] = train(base, name, "--steps", str(STEPS), *LAYOUTS[name])
    out.update({name: train(base, name, "--steps", str(STEPS), *ZEROPP[name]) for name in ZEROPP_ON_EIGHT})
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(base, "dp4-zero1"), os.path.join(base, "from-dp4"))
    dist.barrier()
    out["dp4-zero1->3d-zero3"] = train(
        base,
        "from-dp4",
        "--steps",
        str(STEPS),
        "--load",
        os.path.join(base, "from-dp4", "ckpt"),
        *LAYOUTS["tp2-pp2-dp2-zero3"],
    )
    return out


# the 4-rank layouts a ZeRO-3 checkpoint is resumed into (stage 3 with real units, and 0-2)
RESUMED_FROM_3D = {
    "dp4-zero1": DP4_ZERO1,
    "dp4-zero3": LAYOUTS["dp4-zero3"],
    "tp2-dp2-zero3": ["--tp", "2", "--zero", "3", *UNITS],
    "pp2-dp2-zero3": ["--pp", "2", "--zero", "3", "--micro-batches", "2", *UNITS],
    "dp4-hybrid2x2-zero3": LAYOUTS["dp4-hybrid2x2-zero3"],
    "dp4-zero0": ["--zero", "0"],
    "tp2-dp2-zero2": ["--tp", "2", "--zero", "2"],
}


def launch_four_second(base: str) -> dict[str, list[float]]:
    """The tp2×pp2×dp2 zero3 checkpoint of step HALF resumed under each of RESUMED_FROM_3D."""
    ckpt = os.path.join(base, "tp2-pp2-dp2-zero3", "ckpt", f"step_{HALF:08d}")
    return {
        f"3d-zero3->{name}": train(base, f"from-3d-{name}", "--steps", str(STEPS), "--load", ckpt, *argv)
        for name, argv in RESUMED_FROM_3D.items()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list[float]]]:
    base = str(tmp_path_factory.mktemp("train"))
    losses: dict[str, list[float]] = {}
    for fn, world in (
        (launch_single, 1),
        (launch_two, 2),
        (launch_four_first, 4),
        (launch_eight, 8),
        (launch_four_second, 4),
    ):
        losses.update(run_distributed(fn, world, base, timeout=600)[0])
    return base, losses


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_match_the_single_process_run(runs, layout: str) -> None:
    _, losses = runs
    assert len(losses[layout]) == STEPS
    torch.testing.assert_close(torch.tensor(losses[layout]), torch.tensor(losses["single"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("layout", list(GRAD_SYNC))
def test_grad_sync_policies_match_the_single_process_run(runs, layout: str) -> None:
    _, losses = runs
    torch.testing.assert_close(torch.tensor(losses[layout]), torch.tensor(losses["single"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", list(PP2_DP2))
def test_grad_sync_every_trades_dp_traffic_for_gradient_memory(runs, name: str) -> None:
    """`--grad-sync every` reduce-scatters each micro-batch (m = 4 times the dp bytes) and so
    never holds every full gradient bucket: a lower peak on every rank. The planner, told the
    run's bucket and unit sizes, predicts its model states within 5%."""
    from experiments.sweep_results import planner_error

    base, _ = runs
    summaries = {}
    for sync in ("last", "every"):
        with open(os.path.join(base, f"pp2-dp2-{name}-{sync}", "summary.json")) as f:
            summary = json.load(f)
        assert planner_error(summary) < 0.05
        summaries[sync] = summary["ranks"]
    for last, every in zip(summaries["last"], summaries["every"]):
        assert every["memory_bytes"]["grads"] == last["memory_bytes"]["grads"]  # the shards
        assert every["grads_peak_bytes"] < last["grads_peak_bytes"]
        scatter = [r["comm_per_step"]["dp"]["ops"]["reduce_scatter_tensor"]["bytes"] for r in (last, every)]
        assert scatter[1] == 4 * scatter[0]


@pytest.mark.parametrize("variant", list(LOW_PRECISION))
def test_bf16_and_fp16_runs_track_fp32(runs, variant: str) -> None:
    """bf16 (tp2, SP, selective recompute) and fp16 (pp2 zero-bubble, full recompute,
    ZeRO-2) track the fp32 losses over STEPS steps within 1e-2 relative (measured: 3.2e-4 and
    2.4e-5; fp32 layouts differ by about 1.5e-7)."""
    _, losses = runs
    torch.testing.assert_close(torch.tensor(losses[variant]), torch.tensor(losses["single"]), rtol=1e-2, atol=0)


@pytest.mark.parametrize("variant", list(ZEROPP))
def test_zeropp_runs_track_fp32(runs, variant: str) -> None:
    """int8 parameter all-gathers (blocks of 64), hpZ's secondary partition and int8 gradient
    all-to-alls, with tp 2, SP and the interleaved pipeline on 8 ranks, and with pp 2 × dp 2
    under zero-bubble, 1F1B (reducing every micro-batch) and GPipe on 4,
    track the exact losses over STEPS steps within 1e-2 relative."""
    _, losses = runs
    torch.testing.assert_close(torch.tensor(losses[variant]), torch.tensor(losses["single"]), rtol=1e-2, atol=0)
    assert losses[variant] != losses["single"]  # the gathers really were quantized


def test_training_reduces_the_loss(runs) -> None:
    _, losses = runs
    assert losses["single"][-1] < losses["single"][0] - 0.5


def test_resume_continues_exactly(runs) -> None:
    _, losses = runs
    assert losses["resume-exact"] == losses["pp2-1f1b"]


def test_a_zero3_run_resumes_into_zero3(runs) -> None:
    """Saved and loaded at ZeRO-3 with several units (parameters empty between uses; the
    expected shapes come from the optimizer's record), by one --resume command run twice:
    fresh at first, then from the step-HALF checkpoint."""
    _, losses = runs
    assert losses["resume-zero3"] == losses["dp2-zero3-units"]
    torch.testing.assert_close(
        torch.tensor(losses["dp2-zero3-units"]), torch.tensor(losses["single"]), rtol=1e-5, atol=0
    )


@pytest.mark.parametrize("resumed", ["dp4-zero1->3d-zero3", *(f"3d-zero3->{name}" for name in RESUMED_FROM_3D)])
def test_resume_under_another_layout(runs, resumed: str) -> None:
    _, losses = runs
    torch.testing.assert_close(
        torch.tensor(losses[resumed][-HALF:]), torch.tensor(losses["single"][HALF:]), rtol=1e-5, atol=0
    )


def test_export_is_the_tp1_model_and_matches_across_layouts(runs) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from research.model import GPT, GPTConfig

    base, _ = runs
    single, sharded = (
        load_file(os.path.join(base, "single.safetensors")),
        load_file(os.path.join(base, "3d.safetensors")),
    )
    with safe_open(os.path.join(base, "3d.safetensors"), "pt") as f:
        config = GPTConfig(**json.loads(f.metadata()["model"]))
    model = GPT(config)
    model.load_state_dict(sharded, strict=True)
    assert single.keys() == sharded.keys() == model.state_dict().keys()
    for k, v in single.items():
        torch.testing.assert_close(sharded[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_run_folder_holds_config_metrics_and_summary(runs) -> None:
    from research.config import parse_args

    base, _ = runs
    out = os.path.join(base, "tp2-pp2-dp2-zero3")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "loss_scale",
        "step_time_s",
        "tokens_per_s",
        "tflops_per_device",
        "mfu",
        "mem_peak_bytes",
    ):
        assert key in rows[0], key
    assert rows[0]["loss_scale"] is None and rows[0]["mfu"] is None and rows[0]["mem_peak_bytes"] > 0
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["final_loss"] == rows[-1]["loss"]
    assert len(summary["ranks"]) == 8
    for rank in summary["ranks"]:
        memory = rank["memory_bytes"]
        assert set(memory) == {"params", "grads", "master_and_optimizer", "activations"}
        assert all(v > 0 for v in memory.values()), memory
        assert rank["grads_peak_bytes"] > memory["grads"]  # ZeRO-3: full buckets during backward
        assert {"tp", "pp", "dp"} <= set(rank["comm_per_step"])
        assert rank["comm_per_step"]["pp"]["total"]["calls"] > 0
    assert summary["final_loss_mean"] == pytest.approx(sum(r["loss"] for r in rows[-10:]) / len(rows[-10:]))
    assert summary["startup_s"] > 0
    for row in rows:  # each rank's wait is inside its own step, and the step is the slowest rank's
        assert max(row["comm_wait_s"]) <= row["step_time_s"]
    for rank in summary["ranks"]:  # each part at its own peak
        memory = rank["memory_bytes"]
        assert rank["peak_bytes"] == sum(memory.values()) - memory["grads"] + rank["grads_peak_bytes"]
    # the saved config repeats the run; into its own folder only with --overwrite
    cfg = parse_args(["--config", os.path.join(out, "config.yaml"), "--overwrite"], 8)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero) == (2, 2, 2, 3)
    cfg.log.overwrite = False
    assert cfg.to_dict() == summary["config"]


def test_a_resumed_metrics_file_has_each_step_once(runs) -> None:
    base, _ = runs
    with open(os.path.join(base, "resume", "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, STEPS + 1))


def bad_load(base: str, case: str) -> str:
    """The error of loading a damaged or mismatched copy of the single-process checkpoint."""
    from experiments.train import run

    src = os.path.join(base, "single", "ckpt", f"step_{STEPS:08d}")
    ckpt = os.path.join(base, f"bad-{case}")
    shutil.copytree(src, ckpt)
    extra = []
    if case == "incomplete":
        os.remove(os.path.join(ckpt, "meta.json"))
    elif case == "corrupt":
        for name in os.listdir(ckpt):
            if name.endswith(".distcp"):
                with open(os.path.join(ckpt, name), "r+b") as f:
                    f.truncate(100)
    elif case == "shape":
        extra = ["--d-model", "64"]
    try:
        run(
            [
                *MODEL,
                *TRAIN,
                "--data-cache",
                os.path.join(base, "cache"),
                "--out",
                os.path.join(base, f"out-{case}"),
                "--steps",
                "21",
                "--load",
                ckpt,
                *extra,
            ]
        )
    except CheckpointError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "case, expected",
    [
        ("incomplete", "is incomplete"),
        ("corrupt", "__0_0.distcp is damaged"),
        ("shape", r"another model shape: d_model=32 there, 64 here"),
    ],
)
def test_bad_checkpoints_are_refused_clearly(runs, case: str, expected: str) -> None:
    base, _ = runs
    message = run_distributed(bad_load, 1, base, case, timeout=120)[0]
    assert expected in message, message


def test_the_command_line_fails_with_one_sentence(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--tp", "3", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WORLD_SIZE": "8"},
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: --tp=3 × --pp=1 = 3 does not divide the world size 8"


def test_torchrun_runs_the_tiny_config(tmp_path) -> None:
    """The README's main job, shortened: the tiny 3D config through torchrun, wandb offline."""
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",  # torchrun, of the Python running the tests
        "--standalone",
        "--nproc_per_node=4",
        "-m",
        "experiments.train",
        "--config",
        "experiments/configs/tiny.yaml",
        "--tp",
        "2",
        "--pp",
        "2",
        "--zero",
        "2",
        "--micro-batches",
        "4",
        "--steps",
        "2",
        "--out",
        str(out),
        "--data-cache",
        str(tmp_path / "cache"),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done 2 steps | final loss" in proc.stderr
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert (out / "summary.json").is_file()
