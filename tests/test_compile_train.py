"""`--compile` (each transformer block compiled on its own, inductor on the CPU, fp32) through
the training command: every layout follows the eager single process's loss curve (rtol 1e-5:
inductor's kernels sum in another order) and compiles no new graph after its first step,
ZeRO-3 with several units per block (their gathers between the block's graphs), the pipeline
(1F1B and ZB-H1's split backward), TP + SP, hybrid sharding and experts."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist_utils import run_distributed

STEPS = 10
MODEL = ["--n-layers", "4", "--n-heads", "4", "--d-model", "32", "--max-seq-len", "32"]
MOE = ["--moe-experts", "4", "--moe-top-k", "2"]
TRAIN = [
    *("--seq-len", "32", "--global-batch-size", "8", "--micro-batches", "2", "--lr", "3e-3", "--min-lr", "3e-4"),
    *("--eps", "1e-6", "--seed", "0", "--wandb", "disabled", "--log-every", "1000"),
]
# name -> (ranks, flags, the eager single-process run it equals)
LAYOUTS = {
    "dp2-zero3-units-recompute": (2, ["--zero", "3", "--unit-numel", "3000", "--recompute", "full"], "single"),
    "tp2-sp-pp2-dp2-zero2-1f1b": (
        8,
        ["--tp", "2", "--sequence-parallel", "--pp", "2", "--zero", "2", "--schedule", "1f1b"],
        "single",
    ),
    "dp4-zero3-units-recompute": (4, ["--zero", "3", "--unit-numel", "3000", "--recompute", "full"], "single"),
    "dp4-hybrid2-zero3": (4, ["--dp-shard", "2", "--zero", "3", "--unit-numel", "3000"], "single"),
    "pp2-zb-h1-zero1": (2, ["--pp", "2", "--schedule", "zb-h1", "--zero", "1"], "single"),
    "dp2-ep2-zero3-moe": (2, ["--ep", "2", "--zero", "3", "--unit-numel", "3000", *MOE], "single-moe"),
}
SINGLE = {"single": [], "single-moe": MOE}


def train(base: str, name: str, *extra: str) -> list[dict]:
    from experiments.train import run

    out = os.path.join(base, name)
    run([*MODEL, *TRAIN, "--steps", str(STEPS), "--data-cache", os.path.join(base, "cache"), "--out", out, *extra])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def launch(base: str, runs: dict[str, list[str]]) -> dict[str, list[dict]]:
    return {name: train(base, name, *argv) for name, argv in runs.items()}


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    base = str(tmp_path_factory.mktemp("eager"))
    return run_distributed(launch, 1, base, dict(SINGLE), timeout=300)[0]


@pytest.mark.slow  # a quick check of compilation under ZeRO-3: tests/test_zero_torch_habits.py
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layout_follows_the_eager_single_process(eager, tmp_path, layout: str) -> None:
    world, flags, single = LAYOUTS[layout]
    rows = run_distributed(launch, world, str(tmp_path), {layout: ["--compile", *flags]}, timeout=900)[0][layout]
    losses = torch.tensor([r["loss"] for r in rows])
    torch.testing.assert_close(losses, torch.tensor([r["loss"] for r in eager[single]]), rtol=1e-5, atol=0)
    graphs = [r["compiled_graphs"] for r in rows]
    assert graphs[0] > 0 and len(set(graphs[1:])) == 1 and graphs[1] == graphs[0], graphs  # no recompilation
    assert all("compiled_graphs" not in r for r in eager[single])
