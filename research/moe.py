"""Mixture-of-Experts MLP (Shazeer et al. 2017; GShard, Lepikhin et al. 2021; Switch,
Fedus et al. 2022): a router sends each token to k of E expert MLPs, so parameters grow
with E while the FLOPs per token grow with k.

    p = softmax(x W_rᵀ) ∈ R^E (fp32)         the router, replicated over TP
    (w, i) = top-k(p), w ← w / Σw (renormalize)
    y = Σ_j w_j · Expert_{i_j}(x) [+ SharedMLP(x)]

Experts are dropless by default: each expert takes every token sent to it, its rows
contiguous after a sort, all experts applied as one grouped GEMM. With a capacity factor c
an expert takes at most ceil(c·T·k/E) of a rank's T tokens (the first in token order) and
the overflow is dropped (its slot contributes zero) and counted.

Parallelism. The experts are split over the `ep` ranks of the expert-parallel group and
tokens reach them by all-to-all (`parallel.expert.TokenDispatcher`). Under TP each expert
is split like the dense MLP (up projection by columns, down by rows): every TP rank
routes the same tokens (all of them; under SP the router runs on the rank's sequence
shard and tokens and routing are gathered), computes its slice of every expert, and the
partial outputs are reduced over TP after the weighted sum.

Auxiliary losses, each with a coefficient, over the tokens of the micro-batch on every
data-parallel rank (and every SP shard) together, so that their values do not depend on
the layout and equal the single-process run's on the same micro-batches:

    Switch load balancing   α · E · Σ_e f_e · P_e,  f_e = (slots routed to e)/(T·k),
                                                    P_e = mean router probability of e
    router z-loss (ST-MoE)  β · mean_t (logsumexp_e logits_te)²

Their gradient is that of the single-process loss: the statistics are all-reduced as
constants and each rank back-propagates its own tokens' share × dp, which the data-parallel
mean of the gradients divides again (the cross-entropy's rank gradients carry the same ×dp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel import comm, marks
from parallel.expert.dispatch import TokenDispatcher
from parallel.expert.grouped import grouped_mm
from parallel.expert.groups import ExpertGroups
from parallel.tensor import copy_to_tp, gather_from_sp, reduce_from_tp, sequence_parallel_grad_sync
from parallel.tensor.mappings import reduce_scatter_to_sp, tp_rank, tp_size

Group = dist.ProcessGroup | None


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's shape and losses (from GPTConfig's `moe_*` fields)."""

    d_model: int
    experts: int
    top_k: int
    d_ff: int
    swiglu: bool
    shared_d_ff: int = 0  # width of the always-on shared experts together (0: none)
    capacity_factor: float | None = None
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    renormalize: bool = True


@dataclass
class RouterStats:
    """What the routers saw since the last `take`: per layer, summed over micro-batches."""

    aux_loss: float = 0.0
    z_loss: float = 0.0
    tokens_per_expert: torch.Tensor | None = None  # [E], global over dp (and SP)
    dropped: int = 0  # slots dropped by the capacity on this rank
    slots: int = 0  # slots routed on this rank
    micro_batches: int = 0


def _replicated(module: nn.Module, name: str, group: Group, sequence_parallel: bool) -> None:
    """A parameter every TP rank holds whole: counted once by clipping; under SP (each rank
    sees its own tokens) its gradient is summed over TP."""
    if sequence_parallel:
        sequence_parallel_grad_sync(module, name, group)
    else:
        marks.mark_replicated(module, name, group)


