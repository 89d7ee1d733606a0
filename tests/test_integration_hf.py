"""ZeroTrainer (optim.integrations.hf): transformers.Trainer with ZeroOptimizer trains a tiny
GPT-2 on 2 ranks exactly like a single-process torch loop over the same global batches,
writes the full weights to model.safetensors at every stage, resumes exactly from its
sharded checkpoint, and refuses what it cannot support with one sentence.

All training runs share one 2-rank launch (the `runs` fixture); the tests read its results."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from safetensors.torch import load_file
from torch._dynamo.utils import counters
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, get_scheduler

from optim.integrations.hf import ZERO_OPTIMIZER_DIR, ZeroTrainer
from optim.policies import Communication, MixedPrecision
from parallel import accounting
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

WORLD, STEPS, ACCUM, MICRO, SEQ, VOCAB, EVAL_ROWS = 2, 10, 2, 2, 16, 64, 8
LR, WEIGHT_DECAY, CLIP, WARMUP = 3e-3, 0.1, 1.0, 3
# Adam moves an element whose gradient is rounding noise by up to ±lr: eps = 1e-6 (not 1e-8)
# keeps near-zero gradients from amplifying summation-order differences (as in
# tests/test_model_zero.py). GPT-2's attention key biases have an analytically zero gradient
# (softmax ignores a score added to every key); they stay pure noise below 1e-7, inside ATOL.
EPS, RTOL, ATOL = 1e-6, 1e-5, 1e-6
# several buckets, stage-3 units per block
ZERO_KWARGS = {"communication": Communication(bucket_numel=3000, unit_numel=2000)}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    """STEPS global batches of sequences whose labels are partly masked (-100), so that
    micro-batches hold different numbers of tokens and the loss normalisation matters."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(STEPS * WORLD * ACCUM * MICRO):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = torch.where(torch.rand(SEQ, generator=g) < 0.3, -100, ids)
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def training_args(output_dir: str, **overrides) -> TrainingArguments:
    settings = {
        "output_dir": output_dir,
        "use_cpu": True,
        "report_to": [],
        "max_steps": STEPS,
        "per_device_train_batch_size": MICRO,
        "per_device_eval_batch_size": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "learning_rate": LR,
        "weight_decay": WEIGHT_DECAY,
        "adam_epsilon": EPS,
        "max_grad_norm": CLIP,
        "warmup_steps": WARMUP,
        "lr_scheduler_type": "linear",
        "optim": "adamw_torch",
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 5,
        "disable_tqdm": True,
        "seed": 0,
    }
    return TrainingArguments(**{**settings, **overrides})


