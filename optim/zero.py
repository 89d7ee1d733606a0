"""ZeroOptimizer: a ZeRO (Rajbhandari et al. 2020) distributed optimizer, stages 0-3.

Stage s shards, over N data-parallel ranks, the optimizer state (s ≥ 1), the gradients
(s ≥ 2) and the parameters (s = 3): `optim.sharding` names what each stage shards, and
docs/optimizer.md#what-each-stage-keeps gives the bytes and the communication per stage.

The semantics are torch.optim + DDP's: gradients are averaged over the group, several
backward calls accumulate, and a run on N ranks equals a single-process run of the inner
optimizer on the concatenated batch. A parameter with no gradient on any rank in a step (unused in forward,
frozen, its `.grad` cleared) is not stepped: no update, no weight decay, no step count; each
parameter keeps its own step count, as torch's per-parameter state does. The inner optimizer
must be elementwise, so that it is exact on flat shards.

The hooks that do a step's work, in firing order, are mapped in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from operator import attrgetter
from typing import Any

import torch
import torch.distributed as dist

from optim import fused
from optim.buffers import FlatBucket, arrival_key, assign_buckets, bucket_key
from optim.grad_tracker import GradTracker, clip_coefficient
from optim.grads import GradReducer, QuantizedReduction
from optim.model_state import ModelStateHooks
from optim.policies import Communication, MixedPrecision, ZeroPlusPlus, from_flat_kwargs
from optim.scaler import DynamicLossScaler
from optim.shard_step import ShardStep
from optim.sharding import SHARD_GRADIENTS, SHARD_PARAMETERS, Sharding
from optim.stage3 import ParamGatherer, root_modules, stage3_units
from optim.state_dicts import StateDicts
from optim.zero_setup import (
    OUT_OF_STEP_ADVICE,
    check_experts,
    check_same_model_on_all_ranks,
    check_zero_plus_plus,
    claim,
    param_names,
    torch_order,
    trained_by,
    user_groups,
    validate,
)
from optim.zero_state import ZeroState
from parallel import comm, desync, flight
from parallel.marks import NO_MARKS, ParamMarks, param_marks

__all__ = ["ZeroOptimizer"]


def _shared(name: str, doc: str) -> property:
    """A read-only attribute of ZeroOptimizer kept in its `ZeroState`."""
    return property(attrgetter(f"zero_state.{name}"), doc=doc)


@torch.compiler.disable
def _wait_before_forward(opt: ZeroOptimizer, buckets: list[FlatBucket], module: torch.nn.Module, args: tuple) -> None:
    """overlap_param_gather's forward pre-hook: the module's buckets' gathers end first."""
    opt.wait_params(buckets)


def _wait_before_state_dict(opt: ZeroOptimizer, *args: Any) -> None:
    """overlap_param_gather's state_dict pre-hook: every gather ends first."""
    opt.wait_params()


