"""CUDA correctness: `python -m pytest -m cuda` selects these (and the CUDA tests of
tests/test_fused.py); without a GPU they are skipped. docs/gpu.md has the stream review
they back up.

- ZeroOptimizer stages 0-3 on a 1-rank NCCL group equal torch.optim.AdamW on the same
  device, while the NCCL stream is held back ~50 ms before every forward and step: a
  collective's output read without `work.wait()` on the reading stream, or an input reused
  before the collective read it, then shows as a wrong value instead of a lucky race.
- fp16: overflowing steps change nothing and halve the loss scale; clean steps equal AdamW
  on the unscaled gradients.
- The training command on CUDA (TF32 off) follows the CPU run's losses.
- A checkpoint saved on the GPU resumes on CPU under another layout (dp 2, ZeRO-3) and
  back on the GPU.
- Two gloo ranks sharing one GPU: ZeroOptimizer stages 1-3, and the pipeline executor
  (its receive buffers must be CUDA tensors). Skipped, with gloo's sentence, where gloo
  refuses CUDA tensors.

Bodies that do not need CUDA also run on CPU (the "cpu" parameters), which proves their
logic without a GPU. No code here touches CUDA at import: ranks import this module, and a
CPU rank must still be able to hide the GPU before CUDA starts.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from optim import DynamicLossScaler, ZeroOptimizer
from optim.policies import Communication, MixedPrecision
from parallel import ParallelDims, comm
from parallel.pipeline.executor import PipelineExecutor
from research.model import GPTConfig, pipeline_chunks
from tests.dist_utils import run_distributed, run_nccl
from tests.models import batches, make_model, micro_slices, no_decay_groups

needs_cuda = pytest.mark.skipif("not torch.cuda.is_available()", reason="needs CUDA")
ON_CUDA = (pytest.mark.cuda, needs_cuda)
needs_datasets = pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None, reason="the training command reads its corpus through `datasets`"
)
DEVICES = ["cpu", pytest.param("cuda", marks=ON_CUDA)]

STEPS, BATCH, MICRO, LR, CLIP = 5, 16, 2, 1e-2, 0.5
# several buckets and units
ZERO_KW = {"communication": Communication(bucket_numel=1500, unit_numel=500, resident_numel=100)}
SLEEP_CYCLES = 10**8  # torch.cuda._sleep: ~50 ms at H100 clocks
# Losses and grad norms on CUDA against CPU, fp32 with TF32 off: the kernels sum in other orders (~1e-7 relative per
# op), which Adam carries into the weights. Runs of the training command under layouts that
# also only reorder sums agree to 1e-5 over 20 steps (tests/test_train.py; the checkpoint
# test's chain, run all on CPU, to 5e-8); 10x that leaves room for CUDA's own exp / log and
# cuBLAS's blocking. TF32 (inputs rounded to 10 bits, ~1e-4 to 1e-3 per matmul) is what
# this tolerance is not meant to absorb, and a wrong update (a lost gradient, a stale
# buffer) moves the loss by far more.
DEVICE_RTOL = 1e-4
TRAIN = [
    "--n-layers",
    "2",
    "--n-heads",
    "2",
    "--d-model",
    "32",
    "--max-seq-len",
    "32",
    "--seq-len",
    "32",
    "--vocab-multiple",
    "128",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--warmup-steps",
    "2",
    "--eps",
    "1e-6",
    "--seed",
    "0",
    "--wandb",
    "disabled",
    "--log-every",
    "1000",
]


# ---- running a body on a device ----------------------------------------------------------
def on_cpu(fn, *args):
    """`fn(*args)` with CUDA hidden from this process (a CPU run on a GPU machine too)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    assert not torch.cuda.is_available(), "CUDA was started in this rank before it could be hidden"
    return fn(*args)


def through_nccl(fn, *args):
    """`fn(*args)` with the collectives of a 1-rank group sent through NCCL on its own stream,
    not short-cut to copies on the caller's stream (`comm._alone`): the stream order under
    test. One collective first: NCCL's first call waits for its stream (torch 2.11, NCCL 2.28:
    ~0.5 s behind a held-back stream), which would hide the delay of the next."""
    comm._alone = lambda group: False
    dist.all_reduce(torch.zeros(1, device="cuda"))  # the first NCCL call blocks the host until its stream drains
    torch.cuda.synchronize()
    return fn(*args)


