"""Mixture-of-Experts through the training command: every layout with expert parallelism
(borrowing data-parallel ranks) follows the single-process MoE run's loss curve in fp32,
dropless, with the auxiliary losses on (ZeRO 0-3, hybrid sharding, TP + SP, the pipeline);
its exported weights are the single-process run's; a checkpoint resumes under another ep;
the MoE metrics reach metrics.jsonl."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

STEPS = 8
MODEL = ["--n-layers", "2", "--n-heads", "2", "--d-model", "32", "--max-seq-len", "32"]
MOE = ["--moe-experts", "4", "--moe-top-k", "2", "--moe-shared-experts", "1"]
# m = 2 everywhere: micro-batch j of every dp rank together is the one-process micro-batch j
TRAIN = [
    *("--seq-len", "32", "--global-batch-size", "8", "--micro-batches", "2", "--lr", "3e-3", "--min-lr", "3e-4"),
    *("--eps", "1e-6", "--seed", "0", "--wandb", "disabled", "--log-every", "1000"),
]
UNITS = ("--unit-numel", "1500")  # several ZeRO-3 units: experts, attention and norms gathered apart
LAYOUTS = {
    "dp4-ep2-zero3": ["--ep", "2", "--zero", "3", *UNITS],
    "dp4-ep4-zero3": ["--ep", "4", "--zero", "3", *UNITS],
    "dp4-ep2-zero0": ["--ep", "2", "--zero", "0"],
    "tp2-sp-dp2-ep2-zero2": ["--tp", "2", "--sequence-parallel", "--ep", "2", "--zero", "2", "--bucket-numel", "3000"],
    "pp2-dp2-ep2-zero1-1f1b": ["--pp", "2", "--ep", "2", "--zero", "1", "--schedule", "1f1b"],
    "dp4-hybrid2x2-ep2-zero3": ["--dp-shard", "2", "--ep", "2", "--zero", "3", *UNITS],
}


def train(base: str, name: str, *extra: str) -> list[dict]:
    """One run through the command's code path; its metrics.jsonl rows."""
    from experiments.train import run

    out = os.path.join(base, name)
    run([*MODEL, *MOE, *TRAIN, "--data-cache", os.path.join(base, "cache"), "--out", out, *extra])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def launch_single(base: str) -> dict[str, list[dict]]:
    export = ["--save", os.path.join(base, "single", "ckpt"), "--export", os.path.join(base, "single.safetensors")]
    return {"single": train(base, "single", "--steps", str(STEPS), *export)}


def launch_four(base: str) -> dict[str, list[dict]]:
    out = {name: train(base, name, "--steps", str(STEPS), *argv) for name, argv in LAYOUTS.items()}
    ckpt = os.path.join(base, "ep2", "ckpt")
    export = ["--export", os.path.join(base, "resumed.safetensors")]
    first = train(
        base, "ep2", "--steps", "4", "--lr-decay-steps", str(STEPS), "--save", ckpt, *LAYOUTS["dp4-ep2-zero3"]
    )
    out["ep2-saved"] = first
    out["ep2->ep4"] = train(
        base,
        "ep4",
        "--steps",
        str(STEPS),
        "--load",
        ckpt,
        "--save",
        os.path.join(base, "ep4", "ckpt"),
        *export,
        *LAYOUTS["dp4-ep4-zero3"],
    )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list[dict]]]:
    base = str(tmp_path_factory.mktemp("moe-train"))
    rows: dict[str, list[dict]] = {}
    for fn, world in ((launch_single, 1), (launch_four, 4)):
        rows.update(run_distributed(fn, world, base, timeout=600)[0])
    return base, rows


def losses(rows: list[dict]) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in rows])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_follows_the_single_process_curve(runs, layout: str) -> None:
    _, rows = runs
    assert len(rows[layout]) == STEPS
    torch.testing.assert_close(losses(rows[layout]), losses(rows["single"]), rtol=1e-5, atol=0)
    aux = torch.tensor([r["moe_aux_loss"] for r in rows[layout]])
    torch.testing.assert_close(aux, torch.tensor([r["moe_aux_loss"] for r in rows["single"]]), rtol=1e-5, atol=0)


def test_resume_under_another_ep_continues_the_curve(runs) -> None:
    _, rows = runs
    resumed = rows["ep2-saved"] + rows["ep2->ep4"]  # a fresh folder: metrics.jsonl holds the steps it ran
    torch.testing.assert_close(losses(resumed), losses(rows["single"]), rtol=1e-5, atol=0)


def test_the_export_holds_every_expert_of_the_single_process_run(runs) -> None:
    base, _ = runs
    single, sharded = (
        load_file(os.path.join(base, "single.safetensors")),
        load_file(os.path.join(base, "resumed.safetensors")),
    )
    assert single.keys() == sharded.keys()
    assert single["blocks.0.mlp.experts.up"].shape == (4, 32, 128)
    for name, value in single.items():
        torch.testing.assert_close(sharded[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_moe_metrics_reach_metrics_jsonl(runs) -> None:
    _, rows = runs
    row = rows["dp4-ep2-zero3"][0]
    assert row["moe_aux_loss"] > 0 and row["moe_z_loss"] > 0 and row["moe_dropped_fraction"] == 0.0
    load = row["moe_expert_load"]
    assert set(load) == {"blocks.0.mlp", "blocks.1.mlp"}
    # every token's k slots are counted once per layer: 8 sequences × 32 tokens × 2 per micro-batch, summed
    assert all(0 <= v["tokens_min"] <= v["tokens_max"] and v["tokens_cv"] >= 0 for v in load.values())