class ZeroOptimizer(torch.optim.Optimizer):
    """Shards optimizer state (stage ≥ 1), gradients (≥ 2) and parameters (3) over a
    data-parallel group; a drop-in `torch.optim.Optimizer` (LR schedulers work on it).

    This file builds it and runs the training API; it composes one object per concern:
    `grad_tracker.GradTracker` (which parameters have a gradient, what `.grad` holds, model
    checks, the norms), `shard_step.ShardStep` (the step on the shards and the parameter
    all-gathers), `state_dicts.StateDicts` (state dicts and full weights), `grads.GradReducer`
    (the reductions in backward) and, at stage 3, `stage3.ParamGatherer`.

    Args:
        model: any module; its trainable parameters are moved into flat buckets (and cast
            to `precision.param_dtype`); frozen parameters and floating buffers are cast too.
        optimizer_class: an elementwise `torch.optim.Optimizer` subclass (AdamW, SGD, ...).
        stage: ZeRO stage 0, 1, 2 or 3.
        process_group: the data-parallel group (None: the default group); with
            `replicate_group`, the shard group of one replica.
        replicate_group: hybrid sharding (HSDP, MiCS): the ranks holding this rank's shard in
            the other replicas. States are sharded over `process_group` only (N = its size);
            gradients are reduced there, then all-reduced across the replicas on the shards.
            `parallel.ParallelDims(dp_shard=...)` makes both groups. None: no replicas.
        node_groups: (the ranks of `process_group` on this node, those at this rank's place
            in each node), `ParallelDims.dp_shard_node_groups`; None: the shard group is
            one node. Used by ZeRO++ hpZ and qgZ.
        model_parallel_group: the group over which the model itself is split (tp × pp);
            grad norms and fp16 overflow flags are summed over it after the DP group.
        param_groups: [{"params": [...], **hyperparameters}]; trainable parameters not
            listed join a group with the constructor's optimizer keyword arguments.
        precision: `optim.policies.MixedPrecision` (None: fp32 throughout).
        communication: `optim.policies.Communication` (None: its defaults).
        zero_plus_plus: `optim.policies.ZeroPlusPlus` (None: exact collectives).
        step_backend: fused Adam backend ("triton", "torch_fused", "apex", "torch"; None = auto).
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
        replicate_group: dist.ProcessGroup | None = None,
        node_groups: tuple[dist.ProcessGroup, dist.ProcessGroup | None] | None = None,
        model_parallel_group: dist.ProcessGroup | None = None,
        param_groups: list[dict[str, Any]] | None = None,
        precision: MixedPrecision | None = None,
        communication: Communication | None = None,
        zero_plus_plus: ZeroPlusPlus | None = None,
        step_backend: str | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        policies = from_flat_kwargs(
            optimizer_kwargs,
            {"precision": precision, "communication": communication, "zero_plus_plus": zero_plus_plus},
        )
        self.precision = policies["precision"] or MixedPrecision()
        zpp = policies["zero_plus_plus"] or ZeroPlusPlus()
        validate(model, optimizer_class, stage, zpp.qwz_block)
        check_zero_plus_plus(stage, zpp.hpz, zpp.qgz_bits, node_groups, process_group)
        check_experts(model, zpp.hpz, zpp.qgz_bits)
        groups, group_of = user_groups(model, param_groups, optimizer_kwargs)
        self.zero_state = self._share(
            model,
            optimizer_class,
            stage,
            (process_group, replicate_group, node_groups, model_parallel_group),
            policies["communication"] or Communication(),
            zpp,
            torch_order(param_groups, group_of, len(groups)),
        )
        for group in self.zero_state.dp_groups:
            check_same_model_on_all_ranks(model, stage, group_of, group)
        claim(model, self)  # from here on the model's parameters move into this optimizer's buffers
        self._cast_untrained(model)
        self.zero_state.buckets, units = self._build_buckets(group_of)
        self._init_inner(optimizer_class, groups, optimizer_kwargs)
        self.backend = fused.pick_backend(self.buckets[0].master.device, step_backend)
        self.last_step_skipped = False  # the last step() found an fp16 overflow and changed nothing
        self._register_hooks(units)
        if self.communication.timeout_s is not None and dist.get_world_size() > 1:
            desync.watch(self.communication.timeout_s, OUT_OF_STEP_ADVICE)
        self._end_step()
        self._grad_bytes = self.grad_peak_bytes = self.memory_breakdown()["grads"]
        self._constructed = True

    # ---- what the parts share (optim.zero_state), read-only here ----------------------------
    model = _shared("model", "the model being trained")
    buckets = _shared("buckets", "the flat buckets holding the trained parameters (`optim.buffers`)")
    names = _shared("names", "each trained parameter's name in the model")
    group = _shared("group", "the shard group (the data-parallel group without replicas)")
    replicate_group = _shared("replicate_group", "hybrid sharding: the ranks holding this shard in other replicas")
    node_groups = _shared("node_groups", "ZeRO++: (this node's ranks of the shard group, its peers on other nodes)")
    model_parallel_group = _shared("model_parallel_group", "the group the model is split over (tp × pp)")
    stage = _shared("stage", "the ZeRO stage")
    sharding = _shared("sharding", "what the stage shards (`optim.sharding`)")
    param_dtype = _shared("param_dtype", "the compute dtype of the parameters")
    communication = _shared("communication", "the `Communication` policy")
    zero_plus_plus = _shared("zero_plus_plus", "the `ZeroPlusPlus` policy")
    scaler = _shared("scaler", "the fp16 loss scaler, or None")
    inner = _shared("inner", "the inner optimizer over the fp32 master shards")
    optimizer_class = _shared("optimizer_class", "the inner optimizer's class")
    world = _shared("world", "the shard group's size")
    rank = _shared("rank", "this rank's place in the shard group")

    # ---- construction -------------------------------------------------------------------
    def _share(
        self,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        stage: int,
        groups: tuple,
        communication: Communication,
        zero_plus_plus: ZeroPlusPlus,
        order: list[list[torch.nn.Parameter]],
    ) -> ZeroState:
        """The state the parts share, from the constructor's arguments: `groups` is (the shard
        group, the replicate group, the node groups, the model-parallel group)."""
        group, replicate_group, node_groups, model_parallel_group = groups
        param_dtype = self.precision.compute_dtype
        return ZeroState(
            model=model,
            names=param_names(model),
            group=group,
            replicate_group=replicate_group,
            node_groups=node_groups or (group, None),
            model_parallel_group=model_parallel_group,
            stage=stage,
            param_dtype=param_dtype,
            communication=communication,
            zero_plus_plus=zero_plus_plus,
            scaler=self.precision.loss_scaler or (DynamicLossScaler() if param_dtype == torch.float16 else None),
            optimizer_class=optimizer_class,
            orig_dtypes={id(t): t.dtype for t in [*model.parameters(), *model.buffers()]},
            torch_order=order,
        )

    def _init_inner(self, optimizer_class: type, groups: list[dict[str, Any]], kwargs: dict[str, Any]) -> None:
        """The inner optimizer over the fp32 master shards, one of its groups per user group;
        this optimizer shares its param_groups, state and defaults."""
        self.zero_state.inner = optimizer_class(
            [{**g, "params": [b.master for b in self.buckets if b.group_index == i]} for i, g in enumerate(groups)],
            **kwargs,
        )
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.defaults = self.inner.defaults

    def _register_hooks(self, units: list[tuple[torch.nn.Module, list[FlatBucket]]]) -> None:
        """The parts of a step, each handed the shared `ZeroState` (docs/architecture.md): the
        model check, stage 3's gatherer, the gradient bookkeeping and reducer, the step on the
        shards, the state dicts and the model's own state-dict hooks."""
        state, zpp = self.zero_state, self.zero_plus_plus
        # first among the forward pre-hooks, so that it refuses before stage 3 gathers anything
        self._check_handles = [r.register_forward_pre_hook(self._check_model) for r in root_modules(self.model)]
        if self.communication.overlap_param_gather:
            self._register_param_waits()
        self._gatherer = (
            ParamGatherer(
                self.model,
                units,
                self.group,
                zpp.qwz,
                self.node_groups[0] if zpp.hpz else None,
                flight.side_group(self.group) if self.world > 1 else None,
            )
            if self.sharding.parameters
            else None
        )
        self._grads = GradTracker(state)
        self._scopes: dict[torch.nn.Module, list[int]] = {}  # sync_only: module -> its bucket indices
        quantized = QuantizedReduction(zpp.qgz_bits, *self.node_groups) if zpp.qgz_bits is not None else None
        self._reducer = GradReducer(state, self._grads, self._gatherer, quantized)
        self._shard_step = ShardStep(state, self.backend, self._gatherer)
        self._state_dicts = StateDicts(state, self._shard_step)
        self._model_state = ModelStateHooks(state, self._gatherer)

    @torch.compiler.disable
    def _check_model(self, module: torch.nn.Module, args: tuple) -> None:
        """The model check (`GradTracker.check_model`) before each root forward."""
        self._grads.check_model(module, args)

    @staticmethod
    def of(model: torch.nn.Module) -> ZeroOptimizer | None:
        """The ZeroOptimizer built over `model` (the module it was given), or None."""
        return trained_by(model)

    def _register_param_waits(self) -> None:
        """overlap_param_gather: each module holding trained parameters waits, before its
        forward, for the gathers of their buckets; the model's state_dict() for all of them."""
        bucket_of = {p: b for b in self.buckets for p in b.params}
        for module in self.model.modules():
            mine = list(dict.fromkeys(bucket_of[p] for p in module.parameters(recurse=False) if p in bucket_of))
            if mine:
                module.register_forward_pre_hook(partial(_wait_before_forward, self, mine))
        self.model.register_state_dict_pre_hook(partial(_wait_before_state_dict, self))

    def _broadcast_from_first(self, tensor: torch.Tensor, groups: list | None = None) -> None:
        """Give every rank of `groups` (None: every data-parallel rank) the tensor of the first
        rank of the first group."""
        for group in self.zero_state.dp_groups if groups is None else groups:
            comm.broadcast(tensor, dist.get_global_rank(group, 0) if group is not None else 0, group=group)

    def _cast_untrained(self, model: torch.nn.Module) -> None:
        """Frozen parameters and floating buffers join the model's compute dtype, replicated
        from the first data-parallel rank as DDP does (their original dtypes are kept for
        `full_state_dict`)."""
        for p in model.parameters():
            if not p.requires_grad:
                if p.is_floating_point():
                    p.data = p.data.to(self.param_dtype)
                self._broadcast_from_first(p.data)
        for buf in model.buffers():
            if buf.is_floating_point():
                buf.data = buf.data.to(self.param_dtype)
            self._broadcast_from_first(buf.data)

    def _build_buckets(self, group_of: dict) -> tuple[list[FlatBucket], list[tuple[torch.nn.Module, list[FlatBucket]]]]:
        """The buckets, in the order they are expected to complete in backward (gradients are
        expected in reverse registration order; `assign_buckets`), and at stage 3 the gathered
        units (module, its buckets). A bucket holds one param group of one root module (a
        pipeline rank's chunk, `optim.stage3.root_modules`) and, at stage 3, of one unit."""
        arrival = list(reversed(list(group_of)))
        position = {p: i for i, p in enumerate(arrival)}
        root_of = {p: i for i, r in enumerate(root_modules(self.model)) for p in r.parameters()}
        # what a bucket's parameters share: the groups they are replicated and tied over
        marks_of = {
            p: ParamMarks(replicated=m.replicated, tied=m.tied, expert=m.expert)
            for p, m in param_marks(self.model).items()
        }

        def key(p: torch.nn.Parameter) -> tuple:
            return bucket_key(group_of[p], root_of.get(p), marks_of.get(p, NO_MARKS))

        def make(params: list, sharding: Sharding) -> FlatBucket:
            marks = marks_of.get(params[0], NO_MARKS)
            group, replicate = self._data_parallel_groups(marks)
            return FlatBucket(
                params,
                group_of[params[0]],
                sharding,
                dist.get_rank(group),
                dist.get_world_size(group),
                self.param_dtype,
                self.precision.reduce_dtype,
                on_grad_bytes=self._grad_bytes_changed,
                marks=marks,
                group=group,
                replicate_group=replicate,
                keeps_reduced_sum=self._keeps_reduced_sum(sharding, replicate),
            )

        comm = self.communication
        if self.sharding.parameters:
            buckets, units = self._unit_buckets(group_of, position, key, make)
        else:
            buckets = [
                make(ps, self.sharding) for ps in assign_buckets(arrival, key, comm.bucket_numel, comm.last_bucket)
            ]
            units = []
        self._allocate(buckets)
        return buckets, units

    def _unit_buckets(
        self, group_of: dict, position: dict, key: Callable, make: Callable
    ) -> tuple[list[FlatBucket], list[tuple[torch.nn.Module, list[FlatBucket]]]]:
        """Stage 3: each unit's buckets (one per bucket key), sharded or, for a unit smaller than
        `resident`, kept gathered like stage 2; the buckets in the order they complete, and the
        gathered units."""
        comm = self.communication
        buckets, units = [], []
        for module, params in reversed(stage3_units(self.model, set(group_of), comm.unit_numel)):
            resident = sum(p.numel() for p in params) < comm.resident
            sharding = SHARD_GRADIENTS if resident else SHARD_PARAMETERS
            unit = [make(ps, sharding) for ps in assign_buckets(sorted(params, key=position.get), key, float("inf"))]
            buckets += unit
            if not resident:
                units.append((module, unit))
        last_arrival = arrival_key(position)
        buckets.sort(key=lambda b: last_arrival(b.params))
        return buckets, units

    def _data_parallel_groups(self, marks: ParamMarks) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """The groups a parameter is sharded and replicated over: an expert's own
        (`parallel.marks.mark_expert`: the ranks holding the same experts), else this
        optimizer's."""
        if marks.expert is not None:
            return marks.expert.shard, marks.expert.replicate
        return self.group, self.replicate_group

    def _keeps_reduced_sum(self, sharding: Sharding, replicate_group: dist.ProcessGroup | None) -> bool:
        """Whether a bucket carries earlier reductions of the step through its full buffer
        (`optim.buffers`): not on the replicas after the first, nor under qgZ at stages 2-3,
        whose reductions are added to the shard."""
        first_replica = replicate_group is None or dist.get_rank(replicate_group) == 0
        return first_replica and not (self.zero_plus_plus.qgz_bits is not None and sharding.gradients)

    def _allocate(self, buckets: list[FlatBucket]) -> None:
        """Give each bucket its storage, holding the values of the first rank of its
        data-parallel groups."""
        for bucket in buckets:
            flat = bucket.flat_values([p.detach() for p in bucket.params], torch.float32)
            self._broadcast_from_first(flat, bucket.dp_groups)
            bucket.allocate(flat)

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
        first backward after it reduces everything. Setting `model.require_backward_grad_sync
        = False` (DDP's flag, as nanoGPT-style scripts do on micro-steps) does the same for
        each backward run while it is False. Stages 2-3 then hold full-size
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

    @contextlib.contextmanager
    def overlapped_reductions(self) -> Iterator[None]:
        """Synced backward passes inside return with their gradient reductions still in flight,
        so the caller can communicate or compute meanwhile (a pipeline stage sends its input
        gradient upstream before its reduction ends, not after); leaving the context waits for
        every reduction, so gradients are whole again after it."""
        with self._reducer.overlapped():
            yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global L2 norm of the (unscaled) gradients over every shard and model-parallel
        rank; gradients are scaled by min(1, max_norm / (norm + 1e-6)) in the step."""
        if norm_type != 2.0:
            raise ValueError(f"norm_type={norm_type} is not supported; ZeroOptimizer clips by the L2 norm (2.0)")
        norm = self._grads.grad_norm()
        if torch.isfinite(norm):
            self._clip_coef = clip_coefficient(norm, max_norm)
        return norm

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
        self.wait_params()
        self._grads.finish()
        self._state_dicts.consolidated = None  # a consolidated state dict would be stale
        self.last_step_skipped = False
        if not any(any(b.has_grad) for b in self.buckets):
            self._end_step()
            return loss
        if self.scaler is not None:
            found_inf = not bool(torch.isfinite(self._grads.grad_norm()))
            self.scaler.update(found_inf)
            if found_inf:
                self.last_step_skipped = True
                self._end_step()
                return loss
        self._shard_step.update_and_publish(self.zero_state.unscale * self._clip_coef)
        self._end_step()
        return loss

    def full_grads(self) -> dict[str, torch.Tensor]:
        """name -> the full reduced (averaged, unscaled) gradient of each trained parameter
        with a gradient this step, in fp32. A collective: every rank must call it."""
        return self._grads.full_grads()

    def wait_params(self, buckets: list[FlatBucket] | None = None) -> None:
        """Finish the parameter all-gathers still in flight (of `buckets`; None: all): with
        `overlap_param_gather`, before code that reads parameters outside a forward."""
        self._shard_step.wait(buckets)

    # ---- state dicts (optim.state_dicts) ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Sharded state for `torch.distributed.checkpoint`, canonical per parameter:
        {"params": {name: fp32 master}, "state": {name: {key: tensor}}, "param_groups",
        "loss_scaler"}, each sharded tensor in the parameter's true shape. It loads under any
        other data-parallel size and stage: `sd = opt.state_dict(); dcp.load(sd, ...);
        opt.load_state_dict(sd)`. Entries are views of the optimizer's own storage."""
        return self._state_dicts.state_dict()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """torch's `ZeroRedundancyOptimizer.consolidate_state_dict`: gather the whole optimizer
        state, as the plain `torch.optim` state dict a torch optimizer with the same param groups
        would have (CPU tensors in each parameter's shape), onto rank `to` of the shard group,
        where the next `state_dict()` returns it (Lightning and Fabric then save it from
        rank 0). A collective: every rank must call it. Any ZeroOptimizer of the same model
        loads it with `load_state_dict` on every rank, under any stage and group size. A model
        split over tensor / pipeline / expert ranks is refused (before any communication): one
        rank's file would hold only its part, and another rank would load it silently wrong."""
        split = self.model_parallel_group is not None and dist.get_world_size(self.model_parallel_group) > 1
        if split or any(
            b.marks.expert is not None and dist.get_world_size(b.marks.expert.ep) > 1 for b in self.buckets
        ):
            raise ValueError(
                "this ZeroOptimizer's model is split over tensor, pipeline or expert ranks, so no one rank can hold "
                "its whole state and a consolidated save could not be loaded; save the sharded state with "
                "torch.distributed.checkpoint instead (dcp.save(opt.state_dict(), checkpoint_id=...)), which "
                "loads under any layout"
            )
        self._state_dicts.consolidate(to)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict filled by `torch.distributed.checkpoint.load` (or one returned by
        `state_dict()` under the same layout, also through torch.save / torch.load on every
        rank, the same with every tensor whole, or a plain torch.optim state dict of the same
        model), then republish the parameters. A collective: a state dict that does not fit
        raises on every rank."""
        self._state_dicts.load_state_dict(state_dict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights with the keys and shapes of `model.state_dict()`: trainable
        parameters from the fp32 masters (in their original dtype), the rest as they are. A
        collective: every rank must call it; every rank gets the whole dict. Like the model's
        own state dict it holds this rank's part of a model split across ranks: its TP slices,
        its pipeline stage, its experts under expert parallelism (`parallel.marks.mark_expert`);
        `state_dict()` names every expert once, for checkpoints."""
        return self._state_dicts.full_state_dict()

    def param_shapes(self) -> dict[torch.nn.Parameter, torch.Size]:
        """Each trained parameter's shape, also at stage 3, where it is empty between uses."""
        return self._state_dicts.param_shapes()

    def _end_step(self) -> None:
        self._grads.reset()
        self._clip_coef = 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients. As in torch, `set_to_none=False` keeps them as zeros, so the
        parameters that had one are stepped by the next step() even without a backward."""
        for k, b in enumerate(self.buckets):
            had = b.has_grad
            b.zero_grad()
            if not set_to_none:
                b.has_grad = had
                continue
            for i, p in enumerate(b.params):
                if p.grad is self._grads.placeholders[k][i]:
                    p.grad = None
        self._end_step()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_constructed", False):
            raise NotImplementedError(
                "ZeroOptimizer cannot add parameters after construction; pass every group in param_groups="
            )
        super().add_param_group(param_group)

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
            "params": size(
                [b.param_buffer for b in self.buckets]
                + [b.param_shard for b in self.buckets]
                + list(self.model.parameters())
                + (self._gatherer.secondaries() if self._gatherer is not None else [])
            ),
            "grads": size([b.grad_buffer for b in self.buckets] + [b.grad_shard for b in self.buckets]),
            "master": size([b.master for b in self.buckets]),
            "optimizer": size(
                [v for b in self.buckets for v in self.state[b.master].values() if isinstance(v, torch.Tensor)]
            ),
        }
