"""`--compile` (each transformer block compiled on its own, inductor on the CPU, fp32) through
the training command: every layout follows the eager single process's loss curve (rtol 1e-5:
inductor's kernels sum in another order) and compiles no new graph after its first step,
ZeRO-3 with several units per block (their gathers between the block's graphs), the pipeline
(1F1B and ZB-H1's split backward), TP + SP, hybrid sharding, experts and context parallelism
(all-to-all inside the block's graph, the ring between graphs)."""

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
    "cp2-all-to-all-zero2": (2, ["--cp", "2", "--cp-mode", "all-to-all", "--zero", "2"], "single"),
    "cp2-ring-zero3-units": (2, ["--cp", "2", "--zero", "3", "--unit-numel", "3000"], "single"),
}
SINGLE = {"single": [], "single-moe": MOE}
# a block is one graph where its collectives are operators inside it (`parallel.functional`:
# TP, SP, Ulysses' all-to-all), and the blocks of a process share it
ONE_GRAPH = {"tp2-sp-pp2-dp2-zero2-1f1b", "cp2-all-to-all-zero2"}


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
    if layout in ONE_GRAPH:
        assert graphs[0] == 1, graphs
    assert all("compiled_graphs" not in r for r in eager[single])


def tp_collectives(base: str, runs: dict[str, list[str]]) -> dict[str, tuple[list[dict], dict]]:
    """Each run's metrics rows and its TP collectives per step (summary.json)."""
    out = {}
    for name, rows in launch(base, runs).items():
        with open(os.path.join(base, name, "summary.json")) as f:
            out[name] = (rows, json.load(f)["comm_per_step"]["tp"]["ops"])
    return out


@pytest.mark.slow
def test_a_compiled_tp_sp_block_is_one_graph_with_the_eager_collectives(tmp_path) -> None:
    """Under TP + SP the block's all-reduces, all-gathers and reduce-scatters are operators
    inside its one graph, called at run time: the same calls and bytes as eager (the backward's
    re-gather of each column linear's input included, not merged with the forward's), the same
    losses."""
    flags = ["--tp", "2", "--sequence-parallel", "--steps", "3"]
    out = run_distributed(tp_collectives, 2, str(tmp_path), {"eager": flags, "compiled": ["--compile", *flags]})[0]
    (eager, eager_ops), (compiled, compiled_ops) = out["eager"], out["compiled"]
    assert [r["compiled_graphs"] for r in compiled] == [1, 1, 1]
    assert compiled_ops == eager_ops and eager_ops["all_gather_into_tensor"]["calls"] > 0
    torch.testing.assert_close([r["loss"] for r in compiled], [r["loss"] for r in eager], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_compiled_dropout_trains_as_eager(tmp_path) -> None:
    """Dropout under --compile (the RNG tracker's fork runs eagerly, so the block is not one
    graph): tp 2 + SP trains; the masks are inductor's, not eager's, so the losses agree to
    the noise of the masks (1 %), and no graph is compiled after the first step."""
    flags = ["--tp", "2", "--sequence-parallel", "--dropout", "0.1", "--steps", "3"]
    out = run_distributed(launch, 2, str(tmp_path), {"eager": flags, "compiled": ["--compile", *flags]})[0]
    graphs = [r["compiled_graphs"] for r in out["compiled"]]
    assert graphs[0] > 1 and len(set(graphs)) == 1, graphs
    torch.testing.assert_close(
        [r["loss"] for r in out["compiled"]], [r["loss"] for r in out["eager"]], rtol=0.01, atol=0
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, rtol",
    [
        (["--zero", "3", "--unit-numel", "3000", "--qwz-block", "256", "--qgz-bits", "8"], 1e-4),
        (["--zero", "1", "--precision", "bf16"], 2e-3),
    ],
    ids=["zero3-qwz-qgz", "zero1-bf16"],
)
def test_compiled_zeropp_and_bf16_follow_their_eager_runs(tmp_path, flags: list[str], rtol: float) -> None:
    """ZeRO++'s quantized gathers and reductions, and bf16 compute, under --compile on 2 ranks:
    the eager run of the same flags is the reference (neither is exact against fp32), to the
    rounding of inductor's reordered sums (bf16: its 8 mantissa bits), with no recompilation."""
    flags = [*flags, "--steps", "4"]
    out = run_distributed(launch, 2, str(tmp_path), {"eager": flags, "compiled": ["--compile", *flags]})[0]
    graphs = [r["compiled_graphs"] for r in out["compiled"]]
    assert graphs[0] > 0 and len(set(graphs)) == 1, graphs
    torch.testing.assert_close(
        [r["loss"] for r in out["compiled"]], [r["loss"] for r in out["eager"]], rtol=rtol, atol=0
    )