class RecordingTrainer(ZeroTrainer):
    """ZeroTrainer that keeps this rank's training micro-batches, in order."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        if model.training:
            self.seen.append((inputs["input_ids"].clone(), inputs["labels"].clone()))
        return super().compute_loss(model, inputs, *args, **kwargs)


def train(stage: int, output_dir: str, resume: str | None = None, **overrides) -> dict:
    """One ZeroTrainer run; what it saw, logged and ended with."""
    trainer = RecordingTrainer(
        model=gpt2(),
        args=training_args(output_dir, **overrides),
        train_dataset=dataset(),
        eval_dataset=dataset()[:EVAL_ROWS],
        zero_stage=stage,
        zero_kwargs=ZERO_KWARGS,
    )
    trainer.seen = []
    counters["stats"].clear()
    with accounting.tracking() as log:
        trainer.train(resume_from_checkpoint=resume)
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "seen": trainer.seen,
        "norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        "reductions": log.calls(op="reduce_scatter_tensor") / len(trainer.zero_optimizer.buckets),
        "weights": trainer.zero_optimizer.full_state_dict(),
        "find_unused": trainer.zero_optimizer.communication.find_unused_parameters,
        "eval_loss": trainer.evaluate()["eval_loss"],
        "decay": trainer.get_decay_parameter_names(trainer.model),
        # whether Trainer counts the tokens a causal LM predicts (labels[:, 1:]) or every label:
        # transformers 5.23 counts every label for GPT-2, whose config names no loss_type
        "count_shifted": trainer._loss_shifts_labels,
    }


def stage_overrides(stage: int) -> dict:
    """Stage 2 reduces every micro-batch (accelerate's sync_each_batch), stage 3 checkpoints
    activations. Fresh dicts each call: TrainingArguments writes into accelerator_config."""
    if stage == 1:  # every GPT-2 parameter gets a gradient: the promise holds
        return {"ddp_find_unused_parameters": False}
    if stage == 2:
        return {"accelerator_config": {"gradient_accumulation_kwargs": {"sync_each_batch": True}}}
    return {"activation_checkpointing": True} if stage == 3 else {}


def train_stages(root: str) -> dict:
    """Stages 0-3 for STEPS steps each, then each stage resumed from its checkpoint-5 by a
    fresh trainer."""
    runs = {stage: train(stage, os.path.join(root, f"stage{stage}"), **stage_overrides(stage)) for stage in range(4)}
    for stage in range(4):
        checkpoint = os.path.join(root, f"stage{stage}", "checkpoint-5")
        resumed = os.path.join(root, f"resumed{stage}")
        runs[("resumed", stage)] = train(stage, resumed, resume=checkpoint, **stage_overrides(stage))
    for stage in COMPILED:
        compiled = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
        runs[("compiled", stage)] = train(
            stage, os.path.join(root, f"compiled{stage}"), **compiled, **stage_overrides(stage)
        )
    return runs


def reference(
    seen: list[list[tuple[torch.Tensor, torch.Tensor]]], decay: list[str], count_shifted: bool
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process AdamW over the global batches the ranks saw (step s: micro-batches
    s·ACCUM … of every rank), with the loss Trainer computes: the summed token cross entropy
    over the number of labelled tokens of the whole global batch, counted as Trainer counts
    them. Returns the grad norms and the final weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = gpt2()
        named = list(model.named_parameters())
        opt = torch.optim.AdamW(
            [
                {"params": [p for n, p in named if n in decay], "weight_decay": WEIGHT_DECAY},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ],
            lr=LR,
            eps=EPS,
        )
        sched = get_scheduler("linear", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS)
        norms = []
        for step in range(STEPS):
            batch = [mb for rank in seen for mb in rank[step * ACCUM : (step + 1) * ACCUM]]
            ids = torch.cat([i for i, _ in batch])
            labels = torch.cat([lab for _, lab in batch])
            logits = model(input_ids=ids).logits[:, :-1].float()
            loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")
            (loss / ((labels[:, 1:] if count_shifted else labels) != -100).sum()).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            sched.step()
            opt.zero_grad()
        return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("hf"))
    return root, run_distributed(train_stages, WORLD, root, timeout=240)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matches_single_process_adamw(runs, stage) -> None:
    """Gradient accumulation 2, clipping at 1.0 (the logged norm is the global one), weight
    decay groups, linear warm-up: the norms and final weights (on both ranks) equal the
    single-process loop's, and Trainer.evaluate() gives stage 0's eval loss. Gradients are
    reduced once per step (stage 2: once per micro-batch, as sync_each_batch asks), so the
    micro-batches before the last ran under no_sync()."""
    _, ranks = runs
    run = ranks[0][stage]
    ref_norms, ref_weights = reference([r[stage]["seen"] for r in ranks], run["decay"], run["count_shifted"])
    assert min(ref_norms) < CLIP < max(ref_norms)  # clipping is exercised, and not on every step
    torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref_norms), rtol=RTOL, atol=0)
    for rank in ranks:
        assert rank[stage]["weights"].keys() == ref_weights.keys()
        for name, want in ref_weights.items():
            torch.testing.assert_close(rank[stage]["weights"][name], want, rtol=RTOL, atol=ATOL, msg=name)
    assert run["eval_loss"] == pytest.approx(ranks[0][0]["eval_loss"], rel=RTOL)
    assert run["find_unused"] == (stage != 1)  # TrainingArguments(ddp_find_unused_parameters=False) at stage 1
    if stage > 0:  # stage 0 all-reduces; its all_reduce count mixes in the grad norm's
        assert run["reductions"] == STEPS * (ACCUM if stage == 2 else 1)


COMPILED = (1, 3)


@pytest.mark.parametrize("stage", COMPILED)
def test_torch_compile_trains_as_eager(runs, stage) -> None:
    """TrainingArguments(torch_compile=True): the model Trainer compiles (its stage-3 gathers
    between the compiled graphs) ends on the eager run's norms and weights."""
    _, ranks = runs
    for rank in ranks:
        eager, compiled = rank[stage], rank[("compiled", stage)]
        assert compiled["graphs"] > 0 and eager["graphs"] == 0  # compiled indeed, and only when asked
        assert compiled["seen"] and len(compiled["seen"]) == len(eager["seen"])
        torch.testing.assert_close(torch.tensor(compiled["norms"]), torch.tensor(eager["norms"]), rtol=RTOL, atol=0)
        for name, want in eager["weights"].items():
            torch.testing.assert_close(compiled["weights"][name], want, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_safetensors_holds_the_full_weights(runs, stage) -> None:
    """checkpoint-10/model.safetensors holds every weight at full shape (the tied lm_head once,
    as save_pretrained writes it) equal to the optimizer's full_state_dict; checkpoint-5 holds
    the optimizer's sharded state."""
    root, ranks = runs
    saved = load_file(os.path.join(root, f"stage{stage}", "checkpoint-10", "model.safetensors"))
    full = ranks[0][stage]["weights"]
    assert set(saved) == set(full) - {"lm_head.weight"}
    for name, tensor in saved.items():
        assert torch.equal(tensor, full[name]), name
    assert os.path.isfile(os.path.join(root, f"stage{stage}", "checkpoint-5", ZERO_OPTIMIZER_DIR, ".metadata"))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_from_checkpoint_is_exact(runs, stage) -> None:
    """A fresh ZeroTrainer resumed from checkpoint-5 (the weights come back through the
    optimizer's fp32 masters) sees the same last 5 global batches, logs the same norms and ends
    with bitwise the same weights as the uninterrupted run."""
    _, ranks = runs
    for rank in ranks:
        whole, resumed = rank[stage], rank[("resumed", stage)]
        assert len(resumed["seen"]) == len(whole["seen"]) // 2
        for (ids, labels), (ids_whole, labels_whole) in zip(resumed["seen"], whole["seen"][len(resumed["seen"]) :]):
            assert torch.equal(ids, ids_whole) and torch.equal(labels, labels_whole)
        assert resumed["norms"] == whole["norms"]  # the first 5 from the checkpoint's trainer_state
        for name, tensor in whole["weights"].items():
            assert torch.equal(resumed["weights"][name], tensor), name


def _plain_trainer_checkpoint(args: TrainingArguments, root: str) -> None:
    """Resumes from a plain Trainer's checkpoint (its optimizer.pt is no sharded state)."""
    plain = os.path.join(root, "plain")
    Trainer(model=gpt2(), args=training_args(plain, max_steps=1, save_steps=1), train_dataset=dataset()).train()
    trainer = ZeroTrainer(model=gpt2(), args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=os.path.join(plain, "checkpoint-1"))


def _with(**fields):
    """Builds a ZeroTrainer whose TrainingArguments also set `fields`."""

    def make(args: TrainingArguments, root: str) -> None:
        ZeroTrainer(model=gpt2(), args=training_args(root, **fields), train_dataset=dataset(), eval_dataset=dataset())

    return make


MISUSES = [  # (make, the start of its sentence)
    (
        lambda args, root: ZeroTrainer(
            model=(m := gpt2()), args=args, optimizers=(torch.optim.SGD(m.parameters(), 0.1), None)
        ),
        "ZeroTrainer builds its ZeroOptimizer itself once the model is on its device",
    ),
    (lambda args, root: ZeroTrainer(model=gpt2(), args=args, zero_stage=4), "zero_stage=4 is not a ZeRO stage"),
    (
        lambda args, root: ZeroTrainer(model=gpt2(), args=args, zero_kwargs={"lr": 1.0}),
        "zero_kwargs ['lr'] are not options ZeroTrainer passes to ZeroOptimizer",
    ),
    (
        lambda args, root: ZeroTrainer(
            model=gpt2(), args=args, zero_kwargs={"precision": MixedPrecision(torch.float16)}
        ),
        "zero_kwargs precision param_dtype=torch.float16 needs a loss-scaled backward",
    ),
    (_with(optim="adafactor"), "optim='adafactor' is not an elementwise optimizer"),
    (_with(fp16=True), "ZeroTrainer does not support fp16=True"),
    (
        _with(load_best_model_at_end=True, eval_strategy="steps", eval_steps=5, metric_for_best_model="loss"),
        "ZeroTrainer does not support load_best_model_at_end=True",
    ),
    (_with(fsdp=True), "ZeroTrainer cannot run under DeepSpeed or FSDP"),
    (_plain_trainer_checkpoint, "holds a plain Trainer's optimizer.pt, which ZeroTrainer cannot load"),
]


def misuse(root: str) -> list[str]:
    """The error of each of MISUSES, in order."""
    messages = []
    for make, _ in MISUSES:
        with pytest.raises(ValueError) as error:
            make(training_args(root), root)
        messages.append(str(error.value))
    return messages


def test_misuse_raises_one_sentence(tmp_path) -> None:
    """Each unsupported combination raises its sentence (on one rank, under a time limit)."""
    messages = run_distributed(misuse, 1, str(tmp_path), timeout=120)[0]
    for message, (_, expected) in zip(messages, MISUSES, strict=True):
        assert expected in message, message
        assert ". " not in message and "\n" not in message, message


def test_importing_optim_does_not_import_transformers() -> None:
    """optim and optim.integrations import neither transformers nor accelerate."""
    code = "import sys, optim, optim.integrations; print(sorted({'transformers', 'accelerate'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.stdout.strip() == "[]"
