"""`python -m experiments.trace`: the traced step's FLOPs equal the model's count, its
collective bytes equal the accounting's, the ZeRO collectives are attributed to optim/, and
every file (ops.csv, callgraph.svg/.dot, trace.json) is written on every rank."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from parallel import accounting
from tests.dist_utils import run_distributed

ARGV = ["--config", "experiments/configs/tiny.yaml", "--steps", "1", "--zero", "3", "--unit-numel", "20000"]


def _trace_then_account(out: str) -> dict:
    """Trace one stage-3 step (units small enough that the model has several), then run the
    same step untraced under `accounting.tracking`: what the accounting counts per op."""
    from experiments import train
    from experiments.trace import trace
    from research.trainer import Trainer

    folder = trace([*ARGV, "--out", out])
    trainer = Trainer(train.join([*ARGV, "--out", out]))
    with accounting.tracking() as log:
        trainer.step(0)
    wire: Counter = Counter()
    for ops in log.as_dict().values():
        for op, entry in ops.items():
            wire[op] += entry["bytes"]
    model, seq = trainer.cfg.model, trainer.cfg.data.seq_len
    tokens = trainer.cfg.train.global_batch_size * seq
    _, core, _ = model.forward_flops_per_token(seq)
    return {
        "folder": str(folder),
        "wire": dict(wire),
        "model_flops": model.flops_per_token(seq) * tokens,
        "core_flops": model.n_layers * core * tokens,  # the attention cores' forward
    }


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("trace")
    return run_distributed(_trace_then_account, 2, str(out), timeout=240)


def _rows(folder: str) -> list[dict]:
    with open(Path(folder) / "ops.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_every_rank_writes_the_csv_the_call_graph_and_the_chrome_trace(traced: list[dict]) -> None:
    assert Path(traced[1]["folder"]) == Path(traced[0]["folder"]) / "rank1"
    for rank in traced:
        folder = Path(rank["folder"])
        with open(folder / "ops.csv") as f:
            assert f.readline().strip() == "site,module,op,calls,flops,bytes,time_s"
        svg = (folder / "callgraph.svg").read_text()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg
        dot = (folder / "callgraph.dot").read_text()
        assert dot.startswith("digraph") and '"research/trainer.py:Trainer.step" -> ' in dot
        assert json.loads((folder / "trace.json").read_text())["traceEvents"]


def test_traced_flops_equal_the_models_count(traced: list[dict]) -> None:
    """Both ranks' FLOPs sum to flops_per_token × tokens, plus what torch counts and the
    model does not: the attention backward as 5 matmuls of the s × s square (2.5× forward)
    where the model counts 2× (Narayanan et al.'s 3× forward)."""
    flops = sum(int(r["flops"]) for rank in traced for r in _rows(rank["folder"]))
    expected = traced[0]["model_flops"] + 0.5 * traced[0]["core_flops"]
    assert flops == pytest.approx(expected, rel=1e-9)


def test_traced_collective_bytes_equal_the_accounting(traced: list[dict]) -> None:
    for rank in traced:
        wire: Counter = Counter()
        for r in _rows(rank["folder"]):
            if r["op"].startswith("c10d."):
                wire[r["op"].removeprefix("c10d.")] += int(r["bytes"])
        assert dict(wire) == rank["wire"]
        assert rank["wire"]["reduce_scatter_tensor"] > 0 and rank["wire"]["all_gather_into_tensor"] > 0


def test_zero_collectives_are_attributed_to_optim(traced: list[dict]) -> None:
    """Stage 3's gathers (hooks around each unit's forward and backward) and its gradient
    reduce-scatter show at optim/ call sites, inside the model's modules for the gathers."""
    rows = _rows(traced[0]["folder"])
    for op in ("c10d.all_gather_into_tensor", "c10d.reduce_scatter_tensor"):
        sites = {r["site"] for r in rows if r["op"] == op}
        assert sites and all(site.startswith("optim/") for site in sites), sites
    gathers = {r["module"] for r in rows if r["op"] == "c10d.all_gather_into_tensor"}
    assert any(".blocks." in module for module in gathers), gathers