def one_rank(device: str, fn, *args, timeout: float = 600.0):
    """`fn(device, *args)` on one rank: gloo on CPU, NCCL on cuda:0 (`through_nccl`)."""
    if device == "cuda":
        return run_nccl(through_nccl, fn, device, *args, timeout=timeout)
    return run_distributed(on_cpu, 1, fn, device, *args, timeout=timeout)[0]


def on_host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors go back to the test process on the CPU: CUDA ones would start CUDA there."""
    return {k: v.detach().cpu() for k, v in state.items()}


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def delay_nccl_stream() -> dist.Work:
    """Queue on the default group's NCCL stream a collective that cannot start before a side
    stream has slept SLEEP_CYCLES: every collective issued after it (same group, same
    stream) finishes ~50 ms late, while the compute stream runs on."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        return dist.all_reduce(torch.zeros(1, device="cuda"), async_op=True)


# ---- ZeroOptimizer against torch.optim.AdamW ------------------------------------------------
def zero_run(device: str, stage: int, world: int = 1, delay: bool = False) -> tuple[list[float], list[float], dict]:
    """STEPS steps of TinyLM (tied, frozen, buffer; two param groups) with ZeroOptimizer:
    MICRO micro-batches of this rank's 1/world of each global batch, clipping, warm-up.
    Returns the global mean loss and the grad norm per step, and the full state dict (Adam
    cancels a gradient that is off by a constant factor, the norm does not). With `delay`, the NCCL
    stream is held back before every forward (stage-3 gathers), backward (gathers and
    gradient reductions) and step (publishing all-gathers)."""
    rank = dist.get_rank()
    model = make_model().to(device)
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, param_groups=no_decay_groups(model), lr=LR, **ZERO_KW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    held: list[dist.Work] = []

    def hold_back_nccl() -> None:
        if delay:
            held.append(delay_nccl_stream())

    losses, norms = [], []
    for idx, tgt in batches(STEPS, BATCH):
        total = torch.zeros((), device=device)
        for sl in micro_slices(BATCH, world, rank, MICRO):
            hold_back_nccl()
            loss = model(idx[sl].to(device), tgt[sl].to(device))
            hold_back_nccl()
            opt.backward(loss)
            total += loss.detach() / MICRO
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        hold_back_nccl()
        opt.step()
        sched.step()
        opt.zero_grad()
        while held:
            held.pop().wait()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, norms, on_host(opt.full_state_dict())


