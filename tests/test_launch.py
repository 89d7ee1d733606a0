"""What a researcher sees from the training command: `python -m experiments.train
--nproc-per-node N` checks the configuration before any worker exists (one line, exit 2, in
seconds), torchrun workers print an error once, a finished run is never silently replaced,
and a resume never moves the LR schedule unannounced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY_RUN, slow_except

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "experiments/configs/tiny.yaml", "--wandb", "disabled", "--log-every", "100"]


def train(*argv: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *(launcher or ("-m", "experiments.train")), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
        check=False,
    )


def lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("flags", "sentence"),
    slow_except(
        [(("--schedule", "1fb1"), "error: --schedule=1fb1 must be one of gpipe, 1f1b, interleaved-1f1b, zb-h1")],
        [
            (("--tp", "8"), "error: --tp=8 does not split the model: n_heads=4 is not divisible by tp=8"),
            (("--config", "missing.yaml"), "error: --config=missing.yaml does not exist"),
            (("--nnodes", "two"), "error: --nnodes=two must be a number of nodes N or a range MIN:MAX"),
        ],
    ),
)
def test_a_bad_value_under_the_launch_command_is_one_line_before_any_worker(flags: tuple, sentence: str) -> None:
    """Within 10 s on an idle 2-core machine; a busy one gets 4 times its own `import torch`."""
    started = time.monotonic()
    proc = train("--nproc-per-node", "8", *TINY, *flags)
    took = time.monotonic() - started
    assert proc.returncode == 2 and lines(proc) == [sentence], lines(proc)
    if took > 10:
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=300)
        assert took < 4 * (time.monotonic() - started), f"{took:.1f} s"


@pytest.mark.slow
def test_under_torchrun_each_error_is_printed_once(tmp_path: Path) -> None:
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "experiments.train")
    proc = train(*TINY, "--schedule", "1fb1", "--out", str(tmp_path / "run"), launcher=torchrun)
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("--schedule=1fb1 must be one of") == 1


@pytest.mark.slow
def test_a_run_folder_is_continued_or_replaced_never_silently_overwritten(tmp_path: Path) -> None:
    """The launch command trains; a second fresh run into its --out is refused in one line,
    naming --resume and --overwrite; --overwrite replaces the run, its wandb run included."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    common = [*TINY_RUN, "--steps", "2", "--out", str(out), "--data-cache", str(cache)]
    first = train("--nproc-per-node", "2", *common, "--wandb", "offline")
    assert first.returncode == 0 and (out / "summary.json").is_file(), first.stderr[-2000:]
    again = train("--nproc-per-node", "2", *common)
    assert again.returncode == 2
    assert lines(again) == [
        f"error: --out={out} holds a run (summary.json); continue it with --resume ROOT (the --save-every "
        "checkpoints it saved), replace it with --overwrite, or choose another --out"
    ]
    replaced = train("--nproc-per-node", "2", *common, "--overwrite", "--wandb", "offline")
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.slow
def test_a_resume_that_moves_the_lr_schedule_is_refused_or_announced(tmp_path: Path) -> None:
    """4 steps saved; resuming with --steps 6 would re-stretch the cosine decay: refused in one
    line; --lr-decay-steps 4 trains on along the same schedule; --reschedule applies the new
    one from the resume step, says so, and logs that step's new lr."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    common = [
        *TINY,
        "--warmup-steps",
        "0",
        "--out",
        str(out),
        "--resume",
        str(ckpt),
        "--data-cache",
        str(tmp_path / "cache"),
    ]
    assert train(*common, "--steps", "4", "--save-every", "2").returncode == 0
    refused = train(*common, "--steps", "6")
    assert refused.returncode == 2
    assert lines(refused)[-1].startswith(
        "error: --steps=6 (was 4) changes the LR schedule at step 5: lr 3.000e-04 -> 5.578e-04; keep the "
        "checkpoint's schedule (to train longer on it, pass --lr-decay-steps=4"
    ), lines(refused)
    kept = train(*common, "--steps", "6", "--lr-decay-steps", "4")
    assert kept.returncode == 0, kept.stderr[-2000:]
    moved = train(*common, "--steps", "10", "--reschedule")
    assert moved.returncode == 0, moved.stderr[-2000:]
    said = [line for line in lines(moved) if line.startswith("--reschedule: ")]
    assert said == ["--reschedule: --lr-decay-steps=None (was 4), --steps=10 (was 6) changes the LR schedule at step 7: "
                    "lr 3.000e-04 -> 9.750e-04"], lines(moved)  # fmt: skip
    lrs = {row["step"]: row["lr"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert lrs[5] == lrs[6] == pytest.approx(3e-4) and lrs[7] == pytest.approx(9.75e-4)


@pytest.mark.slow
def test_a_terminal_sees_start_up_progress_and_saves(tmp_path: Path) -> None:
    """Under a pseudo-terminal (of no size, as `script` makes), the launch command's workers
    show the start-up phases, a progress bar and each save."""
    import pty

    argv = [*TINY, "--steps", "4", "--out", str(tmp_path / "run"), "--save", str(tmp_path / "ckpt")]
    argv += ["--save-every", "2", "--data-cache", str(tmp_path / "cache")]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command, with the pseudo-terminal as its stdout and stderr
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "experiments.train", "--nproc-per-node", "2", *argv])
    output = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    _, status = os.waitpid(pid, 0)
    text = output.decode(errors="replace").replace("\r", "\n")
    assert os.waitstatus_to_exitcode(status) == 0, text[-3000:]
    for expected in ("start-up: process groups", "start-up: data", "start-up: model", "4/4", "saved step 2 to "):
        assert expected in text, (expected, text[-3000:])