class Router(nn.Module):
    """Top-k router: logits = x W_rᵀ in fp32, p = softmax(logits), the k largest p."""

    def __init__(self, cfg: MoEConfig, tp_group: Group, sequence_parallel: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.d_model))
        nn.init.normal_(self.weight, std=0.02)
        _replicated(self, "weight", tp_group, sequence_parallel)

    def forward(self, x_th: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, h] -> (logits [T, E] fp32, probs [T, E], weights [T, k], experts [T, k])."""
        logits = F.linear(x_th.float(), self.weight.float())
        probs = logits.softmax(-1)
        weights, experts = probs.topk(self.cfg.top_k, dim=-1)
        if self.cfg.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, probs, weights, experts


class Experts(nn.Module):
    """This rank's E/ep experts, each an MLP (GELU, or SwiGLU: silu(x W_gate) ⊙ x W_up)
    sliced over TP like the dense MLP: up [E/ep, h, G, f/tp] (G = 2: {gate, up}; 1 for
    GELU), down [E/ep, f/tp, h]. Up is one GEMM of width G·f/tp whose gate and up halves are
    contiguous. Every expert's full weights are drawn in expert order, so they do not depend
    on the layout."""

    def __init__(self, cfg: MoEConfig, ep: int, ep_rank: int, tp_group: Group) -> None:
        super().__init__()
        tp, r = tp_size(tp_group), tp_rank(tp_group)
        if cfg.d_ff % tp:
            raise ValueError(f"moe_d_ff={cfg.d_ff} is not divisible by tp={tp}")
        self.swiglu = cfg.swiglu
        up = torch.empty(cfg.experts, cfg.d_model, 2 if cfg.swiglu else 1, cfg.d_ff)
        down = torch.empty(cfg.experts, cfg.d_ff, cfg.d_model)
        nn.init.normal_(up, std=0.02)
        nn.init.normal_(down, std=0.02)
        mine = slice(ep_rank * cfg.experts // ep, (ep_rank + 1) * cfg.experts // ep)
        self.up = nn.Parameter(up[mine].chunk(tp, dim=3)[r].contiguous())
        self.down = nn.Parameter(down[mine].chunk(tp, dim=1)[r].contiguous())
        marks.mark_partitioned(self, "up", 3)
        marks.mark_partitioned(self, "down", 1)

    def forward(self, rows_nh: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by local expert (`counts` of each) -> this TP rank's partial outputs."""
        u = grouped_mm(rows_nh, self.up.flatten(2).to(rows_nh.dtype), counts)
        if self.swiglu:
            gate, up = u.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = F.gelu(u)
        return grouped_mm(a, self.down.to(rows_nh.dtype), counts)


