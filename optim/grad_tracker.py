"""What each parameter's gradient is, between backward and the step: ZeroOptimizer's part
that keeps torch.optim + DDP semantics under other people's habits.

* Which parameters have a gradient: each rank notes them as gradients arrive; after a
  backward that reduced every bucket, and before each step, one max all-reduce of a flag per
  parameter makes every rank agree (as DDP's unused-parameter search does). Parameters
  without a gradient on any rank are not stepped. With `Communication(find_unused_parameters=False)` (DDP's
  default promise: every trained parameter gets a gradient in every step on every rank) the
  two all-reduces are skipped and a parameter without a gradient raises instead.
* What `param.grad` holds: the parameter's `GradPlaceholder` (optim.grad_placeholder), whose
  norm, scaling and zeroing are answered here; a `.grad` found None again (model.zero_grad())
  forgets that gradient; one assigned by hand is refused on every rank.
* What the tensors of `optimizer.param_groups` (the fp32 master shards, one per bucket) hold
  as `.grad`, for trainers that clip "the optimizer's parameters" (Lightning, Fabric): a
  placeholder of the whole bucket, shown whenever the bucket has a gradient, whose norm is
  the bucket's over all its shards, ‖ḡ_k‖_p = (Σ_ranks ‖owned part‖_p^p)^(1/p), so that
  `clip_grad_norm_` over them totals the global norm below, and whose scaling scales the
  bucket's reduced gradient. Under model parallelism no rank's buckets total the global
  norm, so their norm raises, naming `optimizer.clip_grad_norm_`.
* Whether the model is still the one the buffers were built for: a forward pre-hook refuses
  moved or cast parameters, a DDP wrapper and compilation at stage 3.
* The global gradient norm, counting replicated parameters once:

      ‖g‖ = sqrt( Σ_ranks Σ_{owned elements e} w_e · g_e² )

  Every element of every bucket is owned by exactly one rank of its data-parallel group (its
  shard; an expert's by one rank of its expert group, and the experts of the other ranks of
  the shard group are other experts), so summing each rank's owned part over the shard group
  counts it once. Across model-parallel ranks (tensor / pipeline) each rank holds different
  parameters, except those marked replicated with `parallel.marks.mark_replicated` (norms and
  row-parallel biases under TP, tied embeddings across pipeline stages): their bucket counts
  only on the rank that is rank 0 of every group it is replicated over (w_e ∈ {0, 1}).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from optim.buffers import FlatBucket, GradState
from optim.collectives import gather_flat
from optim.grad_placeholder import GradPlaceholder
from optim.integrations import WRAPPED_BY, wrapped_by
from parallel import comm, flight

if TYPE_CHECKING:
    from optim.zero_state import ZeroState

MOVED = (
    "parameter {name!r} no longer lives in ZeroOptimizer's buffers: it was moved, cast or replaced after the "
    "optimizer was built (model.to(), .half(), a new nn.Parameter); move and cast the model first, then build ZeroOptimizer"
)
NOT_TRAINED = (
    "parameter {name!r} has a gradient but ZeroOptimizer does not train it: it was replaced or unfrozen after the "
    "optimizer was built; build ZeroOptimizer once the model is final, with every parameter you will train trainable"
)
MODEL_PARALLEL_CLIP = (
    "clipping the tensors in a model-parallel ZeroOptimizer's param_groups cannot count the other tensor / "
    "pipeline ranks' gradients; clip with optimizer.clip_grad_norm_(max_norm), which gives the global norm"
)
SHARD_GRAD_SET = (
    ".grad of a tensor in ZeroOptimizer's param_groups (a flat fp32 master shard) was assigned by hand; ZeroOptimizer "
    "takes gradients only from backward(), so compute them with loss.backward() and clear them with opt.zero_grad()"
)
UNUSED = (
    "parameter {name!r} got no gradient in this step, but Communication(find_unused_parameters=False) expects one "
    "for every trained parameter on every rank; pass Communication(find_unused_parameters=True) "
    "(--find-unused-parameters), or freeze it before building the optimizer"
)
HAND_SET = (
    "param.grad of {name!r} was assigned by hand; ZeroOptimizer takes gradients only from backward(), so compute "
    "them with loss.backward() and clear them with opt.zero_grad()"
)
WRAPPED = (
    "the model runs inside DistributedDataParallel, but ZeroOptimizer reduces gradients itself: train the bare model "
    "(do not wrap it in DDP; for accelerate, Lightning, Lightning Fabric and the HF Trainer use optim.integrations)"
)


class GradTracker:
    """ZeroOptimizer's gradient bookkeeping (module docstring): the `.grad` placeholders of the
    parameters and of the master shards (their owner), which parameters have a gradient, the
    model checks, the once-per-step finishing of the reduced gradients and their norms. The
    gradient reducer tells it when a backward starts (`check_grads`) and ends (`backward_end`)."""

    def __init__(self, state: ZeroState) -> None:
        self.shared = state
        buckets, param_dtype = state.buckets, state.param_dtype
        self._all_params = [p for b in buckets for p in b.params]  # flat index order of the gradient flags
        self._first_index = [sum(len(b.params) for b in buckets[:k]) for k in range(len(buckets))]
        self._trained = set(self._all_params)
        self._bound = [[p.data_ptr() for p in b.params] if not b.sharding.parameters else [] for b in buckets]
        device = buckets[0].master.device
        self.placeholders = [
            [GradPlaceholder(self, k, i, shape, param_dtype, device) for i, shape in enumerate(b.shapes)]
            for k, b in enumerate(buckets)
        ]
        self.shard_placeholders = [
            GradPlaceholder(self, k, None, b.master.shape, b.master.dtype, device) for k, b in enumerate(buckets)
        ]
        self._hand_set = 0  # 1 + index of a parameter whose .grad was assigned by hand (0: none)
        self.reset()

    def reset(self) -> None:
        """A new step: the gradients are to be finished again, their norms computed again."""
        self._norm: torch.Tensor | None = None
        self._param_norms: tuple[float, torch.Tensor] | None = None  # (norm type, per-parameter norms)
        self._bucket_norms: tuple[float, torch.Tensor] | None = None  # (norm type, per-bucket norms)
        self._finished = False
        self.show_shard_grads()

    def show_shard_grads(self) -> None:
        """Each master shard's `.grad`: its bucket's placeholder while the bucket has a
        gradient, None otherwise (module docstring)."""
        self._shown = [any(b.has_grad) for b in self.buckets]
        for b, placeholder, shown in zip(self.buckets, self.shard_placeholders, self._shown):
            b.master.grad = placeholder if shown else None

    @property
    def buckets(self) -> list[FlatBucket]:
        return self.shared.buckets

    def finish(self) -> None:
        """Once per step, before the norm or the update: check every gradient was reduced and
        every `.grad` is as the optimizer left it (a cleared one forgets its gradient), zero
        the never-reduced ones, sum tied parameters' gradients over their groups (a bucket
        holds only parameters tied over the same groups, so the shards align) and agree on
        which parameters have a gradient on some rank: those are stepped."""
        if self._finished:
            return
        if any(b.grad_state is GradState.ACCUMULATING for b in self.buckets):
            raise RuntimeError(
                "gradients accumulated under no_sync() (or model.require_backward_grad_sync = False) were never "
                "reduced: run the last backward before step() with gradient synchronisation on"
            )
        for name, p in self.shared.model.named_parameters():
            if p.grad is not None and p not in self._trained:
                raise RuntimeError(NOT_TRAINED.format(name=name))
        for b in self.buckets:
            b.zero_if_never_reduced()
            for group in b.marks.tied:
                comm.all_reduce(b.grad_shard, group=group)
        self.share_has_grad(tied=True)  # after it, b.has_grad[i]: parameter i is stepped
        self._finished = True

    def grad_norm(self) -> torch.Tensor:
        """‖ḡ‖₂ over every shard and model-parallel rank (each parameter counted once),
        unscaled; cached until the gradients change."""
        if self._norm is None:
            self.finish()
            with flight.doing("the global gradient norm"):
                self._norm = global_grad_norm(self.buckets, self.shared.norm_groups, self.shared.unscale)
        return self._norm

    def check_grads(self, arriving: tuple[int, int] | None = None) -> None:
        """`.grad` set to None since the last backward (model.zero_grad()) clears that
        gradient; one assigned by hand is noted (1 + its index in `_hand_set`) and refused on
        every rank at the next `share_has_grad`. A master shard's `.grad` found None again
        (a trainer's own zero_grad over param_groups) clears its bucket's gradients. Runs at
        the start of each backward (where `arriving` has just got its new gradient) and before
        each step."""
        for k, b in enumerate(self.buckets):
            if b.master.grad is None and self._shown[k]:
                self._shown[k] = False
                for i, p in enumerate(b.params):
                    if b.has_grad[i]:
                        b.clear_grad(i)
                        b.has_grad[i] = False
                        if (k, i) != arriving:  # the arriving one's new gradient waits in its placeholder
                            p.grad = None
            elif b.master.grad is not None and b.master.grad is not self.shard_placeholders[k]:
                raise RuntimeError(SHARD_GRAD_SET)
            for i, p in enumerate(b.params):
                if p.grad is self.placeholders[k][i] or (k, i) == arriving:
                    continue
                if p.grad is not None:
                    self._hand_set = self._hand_set or self._first_index[k] + i + 1
                elif b.has_grad[i]:
                    b.clear_grad(i)
                    b.has_grad[i] = False

    def share_has_grad(self, tied: bool) -> None:
        """Which parameters have a gradient: on any rank of the group (and, with `tied`, of
        their tie groups: only at the step, which every pipeline stage reaches) when
        searching for unused parameters; every one, on this rank, otherwise. Every rank then
        shows each one's placeholder in `.grad`. A `.grad` assigned by hand (on any rank,
        when searching) raises on every rank that knows of it."""
        self.check_grads()
        with flight.doing("the agreement on which parameters have a gradient"):
            searching = self.shared.communication.find_unused_parameters
            hand_set = self._agree_on_has_grad(tied) if searching else self._hand_set
        self._hand_set = 0
        if hand_set:
            raise RuntimeError(HAND_SET.format(name=self.shared.names[self._all_params[hand_set - 1]]))
        for k, b in enumerate(self.buckets):
            for i, p in enumerate(b.params):
                if not (b.has_grad[i] or searching):
                    raise RuntimeError(UNUSED.format(name=self.shared.names[p]))
                if b.has_grad[i] and p.grad is None:
                    p.grad = self.placeholders[k][i]
        self.show_shard_grads()

    def _agree_on_has_grad(self, tied: bool) -> int:
        """As DDP finds unused parameters: one max all-reduce of a flag per parameter over the
        ranks holding it (the data-parallel ranks; an expert's own ranks for experts), the
        first one's last entry carrying `_hand_set`; returns the agreed `_hand_set` (1 + a flat
        index, 0: none)."""
        hand_set = self._hand_set
        dense = tuple(self.shared.dp_groups)
        by_groups: dict[tuple, list[int]] = {dense: []}  # data-parallel groups -> their buckets
        for k, b in enumerate(self.buckets):
            by_groups.setdefault(tuple(b.dp_groups) if b.marks.expert is not None else dense, []).append(k)
        for groups, ks in by_groups.items():
            flags = torch.tensor(
                [g for k in ks for g in self.buckets[k].has_grad] + ([hand_set] if groups is dense else []),
                dtype=torch.int32,
                device=self.buckets[0].grad_shard.device,
            )
            for group in groups:
                if dist.get_world_size(group) > 1:
                    comm.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            start = 0
            for k in ks:
                b = self.buckets[k]
                for group in b.marks.tied if tied else ():
                    comm.all_reduce(flags[start : start + len(b.params)], op=dist.ReduceOp.MAX, group=group)
                b.has_grad = [bool(f) for f in flags[start : start + len(b.params)].tolist()]
                start += len(b.params)
            if groups is dense:
                hand_set = int(flags[-1])
        return hand_set

    def backward_end(self, synced: bool) -> None:
        """After every backward (and stage 3's freeing): a backward that reduced every bucket
        agrees on which parameters got a gradient, so `.grad` shows the same parameters on
        every rank (as under DDP) for third-party clipping."""
        self._param_norms = self._bucket_norms = None
        if synced:
            self.share_has_grad(tied=False)
        else:  # a clip now reaches finish(), which names the missing synced backward
            self.show_shard_grads()

    def check_model(self, module: torch.nn.Module, args: tuple) -> None:
        """Forward pre-hook: refuse a DDP wrapper and parameters moved or cast since
        construction, before they can train silently wrong."""
        ddp = DistributedDataParallel._get_active_ddp_module()
        if ddp is not None:
            framework = wrapped_by(ddp)
            raise RuntimeError(WRAPPED_BY[framework].format(stage=self.shared.stage) if framework else WRAPPED)
        for k, b in enumerate(self.buckets):
            device = b.param_shard.device
            for i, p in enumerate(b.params):
                if b.sharding.parameters:  # empty between uses; moved or cast, it changes device or dtype
                    bound = (
                        p.dtype == self.shared.param_dtype
                        and p.device == device
                        and (p.numel() == 0 or p.shape == b.shapes[i])
                    )
                else:  # a view of the bucket; moved or cast, it is new storage
                    bound = p.data_ptr() == self._bound[k][i]
                if not bound:
                    raise RuntimeError(MOVED.format(name=self.shared.names.get(p, "?")))

    # ---- .grad placeholders (optim.grad_placeholder): their owner's answers -----------------
    def grad_norm_of(self, k: int, i: int | None, norm_type: float) -> torch.Tensor:
        """‖ḡ‖_p of parameter i of bucket k (i None: of the whole bucket, `_bucket_norm`),
        unscaled, over all shards: ‖ḡ‖_p^p summed over the owned parts (the largest part's norm
        for p = ∞) in one all-reduce that gives every parameter's norm, reused until the
        gradients change."""
        if i is None:
            return self._bucket_norm(k, norm_type)
        if self._param_norms is None or self._param_norms[0] != norm_type:
            self.finish()
            inf = norm_type == float("inf")
            parts = [
                b.param_slice(b.grad_shard, j, b.shard_range)[1] for b in self.buckets for j in range(len(b.params))
            ]
            local = torch.zeros(len(parts), dtype=torch.float64, device=self.buckets[0].grad_shard.device)
            for at, part in enumerate(parts):
                if part.numel():
                    local[at] = torch.linalg.vector_norm(part, norm_type, dtype=torch.float32).double()
            local = local if inf else local**norm_type
            owners = [b.group for b in self.buckets for _ in b.params]  # each parameter's shard group
            for group in dict.fromkeys(owners):
                if dist.get_world_size(group) > 1:
                    mine = torch.tensor([o is group for o in owners], device=local.device)
                    part = local[mine]
                    comm.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
                    local[mine] = part
            norms = local if inf else local ** (1.0 / norm_type)
            self._param_norms = (norm_type, (norms * self.shared.unscale).float())
        return self._param_norms[1][self._first_index[k] + i]

    def _bucket_norm(self, k: int, norm_type: float) -> torch.Tensor:
        """‖ḡ_k‖_p of bucket k over its shard group, each element counted once as in
        `global_grad_norm` (so Σ_k ‖ḡ_k‖₂² is its square when no model-parallel group joins
        it), unscaled; every bucket's in one all-reduce, reused until the gradients change."""
        if len(self.shared.norm_groups) > 1:
            raise RuntimeError(MODEL_PARALLEL_CLIP)
        if self._bucket_norms is None or self._bucket_norms[0] != norm_type:
            self.finish()
            inf = norm_type == float("inf")
            local = torch.zeros(len(self.buckets), dtype=torch.float64, device=self.buckets[0].grad_shard.device)
            for at, b in enumerate(self.buckets):
                part = owned_grad(b)
                if counts_in_norm(b) and part.numel():
                    local[at] = torch.linalg.vector_norm(part, norm_type, dtype=torch.float32).double()
            local = local if inf else local**norm_type
            group = self.shared.group
            if dist.get_world_size(group) > 1:
                comm.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
            norms = local if inf else local ** (1.0 / norm_type)
            self._bucket_norms = (norm_type, (norms * self.shared.unscale).float())
        return self._bucket_norms[1][k]

    def scale_grad_of(self, k: int, i: int | None, factor: torch.Tensor | float) -> None:
        self.finish()
        b = self.buckets[k]
        (b.grad_shard if i is None else b.param_slice(b.grad_shard, i, b.opt_range)[1]).mul_(factor)
        self._param_norms = self._bucket_norms = self._norm = None

    def zero_grad_of(self, k: int, i: int | None) -> None:
        b = self.buckets[k]
        for j in range(len(b.params)) if i is None else [i]:
            b.clear_grad(j)
        self._param_norms = self._bucket_norms = self._norm = None

    def full_grads(self) -> dict[str, torch.Tensor]:
        """name -> the full reduced (averaged, unscaled) gradient of each trained parameter
        with a gradient this step, in fp32. A collective: every rank must call it."""
        self.finish()
        grads = {}
        for b in self.buckets:
            flat = gather_flat(b, b.grad_shard.float() * self.shared.unscale, b.group)
            for i, p in enumerate(b.params):
                if b.has_grad[i]:
                    grads[self.shared.names[p]] = b.param_view(flat, i).clone()
        return grads


# ---- the global norm (module docstring) ----------------------------------------------------
def counts_in_norm(bucket: FlatBucket) -> bool:
    """Whether this rank's copy of the bucket's (equally marked) parameters enters the norm."""
    return all(dist.get_rank(g) == 0 for g in bucket.marks.replicated)


def owned_grad(bucket: FlatBucket) -> torch.Tensor:
    """This rank's owned part of the reduced gradient (stage 0 holds all of it)."""
    if not bucket.sharding.optimizer_state:
        lo, hi = bucket.shard_range
        return bucket.grad_shard[lo:hi]
    return bucket.grad_shard


def global_grad_norm(
    buckets: list[FlatBucket],
    groups: list[dist.ProcessGroup | None],
    multiplier: float = 1.0,
) -> torch.Tensor:
    """‖multiplier · g‖₂ over all ranks of `groups` (summed over each group in turn), fp32.

    Non-finite gradients give a non-finite norm on every rank, which is how an fp16
    overflow on any one rank is seen by all of them.
    """
    device = buckets[0].grad_shard.device if buckets else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for bucket in buckets:
        if counts_in_norm(bucket):
            sq += torch.linalg.vector_norm(owned_grad(bucket), dtype=torch.float32).double() ** 2
    for group in groups:
        comm.all_reduce(sq, group=group)
    return (sq.sqrt() * multiplier).float()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> float:
    """min(1, max_norm / (‖g‖ + 1e-6)), as in torch.nn.utils.clip_grad_norm_."""
    return min(1.0, max_norm / (float(norm) + 1e-6))
