"""The training loop: one optimizer step = one global batch through the pipeline schedule.

Per step, data-parallel rank d takes rows [d·B/dp, (d+1)·B/dp) of global batch `step`
(B = global batch size), split into m micro-batches (whole sequences; under context parallelism
the model keeps each cp rank's share of every sequence, `ContextGroups.shard`); the `PipelineExecutor` runs them
through this rank's model chunks (pp = 1 is the one-stage pipeline: forward and backward
per micro-batch, gradient reduction deferred to the last backward); then the ZeroOptimizer
clips by the global norm and steps. The logged loss is the mean over the global batch:
(1/dp) Σ_d (1/m) Σ_i loss(d, i), every micro-batch holding the same number of tokens (a cp
rank's loss is its share × cp, so the mean over dp × cp is the same number).

LR: linear warm-up to `lr` over `warmup_steps`, then cosine decay to `min_lr` at step
`lr_decay_steps` (default: the last step) and `min_lr` after it (or constant). Weight decay applies to matrices, not to norms and biases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters

from optim import ZeroOptimizer
from optim.policies import DTYPES, Communication, MixedPrecision, ZeroPlusPlus
from parallel import accounting, comm
from parallel.pipeline.executor import PipelineExecutor
from parallel.random import seed_everything
from research import checkpoint, costmodel, data, metrics, moe
from research.config import RUN_FILES, RunConfig, TrainConfig, check_vocab, save_yaml
from research.errors import NonFiniteLossError
from research.model import GPTConfig, compile_blocks, pipeline_chunks

SCHEDULE = ("lr", "min_lr", "warmup_steps", "lr_decay_steps", "lr_schedule", "steps")  # what sets lr(t)


def lr_multiplier(tr: TrainConfig) -> Callable[[int], float]:
    """lr(t)/lr: (t+1)/W for t < W warm-up steps, then cosine from 1 at step W to
    min_lr/lr at the last decay step D-1 (D = lr_decay_steps or steps), flat after it
    (constant 1 with lr_schedule=constant)."""
    floor = tr.min_lr / tr.lr
    decay_steps = tr.lr_decay_steps or tr.steps

    def multiplier(t: int) -> float:
        if t < tr.warmup_steps:
            return (t + 1) / tr.warmup_steps
        if tr.lr_schedule == "constant":
            return 1.0
        span = max(1, decay_steps - tr.warmup_steps - 1)
        progress = min(1.0, (t - tr.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def load_data(cfg: RunConfig) -> tuple[GPTConfig, data.GlobalBatches]:
    """The run's model config with its vocabulary raised to the tokenizer's, and the run's
    global batches (a collective when torch.distributed is initialized: rank 0 tokenizes).
    A vocabulary that --tp does not split is a ConfigError before any tokenizing; unusable
    data is a DataError on every rank, printed by the rank that found it."""
    tokenizer = data.load_tokenizer(cfg.data.tokenizer)
    model = cfg.model.with_vocab_of(tokenizer.vocab_size)
    check_vocab(model, cfg.parallel.tp)
    tokens = data.load_tokens(
        cfg.data.data,
        tokenizer,
        cache_dir=cfg.data.data_cache,
        num_proc=cfg.data.num_proc,
        text_field=cfg.data.text_field,
    )
    return model, data.GlobalBatches(
        tokens, cfg.data.seq_len, cfg.train.global_batch_size, cfg.train.seed, source=data.describe(cfg.data.data)
    )


def one_graph_per_block(cfg: RunConfig) -> bool:
    """Whether --compile can hold each block in one graph (fullgraph): nothing breaks it, no
    ZeRO-3 gather, no ring of context parallelism, no MoE routing (TP, SP and all-to-all
    context parallelism run `parallel.functional`'s operators, inside the graph), no dropout
    (its RNG-tracker fork saves and restores the generator's state, eagerly)."""
    par = cfg.parallel
    ring = par.cp > 1 and par.cp_mode != "all-to-all"
    return par.zero < 3 and not ring and not cfg.model.moe_experts and cfg.model.dropout == 0


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Matrices decay; vectors (norm weights, biases) do not."""
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_optimizer(
    cfg: RunConfig,
    model: nn.Module,
    dp_group: dist.ProcessGroup | None = None,
    mp_group: dist.ProcessGroup | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    node_groups: tuple[dist.ProcessGroup, dist.ProcessGroup | None] | None = None,
) -> ZeroOptimizer:
    """The run's ZeroOptimizer over `model`: AdamW with decay on matrices only, the ZeRO
    stage, precision, reduction dtype, fp16 loss scaling and bucket sizes of `cfg`, sharded
    over `dp_group` (None: the default group; with `replicate_group`, one replica's shard
    group), norms taken over `mp_group` too; with --hpz, the secondary partition in
    `node_groups` (`ParallelDims.dp_shard_node_groups`), which qgZ's all-to-alls follow too."""
    par, tr = cfg.parallel, cfg.train
    return ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=par.zero,
        process_group=dp_group,
        replicate_group=replicate_group,
        model_parallel_group=mp_group,
        param_groups=weight_decay_groups(model, tr.weight_decay),
        node_groups=node_groups,
        precision=MixedPrecision(DTYPES[tr.precision], DTYPES[tr.reduce_dtype]),
        communication=Communication(
            bucket_numel=par.bucket_numel,
            unit_numel=par.unit_numel,
            overlap_param_gather=par.overlap_param_gather,
            find_unused_parameters=par.find_unused_parameters,
            # --comm-timeout's desync report speaks first; the watchdog covers what it cannot see
            timeout_s=par.comm_timeout + 30 if par.comm_timeout else Communication.timeout_s,
        ),
        zero_plus_plus=ZeroPlusPlus(par.qwz_block, par.qwz_float8, par.hpz, par.qgz_bits),
        lr=tr.lr,
        betas=(tr.beta1, tr.beta2),
        eps=tr.eps,
    )


class Trainer:
    """Builds everything a run needs from a validated `RunConfig` (a collective: every rank
    constructs one), then `train()` runs the steps and returns the summary."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        par, tr = cfg.parallel, cfg.train
        self._created = started = time.perf_counter()
        self.device = _device()
        self.dims = d = par.dims().build(timeout_s=par.comm_timeout)
        self.rank = dist.get_rank()
        seed_everything(tr.seed, d.tp_rank, d.pp_rank)
        context = f" × cp {d.cp} ({par.cp_mode})" if d.cp > 1 else ""
        layout = f"tp {d.tp}{context} × pp {d.pp} × dp {d.dp}" + (f" (ep {d.ep})" if d.ep > 1 else "")
        metrics.say(f"start-up: process groups, {layout} ({time.perf_counter() - started:.1f} s)")
        started = time.perf_counter()
        cfg.model, self.batches = load_data(cfg)
        metrics.say(
            f"start-up: data, {len(self.batches.tokens):,} tokens from {data.describe(cfg.data.data)} "
            f"({time.perf_counter() - started:.1f} s)"
        )
        started = time.perf_counter()
        self._build_model()
        self.start_step = 0
        self.resumed_from: str | None = None  # the checkpoint folder loaded
        self._load_or_resume()
        trained = sum(shape.numel() for shape in self.opt.param_shapes().values())
        metrics.say(
            f"start-up: model ({trained:,} trained parameters on rank 0{', blocks compiled' if self.compiled else ''}) "
            f"and ZeRO-{par.zero} optimizer "
            f"({time.perf_counter() - started:.1f} s); the first step warms up"
        )

    def _build_model(self) -> None:
        """This rank's pipeline chunks, the ZeroOptimizer, the LR schedule and the executor."""
        cfg, dims = self.cfg, self.dims
        par, tr = cfg.parallel, cfg.train
        chunks = pipeline_chunks(
            cfg.model,
            dims.pp_rank,
            dims.pp,
            par.virtual_stages,
            dims.tp_group,
            dims.embedding_group,
            par.sequence_parallel,
            expert_groups=dims.expert_groups,
            context=dims.context,
        )
        self.model = nn.ModuleList(chunks).to(self.device)
        self.param_dtype = DTYPES[tr.precision]
        self.opt = build_optimizer(
            cfg, self.model, dims.dp_shard_group, dims.mp_group, dims.dp_replicate_group, dims.dp_shard_node_groups
        )
        self.compiled = tr.compile if tr.compile is not None else self.device.type == "cuda"
        if self.compiled:
            compile_blocks(chunks, fullgraph=one_graph_per_block(cfg))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_multiplier(cfg.train))
        self.executor = PipelineExecutor(
            chunks,
            par.schedule,
            tr.micro_batches,
            dims.pp_group,
            optimizer=self.opt,
            grad_sync=par.grad_sync,
        )
        seq = cfg.data.seq_len // dims.cp // (dims.tp if par.sequence_parallel and dims.tp > 1 else 1)
        self.activation_shape = (seq, tr.micro_batch_size, cfg.model.d_model)

    # ---- checkpoints ----------------------------------------------------------------------
    def _load_or_resume(self) -> None:
        """--load a checkpoint, or --resume from the latest one in a folder if it holds any."""
        where = self.cfg.checkpoint
        if where.load:
            self._resume(where.load)
        elif where.resume:
            found = checkpoint.latest(where.resume)
            if found is not None:
                self._resume(found)
            metrics.say(
                f"--resume: resuming from {found} at step {self.start_step}"
                if found is not None
                else f"--resume: {where.resume} holds no checkpoint yet; starting at step 0"
            )

    def _expected_shapes(self) -> dict[str, list[int]]:
        return checkpoint.full_shapes(self.model, self.opt, self.dims.tp)

    def _resume(self, where: str) -> None:
        path = checkpoint.resolve(where)
        meta = checkpoint.read_meta(path)
        checkpoint.verify_files(path, meta)
        checkpoint.check_compatible(path, meta, self.cfg.model, self._expected_shapes())
        saved_batch = meta["data"]["global_batch_size"]
        if saved_batch != self.cfg.train.global_batch_size:
            raise checkpoint.CheckpointError(
                f"--global-batch-size={self.cfg.train.global_batch_size} differs from the checkpoint's {saved_batch}; "
                "resume with the same global batch size (the data position counts its batches)"
            )
        changed = self._schedule_change(meta)
        rng_restored = checkpoint.load(path, meta, self.model, self.opt, self.dims)
        self.scheduler.load_state_dict(meta["scheduler"])
        self.start_step = meta["step"]
        if changed:
            self._reschedule(changed)
        if not rng_restored:
            seed_everything(self.cfg.train.seed + self.start_step, self.dims.tp_rank, self.dims.pp_rank)
        self.resumed_from = path

    def _schedule_change(self, meta: dict[str, Any]) -> str:
        """The LR schedule flags that differ from the checkpoint's where they change lr(t) for a
        step still to run ("" when none). Such a change is refused unless --reschedule."""
        tr, step = self.cfg.train, meta["step"]
        recorded = meta.get("config", {}).get("train", {})
        saved = dataclasses.replace(tr, **{k: recorded.get(k, getattr(tr, k)) for k in SCHEDULE})
        old, new = lr_multiplier(saved), lr_multiplier(tr)
        if all(math.isclose(saved.lr * old(t), tr.lr * new(t)) for t in range(step, tr.steps)):
            return ""
        flags = [f"--{k.replace('_', '-')}={getattr(tr, k)} (was {getattr(saved, k)})" for k in SCHEDULE]
        changes = ", ".join(f for k, f in zip(SCHEDULE, flags) if getattr(tr, k) != getattr(saved, k))
        what = f"{changes} changes the LR schedule at step {step + 1}: lr {saved.lr * old(step):.3e} -> {tr.lr * new(step):.3e}"
        if not self.cfg.checkpoint.reschedule:
            keep = f"--lr-decay-steps={saved.lr_decay_steps or saved.steps}"
            raise checkpoint.CheckpointError(
                f"{what}; keep the checkpoint's schedule (to train longer on it, pass {keep}: the lr stays at "
                "--min-lr after it), or pass --reschedule to apply the new one from this step"
            )
        return what

    def _reschedule(self, what: str) -> None:
        """--reschedule: the new schedule from the resume step on (the checkpoint's scheduler
        and optimizer hold the old one's base lr and this step's lr), said on the console."""
        lr = self.cfg.train.lr
        self.scheduler.base_lrs = [lr] * len(self.opt.param_groups)
        for group in self.opt.param_groups:
            group["initial_lr"] = lr
            group["lr"] = lr * lr_multiplier(self.cfg.train)(self.start_step)
        metrics.say(f"--reschedule: {what}")

    def _save(self, step: int) -> str:
        cfg = self.cfg
        meta = {
            "data": {
                "seed": cfg.train.seed,
                "global_batch_size": cfg.train.global_batch_size,
                "consumed_samples": step * cfg.train.global_batch_size,
            },
            "scheduler": self.scheduler.state_dict(),
            "layout": {
                "tp": self.dims.tp,
                "pp": self.dims.pp,
                "dp": self.dims.dp,
                "dp_shard": self.dims.dp_shard,
                "ep": self.dims.ep,
                "cp": self.dims.cp,
                "cp_mode": cfg.parallel.cp_mode,
                "zero": cfg.parallel.zero,
                "schedule": cfg.parallel.schedule,
                "virtual_stages": cfg.parallel.virtual_stages,
            },
            "model": dataclasses.asdict(cfg.model),
            "config": cfg.to_dict(),
        }
        return checkpoint.save(cfg.checkpoint.root, step, self.model, self.opt, self.dims, meta)

    # ---- one step -------------------------------------------------------------------------
    def step(self, step: int) -> tuple[torch.Tensor | None, torch.Tensor, float]:
        """Train step `step` (0-based) on its batch: (this rank's mean micro-batch loss or
        None, global grad norm, the lr used)."""
        inputs, labels = self.batches.batch(step)
        micro = data.local_micro_batches(inputs, labels, self.dims.dp_rank, self.dims.dp, self.cfg.train.micro_batches)
        ids = [x.to(self.device) for x, _ in micro]
        targets = [y.to(self.device) for _, y in micro]
        return self._train_on(ids, targets)

    def _train_on(
        self, ids: list[torch.Tensor], targets: list[torch.Tensor]
    ) -> tuple[torch.Tensor | None, torch.Tensor, float]:
        """One optimizer step on this rank's micro-batches, already on the device: everything
        the step creates is made on the device, which tests/test_placement.py checks."""
        loss = self.executor.run(ids, targets, self.activation_shape, self.param_dtype)
        clip = self.cfg.train.clip_grad
        norm = self.opt.clip_grad_norm_(clip if clip > 0 else math.inf)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        if not self.opt.last_step_skipped:
            self.scheduler.step()
        self.opt.zero_grad()
        return loss, norm, lr

    def _global_loss(self, loss: torch.Tensor | None) -> float:
        """Mean loss over the global batch, on every rank (only last-stage ranks hold one)."""
        value = torch.tensor([float(loss) if loss is not None else 0.0], dtype=torch.float64, device=self.device)
        comm.all_reduce(value, group=self.dims.pp_group)
        comm.all_reduce(value, group=self.dims.dp_cp_group)
        return value.item() / (self.dims.dp * self.dims.cp)

    # ---- the run --------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Run steps start_step .. steps-1; write metrics.jsonl, summary.json, checkpoints.
        A resumed run with no step left says so and returns {}, leaving its folder as it is."""
        cfg, tr = self.cfg, self.cfg.train
        out, lead = cfg.log.out, self.rank == 0
        if self._nothing_left():
            return {}
        if lead:
            self._prepare_out()
        tokens_per_step = tr.global_batch_size * cfg.data.seq_len
        flops_per_token = dataclasses.replace(cfg.model, recompute="none").flops_per_token(cfg.data.seq_len)
        peak = metrics.peak_flops(self.device, self.param_dtype)
        world = dist.get_world_size()
        group = cfg.log.wandb_group or os.path.basename(os.path.normpath(out))
        with contextlib.ExitStack() as stack:
            file = stack.enter_context(metrics.MetricsFile(os.path.join(out, "metrics.jsonl"))) if lead else None
            run_id = metrics.run_id_for(out, resuming=self.start_step > 0) if lead else None
            run = stack.enter_context(
                metrics.WandbRun(
                    cfg.log.wandb, cfg.log.wandb_project, group, cfg.log.wandb_name, out, cfg.to_dict(), run_id
                )
            )
            console = metrics.Console(tr.steps, self.start_step, enabled=lead, log_every=cfg.log.log_every)
            comm_total: dict[str, dict[str, dict[str, int]]] = {}
            rows: list[dict[str, Any]] = []
            activation_peak = 0
            nonfinite = 0  # consecutive steps with a NaN/Inf loss
            comm.barrier()  # the ranks start the first step together: start-up is not a step's wait
            started = time.perf_counter()
            startup_s = started - self._created
            for step in range(self.start_step, tr.steps):
                row, log, measured = self._timed_step(
                    step, step == self.start_step, tokens_per_step, flops_per_token, world, peak
                )
                activation_peak = measured if measured is not None else activation_peak
                _merge(comm_total, log)
                rows.append(row)
                if lead:
                    file.write(row)
                    run.log(row, step + 1)
                console.update(step + 1, row)
                nonfinite = self._check_loss_and_save(step, row["loss"], nonfinite, console)
            summary = self._summary(rows, comm_total, activation_peak, time.perf_counter() - started)
            summary["startup_s"] = startup_s
            if lead:
                self._write_summary(summary, run)
            console.close(summary)
        comm.barrier()
        return summary

    def _prepare_out(self) -> None:
        """The run folder (first rank): its config.yaml, metrics.jsonl cut to the steps before
        this start, and a "resumed" event saying why the run started again; with --overwrite a
        fresh run first removes the files of the run it replaces (its wandb run included)."""
        out = self.cfg.log.out
        os.makedirs(out, exist_ok=True)
        if self.cfg.log.overwrite and self.start_step == 0:
            for name in (*RUN_FILES, "events.jsonl", "wandb_id"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(out, name))
            shutil.rmtree(os.path.join(out, "wandb"), ignore_errors=True)
        save_yaml(self.cfg, os.path.join(out, "config.yaml"))
        _keep_metrics_before(os.path.join(out, "metrics.jsonl"), self.start_step)
        if self.resumed_from is not None:
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            cause = (
                f"torchrun restarted the workers (attempt {attempt}) after one failed"
                if attempt
                else "the job was started again"
            )
            metrics.log_event(out, "resumed", step=self.start_step, checkpoint=self.resumed_from, cause=cause)

    def _check_loss_and_save(self, step: int, loss: float, nonfinite: int, console: metrics.Console) -> int:
        """The number of consecutive non-finite losses up to this step (the run stops when it
        reaches --max-nonfinite-steps); saves a checkpoint when one is due, unless the loss is
        not finite."""
        tr, ck = self.cfg.train, self.cfg.checkpoint
        nonfinite = 0 if math.isfinite(loss) else nonfinite + 1
        if nonfinite >= tr.max_nonfinite_steps:
            raise NonFiniteLossError(
                f"the loss was {loss} for {nonfinite} consecutive step(s) up to step {step + 1} "
                f"(--max-nonfinite-steps={tr.max_nonfinite_steps}); lower --lr, use --precision bf16 "
                "or fp32, or resume from an earlier checkpoint"
            )
        every = ck.save_every
        if ck.root and ((every and (step + 1) % every == 0) or step + 1 == tr.steps):
            if nonfinite:
                console.warn(f"step {step + 1}: the loss is {loss}: checkpoint not saved")
            else:
                started = time.perf_counter()
                path = self._save(step + 1)
                console.say(f"saved step {step + 1} to {path} ({time.perf_counter() - started:.1f} s)")
        return nonfinite

    def _write_summary(self, summary: dict[str, Any], run: metrics.WandbRun) -> None:
        """Rank 0: the export (if asked), summary.json and the wandb summary."""
        cfg = self.cfg
        if cfg.checkpoint.export:
            checkpoint.export(cfg.checkpoint.root, cfg.checkpoint.export)
        metrics.write_json(os.path.join(cfg.log.out, "summary.json"), summary)
        run.summary({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})

    def _nothing_left(self) -> bool:
        """Whether a resumed run is already at --steps (said on the console)."""
        tr = self.cfg.train
        if self.start_step < tr.steps:
            return False
        metrics.say(
            f"nothing to train: the checkpoint is at step {self.start_step} of --steps={tr.steps}; raise --steps "
            f"to train on (with --lr-decay-steps={tr.lr_decay_steps or self.start_step} the LR schedule stays)"
        )
        return True

    def _timed_step(
        self, step: int, measure_activations: bool, tokens: int, flops_per_token: float, world: int, peak: float | None
    ) -> tuple[dict[str, Any], dict, int | None]:
        """One step and its metrics row, communication log and (if asked) activation peak."""
        metrics.reset_peak_memory(self.device)
        meter = metrics.ActivationMeter(self.model) if measure_activations else contextlib.nullcontext()
        t0 = time.perf_counter()
        with accounting.tracking() as log, meter:
            loss, norm, lr = self.step(step)
        loss_value = self._global_loss(loss)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        ranked = self._over_ranks(metrics.peak_memory_bytes(self.device), log.wait_s, time.perf_counter() - t0)
        step_time = ranked["step_time_s"]
        row = {
            "step": step + 1,
            "loss": loss_value,
            "grad_norm": float(norm),
            "lr": lr,
            "loss_scale": self.opt.scaler.scale if self.opt.scaler is not None else None,
            "skipped": self.opt.last_step_skipped,
            **ranked,
            **metrics.throughput(tokens, step_time, flops_per_token, world, peak),
        }
        if self.compiled:  # distinct graphs compiled so far on this rank: constant once warm, or it recompiles
            row["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
        if self.cfg.model.moe_experts:  # the loss: cross-entropy and every MoE layer's auxiliary losses
            merged = moe.merge_router_metrics(
                metrics.all_ranks(moe.router_metrics(self.model, count_slots=self.dims.tp_rank == 0))
            )
            row["loss"] += merged["moe_aux_loss"] + merged["moe_z_loss"] - merged.pop("in_loss")
            row.update(merged)
        return row, log.as_dict(), meter.peak_bytes if measure_activations else None

    def _over_ranks(self, peak_bytes: int, wait_s: float, step_s: float) -> dict[str, Any]:
        """The step's time and peak memory, the largest over ranks (each rank times its own
        step; the slowest sets the pace), and each rank's seconds blocked in collectives within
        its step (`comm_wait_s`, rank order: the ranks that wait are those whose peers are late
        or whose links are slow; never more than `step_time_s`)."""
        rows = metrics.over_ranks([float(peak_bytes), wait_s, step_s], self.device)
        return {
            "step_time_s": max(r[2] for r in rows),
            "mem_peak_bytes": int(max(r[0] for r in rows)),
            "comm_wait_s": [r[1] for r in rows],
        }

    def _summary(
        self, rows: list[dict[str, Any]], comm_total: dict, activation_peak: int, wall: float
    ) -> dict[str, Any]:
        """The run's summary (identical on every rank; a collective)."""
        memory = self.opt.memory_breakdown()
        states = memory["params"] + memory["master"] + memory["optimizer"]
        mine = {
            "rank": self.rank,
            "coords": dict(zip(("pp", "dp", "cp", "tp"), self.dims.coords_of(self.rank))),
            "node": self.rank // self.dims.ranks_per_node,
            "memory_bytes": {
                "params": memory["params"],
                "grads": memory["grads"],
                "master_and_optimizer": memory["master"] + memory["optimizer"],
                "activations": activation_peak,
            },
            "grads_peak_bytes": self.opt.grad_peak_bytes,
            # each part at its own peak: an upper bound of what the rank held at once
            "peak_bytes": states + self.opt.grad_peak_bytes + activation_peak,
            "comm_per_step": metrics.comm_per_step(
                comm_total, max(1, len(rows)), groups=("tp", "pp", "dp", "ep", *(("cp",) if self.dims.cp > 1 else ()))
            ),
        }
        ranks = metrics.all_ranks(mine)
        return {
            **metrics.summarize(rows),
            "first_step": self.start_step + 1,
            "wall_time_s": wall,
            "num_params": costmodel.num_params(self.cfg.model),
            "active_params": costmodel.active_params(self.cfg.model),
            "comm_per_step": ranks[0]["comm_per_step"],
            "ranks": ranks,
            "config": self.cfg.to_dict(),
        }


def _keep_metrics_before(path: str, start_step: int) -> None:
    """Drop metrics.jsonl lines of steps after `start_step` (all of them for a fresh run),
    so a resumed run's file has each step once."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= start_step]
    with open(path, "w") as f:
        f.writelines(kept)


def _merge(total: dict, step_log: dict) -> None:
    for group, ops in step_log.items():
        for op, entry in ops.items():
            into = total.setdefault(group, {}).setdefault(op, dict.fromkeys(entry, 0))
            for k, v in entry.items():
                into[k] += v


def _device() -> torch.device:
    """One GPU per rank (LOCAL_RANK) when CUDA is there, else the CPU (torchrun gives each
    process OMP_NUM_THREADS=1 unless told otherwise)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")