class MoE(nn.Module):
    """The MoE MLP of a block (see the module docstring). `forward(x_sbh)` returns the
    output and the layer's auxiliary losses (a scalar with the single-process gradient)."""

    def __init__(
        self,
        cfg: MoEConfig,
        tp_group: Group = None,
        sequence_parallel: bool = False,
        groups: ExpertGroups | None = None,
        shared: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= cfg.top_k <= cfg.experts:
            raise ValueError(f"moe_top_k={cfg.top_k} must be between 1 and moe_experts={cfg.experts}")
        self.cfg, self.tp_group = cfg, tp_group
        self.groups = groups or ExpertGroups()
        self.sp = sequence_parallel and tp_size(tp_group) > 1
        self.dispatcher = TokenDispatcher(cfg.experts, self.groups.ep, cfg.capacity_factor)
        self.router = Router(cfg, tp_group, self.sp)
        self.experts = Experts(cfg, self.dispatcher.ep, self.dispatcher.ep_rank, tp_group)
        if self.groups.ep is not None:  # ZeRO reduces and shards them over the ranks holding the same experts
            for name in ("up", "down"):
                marks.mark_expert(self.experts, name, self.groups.ep, self.groups.shard, self.groups.replicate)
        self.shared = shared
        self.stats = RouterStats()
        self._totals: torch.Tensor | None = None  # aux loss, z-loss, tokens per expert since `take_stats`

    def forward(self, x_sbh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, b, h = x_sbh.shape
        logits, probs, weights, experts = self.router(x_sbh.reshape(-1, h))
        aux = self._aux_losses(logits, probs, experts)
        x_all, w_all, e_all = self._tokens_of_the_tp_group(x_sbh, weights.view(s, b, -1), experts.view(s, b, -1))
        y = self._experts_of(x_all, w_all, e_all)
        if tp_size(self.tp_group) > 1:
            y = reduce_scatter_to_sp(y, self.tp_group) if self.sp else reduce_from_tp(y, self.tp_group)
        if _recording():
            self.stats.dropped += self.dispatcher.dropped
            self.stats.slots += e_all.numel()
        if self.shared is not None:
            y = y + self.shared(x_sbh)
        return y, aux

    @torch.compiler.disable
    def _experts_of(self, x_all: torch.Tensor, w_all: torch.Tensor, e_all: torch.Tensor) -> torch.Tensor:
        """The routed tokens through their experts and back (dispatch, grouped GEMM, combine),
        outside any compiled graph: their sizes change with the routing every step, which
        would recompile a graph that held them."""
        k, h = self.cfg.top_k, x_all.shape[-1]
        rows, counts, plan = self.dispatcher.dispatch(x_all.reshape(-1, h), e_all.reshape(-1, k))
        return self.dispatcher.combine(self.experts(rows, counts), plan, w_all.reshape(-1, k)).view(x_all.shape)

    def _tokens_of_the_tp_group(
        self, x_sbh: torch.Tensor, w_sbk: torch.Tensor, e_sbk: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every TP rank sends the same tokens to the experts: under SP the ranks' sequence
        shards (and their routing) gathered; otherwise the replicated input, whose gradient
        (each rank's partial experts) is summed over TP."""
        if tp_size(self.tp_group) == 1:
            return x_sbh, w_sbk, e_sbk
        if self.sp:
            return (
                gather_from_sp(x_sbh, self.tp_group),
                gather_from_sp(w_sbk, self.tp_group),
                gather_from_sp(e_sbk, self.tp_group),
            )
        return copy_to_tp(x_sbh, self.tp_group), copy_to_tp(w_sbk, self.tp_group), e_sbk

    def _aux_losses(self, logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss and the z-loss over the micro-batch of every dp rank (and
        SP shard): their value, with the gradient of each rank's own tokens' share × dp."""
        cfg = self.cfg
        e = cfg.experts
        counts = torch.bincount(experts.reshape(-1), minlength=e).float()
        prob_sum = probs.sum(0)
        z_sum = torch.logsumexp(logits, -1).square().sum()
        tokens = torch.tensor([float(probs.shape[0])], device=probs.device)
        stats = torch.cat([counts, prob_sum.detach(), z_sum.detach().view(1), tokens])
        for group in [self.tp_group if self.sp else None, self.groups.dp]:
            if group is not None:
                comm.all_reduce(stats, group=group)
        total_tokens = stats[-1]
        f = stats[:e] / (total_tokens * cfg.top_k)
        aux_value = cfg.aux_loss_coeff * e * (f * stats[e : 2 * e] / total_tokens).sum()
        z_value = cfg.z_loss_coeff * stats[2 * e] / total_tokens
        dp = dist.get_world_size(self.groups.dp) if self.groups.dp is not None else 1
        own = dp * (cfg.aux_loss_coeff * e * (f * prob_sum).sum() + cfg.z_loss_coeff * z_sum) / total_tokens
        if _recording():  # summed on the device: read once per step by `take_stats`, no sync per layer
            totals = torch.cat([aux_value.view(1), z_value.view(1), stats[:e]]).detach()
            self._totals = totals if self._totals is None else self._totals + totals
            self.stats.micro_batches += 1
        return own + (aux_value + z_value - own).detach()

    def take_stats(self) -> RouterStats:
        """The statistics since the last call, and a fresh start."""
        stats, totals = self.stats, self._totals
        if totals is not None:
            totals = totals.cpu()
            stats.aux_loss, stats.z_loss, stats.tokens_per_expert = float(totals[0]), float(totals[1]), totals[2:]
        self.stats, self._totals = RouterStats(), None
        return stats


def _recording() -> bool:
    """Outside a backward pass: a recomputed forward (activation recompute) is not counted twice."""
    return torch._C._current_graph_task_id() == -1


def router_metrics(chunks: nn.ModuleList, count_slots: bool) -> dict[str, Any]:
    """The MoE layers of this rank's model chunks since the last call (their statistics
    start afresh): per layer the mean auxiliary and z-loss per micro-batch, whether its chunk
    adds them to the loss it returns (`post`), and the tokens per expert (min, max,
    coefficient of variation, over the whole micro-batches of every dp rank); the slots this
    rank dropped and routed (`count_slots`: counted on one rank of each TP group, which all
    route the same tokens)."""
    layers, dropped, slots = {}, 0, 0
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if not isinstance(module, MoE):
                continue
            stats = module.take_stats()
            if not stats.micro_batches:
                continue
            load = stats.tokens_per_expert
            layers[name] = {
                "aux_loss": stats.aux_loss / stats.micro_batches,
                "z_loss": stats.z_loss / stats.micro_batches,
                "in_loss": bool(getattr(chunk, "post", True)),
                "tokens_min": float(load.min()),
                "tokens_max": float(load.max()),
                "tokens_cv": float(load.std(correction=0) / load.mean()) if load.sum() else 0.0,
            }
            dropped += stats.dropped if count_slots else 0
            slots += stats.slots if count_slots else 0
    return {"layers": layers, "dropped": dropped, "slots": slots}


def merge_router_metrics(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's MoE fields from every rank's `router_metrics`: the auxiliary and z-losses
    summed over layers (the terms they add to the loss), the dropped fraction of all slots,
    each layer's expert load; and `in_loss`, the part of the first two that the last pipeline
    stage's returned loss already holds (the other stages back-propagate theirs unseen)."""
    layers = {name: layer for r in per_rank for name, layer in r["layers"].items()}
    slots = sum(r["slots"] for r in per_rank)
    return {
        "in_loss": sum(layer["aux_loss"] + layer["z_loss"] for layer in layers.values() if layer["in_loss"]),
        "moe_aux_loss": sum(layer["aux_loss"] for layer in layers.values()),
        "moe_z_loss": sum(layer["z_loss"] for layer in layers.values()),
        "moe_dropped_fraction": sum(r["dropped"] for r in per_rank) / slots if slots else 0.0,
        "moe_expert_load": {
            name: {k: layer[k] for k in ("tokens_min", "tokens_max", "tokens_cv")} for name, layer in layers.items()
        },
    }