def reference_run(device: str, world: int = 1) -> tuple[list[float], list[float], dict]:
    """`zero_run` in one process with torch.optim.AdamW: the gradient of each step is
    (1/world) Σ over all ranks' micro-batch losses, as DDP averages."""
    model = make_model().to(device)
    opt = torch.optim.AdamW(no_decay_groups(model), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    losses, norms = [], []
    for idx, tgt in batches(STEPS, BATCH):
        total = 0.0
        for rank in range(world):
            for sl in micro_slices(BATCH, world, rank, MICRO):
                loss = model(idx[sl].to(device), tgt[sl].to(device))
                (loss / world).backward()
                total += loss.item() / (MICRO * world)
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, on_host(model.state_dict())


def zero_and_reference(device: str, stage: int) -> tuple[tuple, tuple]:
    return zero_run(device, stage, delay=device == "cuda"), reference_run(device)


def assert_same_run(run: tuple, ref: tuple) -> None:
    """fp32 parity as in tests/test_zero_parity.py: the fused Adam step rounds differently
    from torch's by about an ulp per step."""
    (losses, norms, state), (ref_losses, ref_norms, ref_state) = run, ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert state.keys() == ref_state.keys()
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.cuda
@needs_cuda
def test_delayed_nccl_stream_exposes_a_missing_wait() -> None:
    """The harness of the next test is not vacuous: without `wait()` the compute stream reads
    an all-gather's output before the delayed NCCL stream has written it."""
    unsynced, synced = run_nccl(through_nccl, _read_with_and_without_wait)
    assert unsynced == 0.0, "the NCCL stream was not held back: the stream test below proves nothing"
    assert synced == 1.0


def _read_with_and_without_wait() -> tuple[float, float]:
    held = delay_nccl_stream()
    out = torch.zeros(1, device="cuda")
    work = comm.all_gather_into_tensor(out, torch.ones(1, device="cuda"), async_op=True)
    early = out.clone()
    work.wait()
    late = out.clone()
    held.wait()
    return early.item(), late.item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_match_adamw(device: str, stage: int) -> None:
    """Every gather, reduction and publish is consumed on the compute stream only after its
    wait (on CUDA the NCCL stream runs ~50 ms behind); results equal AdamW's."""
    run, ref = one_rank(device, zero_and_reference, stage)
    assert_same_run(run, ref)


# ---- fp16 loss scaling ------------------------------------------------------------------------
def fp16_steps(device: str, stage: int) -> dict:
    """fp16 compute from init scale 2^30 (hysteresis 1) until three clean steps, beside a
    reference: an fp16 copy of the model whose fp32 masters torch.optim.AdamW updates from
    its gradients divided by the same scale (clipped likewise, the norm recorded), then
    rounds back to fp16.
    Each step draws a new batch. Returns what the test checks."""
    model = make_model().to(device)
    reference = make_model().to(device)
    ref16 = make_model().to(device).half()
    masters = [p for p in reference.parameters() if p.requires_grad]
    halves = [p for p in ref16.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(no_decay_groups(reference), lr=LR)
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        precision=MixedPrecision(torch.float16, loss_scaler=DynamicLossScaler(init_scale=2.0**30, hysteresis=1)),
        param_groups=no_decay_groups(model),
        lr=LR,
        **ZERO_KW,
    )
    scales, skipped, skipped_changed, losses, ref_losses, norms, ref_norms = [], [], [], [], [], [], []
    for cpu_idx, cpu_tgt in batches(40, 8):
        idx, tgt = cpu_idx.to(device), cpu_tgt.to(device)
        scale = opt.scaler.scale
        before = opt.full_state_dict()
        loss = model(idx, tgt)
        opt.backward(loss)
        norm = float(opt.clip_grad_norm_(CLIP))
        opt.step()
        opt.zero_grad()
        scales.append(scale)
        skipped.append(opt.last_step_skipped)
        if opt.last_step_skipped:
            after = opt.full_state_dict()
            skipped_changed.append([k for k in before if not torch.equal(before[k], after[k])])
            continue
        losses.append(loss.item())
        norms.append(norm)
        ref_loss = ref16(idx, tgt)
        (ref_loss * scale).backward()
        for master, half in zip(masters, halves):
            master.grad = half.grad.float() / scale
            half.grad = None
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(masters, CLIP)))
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for master, half in zip(masters, halves):
                half.copy_(master)
        ref_losses.append(ref_loss.item())
        if len(losses) == 3:
            break
    trained = {name for name, p in reference.named_parameters(remove_duplicate=False) if p.requires_grad}
    ref_state = {k: v.float() for k, v in ref16.state_dict().items()}  # frozen weights: fp16, as the model's
    ref_state.update({k: v for k, v in reference.state_dict().items() if k in trained})
    return {
        "scales": scales,
        "skipped": skipped,
        "skipped_changed": skipped_changed,
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "state": on_host(opt.full_state_dict()),
        "ref_state": on_host(ref_state),
        "steps": sorted({int(s["step"]) for s in opt.state.values()}),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_skips_and_clean_steps_match_adamw(device: str, stage: int) -> None:
    out = one_rank(device, fp16_steps, stage)
    skipped, scales = out["skipped"], out["scales"]
    assert skipped[0], "2^30 did not overflow fp16: the skip path was not exercised"
    assert out["skipped_changed"] == [[]] * sum(skipped), "a skipped step changed the weights"
    assert scales[1:] == [s / 2 if skip else s for s, skip in zip(scales, skipped)][:-1], "backoff 0.5, no growth"
    assert out["steps"] == [3], "Adam's step count must count clean steps only"
    # Both sides run the same fp16 kernels on the same fp16 weights, so the losses agree up
    # to fp16 weights whose master differs by an ulp of the Adam step landing on a rounding edge.
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(out["ref_losses"]), rtol=1e-3, atol=0)
    # the unscaled norm: Adam itself would hide a gradient left multiplied by the scale
    torch.testing.assert_close(torch.tensor(out["norms"]), torch.tensor(out["ref_norms"]), rtol=1e-3, atol=0)
    for k, ref in out["ref_state"].items():
        torch.testing.assert_close(out["state"][k], ref, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


# ---- the training command on CUDA ---------------------------------------------------------------
def train_curves(device: str, base: str, name: str, *argv: str) -> list[tuple[float, float]]:
    """`experiments.train.run` (fp32; TF32 off on CUDA) into base/name; (loss, grad norm)
    per step."""
    from experiments.train import run

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    out = os.path.join(base, name)
    run([*TRAIN, "--data-cache", os.path.join(base, "cache"), "--out", out, *argv])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(row["loss"], row["grad_norm"]) for row in map(json.loads, f)]


