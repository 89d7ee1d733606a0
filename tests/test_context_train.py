"""Context parallelism through the training command: every layout with cp follows the
single-process run in fp32 (every step's loss and grad norm, rtol 1e-5) and ends on its
weights (the gathered export): ring, all-to-all and hybrid attention, composed with ZeRO 0-3
(stage 3 with several units), TP + SP, the pipeline, a sliding window and experts; a cp2
checkpoint resumes as cp4 and as one process on the same curve."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.dist_utils import run_distributed

STEPS = 6
MODEL = ["--n-layers", "2", "--n-heads", "4", "--d-model", "32", "--max-seq-len", "128"]
MOE = ["--moe-experts", "4", "--moe-top-k", "2"]
WINDOW = ["--sliding-window", "48"]
TRAIN = [
    *("--seq-len", "128", "--global-batch-size", "4", "--micro-batches", "2", "--lr", "3e-3", "--min-lr", "3e-4"),
    *("--eps", "1e-6", "--seed", "0", "--wandb", "disabled", "--log-every", "1000"),
]
UNITS = ("--unit-numel", "1500")  # several ZeRO-3 units
# name -> (ranks, flags, the single-process run it equals)
LAYOUTS = {
    "cp2-zero3": (4, ["--cp", "2", "--zero", "3", *UNITS], "single"),
    "tp2-sp-cp2-zero2": (8, ["--tp", "2", "--sequence-parallel", "--cp", "2", "--zero", "2"], "single"),
    "pp2-cp2-1f1b-zero1": (4, ["--pp", "2", "--cp", "2", "--schedule", "1f1b", "--zero", "1"], "single"),
    "cp4-zero2": (4, ["--cp", "4", "--zero", "2"], "single"),
    "cp2-all-to-all-zero1": (2, ["--cp", "2", "--cp-mode", "all-to-all", "--zero", "1"], "single"),
    "cp4-hybrid2-zero2": (4, ["--cp", "4", "--cp-mode", "hybrid", "--cp-a2a", "2", "--zero", "2"], "single"),
    "cp2-zero3-window": (2, ["--cp", "2", "--zero", "3", *UNITS, *WINDOW], "single-window"),
    "cp2-ep2-zero3-moe": (4, ["--cp", "2", "--ep", "2", "--zero", "3", *UNITS, *MOE], "single-moe"),
}
SINGLE = {"single": [], "single-window": WINDOW, "single-moe": MOE}
QUICK = {"cp2-zero3-window"}  # the one layout of the quick run


def train(base: str, name: str, *extra: str) -> list[dict]:
    """One run through the command's code path, exported at its end; its metrics.jsonl rows."""
    from experiments.train import run

    out = os.path.join(base, name)
    export = ["--save", os.path.join(out, "ckpt"), "--export", os.path.join(base, f"{name}.safetensors")]
    run([*MODEL, *TRAIN, "--data-cache", os.path.join(base, "cache"), "--out", out, *export, *extra])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def launch(base: str, runs: dict[str, list[str]]) -> dict[str, list[dict]]:
    return {name: train(base, name, *argv) for name, argv in runs.items()}


def _runs(base: str, names: set[str]) -> dict[str, list[dict]]:
    singles = {LAYOUTS[n][2] for n in names}
    rows = run_distributed(launch, 1, base, {s: ["--steps", str(STEPS), *SINGLE[s]] for s in singles}, timeout=600)[0]
    for world in sorted({LAYOUTS[n][0] for n in names}):
        runs = {n: ["--steps", str(STEPS), *LAYOUTS[n][1]] for n in names if LAYOUTS[n][0] == world}
        rows.update(run_distributed(launch, world, base, runs, timeout=900)[0])
    return rows


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list[dict]]]:
    base = str(tmp_path_factory.mktemp("cp-quick"))
    return base, _runs(base, QUICK)


@pytest.fixture(scope="module")
def every(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list[dict]]]:
    base = str(tmp_path_factory.mktemp("cp-every"))
    return base, _runs(base, set(LAYOUTS) - QUICK)


def _column(rows: list[dict], key: str) -> torch.Tensor:
    return torch.tensor([r[key] for r in rows])


def _check(base: str, rows: dict[str, list[dict]], layout: str) -> None:
    single = LAYOUTS[layout][2]
    assert len(rows[layout]) == STEPS
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(_column(rows[layout], key), _column(rows[single], key), rtol=1e-5, atol=0)
    want, got = (load_file(os.path.join(base, f"{name}.safetensors")) for name in (single, layout))
    assert want.keys() == got.keys()
    for name, value in want.items():  # atol: Adam's m/√v magnifies fp32 reordering on weights near 0
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_cp_layout_follows_the_single_process_run(quick) -> None:
    base, rows = quick
    for layout in QUICK:
        _check(base, rows, layout)


def _resumed(base: str) -> list[dict]:
    """cp2 ZeRO-3 for steps 1-2, its checkpoint loaded as cp4 ZeRO-1 for steps 3-4, then as
    one process for 5-6 (each run's metrics.jsonl holds the steps it ran)."""
    decay = ["--lr-decay-steps", str(STEPS)]
    ckpt = lambda name: os.path.join(base, name, "ckpt")  # noqa: E731
    stages = [
        (4, "resume-cp2", ["--steps", "2", "--cp", "2", "--zero", "3", *UNITS]),
        (4, "resume-cp4", ["--steps", "4", "--cp", "4", "--zero", "1", "--load", ckpt("resume-cp2")]),
        (1, "resume-single", ["--steps", str(STEPS), "--load", ckpt("resume-cp4")]),
    ]
    rows = []
    for world, name, argv in stages:
        rows += run_distributed(launch, world, base, {name: [*decay, *argv]}, timeout=600)[0][name]
    return rows


@pytest.mark.slow
def test_a_cp2_checkpoint_resumes_as_cp4_and_as_one_process(every) -> None:
    base, rows = every
    resumed = _resumed(base)
    torch.testing.assert_close(_column(resumed, "loss"), _column(rows["single"], "loss"), rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - QUICK))
def test_every_cp_layout_follows_the_single_process_run(every, layout: str) -> None:
    _check(*every, layout)
