"""Data-parallel training demo of `optim.ZeroOptimizer` (the main job until the 3D trainer).

    torchrun --standalone --nproc_per_node=2 -m experiments.train_dp_demo [--stage 3] [--steps 40]

A byte-level causal transformer learns the source text of Python's own standard library
(present on every machine). Each rank trains on its slice of every global batch; the
global batch sequence depends only on the seed. Prints the loss per step, then the
per-rank memory of model states and the communication per step of the last step.
"""
from __future__ import annotations

import argparse
import os
import textwrap
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from optim import ZeroOptimizer
from parallel import comm

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class ByteLM(nn.Module):
    """Pre-norm causal transformer over bytes with tied input/output embeddings."""

    def __init__(self, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens_bs: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        s = tokens_bs.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(s, dtype=self.pos.dtype)
        x_bsh = self.blocks(self.embed(tokens_bs) + self.pos[:s], mask=mask, is_causal=True)
        logits_bsv = self.head(self.norm(x_bsh)).float()
        return F.cross_entropy(logits_bsv.flatten(0, 1), targets_bs.flatten())


def corpus() -> torch.Tensor:
    """Bytes of two standard-library modules: text that exists wherever Python does."""
    text = b"".join(open(m.__file__, "rb").read() for m in (argparse, textwrap))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage 0-3")
    p.add_argument("--precision", choices=DTYPES, default="fp32")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch_size % world:
        raise SystemExit(f"--global-batch-size={args.global_batch_size} is not divisible by {world} ranks")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(args.seed)
    model = ByteLM(args.dim, args.layers, args.heads, args.seq_len)
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=args.stage, param_dtype=DTYPES[args.precision],
                        lr=args.lr, weight_decay=0.1, bucket_numel=2**16, unit_numel=2**14)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    data, gen = corpus(), torch.Generator().manual_seed(args.seed)
    per_rank = args.global_batch_size // world
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.global_batch_size,), generator=gen)
        mine = starts[rank * per_rank : (rank + 1) * per_rank]
        window = torch.stack([data[s : s + args.seq_len + 1] for s in mine.tolist()])
        t0 = time.perf_counter()
        with comm.tracking() as log:
            loss = model(window[:, :-1], window[:, 1:])
            opt.backward(loss)
            norm = opt.clip_grad_norm_(args.clip_grad)
            opt.step()
        sched.step()
        opt.zero_grad()
        mean_loss = loss.detach().float()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {step + 1:4d}  loss {mean_loss.item() / world:.4f}  grad_norm {norm.item():.3f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}  {1e3 * (time.perf_counter() - t0):.0f} ms", flush=True)
    memory = opt.memory_breakdown()
    if rank == 0:
        print(f"stage {args.stage}, {world} ranks, {args.precision}: model-state bytes per rank {memory}")
        print(f"communication of the last step per group and op: {log.as_dict()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