@pytest.mark.cuda
@needs_cuda
@needs_datasets
@pytest.mark.parametrize("zero", ["1", "3"])
def test_training_command_on_cuda_follows_the_cpu_run(tmp_path, zero: str) -> None:
    argv = ("--steps", "6", "--zero", zero, "--unit-numel", "3000")
    cpu = one_rank("cpu", train_curves, str(tmp_path), "cpu", *argv)
    gpu = one_rank("cuda", train_curves, str(tmp_path), "cuda", *argv)
    assert len(gpu) == 6
    torch.testing.assert_close(torch.tensor(gpu), torch.tensor(cpu), rtol=DEVICE_RTOL, atol=0)


@pytest.mark.cuda
@needs_cuda
@needs_datasets
def test_checkpoint_moves_from_gpu_to_cpu_layout_and_back(tmp_path) -> None:
    """12 steps as GPU steps 1-4 (saved), CPU dp 2 ZeRO-3 steps 5-8 (loaded, saved), GPU
    steps 9-12 (loaded): losses and grad norms follow one uninterrupted CPU run."""
    base = str(tmp_path)
    common = ("--lr-decay-steps", "12")
    gpu_ckpt, cpu_ckpt = os.path.join(base, "gpu-ckpt"), os.path.join(base, "cpu-ckpt")
    straight = one_rank("cpu", train_curves, base, "straight", "--steps", "12", *common)
    first = one_rank("cuda", train_curves, base, "gpu-1", "--steps", "4", "--save", gpu_ckpt, *common)
    second = run_distributed(
        on_cpu,
        2,
        train_curves,
        "cpu",
        base,
        "cpu-dp2",
        "--steps",
        "8",
        "--zero",
        "3",
        "--load",
        gpu_ckpt,
        "--save",
        cpu_ckpt,
        *common,
        timeout=600,
    )[0]
    third = one_rank("cuda", train_curves, base, "gpu-2", "--steps", "12", "--load", cpu_ckpt, *common)
    assert (len(first), len(second), len(third)) == (4, 4, 4)
    torch.testing.assert_close(torch.tensor(first + second + third), torch.tensor(straight), rtol=DEVICE_RTOL, atol=0)


# ---- two gloo ranks on one GPU ------------------------------------------------------------------
def gloo_refusal(device: str) -> str | None:
    """Why this gloo group cannot run ZeroOptimizer's collectives on `device` tensors (the
    same answer on every rank), or None."""
    world = dist.get_world_size()
    x = torch.ones(2 * world, device=device)
    reason = None
    try:
        comm.broadcast(x, 0)
        comm.all_reduce(x.double())
        comm.reduce_scatter_tensor(x[:2].clone(), x, async_op=True).wait()
        comm.all_gather_into_tensor(x, x[:2].clone(), async_op=True).wait()
    except RuntimeError as e:
        reason = f"gloo refuses {device} tensors: {str(e).strip().splitlines()[0]}"
    reasons = [r for r in comm.all_gather_object(reason) if r is not None]
    return reasons[0] if reasons else None


def on_shared_gpu(fn, *args):
    """`fn("cuda", *args)` on a gloo rank whose GPU is cuda:0, as for every rank here. CUDA is
    started now, so that DeviceMesh does not pick cuda:LOCAL_RANK; ("skip", why) where gloo
    refuses CUDA tensors."""
    torch.cuda.set_device(0)
    torch.cuda.init()
    refusal = gloo_refusal("cuda")
    return ("skip", refusal) if refusal else fn("cuda", *args)


def skip_if_refused(results: list) -> None:
    """pytest.skip with gloo's sentence when the ranks answered ("skip", why)."""
    if isinstance(results[0], tuple) and results[0][0] == "skip":
        pytest.skip(results[0][1])


def zero_on_two_ranks(device: str, stage: int) -> tuple[tuple, tuple | None]:
    run = zero_run(device, stage, world=2)
    return run, reference_run(device, world=2) if dist.get_rank() == 0 else None


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_on_two_gloo_ranks_sharing_one_gpu(stage: int) -> None:
    """Sharded state, reduce-scatter, all-gather and stage-3 prefetch on CUDA tensors across
    two processes: equal to AdamW on the concatenated batch, on the same GPU."""
    results = run_distributed(on_shared_gpu, 2, zero_on_two_ranks, stage, timeout=600)
    skip_if_refused(results)
    (run, ref), (other, _) = results
    assert_same_run(run, ref)
    assert_same_run(other, ref)


