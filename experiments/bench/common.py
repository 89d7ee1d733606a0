"""Shared pieces of the benchmarks under ``experiments/bench``.

- ``launch(fn, world_size, *args)``: run ``fn`` on ``world_size`` local gloo ranks and
  return the per-rank results (a small torchrun: the parent hosts the rendezvous
  TCPStore, each rank joins it with torchrun's environment variables).
- ``TinyGPT``: a small causal LM (token + position embedding, pre-norm blocks of causal
  self-attention and a GELU MLP, final LayerNorm, head tied to the token embedding).
- ``batch(...)``: deterministic synthetic batches that are learnable (each sequence
  follows a fixed random bigram permutation), so losses visibly go down.
- ``model_state_bytes(...)``: bytes of params / grads / optimizer state that exist on a
  rank, each storage counted once (DTensors count their local shard).
- ``take_turns(...)``: the methods of a benchmark stepping in turn, in an order that rotates
  every step, so that all of them see the same machine load.
- ``timed(fn, device, repeats)``: median seconds of a call (CUDA events on a GPU).
- ``median`` / ``percentile`` / ``spread_ms``: statistics of step times.

A benchmark's config and command line: ``config``; its tables: ``tables``; its results: ``results``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from parallel.launch import DEFAULT_PRELOAD, run_local

M = TypeVar("M")
T = TypeVar("T")

# ---------------------------------------------------------------------------------------
# Launching local gloo ranks
# ---------------------------------------------------------------------------------------

# Imported once by the forkserver the ranks fork from (see parallel.launch).
_PRELOAD = (
    *DEFAULT_PRELOAD,
    "torch.distributed.fsdp",
    "torch.distributed.optim",
    "torch.nn.parallel",
    "experiments.bench.common",
)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 900.0, threads: int = 1) -> list[Any]:
    """``fn(*args)`` on ``world_size`` fresh gloo processes (``torch.set_num_threads(threads)``
    each); their return values in rank order (parallel.launch.run_local)."""
    return run_local(fn, world_size, *args, timeout=timeout, threads=threads, preload=_PRELOAD)


# ---------------------------------------------------------------------------------------
# Model and data
# ---------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)); x + mlp(ln2(x)). Bias-free linears."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim, bias=False)
        self.fc2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        b, s, h = x_bsh.shape
        q, k, v = self.qkv(self.ln1(x_bsh)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a_bnsd = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_bsh = x_bsh + self.proj(a_bnsd.transpose(1, 2).reshape(b, s, h))
        return x_bsh + self.fc2(F.gelu(self.fc1(self.ln2(x_bsh))))


class TinyGPT(nn.Module):
    """Causal LM: tok + pos embedding, ``layers`` blocks, final LayerNorm, tied head.
    ``forward(idx_bs, targets_bs)`` returns the mean cross-entropy loss."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(
                    p, std=0.02 / (2 * layers) ** 0.5 if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                )

    def forward(self, idx_bs: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        x_bsh = self.tok(idx_bs) + self.pos.weight[: idx_bs.shape[1]]
        for block in self.blocks:
            x_bsh = block(x_bsh)
        logits_bsv = self.head(self.ln_f(x_bsh))
        return F.cross_entropy(logits_bsv.flatten(0, 1), targets_bs.flatten())


def make_model(seed: int, vocab: int, dim: int, layers: int, heads: int, seq: int) -> TinyGPT:
    """The same weights on every rank and for every method (seeded construction)."""
    torch.manual_seed(seed)
    return TinyGPT(vocab, dim, layers, heads, seq)


def batch(step: int, global_batch: int, seq: int, vocab: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step``: (idx, targets), each [global_batch, seq]. Token t is followed
    by perm[t] for a fixed random permutation, so a model can learn it. Both are contiguous
    (torch 2.11's pipelining rejects a stage input whose strides differ from a fresh tensor's)."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    start = torch.randint(0, vocab, (global_batch,), generator=torch.Generator().manual_seed(seed + 1 + step))
    tokens = torch.empty(global_batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = start
    for i in range(seq):
        tokens[:, i + 1] = perm[tokens[:, i]]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def matching_adamw(step_backend: str | None = None) -> dict[str, bool]:
    """torch.optim.AdamW's keywords for the kernel family of ZeroOptimizer's step backend
    (None: its pick on the CPU): fused=True for torch_fused, foreach=True for torch, so that
    a comparison is about the data-parallel machinery, not about the Adam kernel."""
    from optim import fused

    backend = step_backend or fused.pick_backend("cpu")
    return {"torch_fused": {"fused": True}, "torch": {"foreach": True}}.get(backend, {})


# ---------------------------------------------------------------------------------------
# Memory of model states
# ---------------------------------------------------------------------------------------


def _local(t: Any) -> torch.Tensor | None:
    if not isinstance(t, torch.Tensor):
        return None
    if hasattr(t, "to_local"):  # DTensor (FSDP2): this rank's shard
        t = t.to_local()
    return t


def model_state_bytes(categories: dict[str, Iterable[Any]]) -> dict[str, int]:
    """Bytes per category of the tensors given (DTensors: their local shard), each
    underlying storage counted once, in the first category that names it (so a gradient
    that is a view of a DDP bucket counts the whole bucket once)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, tensors in categories.items():
        total = 0
        for tensor in tensors:
            t = _local(tensor)
            if t is None or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        out[name] = total
    return out


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of a torch optimizer's state (step counters included)."""
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


# ---------------------------------------------------------------------------------------
# Taking turns, timing and statistics
# ---------------------------------------------------------------------------------------


def rotated(names: Sequence[str], k: int) -> list[str]:
    """The methods' order at step k: `names` rotated left by k."""
    k %= len(names)
    return [*names[k:], *names[:k]]


def take_turns(
    names: Sequence[str],
    rounds: int,
    steps: int,
    build: Callable[[int], Mapping[str, M]],
    step: Callable[[str, M, int], T],
) -> Iterator[dict[str, list[T]]]:
    """Per round r: fresh methods `build(r)` (name -> method), then `steps` steps i in each of
    which every method takes its turn, `step(name, method, i)`, in the order `rotated(names,
    r + i)`, so that all of them see the same machine load. Yields each round's step results
    by method, warm-up steps included, after freeing its methods."""
    for r in range(rounds):
        methods = build(r)
        out: dict[str, list[T]] = {m: [] for m in names}
        for i in range(steps):
            for m in rotated(names, r + i):
                out[m].append(step(m, methods[m], i))
        del methods
        gc.collect()
        yield out


def step_times(turns: Iterable[dict[str, list[float]]], warmup: int) -> dict[str, dict[str, list[float]]]:
    """Per method, from rounds of `take_turns` whose steps give milliseconds: "times_ms", the
    timed steps of every round (the first `warmup` of each left out), and "round_medians_ms"."""
    out: dict[str, dict[str, list[float]]] = {}
    for round_ in turns:
        for m, times in round_.items():
            entry = out.setdefault(m, {"times_ms": [], "round_medians_ms": []})
            entry["times_ms"] += times[warmup:]
            entry["round_medians_ms"].append(median(times[warmup:]))
    return out


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs after two warm-up runs: between CUDA
    events (then a synchronize) on a GPU, by the wall clock on the CPU."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return median(times)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile, q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return percentile(values, 50)


def spread_ms(times_ms: list[float]) -> dict[str, float]:
    """{"median_ms", "p25_ms", "p75_ms"} of step times."""
    return {"median_ms": median(times_ms), "p25_ms": percentile(times_ms, 25), "p75_ms": percentile(times_ms, 75)}
