"""Small models and a reference training loop shared by the optimizer tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-norm MLP block with prime, uneven sizes."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Tied input/output embedding, a frozen layer, a buffer, uneven (prime) sizes.

    `reverse_blocks` runs the blocks in reverse order (a model whose module order changes).
    """

    def __init__(self, vocab: int = 37, dim: int = 24, hidden: int = 53, n_blocks: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("mix", torch.tensor(0.5))
        self.reverse_blocks = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.mix * torch.tanh(self.frozen(x))
        for block in reversed(self.blocks) if self.reverse_blocks else self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(seed: int = 0, **kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def batches(
    steps: int, global_batch: int, seq: int = 8, vocab: int = 37, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches on every rank: (idx, targets), each [global_batch, seq]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


def no_decay_groups(model: nn.Module) -> list[dict]:
    """AdamW convention: no weight decay on biases and norms (1-D parameters)."""
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def micro_slices(global_batch: int, world: int, rank: int, micro: int) -> list[slice]:
    """Rank `rank`'s micro-batches of the global batch: contiguous 1/world, split in `micro`."""
    per_rank = global_batch // world
    size = per_rank // micro
    start = rank * per_rank
    return [slice(start + k * size, start + (k + 1) * size) for k in range(micro)]


def reference_run(
    steps: int,
    global_batch: int,
    micro: int,
    world: int,
    optimizer_class: type = torch.optim.AdamW,
    clip: float | None = 0.5,
    make: Callable[[], nn.Module] = make_model,
    before_step: Callable[[nn.Module, int], None] | None = None,
    **opt_kwargs,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process torch.optim run on the same global batches: for each step the gradient
    is (1/world) Σ over the world·micro micro-batch mean losses, as under DDP."""
    model = make()
    opt = optimizer_class(no_decay_groups(model), **opt_kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    losses = []
    for step, (idx, tgt) in enumerate(batches(steps, global_batch)):
        if before_step is not None:
            before_step(model, step)
        total = 0.0
        for r in range(world):
            for sl in micro_slices(global_batch, world, r, micro):
                loss = model(idx[sl], tgt[sl])
                (loss / world).backward()
                total += loss.item() / (world * micro)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