CONFIG = GPTConfig(vocab_size=61, n_layers=4, n_heads=4, d_model=32, max_seq_len=16, vocab_multiple=64)
M, MB = 4, 2


class _StagedWork:
    """A gloo p2p work on a host copy; `wait()` then lands a received copy in its buffer."""

    def __init__(self, work: dist.Work, land=None) -> None:
        self.work, self.land = work, land

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        self.work.wait()
        if self.land is not None:
            self.land()


def staged_batch_isend_irecv(ops: list[dist.P2POp]) -> list[_StagedWork]:
    """`comm.batch_isend_irecv` through host copies (gloo sends host memory only): a send
    copies its tensor now, a receive lands in the caller's buffer when waited for."""
    staged = [
        dist.P2POp(
            op.op,
            op.tensor.cpu() if op.op is dist.isend else torch.empty_like(op.tensor, device="cpu"),
            op.peer,
            op.group,
            op.tag,
        )
        for op in ops
    ]
    works = dist.batch_isend_irecv(staged)
    return [
        _StagedWork(w, None if op.op is dist.isend else functools.partial(op.tensor.copy_, s.tensor))
        for w, op, s in zip(works, ops, staged)
    ]


def pipeline_losses(device: str) -> list[float] | None:
    """Three steps of a GPT on pp = 2 (1F1B, ZeRO-1 over dp = 1) on `device`, p2p staged
    through host memory; the last stage's losses (None on the first)."""
    comm.batch_isend_irecv = staged_batch_isend_irecv  # this rank's own process
    dims = ParallelDims(pp=2).build(device_type=device)
    chunks = [
        c.to(device) for c in pipeline_chunks(CONFIG, dims.pp_rank, dims.pp, 1, dims.tp_group, dims.embedding_group)
    ]
    opt = ZeroOptimizer(
        torch.nn.ModuleList(chunks),
        torch.optim.AdamW,
        stage=1,
        process_group=dims.dp_group,
        model_parallel_group=dims.mp_group,
        lr=3e-3,
        eps=1e-6,
    )
    executor = PipelineExecutor(chunks, "1f1b", M, dims.pp_group, optimizer=opt)
    losses = []
    for ids, labels in batches(3, M * MB, CONFIG.max_seq_len, CONFIG.vocab_size):
        loss = executor.run(
            [ids[i * MB : (i + 1) * MB].to(device) for i in range(M)],
            [labels[i * MB : (i + 1) * MB].to(device) for i in range(M)],
            (CONFIG.max_seq_len, MB, CONFIG.d_model),
        )
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    return losses if dims.pp_rank == 1 else None


@pytest.mark.cuda
@needs_cuda
def test_pipeline_on_cuda_receives_into_gpu_buffers() -> None:
    """pp = 2 on two gloo ranks sharing one GPU (p2p staged through host memory): activations
    and gradients received into CUDA buffers, losses as on CPU."""
    cpu = run_distributed(pipeline_losses, 2, "cpu", timeout=300)[1]
    results = run_distributed(on_shared_gpu, 2, pipeline_losses, timeout=600)
    skip_if_refused(results)
    torch.testing.assert_close(torch.tensor(results[1]), torch.tensor(cpu), rtol=DEVICE_RTOL, atol=0)


# ---- torch 2.11 ---------------------------------------------------------------------------------
def collectives_without_the_single_names() -> tuple[list[float], list[float]]:
    """comm's all-gather and reduce-scatter on a torch without all_gather_single /
    reduce_scatter_single (torch 2.11), and without a deprecation warning on this torch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = torch.full((2,), float(rank + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        full = torch.empty(2 * world)
        comm.all_gather_into_tensor(full, shard)
    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):
            delattr(dist, name)  # this rank's own process
    gathered = torch.empty(2 * world)
    comm.all_gather_into_tensor(gathered, shard)
    assert torch.equal(gathered, full)
    reduced = torch.empty(2)
    comm.reduce_scatter_tensor(reduced, torch.arange(2.0 * world), async_op=True).wait()
    return gathered.tolist(), reduced.tolist()


def test_comm_runs_on_torch_without_the_single_collectives() -> None:
    results = run_distributed(collectives_without_the_single_names, 2)
    assert results == [([1, 1, 2, 2], [0, 2]), ([1, 1, 2, 2], [4, 6])]
