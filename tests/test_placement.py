"""Every tensor a training step makes is made on the model's device: one step of each layout
with the default device set to meta while it runs (`Trainer._train_on`), so a tensor created
without `device=` is a meta tensor and fails the step, as a CPU tensor would on a GPU (NCCL
refuses it; an op mixing it with CUDA tensors raises). `parallel.comm` refuses, in one
sentence, a collective handed a tensor on a device its backend does not run on.

Found and fixed by this check: the pipeline executor's scale for the MoE auxiliary losses of a
chunk without the loss (made on the CPU: a host-to-device copy in every such backward on a
GPU), and the stage-3 check-in's tensors (they travel over a gloo side group, so they are
now made on the CPU explicitly). A layout that fails on some ranks only fails the others
within the 30 s collective timeout."""

from __future__ import annotations

import os
import traceback

import pytest
import torch

from parallel import comm
from tests.dist_utils import run_distributed

MODEL = ["--n-layers", "4", "--n-heads", "2", "--d-model", "32", "--max-seq-len", "32", "--vocab-multiple", "128"]
LAYOUTS = {
    "zero0": ["--zero", "0"],
    "zero1-bf16": ["--zero", "1", "--precision", "bf16"],
    "zero2-accumulation": ["--zero", "2", "--micro-batches", "2"],
    "zero3-units": ["--zero", "3", "--unit-numel", "2000"],
    "tp2-sp-zero2": ["--tp", "2", "--sequence-parallel", "--zero", "2"],
    "pp2-1f1b-zero1": ["--pp", "2", "--micro-batches", "2", "--zero", "1"],
    "pp2-interleaved": ["--pp", "2", "--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--micro-batches", "2"],
    "hybrid-zero3": ["--dp-shard", "2", "--zero", "3", "--unit-numel", "2000"],
    "zero++": ["--zero", "3", "--qwz-block", "256", "--hpz", "--qgz-bits", "8", "--unit-numel", "2000"],
    "moe-ep2-zero3": ["--moe-experts", "4", "--ep", "2", "--zero", "3", "--unit-numel", "2000"],
    "moe-tp2-sp-ep2": ["--moe-experts", "4", "--tp", "2", "--sequence-parallel", "--ep", "2", "--zero", "1"],
    "moe-pp2-ep2-capacity": [
        *("--moe-experts", "4", "--pp", "2", "--ep", "2", "--micro-batches", "2", "--moe-capacity-factor", "1.5")
    ],
    "fp16": ["--precision", "fp16", "--zero", "1"],
}


def _steps_on_meta(base: str, data: str) -> dict[str, str]:
    """Two steps of every layout with the step's default device meta; the error of each that fails."""
    from experiments.train import run
    from research.trainer import Trainer

    train_on = Trainer._train_on

    def on_meta(self: Trainer, ids: list[torch.Tensor], targets: list[torch.Tensor]) -> tuple:
        with torch.device("meta"):
            return train_on(self, ids, targets)

    Trainer._train_on = on_meta
    failed = {}
    for name, argv in LAYOUTS.items():
        out = os.path.join(base, name)
        common = ["--seq-len", "32", "--global-batch-size", "8", "--steps", "2", "--wandb", "disabled"]
        common += [
            "--log-every",
            "1000",
            "--comm-timeout",
            "30",
            "--data",
            data,
            "--data-cache",
            os.path.join(base, "cache"),
            "--out",
            out,
        ]
        try:
            run([*MODEL, *common, *argv])
        except Exception as e:  # reported per layout: every rank fails alike
            failed[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    return failed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_layout_makes_its_tensors_on_the_model_device(tmp_path) -> None:
    data = tmp_path / "text.txt"
    data.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(200)))
    failed = run_distributed(_steps_on_meta, 4, str(tmp_path), str(data), timeout=540)[0]
    assert not failed, failed


def _meta_all_reduce() -> str:
    try:
        comm.all_reduce(torch.zeros(4, device="meta"))
    except ValueError as e:
        return str(e)
    return ""


def test_a_collective_refuses_a_tensor_off_its_backends_devices() -> None:
    sentence = run_distributed(_meta_all_reduce, 2, timeout=60)[0]
    assert "all_reduce on group" in sentence and "(gloo) got tensors on meta" in sentence
    assert "create it on the model's device" in sentence
