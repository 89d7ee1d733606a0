"""Pipeline-parallel GPT training equals the single-process model: layer partitioning,
the executor for each schedule, tied embeddings across the first and last stage, and
ZeroOptimizer on the stages."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from optim import ZeroOptimizer
from optim.policies import Communication, MixedPrecision
from parallel import ParallelDims
from parallel.pipeline.executor import PipelineExecutor
from parallel.pipeline.partition import layer_ranges
from research.model import GPT, GPTConfig, pipeline_chunks
from tests.conftest import slow_except
from tests.dist_utils import run_distributed

CONFIG = GPTConfig(vocab_size=61, n_layers=8, n_heads=4, d_model=32, max_seq_len=16, vocab_multiple=64)
STEPS, M, MB, LR, CLIP, EPS = 5, 4, 2, 3e-3, 0.5, 1e-6


def warmup(step: int) -> float:
    """A short warm-up and eps = 1e-6 keep Adam from amplifying summation-order rounding in
    elements whose gradient is ~1e-8 (see tests/test_model_zero.py)."""
    return min(1.0, (step + 1) / 5)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, CONFIG.vocab_size, (M * MB, CONFIG.max_seq_len + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, no pipeline: the mean micro-batch loss per step, AdamW."""
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    losses, norms = [], []
    for ids, labels in batches():
        total = 0.0
        for i in range(M):
            loss = model(ids[i * MB : (i + 1) * MB], labels[i * MB : (i + 1) * MB])
            (loss / M).backward()
            total += loss.item() / M
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_pipeline(schedule: str, virtual_stages: int, stage: int) -> tuple[list[float], list[float], dict]:
    dims = ParallelDims(pp=dist.get_world_size()).build()
    chunks = pipeline_chunks(CONFIG, dims.pp_rank, dims.pp, virtual_stages, dims.tp_group, dims.embedding_group)
    model = nn.ModuleList(chunks)
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        process_group=dims.dp_group,
        model_parallel_group=dims.mp_group,
        lr=LR,
        eps=EPS,
        communication=Communication(bucket_numel=3000, unit_numel=2000),
    )
    executor = PipelineExecutor(chunks, schedule, M, dims.pp_group, optimizer=opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    losses, norms = [], []
    for ids, labels in batches():
        inputs = [ids[i * MB : (i + 1) * MB] for i in range(M)]
        targets = [labels[i * MB : (i + 1) * MB] for i in range(M)]
        loss = executor.run(inputs, targets, (CONFIG.max_seq_len, MB, CONFIG.d_model))
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    state = {k.split(".", 1)[1]: v for k, v in opt.full_state_dict().items()}
    return losses, norms, state


LAYOUTS = [
    (2, "gpipe", 1),
    (2, "1f1b", 1),
    (2, "interleaved-1f1b", 2),
    (2, "zb-h1", 1),
    (4, "gpipe", 1),
    (4, "1f1b", 1),
    (4, "interleaved-1f1b", 2),
    (4, "zb-h1", 1),
    (1, "interleaved-1f1b", 2),
]
QUICK = [(2, "1f1b", 1, 1), (2, "interleaved-1f1b", 2, 3), (2, "zb-h1", 1, 1)]


@pytest.mark.parametrize(
    "pp,schedule,v,stage",
    slow_except(QUICK, [(*layout, stage) for stage in (1, 3) for layout in LAYOUTS if (*layout, stage) not in QUICK]),
)
def test_pipeline_matches_single_process(pp: int, schedule: str, v: int, stage: int) -> None:
    ref_losses, ref_norms, ref_state = reference()
    results = run_distributed(train_pipeline, pp, schedule, v, stage, timeout=300)
    losses = results[-1][0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    state = {}
    for _losses, norms, rank_state in results:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        for k, value in rank_state.items():
            if k in state:  # the tied embedding, on the first and the last stage
                torch.testing.assert_close(value, state[k], rtol=0, atol=0)
            state[k] = value
    assert state.keys() == ref_state.keys()
    for k, value in ref_state.items():
        torch.testing.assert_close(state[k], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_layer_ranges() -> None:
    assert layer_ranges(8, 4) == [range(2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="7 layers do not split evenly into 4 pipeline stages"):
        layer_ranges(7, 4)
    uneven = layer_ranges(10, 4, allow_uneven=True)
    assert [len(r) for r in uneven] == [2, 3, 3, 2] and sum(len(r) for r in uneven) == 10
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages"):
        layer_ranges(3, 4)


def train_3d(stage: int) -> tuple[list[float | None], list[float], dict]:
    """tp 2 × pp 2 × dp 2: dp rank d runs rows (i·dp + d)·MB ... of micro-batch i."""
    from tests.test_model_parity import gather_tp, tp_dims

    dims = ParallelDims(tp=2, pp=2).build()
    chunks = pipeline_chunks(CONFIG, dims.pp_rank, dims.pp, 1, dims.tp_group, dims.embedding_group)
    model = nn.ModuleList(chunks)
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        process_group=dims.dp_group,
        model_parallel_group=dims.mp_group,
        lr=LR,
        eps=EPS,
        communication=Communication(bucket_numel=3000, unit_numel=1000),
    )
    executor = PipelineExecutor(chunks, "1f1b", M, dims.pp_group, optimizer=opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    mb = MB // dims.dp
    losses, norms = [], []
    for ids, labels in batches():
        rows = [slice(i * MB + dims.dp_rank * mb, i * MB + (dims.dp_rank + 1) * mb) for i in range(M)]
        loss = executor.run([ids[r] for r in rows], [labels[r] for r in rows], (CONFIG.max_seq_len, mb, CONFIG.d_model))
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        if loss is not None:
            dist.all_reduce(loss, group=dims.dp_group)
            loss = loss.item() / dims.dp
        losses.append(loss)
    names = tp_dims(model)
    full = opt.full_state_dict()
    state = gather_tp({k: full[k] for k in names}, names, dims.tp_group)
    return losses, norms, {k.split(".", 1)[1]: v for k, v in state.items()}


@pytest.mark.parametrize("stage", slow_except([1], [0, 2, 3]))
def test_3d_tp2_pp2_dp2_matches_single_process(stage: int) -> None:
    ref_losses, ref_norms, ref_state = reference()
    results = run_distributed(train_3d, 8, stage, timeout=400)
    torch.testing.assert_close(torch.tensor(results[-1][0]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    state = {}
    for _, norms, rank_state in results:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        state.update(rank_state)
    assert state.keys() == ref_state.keys()
    for k, value in ref_state.items():
        torch.testing.assert_close(state[k], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def measured_order(schedule_name: str, v: int) -> tuple[list, list]:
    """The compute actions the executor ran, in order, next to the schedule's."""
    from parallel.pipeline.schedules import COMPUTE, schedule

    dims = ParallelDims(pp=dist.get_world_size()).build()
    chunks = pipeline_chunks(CONFIG, dims.pp_rank, dims.pp, v, dims.tp_group, dims.embedding_group)
    executor = PipelineExecutor(chunks, schedule_name, M, dims.pp_group)
    outputs = []
    for chunk in chunks:
        if not chunk.post:
            chunk.register_forward_hook(lambda module, args, out: outputs.append(out))
    ids, labels = batches()[0]
    executor.run(
        [ids[i * MB : (i + 1) * MB] for i in range(M)],
        [labels[i * MB : (i + 1) * MB] for i in range(M)],
        (CONFIG.max_seq_len, MB, CONFIG.d_model),
    )
    ran = [(kind, mb, chunk) for _, kind, mb, chunk, start, end in executor.events]
    assert all(e[4] <= e[5] for e in executor.events)
    assert all(out.numel() == 0 for out in outputs), "sent activations must be freed"
    assert outputs or dims.is_last_stage
    planned = [
        (a.kind, a.microbatch, a.chunk)
        for a in schedule(schedule_name, dims.pp, dims.pp_rank, M, v)
        if a.kind in COMPUTE
    ]
    return ran, planned


@pytest.mark.parametrize("schedule_name,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_measured_action_order_is_the_schedule(schedule_name: str, v: int) -> None:
    """... and the storage of every activation sent downstream is freed after its send."""
    for ran, planned in run_distributed(measured_order, 2, schedule_name, v):
        assert ran == planned


def bad_executor(schedule_name: str, microbatches: int, v: int) -> str:
    dims = ParallelDims(pp=dist.get_world_size()).build()
    chunks = pipeline_chunks(CONFIG, dims.pp_rank, dims.pp, v, dims.tp_group, dims.embedding_group)
    try:
        PipelineExecutor(chunks, schedule_name, microbatches, dims.pp_group)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "schedule_name,m,v,expected",
    [
        ("1f1b", 2, 1, "1f1b with pp=4 needs at least 4 micro-batches, got 2"),
        ("1f1b", 4, 2, "does not interleave"),
        ("interleaved-1f1b", 6, 2, "interleaved-1f1b with pp=4 needs micro-batches divisible by 4, got 6"),
    ],
)
def test_bad_pipeline_input_fails_before_the_first_step(schedule_name: str, m: int, v: int, expected: str) -> None:
    for message in run_distributed(bad_executor, 4, schedule_name, m, v, timeout=60):
        assert expected in message, message


def test_uneven_layers_are_refused_by_default() -> None:
    with pytest.raises(ValueError, match="do not split evenly"):
        pipeline_chunks(GPTConfig(n_layers=6), 0, 4)


def train_fp16_pipeline(overflow_at: int | None) -> tuple[list, list[float], list[bool], dict]:
    """pp = 2, 1F1B, ZeRO stage 1 in fp16. With `overflow_at`, the last stage's loss of that
    step is inf: every rank must see a non-finite norm, skip the step and back off."""
    from optim import DynamicLossScaler

    dims = ParallelDims(pp=dist.get_world_size()).build()
    chunks = pipeline_chunks(CONFIG, dims.pp_rank, dims.pp, 1, dims.tp_group, dims.embedding_group)
    model = nn.ModuleList(chunks)
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=1,
        process_group=dims.dp_group,
        model_parallel_group=dims.mp_group,
        precision=MixedPrecision(torch.float16, loss_scaler=DynamicLossScaler(init_scale=2.0**10, hysteresis=1)),
        lr=LR,
        eps=EPS,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)

    class PoisonedLossScale:
        """`opt` as the executor sees it, with an infinite loss scale while `on`."""

        on = False

        def no_sync(self):
            return opt.no_sync()

        def sync_only(self, module):
            return opt.sync_only(module)

        def overlapped_reductions(self):
            return opt.overlapped_reductions()

        def scale_loss(self, loss):
            return opt.scale_loss(loss) * (float("inf") if self.on else 1.0)

    poison = PoisonedLossScale()
    executor = PipelineExecutor(chunks, "1f1b", M, dims.pp_group, optimizer=poison)
    losses, scales, changed = [], [], []
    for step, (ids, labels) in enumerate(batches()):
        poison.on = step == overflow_at
        before = {k: v.clone() for k, v in opt.full_state_dict().items()}
        loss = executor.run(
            [ids[i * MB : (i + 1) * MB] for i in range(M)],
            [labels[i * MB : (i + 1) * MB] for i in range(M)],
            (CONFIG.max_seq_len, MB, CONFIG.d_model),
            torch.float16,
        )
        opt.clip_grad_norm_(CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
        scales.append(opt.scaler.scale)
        changed.append(any(not torch.equal(v, before[k]) for k, v in opt.full_state_dict().items()))
    return losses, scales, changed, {k.split(".", 1)[1]: v for k, v in opt.full_state_dict().items()}


def test_fp16_pipeline_tracks_fp32_and_skips_overflow_everywhere() -> None:
    ref_losses, _, ref_state = reference()
    clean = run_distributed(train_fp16_pipeline, 2, None)
    torch.testing.assert_close(torch.tensor(clean[-1][0]), torch.tensor(ref_losses), rtol=5e-3, atol=0)
    for _, _, _, state in clean:
        for k, v in state.items():
            torch.testing.assert_close(v, ref_state[k], rtol=0, atol=2e-2, msg=lambda m, k=k: f"{k}: {m}")
    for _, scales, changed, _ in run_distributed(train_fp16_pipeline, 2, 1):
        assert changed == [True, False, True, True, True], changed
        assert scales == [2.0**10] + [2.0**9] * 4, scales


@pytest.mark.parametrize("overrides", [{}, {"activation": "swiglu", "norm": "rmsnorm", "position": "rope"}])
def test_split_backward_weight_step_computes_only_weight_gradients(overrides: dict) -> None:
    """B + W of a middle stage give the gradients of one full backward, and W starts at the
    boundary nodes for every weight (no weight needs the backward from the output again)."""
    import contextlib
    import dataclasses

    from parallel.pipeline.split_backward import backward_input

    config = dataclasses.replace(CONFIG, **overrides)
    chunk = GPT(config, layers=range(2, 4), pre=False, post=False)
    params = [p for p in chunk.parameters() if p.requires_grad]
    x = torch.randn(CONFIG.max_seq_len, MB, CONFIG.d_model, requires_grad=True)
    g = torch.randn(CONFIG.max_seq_len, MB, CONFIG.d_model)
    expected = torch.autograd.grad(chunk(x), [x, *params], g)
    dx, work = backward_input(chunk(x), g, x, params)
    assert work.parts and not work.rest
    work.run(lambda last: contextlib.nullcontext())
    for got, want in zip([dx, *(p.grad for p in params)], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
