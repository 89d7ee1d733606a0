"""Token dispatch for expert parallelism (GShard, Lepikhin et al. 2021; Megatron-Core's
all-to-all dispatcher): the E experts are split over the ep ranks of `ep_group`, rank j
holding experts [j·E/ep, (j+1)·E/ep). Each rank routes its own tokens; `dispatch` sends
every (token, choice) slot to the rank of its expert, and `combine` brings each result back
to the slot it came from.

    dispatch: slots sorted by expert (stable: token order within an expert)
              -> [capacity: keep the first C slots of each expert, pad to C]
              -> all-to-all (dropless: the counts first, then uneven splits; capacity:
                 equal splits of E·C slots)
              -> received rows regrouped from (source rank, local expert) to
                 (local expert, source rank), so each local expert's rows are contiguous
    combine:  the inverse of each step; a dropped slot comes back as zeros.

Bytes per dispatch (and again per combine, and both again in backward): the rows that
leave the rank, h·(its slots to other ranks); with a balanced router T·k·h·(ep−1)/ep.
With ep = 1 there is no exchange, only the sort. Every step is a permutation or a
collective whose backward is the inverse one, so dispatch then combine is the identity on
kept slots, values and gradients exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel import comm

Group = dist.ProcessGroup | None


class _AllToAll(torch.autograd.Function):
    """Rows of `x` in `send` parts to the ranks of `group`; `recv` rows back from each. The
    backward sends the gradients back the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:  # type: ignore[override]
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple:  # type: ignore[override]
        return _exchange(g.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    comm.all_to_all_single(out, x.contiguous(), group, output_split_sizes=recv, input_split_sizes=send)
    return out


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: `send[j]` rows to rank j, `recv[j]` from it."""
    return _AllToAll.apply(x, send, recv, group)


@dataclass
class DispatchPlan:
    """What `combine` needs to undo a `dispatch`."""

    order: torch.Tensor  # kept slots (flat token·k + choice), in the order they were sent
    slots: int  # T·k
    k: int
    send: list[int]  # rows sent to each ep rank
    recv: list[int]  # rows received from each ep rank
    regroup: torch.Tensor | None  # received row -> position in expert-major order
    padded: torch.Tensor | None  # capacity: the row of each kept slot among the E·C sent


class TokenDispatcher:
    """Sends routed tokens to the ranks of their experts and back (see the module docstring).

    Args:
        num_experts: E, divisible by the size of `ep_group`.
        ep_group: the expert-parallel group (None: this rank alone holds every expert).
        capacity_factor: None: dropless. Else each expert takes at most
            C = ceil(capacity_factor · T·k / E) slots of this rank's tokens (the first ones
            in token order; T: the most tokens any rank of the group routes); the rest are
            dropped and counted.
    """

    def __init__(self, num_experts: int, ep_group: Group = None, capacity_factor: float | None = None) -> None:
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} experts cannot be split over ep={self.ep} ranks; make E a multiple of ep")
        self.num_experts, self.group, self.capacity_factor = num_experts, ep_group, capacity_factor
        self.local_experts = num_experts // self.ep
        self.dropped = 0  # slots the last dispatch dropped (capacity)
        self.slots_per_expert: int | None = None  # the last dispatch's capacity C

    def capacity(self, slots: int) -> int:
        return math.ceil(self.capacity_factor * slots / self.num_experts)

    def dispatch(self, x_th: torch.Tensor, experts_tk: torch.Tensor) -> tuple[torch.Tensor, list[int], DispatchPlan]:
        """This rank's tokens x [T, h] and their experts [T, k] -> the rows for this rank's
        local experts [n, h], each expert's row count, and the plan `combine` undoes."""
        flat = experts_tk.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.capacity_factor is None:
            return self._dropless(x_th, order, counts, experts_tk.shape[-1])
        return self._with_capacity(x_th, flat, order, counts, experts_tk.shape[-1])

    def _dropless(
        self, x_th: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, list[int], DispatchPlan]:
        slots = len(order)
        rows = x_th[order // k]
        self.dropped = 0
        if self.ep == 1:
            plan = DispatchPlan(order, slots, k, [slots], [slots], None, None)
            return rows, counts.tolist(), plan
        # counts[j, e]: slots of this rank for local expert e of rank j; arrived[j, e]: from rank j
        arrived = torch.empty_like(counts)
        comm.all_to_all_single(arrived, counts, self.group)
        counts, arrived = counts.view(self.ep, -1), arrived.view(self.ep, -1)
        send, recv = counts.sum(1).tolist(), arrived.sum(1).tolist()
        received = all_to_all(rows, send, recv, self.group)
        regroup = _source_to_expert_major(arrived)
        plan = DispatchPlan(order, slots, k, send, recv, regroup, None)
        return _permuted(received, regroup), arrived.sum(0).tolist(), plan

    def _with_capacity(
        self,
        x_th: torch.Tensor,
        flat: torch.Tensor,
        order: torch.Tensor,
        counts: torch.Tensor,
        k: int,
    ) -> tuple[torch.Tensor, list[int], DispatchPlan]:
        slots = flat.numel()
        most = torch.tensor([slots], dtype=torch.int64, device=flat.device)
        if self.ep > 1:  # equal splits need one capacity on every rank of the group
            comm.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        c = self.slots_per_expert = self.capacity(int(most))
        start = counts.cumsum(0) - counts
        position = torch.arange(slots, device=flat.device) - start[flat[order]]
        keep = position < c
        order = order[keep]
        self.dropped = slots - int(keep.sum())
        padded = flat[order] * c + position[keep]  # row of each kept slot among E·C
        rows = x_th.new_zeros(self.num_experts * c, x_th.shape[-1]).index_copy(0, padded, x_th[order // k])
        per_rank = self.local_experts * c
        send = recv = [per_rank] * self.ep
        received = all_to_all(rows, send, recv, self.group) if self.ep > 1 else rows
        arrived = torch.full((self.ep, self.local_experts), c, dtype=torch.int64, device=flat.device)
        regroup = _source_to_expert_major(arrived) if self.ep > 1 else None
        plan = DispatchPlan(order, slots, k, send, recv, regroup, padded)
        return _permuted(received, regroup), [self.ep * c] * self.local_experts, plan

    def combine(self, y_nh: torch.Tensor, plan: DispatchPlan, weights_tk: torch.Tensor | None = None) -> torch.Tensor:
        """The local experts' rows [n, h] (as `dispatch` gave them) -> one row per slot
        [T·k, h] in (token, choice) order, zeros for dropped slots; with `weights_tk` [T, k],
        each token's weighted sum of its slots instead, [T, h] (Σ_j w_tj · y_tj in one pass)."""
        y = _unpermuted(y_nh, plan.regroup)
        if self.ep > 1:
            y = all_to_all(y, plan.recv, plan.send, self.group)
        if plan.padded is not None:
            y = y[plan.padded]
        if weights_tk is None:
            return y.new_zeros(plan.slots, y.shape[-1]).index_copy(0, plan.order, y)
        w = weights_tk.reshape(-1)[plan.order].to(y.dtype).unsqueeze(1)
        return y.new_zeros(plan.slots // plan.k, y.shape[-1]).index_add(0, plan.order // plan.k, y * w)


def _source_to_expert_major(arrived: torch.Tensor) -> torch.Tensor:
    """For rows received grouped by (source rank j, local expert e), `arrived[j, e]` of each:
    the position of each row once regrouped by (e, j)."""
    ep, experts = arrived.shape
    device = arrived.device
    sizes = arrived.reshape(-1)
    source_start = sizes.cumsum(0) - sizes  # start of block (j, e) among received rows
    by_expert = arrived.t().reshape(-1)
    target_start = (by_expert.cumsum(0) - by_expert).view(experts, ep).t().reshape(-1)  # start of (j, e) after
    block = torch.repeat_interleave(torch.arange(ep * experts, device=device), sizes)
    within = torch.arange(int(sizes.sum()), device=device) - source_start[block]
    return target_start[block] + within


def _permuted(rows: torch.Tensor, regroup: torch.Tensor | None) -> torch.Tensor:
    """rows[i] moved to position regroup[i] (differentiable)."""
    if regroup is None:
        return rows
    return rows.new_zeros(rows.shape).index_copy(0, regroup, rows)


def _unpermuted(rows: torch.Tensor, regroup: torch.Tensor | None) -> torch.Tensor:
    """The inverse of `_permuted`: row regroup[i] back to position i."""
    return rows if regroup is None else rows[regroup]
