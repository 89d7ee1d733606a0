"""ZeroOptimizer: a ZeRO (Rajbhandari et al. 2020) distributed optimizer, stages 0-3.

With N data-parallel ranks, Ψ parameters and K bytes of optimizer state per parameter
(mixed-precision Adam: fp32 master + m + v, K = 12), the model states per rank are

    stage 0  (plain DP)          params 2Ψ   grads 2Ψ    optimizer KΨ
    stage 1  (optimizer states)  params 2Ψ   grads 2Ψ    optimizer KΨ/N
    stage 2  (+ gradients)       params 2Ψ   grads 2Ψ/N  optimizer KΨ/N
    stage 3  (+ parameters)      params 2Ψ/N grads 2Ψ/N  optimizer KΨ/N

(2 = bytes of the bf16 / fp16 dtype; grads use the reduce dtype). The semantics are
torch.optim + DDP's: gradients are averaged over the group, several backward calls
accumulate, and a run on N ranks equals a single-process run of the inner optimizer on the
concatenated batch. A parameter with no gradient on any rank in a step (unused in forward,
frozen, its `.grad` cleared) is not stepped: no update, no weight decay, no step count; each
parameter keeps its own step count, as torch's per-parameter state does. The inner optimizer
must be elementwise, so that it is exact on flat shards.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.nn.parallel import DistributedDataParallel

from optim import clip, fused, sharded_state, state_formats
from optim.buffers import FlatBucket, arrival_key, assign_buckets
from optim.grad_placeholder import GradPlaceholder
from optim.grads import GradReducer
from optim.scaler import DynamicLossScaler
from optim.stage3 import ParamGatherer, roots, stage3_units
from parallel import comm

NOT_ELEMENTWISE = {"LBFGS", "Adafactor", "Muon", "LAMB", "Lamb", "FusedLAMB", "Shampoo", "SparseAdam", "LARS"}
PARAM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
DEFAULT_BUCKET_NUMEL = 2**24
DEFAULT_UNIT_NUMEL = 2**22

MOVED = ("parameter {name!r} no longer lives in ZeroOptimizer's buffers: it was moved, cast or replaced after the "
         "optimizer was built (model.to(), .half(), a new nn.Parameter); move and cast the model first, then build ZeroOptimizer")
NOT_TRAINED = ("parameter {name!r} has a gradient but ZeroOptimizer does not train it: it was replaced or unfrozen after the "
               "optimizer was built; build ZeroOptimizer once the model is final, with every parameter you will train trainable")
COMPILED = ("torch.compile cannot trace ZeRO stage 3, whose hooks gather and free the parameters around every "
            "module; use stage 2 with torch.compile, or stage 3 without it")
WRAPPED = ("the model runs inside DistributedDataParallel, but ZeroOptimizer reduces gradients itself: train the bare model "
           "(do not wrap it in DDP; for Lightning and HF Trainer use optim.integrations)")


def default_resident_numel(unit_numel: int) -> int:
    """Stage-3 units smaller than this stay gathered when `resident_numel` is not given."""
    return unit_numel // 16


class ZeroOptimizer(torch.optim.Optimizer):
    """Shards optimizer state (stage ≥ 1), gradients (≥ 2) and parameters (3) over a
    data-parallel group; a drop-in `torch.optim.Optimizer` (LR schedulers work on it).

    Args:
        model: any module; its trainable parameters are moved into flat buckets (and cast
            to `param_dtype`); frozen parameters and floating buffers are cast too.
        optimizer_class: an elementwise `torch.optim.Optimizer` subclass (AdamW, SGD, ...).
        stage: ZeRO stage 0, 1, 2 or 3.
        process_group: the data-parallel group (None: the default group).
        param_groups: [{"params": [...], **hyperparameters}]; trainable parameters not
            listed join a group with the constructor's optimizer keyword arguments.
        param_dtype: dtype of the model's compute copy (None = fp32); masters stay fp32.
        reduce_dtype: dtype in which gradients are accumulated and reduced.
        bucket_numel: target elements per bucket at stages 0-2.
        unit_numel: stage 3 gathers a module's parameters together once they reach this.
        resident_numel: stage-3 units smaller than this stay gathered, like stage 2
            (None: unit_numel // 16).
        step_backend: fused Adam backend ("triton", "torch_fused", "apex", "torch"; None = auto).
        model_parallel_group: the group over which the model itself is split (tp × pp);
            grad norms and fp16 overflow flags are summed over it after the DP group.
        loss_scaler: dynamic loss scaler for fp16 (created by default for fp16).
        **optimizer_kwargs: passed to `optimizer_class` (lr, weight_decay, betas, ...).

    `grad_peak_bytes`: the most gradient bytes this rank has held since construction. At
    stages 2-3 it includes the full-size buckets that exist between a bucket's first
    gradient and its reduction, which under `no_sync()` (gradient accumulation) means all
    of them until the last backward; `memory_breakdown()` shows what exists now.

    `param.grad`: after backward, each parameter with a gradient holds a `GradPlaceholder`
    (optim.grad_placeholder): `torch.nn.utils.clip_grad_norm_` and `model.zero_grad()` work on
    it exactly as on a dense gradient; `full_grads()` gathers the values.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        stage: int = 2,
        process_group: dist.ProcessGroup | None = None,
        param_groups: list[dict[str, Any]] | None = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        unit_numel: int = DEFAULT_UNIT_NUMEL,
        resident_numel: int | None = None,
        step_backend: str | None = None,
        model_parallel_group: dist.ProcessGroup | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        _validate(model, optimizer_class, stage, param_dtype)
        self.model = model
        self.optimizer_class = optimizer_class
        self.stage = stage
        self.group = process_group
        self.param_dtype = param_dtype or torch.float32
        self.model_parallel_group = model_parallel_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.names = _param_names(model)
        groups, group_of = _user_groups(model, param_groups, optimizer_kwargs)
        self._torch_order = _torch_order(param_groups, group_of, len(groups))
        _check_same_model_on_all_ranks(model, stage, group_of, process_group)
        self._orig_dtypes = {id(t): t.dtype for t in [*model.parameters(), *model.buffers()]}
        self._cast_untrained(model)

        resident = default_resident_numel(unit_numel) if resident_numel is None else resident_numel
        self.buckets = self._build_buckets(group_of, reduce_dtype, bucket_numel, unit_numel, resident)
        self._param_steps = [[0] * len(b.params) for b in self.buckets]  # torch's per-parameter "step"
        self._stepping: list[list[bool]] = []  # per bucket: parameter i is stepped by this step()
        self._param_norms: tuple[float, torch.Tensor] | None = None  # (norm type, per-parameter norms)
        self._hand_set = 0  # 1 + index of a parameter whose .grad was assigned by hand (0: none)
        device = self.buckets[0].master.device
        self._placeholders = [
            [GradPlaceholder(self, k, i, shape, self.param_dtype, device) for i, shape in enumerate(b.shapes)]
            for k, b in enumerate(self.buckets)
        ]
        self._bound = [[p.data_ptr() for p in b.params] if b.stage < 3 else [] for b in self.buckets]
        self._trained = {p for b in self.buckets for p in b.params}
        self._check_handles = [r.register_forward_pre_hook(self._check_model) for r in roots(model)]
        self.inner = optimizer_class(
            [{**g, "params": [b.master for b in self.buckets if b.group_index == i]} for i, g in enumerate(groups)],
            **optimizer_kwargs,
        )
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.defaults = self.inner.defaults

        self.backend = fused.pick_backend(device, step_backend)
        self.scaler = loss_scaler or (DynamicLossScaler() if self.param_dtype == torch.float16 else None)
        self.last_step_skipped = False  # the last step() found an fp16 overflow and changed nothing
        self._gatherer = None
        self._scopes: dict[torch.nn.Module, list[int]] = {}  # sync_only: module -> its bucket indices
        if stage == 3:
            self._gatherer = ParamGatherer(model, self._units, process_group)
        self._reducer = GradReducer(
            self.buckets,
            process_group,
            self._placeholders,
            on_backward_start=lambda k, i: self._check_grads(arriving=(k, i)),
            on_bucket_done=(lambda i: self._gatherer.bucket_done(self.buckets[i])) if self._gatherer else None,
            on_backward_end=self._backward_end,
        )
        self._end_step()
        self._grad_bytes = self.grad_peak_bytes = self.memory_breakdown()["grads"]
        self._constructed = True

    # ---- construction -------------------------------------------------------------------
    def _group_rank0(self) -> int:
        """Global rank of the data-parallel group's rank 0 (the source of replicated state)."""
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def _cast_untrained(self, model: torch.nn.Module) -> None:
        """Frozen parameters and floating buffers join the model's compute dtype, replicated
        from group rank 0 as DDP does."""
        src = self._group_rank0()
        for p in model.parameters():
            if not p.requires_grad:
                if p.is_floating_point():
                    p.data = p.data.to(self.param_dtype)
                comm.broadcast(p.data, src, group=self.group)
        for buf in model.buffers():
            if buf.is_floating_point():
                buf.data = buf.data.to(self.param_dtype)
            comm.broadcast(buf.data, src, group=self.group)

    def _build_buckets(
        self, group_of: dict, reduce_dtype: torch.dtype, bucket_numel: int, unit_numel: int, resident_numel: int
    ) -> list[FlatBucket]:
        """Buckets in the order they are expected to complete in backward, whose gradients are
        expected in reverse registration order: by the position of their last parameter in
        it (`assign_buckets`). A bucket holds one param group of one root module
        (`optim.stage3.roots`: the chunks of a pipeline rank) and, at stage 3, of one unit."""
        arrival = list(reversed(list(group_of)))
        position = {p: i for i, p in enumerate(arrival)}
        root_of = {p: i for i, r in enumerate(roots(self.model)) for p in r.parameters()}

        def key(p: torch.nn.Parameter) -> tuple:
            marks = (*comm.replicated_groups(p), *comm.tied_groups(p))
            return (group_of[p], root_of.get(p), tuple(id(g) for g in marks))

        def make(params: list, stage: int) -> FlatBucket:
            return FlatBucket(params, group_of[params[0]], stage, self.rank, self.world, self.param_dtype, reduce_dtype,
                              on_grad_bytes=self._grad_bytes_changed)

        if self.stage < 3:
            buckets = [make(ps, self.stage) for ps in assign_buckets(arrival, key, bucket_numel)]
        else:
            buckets, self._units = [], []
            for module, params in reversed(stage3_units(self.model, set(group_of), unit_numel)):
                stage = 2 if sum(p.numel() for p in params) < resident_numel else 3
                unit = [make(ps, stage) for ps in assign_buckets(sorted(params, key=position.get), key, float("inf"))]
                buckets += unit
                if stage == 3:
                    self._units.append((module, unit))
            last_arrival = arrival_key(position)
            buckets.sort(key=lambda b: last_arrival(b.params))
        src = self._group_rank0()
        for bucket in buckets:
            flat = bucket.flat_values([p.detach() for p in bucket.params], torch.float32)
            comm.broadcast(flat, src, group=self.group)
            bucket.allocate(flat)
        return buckets

    # ---- training API -------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss × the fp16 loss scale (the loss itself for fp32 / bf16); for code that runs
        backward itself, such as a pipeline executor."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), multiplied by the loss scale when training in fp16."""
        self.scale_loss(loss).backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communicating; the
        first backward after it reduces everything. Stages 2-3 then hold full-size
        gradient buckets until that backward."""
        with self._reducer.no_sync():
            yield

    @contextlib.contextmanager
    def sync_only(self, module: torch.nn.Module) -> Iterator[None]:
        """Backward passes inside reach only `module`'s trainable parameters (on every rank
        alike) and reduce only the buckets holding them, each as soon as it is complete.
        Made for pipeline chunks (a rank's chunks never share a bucket) whose gradients are
        reduced every micro-batch: stages 2-3 then keep one chunk's full buckets at a time,
        for one reduction of the chunk per backward."""
        if module not in self._scopes:
            params = set(module.parameters())
            self._scopes[module] = [i for i, b in enumerate(self.buckets) if any(p in params for p in b.params)]
        with self._reducer.only(self._scopes[module]):
            yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global L2 norm of the (unscaled) gradients over every shard and model-parallel
        rank; gradients are scaled by min(1, max_norm / (norm + 1e-6)) in the step."""
        if norm_type != 2.0:
            raise ValueError(f"norm_type={norm_type} is not supported; ZeroOptimizer clips by the L2 norm (2.0)")
        norm = self._grad_norm()
        if torch.isfinite(norm):
            self._clip_coef = clip.clip_coefficient(norm, max_norm)
        return norm

    def _grad_norm(self) -> torch.Tensor:
        if self._norm is None:
            self._finish_grads()
            groups = [self.group] + ([self.model_parallel_group] if self.model_parallel_group is not None else [])
            self._norm = clip.global_grad_norm(self.buckets, groups, self._unscale)
        return self._norm

    @property
    def _unscale(self) -> float:
        return 1.0 / self.scaler.scale if self.scaler is not None else 1.0

    def _finish_grads(self) -> None:
        """Once per step, before the norm or the update: check every gradient was reduced and
        every `.grad` is as the optimizer left it (a cleared one forgets its gradient), zero
        the never-reduced ones, sum tied parameters' gradients over their groups (a bucket
        holds only parameters tied over the same groups, so the shards align) and agree on
        which parameters have a gradient on some rank: those are stepped."""
        if self._grads_finished:
            return
        if self._reducer.unsynced:
            raise RuntimeError(
                "gradients accumulated under no_sync() were never reduced: run the last backward before step() outside no_sync()"
            )
        for name, p in self.model.named_parameters():
            if p.grad is not None and p not in self._trained:
                raise RuntimeError(NOT_TRAINED.format(name=name))
        for b in self.buckets:
            b.zero_if_never_reduced()
            for group in comm.tied_groups(b.params[0]):
                comm.all_reduce(b.grad_shard, group=group)
        self._stepping = self._share_got(tied=True)
        self._grads_finished = True

    def _check_grads(self, arriving: tuple[int, int] | None = None) -> None:
        """`.grad` set to None since the last backward (model.zero_grad()) clears that
        gradient; one assigned by hand is noted (1 + its index in `_hand_set`) and refused on
        every rank at the next `_share_got`. Runs at the start of each backward (where
        `arriving` has just got its new gradient) and before each step."""
        index = 0
        for k, b in enumerate(self.buckets):
            for i, p in enumerate(b.params):
                index += 1
                if p.grad is self._placeholders[k][i] or (k, i) == arriving:
                    continue
                if p.grad is not None:
                    self._hand_set = self._hand_set or index
                elif b.got[i]:
                    b.clear_grad(i)
                    b.got[i] = False

    def _share_got(self, tied: bool) -> list[list[bool]]:
        """Which parameters have a gradient on any rank of the group (and, with `tied`, of
        their tie groups: only at the step, which every pipeline stage reaches), as DDP finds
        them: one max all-reduce of a flag per parameter. Every rank then marks them as
        having a gradient and shows its placeholder in `.grad`. A `.grad` assigned by hand on
        any rank (the last flag) raises on every rank."""
        self._check_grads()
        flags = torch.tensor([g for b in self.buckets for g in b.got] + [self._hand_set], dtype=torch.int32,
                             device=self.buckets[0].grad_shard.device)
        if self.world > 1:
            comm.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        hand_set, self._hand_set = int(flags[-1]), 0
        if hand_set:
            name = self.names[[p for b in self.buckets for p in b.params][hand_set - 1]]
            raise RuntimeError(f"param.grad of {name!r} was assigned by hand; ZeroOptimizer takes gradients only from "
                               "backward(), so compute them with loss.backward() and clear them with opt.zero_grad()")
        start = 0
        for b in self.buckets:
            for group in comm.tied_groups(b.params[0]) if tied else ():
                comm.all_reduce(flags[start : start + len(b.params)], op=dist.ReduceOp.MAX, group=group)
            start += len(b.params)
        got, start = [], 0
        for k, b in enumerate(self.buckets):
            b.got = [bool(f) for f in flags[start : start + len(b.params)].tolist()]
            start += len(b.params)
            for i, p in enumerate(b.params):
                if b.got[i] and p.grad is None:
                    p.grad = self._placeholders[k][i]
            got.append(list(b.got))
        return got

    def _backward_end(self, synced: bool) -> None:
        """After every backward: stage 3 frees what it gathered; a backward that reduced every
        bucket also agrees on which parameters got a gradient, so `.grad` shows the same
        parameters on every rank (as under DDP) for third-party clipping."""
        self._param_norms = None
        if self._gatherer is not None:
            self._gatherer.backward_end()
        if synced:
            self._share_got(tied=False)

    def _check_model(self, module: torch.nn.Module, args: tuple) -> None:
        """Forward pre-hook: refuse a DDP wrapper, compilation at stage 3 and parameters moved
        or cast since construction, before they can train silently wrong."""
        if DistributedDataParallel._get_active_ddp_module() is not None:
            raise RuntimeError(WRAPPED)
        if self.stage == 3 and (torch.compiler.is_compiling() or get_eval_frame_callback() is not None):
            raise RuntimeError(COMPILED)
        for k, b in enumerate(self.buckets):
            device = b.param_shard.device
            for i, p in enumerate(b.params):
                if b.stage == 3:  # empty between uses; moved or cast, it changes device or dtype
                    bound = p.dtype == self.param_dtype and p.device == device and (p.numel() == 0 or p.shape == b.shapes[i])
                else:  # a view of the bucket; moved or cast, it is new storage
                    bound = p.data_ptr() == self._bound[k][i]
                if not bound:
                    raise RuntimeError(MOVED.format(name=self.names.get(p, "?")))

    # ---- param.grad placeholders (optim.grad_placeholder) --------------------------------
    def _grad_norm_of(self, k: int, i: int, norm_type: float) -> torch.Tensor:
        """‖ḡ‖_p of parameter i of bucket k, unscaled, over all shards: one all-reduce gives
        every parameter's norm, reused until the gradients change."""
        if self._param_norms is None or self._param_norms[0] != norm_type:
            self._finish_grads()
            device = self.buckets[0].grad_shard.device
            local = torch.zeros(sum(len(b.params) for b in self.buckets), dtype=torch.float64, device=device)
            at = 0
            for b in self.buckets:
                for j in range(len(b.params)):
                    for piece in b.grad_pieces(j, b.shard_range):
                        part = torch.linalg.vector_norm(piece, norm_type, dtype=torch.float32).double()
                        local[at] = torch.maximum(local[at], part) if norm_type == float("inf") else local[at] + part**norm_type
                    at += 1
            op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
            if self.world > 1:
                comm.all_reduce(local, op=op, group=self.group)
            norms = local if norm_type == float("inf") else local ** (1.0 / norm_type)
            self._param_norms = (norm_type, (norms * self._unscale).float())
        start = sum(len(b.params) for b in self.buckets[:k])
        return self._param_norms[1][start + i]

    def _scale_grad_of(self, k: int, i: int, factor: torch.Tensor | float) -> None:
        self._finish_grads()
        b = self.buckets[k]
        for piece in b.grad_pieces(i, b.opt_range):
            piece.mul_(factor)
        self._param_norms = self._norm = None

    def _zero_grad_of(self, k: int, i: int) -> None:
        self.buckets[k].clear_grad(i)
        self._param_norms = self._norm = None

    def full_grads(self) -> dict[str, torch.Tensor]:
        """name -> the full reduced (averaged, unscaled) gradient of each trained parameter
        with a gradient this step, in fp32. A collective: every rank must call it."""
        self._finish_grads()
        grads = {}
        for k, b in enumerate(self.buckets):
            flat = self._gather_flat(b, b.grad_shard.float() * self._unscale)
            for i, p in enumerate(b.params):
                if self._stepping[k][i]:
                    grads[self.names[p]] = b.param_view(flat, i).clone()
        return grads

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step on this rank's shards, then the updated parameters are
        published (all-gathered at stages 1-2). Parameters without a gradient on any rank
        are left alone, as torch.optim does. With fp16, a non-finite gradient on any rank
        skips the step on every rank, lowers the loss scale and sets `last_step_skipped` (an
        LR scheduler should then not advance)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._finish_grads()
        self.last_step_skipped = False
        if not any(any(s) for s in self._stepping):
            self._end_step()
            return loss
        if self.scaler is not None:
            found_inf = not bool(torch.isfinite(self._grad_norm()))
            self.scaler.update(found_inf)
            if found_inf:
                self.last_step_skipped = True
                self._end_step()
                return loss
        multiplier = self._unscale * self._clip_coef
        if self._fusable():
            for g, group in enumerate(self.param_groups):
                self._fused_step(group, [k for k, b in enumerate(self.buckets) if b.group_index == g], multiplier)
        else:
            self._inner_step(multiplier)
        for steps, stepping in zip(self._param_steps, self._stepping):
            for i, s in enumerate(stepping):
                steps[i] += s
        self._publish_params()
        self._end_step()
        return loss

    def _runs(self, k: int) -> list[tuple[int, list[tuple[int, int]]]]:
        """Bucket k's parameters stepped now, grouped by their step count so far: (count,
        master ranges [a, b)); one range over the whole master when all are alike."""
        b, stepping, steps = self.buckets[k], self._stepping[k], self._param_steps[k]
        if all(stepping) and len(set(steps)) == 1:
            return [(steps[0], [(0, b.master.numel())])]
        runs: dict[int, list[tuple[int, int]]] = {}
        for i, s, e, at in b.ranges_of(*b.opt_range):
            if stepping[i]:
                runs.setdefault(steps[i], []).append((at, at + e - s))
        return sorted(runs.items())

    def _fusable(self) -> bool:
        return all(fused.adam_hyperparams(g, self.optimizer_class) is not None for g in self.param_groups)

    def _fused_step(self, group: dict, bucket_indices: list[int], multiplier: float) -> None:
        """Adam/AdamW in one pass per shard (per range of parameters with the same step
        count), writing the low-precision params too. The state keeps torch's keys and
        layout, so it is interchangeable with the inner step."""
        by_count: dict[int, list[tuple[FlatBucket, int, int]]] = {}
        for k in bucket_indices:
            b = self.buckets[k]
            self._init_adam_state(b.master)
            for count, ranges in self._runs(k):
                by_count.setdefault(count, []).extend((b, lo, hi) for lo, hi in ranges)
        hyper = fused.adam_hyperparams(group, self.optimizer_class)
        for count, pieces in sorted(by_count.items()):
            state = [self.state[b.master] for b, _, _ in pieces]
            fused.adam_step_(
                self.backend,
                [b.master[lo:hi] for b, lo, hi in pieces],
                [b.grad_shard[lo:hi] for b, lo, hi in pieces],
                [s["exp_avg"][lo:hi] for s, (_, lo, hi) in zip(state, pieces)],
                [s["exp_avg_sq"][lo:hi] for s, (_, lo, hi) in zip(state, pieces)],
                [b.opt_param[lo:hi] if b.opt_param.data_ptr() != b.master.data_ptr() else None for b, lo, hi in pieces],
                step=count + 1,
                grad_scale=multiplier,
                **hyper,
            )
        for k in bucket_indices:
            self.state[self.buckets[k].master]["step"].fill_(max(self._param_steps[k]) + 1)

    def _init_adam_state(self, master: torch.Tensor) -> None:
        state = self.state[master]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)

    def _inner_step(self, multiplier: float) -> None:
        """Any elementwise optimizer: its own step on the fp32 master shards. Buckets whose
        parameters are stepped alike take one step together; the others one per run."""
        whole, partial = [], []
        for k, b in enumerate(self.buckets):
            runs = self._runs(k)
            if len(runs) == 1 and runs[0][1] == [(0, b.master.numel())]:
                whole.append((b, runs[0][0]))
            elif runs:
                partial.append((b, runs))
        for b, count in whole:
            self._set_inner_count(b.master, count)
            b.master.grad = b.grad_shard.float().mul_(multiplier)
        self.inner.step()
        for b, _ in whole:
            b.master.grad = None
        for b, runs in partial:
            self._inner_step_runs(b, runs, multiplier)
        for b in self.buckets:
            b.write_master_to_params()

    def _inner_step_runs(self, b: FlatBucket, runs: list[tuple[int, list[tuple[int, int]]]], multiplier: float) -> None:
        """The inner step on ranges of one master only: for each run, the step from the state
        before (a fresh state for parameters never stepped, so first-step rules apply), kept
        only on the run's ranges; the other ranges keep their values and state."""
        master = b.master
        before_master, before_state = master.clone(), _clone_state(self.state[master])
        result_master, result_state = master.clone(), _clone_state(before_state)
        for count, ranges in runs:
            master.copy_(before_master)
            self.inner.state[master] = _clone_state(before_state) if count > 0 else {}
            self._set_inner_count(master, count)
            master.grad = b.grad_shard.float().mul_(multiplier)
            self.inner.step()
            master.grad = None
            after = self.inner.state[master]
            for key, value in after.items():
                if isinstance(value, torch.Tensor) and value.shape == master.shape:
                    target = result_state.setdefault(key, torch.zeros_like(value))
                    for lo, hi in ranges:
                        target[lo:hi] = value[lo:hi]
                elif key not in result_state:
                    result_state[key] = value
            for lo, hi in ranges:
                result_master[lo:hi] = master[lo:hi]
        master.copy_(result_master)
        self.inner.state[master] = result_state

    def _set_inner_count(self, master: torch.Tensor, count: int) -> None:
        """The inner optimizer's scalar "step" set to the parameters' own count."""
        step = self.state[master].get("step")
        if isinstance(step, torch.Tensor):
            step.fill_(count)

    def _publish_params(self) -> None:
        """All-gather updated shards into the full parameter buffers (stages 1-2 and
        resident stage-3 units); stage 0 updated everything, stage 3 gathers on use."""
        works = [
            comm.all_gather_into_tensor(b.param_buffer, b.param_shard, group=self.group, async_op=True)
            for b in self.buckets
            if b.stage in (1, 2)
        ]
        for w in works:
            if w is not None:
                w.wait()

    def _end_step(self) -> None:
        self._norm = None
        self._param_norms = None
        self._clip_coef = 1.0
        self._grads_finished = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients. As in torch, `set_to_none=False` keeps them as zeros, so the
        parameters that had one are stepped by the next step() even without a backward."""
        for k, b in enumerate(self.buckets):
            got = b.got
            b.zero_grad()
            if not set_to_none:
                b.got = got
                continue
            for i, p in enumerate(b.params):
                if p.grad is self._placeholders[k][i]:
                    p.grad = None
        self._reducer.unsynced.clear()
        self._end_step()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_constructed", False):
            raise NotImplementedError("ZeroOptimizer cannot add parameters after construction; pass every group in param_groups=")
        super().add_param_group(param_group)

    # ---- state ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights with the keys and shapes of `model.state_dict()`: trainable
        parameters from the fp32 masters (in their original dtype), the rest as they are.
        A collective: every rank must call it; every rank gets the whole dict."""
        full: dict[torch.nn.Parameter, torch.Tensor] = {}
        for b in self.buckets:
            flat = self._gather_flat(b, b.master)
            for i, p in enumerate(b.params):
                full[p] = b.param_view(flat, i).to(self._orig_dtypes[id(p)]).clone()
        return {
            k: full[v] if v in full else v.detach().to(self._orig_dtypes.get(id(v), v.dtype)).clone()
            for k, v in self.model.state_dict(keep_vars=True).items()
        }

    def _gather_flat(self, bucket: FlatBucket, shard: torch.Tensor) -> torch.Tensor:
        """The full flat tensor of which `shard` (master-shaped) is this rank's part."""
        if bucket.stage == 0:
            return shard
        flat = torch.empty(bucket.numel, dtype=shard.dtype, device=shard.device)
        comm.all_gather_into_tensor(flat, shard, group=self.group)
        return flat

    def state_dict(self) -> dict[str, Any]:
        """Sharded state for `torch.distributed.checkpoint`, canonical per parameter:
        {"params": {name: fp32 master}, "state": {name: {key: tensor}}, "param_groups":
        (hyperparameters per group), "loss_scaler"}, each sharded tensor in the parameter's true shape. It loads under
        any other data-parallel size and stage: `sd = opt.state_dict(); dcp.load(sd, ...);
        opt.load_state_dict(sd)`. Entries are views of the optimizer's own storage."""
        self._materialize_state()
        params: dict[str, Any] = {}
        state: dict[str, dict[str, Any]] = {}
        for k, b in enumerate(self.buckets):
            for name, sharded in self._sharded_views(b, b.master).items():
                params[name] = sharded
            for key, value in self.state[b.master].items():
                if value.numel() == b.master.numel():
                    for name, sharded in self._sharded_views(b, value).items():
                        state.setdefault(name, {})[key] = sharded
                else:
                    for i, p in enumerate(b.params):
                        own = torch.tensor(float(self._param_steps[k][i])) if key == "step" else value
                        state.setdefault(self.names[p], {})[key] = own
        # a tuple is one opaque (pickled) entry for DCP, whose save and load traversals
        # disagree on how to flatten lists of plain dicts
        groups = tuple({k: v for k, v in g.items() if k != "params"} for g in self.param_groups)
        sd = state_formats.ShardedStateDict(params=params, state=state, param_groups=groups)
        if self.scaler is not None:
            sd["loss_scaler"] = self.scaler.state_dict()
        sd.layout = self._layout()
        return sd

    def _layout(self) -> dict[str, Any]:
        """This rank's place in the sharding, recorded in a torch.save'd state dict."""
        names = [(self.names[p], tuple(p.shape if b.stage < 3 else b.shapes[i])) for b in self.buckets for i, p in enumerate(b.params)]
        buckets = [[self.names[p] for p in b.params] for b in self.buckets]
        return {"rank": self.rank, "world": self.world, "layout": state_formats.fingerprint(self.stage, names, buckets)}

    def _sharded_views(self, bucket: FlatBucket, shard: torch.Tensor) -> dict[str, Any]:
        """name -> sharded tensor whose local pieces view `shard` (master-shaped)."""
        lo, hi = bucket.shard_range
        base = lo - bucket.opt_range[0]
        all_ranges = [
            {i: (s, e) for i, s, e, _ in bucket.shard_ranges(r)} for r in range(self.world)
        ]
        out = {}
        for i, p in enumerate(bucket.params):
            pieces = [(s, shard[base + at : base + at + e - s]) for j, s, e, at in bucket.ranges_of(lo, hi) if j == i]
            ranges = [[rs[i]] if i in rs else [] for rs in all_ranges]
            out[self.names[p]] = sharded_state.sharded_tensor_from_flat(bucket.shapes[i], pieces, ranges, self.group)
        return out

    def _materialize_state(self) -> None:
        """Create the inner optimizer's state before its first step, so a checkpoint can be
        loaded into it: one step with zero gradients and lr 0, after which the masters are
        restored and every state tensor is zeroed (a fresh state for Adam-like optimizers)."""
        if all(self.state[b.master] for b in self.buckets):
            return
        if self._fusable():
            for b in self.buckets:
                self._init_adam_state(b.master)
            return
        saved = [b.master.clone() for b in self.buckets]
        lrs = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = 0.0
        for b in self.buckets:
            b.master.grad = torch.zeros_like(b.master)
        self.inner.step()
        for b, m, g, lr in zip(self.buckets, saved, self.param_groups, lrs):
            b.master.copy_(m)
            b.master.grad = None
            g["lr"] = lr
            for value in self.state[b.master].values():
                if isinstance(value, torch.Tensor):
                    value.zero_()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict filled by `torch.distributed.checkpoint.load` (or one returned
        by `state_dict()` under the same layout, also through torch.save / torch.load on every
        rank, or a plain torch.optim state dict of the same model), then republish the
        parameters. A collective: a state dict that does not fit raises on every rank."""
        self._materialize_state()
        if state_formats.RANK_LOCAL in state_dict:
            state_formats.check_rank_local(state_dict, self._layout(), self.group)
            state_dict = self._fill_from_rank_local(state_dict)
        elif state_formats.is_torch_format(state_dict):
            self._load_torch_format(state_dict)
            return
        else:
            state_formats.agree(self._canonical_problem(state_dict), self.group)
        mine = self.state_dict()
        _copy_into(mine["params"], state_dict["params"])
        for name, entries in mine["state"].items():
            _copy_into(entries, state_dict["state"][name])
        for k, b in enumerate(self.buckets):
            for i, p in enumerate(b.params):
                step = state_dict["state"][self.names[p]].get("step")
                if step is not None:
                    self._param_steps[k][i] = int(step)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the checkpoint has {len(saved_groups)} param groups and this optimizer {len(self.param_groups)}; build the optimizer with the same param_groups"
            )
        for group, saved in zip(self.param_groups, saved_groups):
            group.update(saved)
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])
        if self.stage == 0:
            self._replicate_stage0()
        for b in self.buckets:
            b.write_master_to_params()
        self._publish_params()

    def _canonical_problem(self, sd: Any) -> str | None:
        """Why `sd` is not a state dict of this optimizer's parameters; None if it is."""
        if not isinstance(sd, dict) or not {"params", "state", "param_groups"} <= set(sd):
            return ("this is not a ZeroOptimizer state dict (it lacks 'params', 'state' or 'param_groups'); load the dict "
                    "opt.state_dict() returns, filled by dcp.load or saved by torch.save on every rank, or a torch.optim "
                    "state dict of the same model")
        for name in (self.names[p] for b in self.buckets for p in b.params):
            if name not in sd["params"] or name not in sd["state"]:
                return f"the optimizer state dict has no parameter {name!r}: it was saved for another model or optimizer"
        return None

    def _fill_from_rank_local(self, local: dict[str, Any]) -> dict[str, Any]:
        """This optimizer's own state dict with the pieces a torch.save'd one holds copied in."""
        mine = self.state_dict()
        for ours, theirs in [(mine["params"], local["params"])] + [
            (entries, local["state"][name]) for name, entries in mine["state"].items()
        ]:
            for key, target in ours.items():
                pieces = _local_tensors(target)
                saved = theirs[key] if isinstance(theirs[key], list) else [theirs[key]]
                for dst, src in zip(pieces, saved):
                    dst.copy_(src)
                if not hasattr(target, "local_shards"):
                    ours[key] = theirs[key]
        return {**mine, "param_groups": local["param_groups"], **({"loss_scaler": local["loss_scaler"]} if "loss_scaler" in local else {})}

    def _load_torch_format(self, sd: dict[str, Any]) -> None:
        """A torch.optim state dict of the same model: each parameter's state, numbered as a
        torch optimizer with the same param groups numbers it, copied into its owned part."""
        order = [[(self.names[p], p.shape if p.numel() else self._shape_of(p)) for p in group] for group in self._torch_order]
        problem = state_formats.torch_format_problem(sd, order)
        keys = {key for b in self.buckets for key in self.state[b.master]}
        extra = {key for entries in sd["state"].values() for key in entries} - keys
        extra |= {key for group in sd["param_groups"] for key in group} - {"params", *self.param_groups[0]}
        if problem is None and extra:
            problem = (f"the torch optimizer state has entries {sorted(extra)} that {self.optimizer_class.__name__} does not "
                       "have: it comes from another optimizer class; build ZeroOptimizer with the same one")
        state_formats.agree(problem, self.group)
        index_of = {p: index for group, mine in zip(sd["param_groups"], self._torch_order) for index, p in zip(group["params"], mine)}
        for k, b in enumerate(self.buckets):
            state = self.state[b.master]
            for i, p in enumerate(b.params):
                self._param_steps[k][i] = int(sd["state"].get(index_of[p], {}).get("step", 0))
            for i, s, e, at in b.ranges_of(*b.opt_range):
                for key, value in sd["state"].get(index_of[b.params[i]], {}).items():
                    target = state.get(key)
                    if key != "step" and isinstance(target, torch.Tensor) and target.shape == b.master.shape:
                        target[at : at + e - s] = value.reshape(-1)[s:e]
        for group, saved in zip(self.param_groups, sd["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _shape_of(self, p: torch.nn.Parameter) -> torch.Size:
        b = next(b for b in self.buckets if any(p is q for q in b.params))
        return b.shapes[next(i for i, q in enumerate(b.params) if q is p)]

    def _replicate_stage0(self) -> None:
        """Stage 0 loads only its own shard of each replicated tensor; gather the rest."""
        for b in self.buckets:
            lo, hi = b.shard_range
            for t in [b.master, *(v for v in self.state[b.master].values() if v.numel() == b.master.numel())]:
                comm.all_gather_into_tensor(t, t[lo:hi].clone(), group=self.group)

    # ---- introspection --------------------------------------------------------------------
    def _grad_bytes_changed(self, delta: int) -> None:
        self._grad_bytes += delta
        self.grad_peak_bytes = max(self.grad_peak_bytes, self._grad_bytes)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes per rank of the model states that exist right now, by category: params
        (low-precision copies), grads, master (fp32 copies not aliasing params) and
        optimizer (inner state). Each storage is counted once, in the first category."""
        seen: set[int] = set()

        def size(tensors: list[torch.Tensor | None]) -> int:
            total = 0
            for t in tensors:
                if t is None or t.numel() == 0:
                    continue
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        return {
            "params": size([b.param_buffer for b in self.buckets] + [b.param_shard for b in self.buckets]
                           + [p for p in self.model.parameters()]),
            "grads": size([b.grad_buffer for b in self.buckets] + [b.grad_shard for b in self.buckets]),
            "master": size([b.master for b in self.buckets]),
            "optimizer": size([v for b in self.buckets for v in self.state[b.master].values()
                               if isinstance(v, torch.Tensor)]),
        }


# ---- helpers ------------------------------------------------------------------------------
def _validate(model: torch.nn.Module, optimizer_class: Any, stage: Any, param_dtype: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, got {optimizer_class!r}"
        )
    if optimizer_class.__name__ in NOT_ELEMENTWISE:
        raise ValueError(
            f"{optimizer_class.__name__} is not elementwise (its update of one element depends on others), "
            "so it is not exact on flat shards; use an elementwise optimizer such as AdamW, SGD or Adagrad"
        )
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype={param_dtype} is not supported; use None (fp32), torch.bfloat16 or torch.float16")
    if not dist.is_initialized():
        raise RuntimeError(
            "ZeroOptimizer needs torch.distributed initialized: launch with torchrun and call "
            "dist.init_process_group() first (world_size=1 is fine)"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameter (every parameter has requires_grad=False)")


def _param_names(model: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    """The first name of each parameter (a tied parameter keeps the first)."""
    names: dict[torch.nn.Parameter, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(p, name)
    return names


def _user_groups(
    model: torch.nn.Module, param_groups: list[dict[str, Any]] | None, defaults: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[torch.nn.Parameter, int]]:
    """Hyperparameters per group (without "params") and trainable parameter -> group index,
    in model registration order."""
    trainable = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    assigned: dict[torch.nn.Parameter, int] = {}
    groups: list[dict[str, Any]] = []
    for i, g in enumerate(param_groups or []):
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in ps:
            if p in assigned:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is in param groups {assigned[p]} and {i}; list it once")
            if not any(p is q for q in trainable):
                raise ValueError(f"param group {i} lists a tensor of shape {tuple(p.shape)} that is not a trainable parameter of the model")
            assigned[p] = i
        groups.append({k: v for k, v in g.items() if k != "params"})
    rest = [p for p in trainable if p not in assigned]
    if rest:
        groups.append({})
        for p in rest:
            assigned[p] = len(groups) - 1
    return groups, {p: assigned[p] for p in trainable}


def _torch_order(
    param_groups: list[dict[str, Any]] | None, group_of: dict[torch.nn.Parameter, int], n_groups: int
) -> list[list[torch.nn.Parameter]]:
    """The parameters of each group in the order a torch.optim optimizer built with the same
    `param_groups` numbers them (the ungrouped rest, last, in registration order)."""
    listed = [[g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]) for g in param_groups or []]
    rest = [p for p, g in group_of.items() if g == len(listed)]
    return (listed + [rest])[:n_groups]


def _check_same_model_on_all_ranks(
    model: torch.nn.Module, stage: int, group_of: dict, group: dist.ProcessGroup | None
) -> None:
    """One all_gather_object of each rank's parameter signature; every rank raises the same
    error when they differ, so a mismatch can never turn into a hang."""
    signature = (
        stage,
        [(name, tuple(p.shape), str(p.dtype), p.requires_grad, group_of.get(p)) for name, p in model.named_parameters()],
    )
    everyone = comm.all_gather_object(signature, group=group)
    for r, other in enumerate(everyone):
        if other != everyone[0]:
            diff = _first_difference(everyone[0], other)
            raise ValueError(f"the model differs between group ranks 0 and {r} at construction ({diff}); build the same model on every rank")


def _first_difference(a: tuple, b: tuple) -> str:
    if a[0] != b[0]:
        return f"stage {a[0]} vs {b[0]}"
    if len(a[1]) != len(b[1]):
        return f"{len(a[1])} vs {len(b[1])} parameters"
    for x, y in zip(a[1], b[1]):
        if x != y:
            return f"parameter {x[0]}: {x[1:]} vs {y[0]}: {y[1:]}"
    return "unknown"


def _copy_into(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Copy loaded values into the optimizer's own views, unless they are the same storage."""
    for key, target in mine.items():
        source = theirs[key]
        for dst, src in zip(_local_tensors(target), _local_tensors(source)):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)


def _clone_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _local_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor) and hasattr(value, "local_shards"):
        return [s.tensor for s in value.local_shards()]
    return [value]
