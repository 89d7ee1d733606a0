"""Checks and bookkeeping of ZeroOptimizer's construction: arguments, parameter names,
param groups (and their torch.optim numbering), the same model on every rank."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from optim.state_dicts import agree
from parallel import comm, marks

NOT_ELEMENTWISE = {"LBFGS", "Adafactor", "Muon", "LAMB", "Lamb", "FusedLAMB", "Shampoo", "SparseAdam", "LARS"}
OUT_OF_STEP_ADVICE = (
    "Every rank must make the same training calls in the same order: at ZeRO stage 3 each forward, backward and "
    "model.state_dict() gathers from all ranks, so evaluate and save on every rank; if a rank is only slow, raise "
    "ZeroOptimizer(communication=Communication(timeout_s=...))"
)
# Every module that a ZeroOptimizer trains (the model and its submodules). The optimizer moves
# the parameters into its own buffers and hooks the modules, so a second one over any of them
# would see the first's views and both would reduce the same gradients.
_TRAINED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
# The model each ZeroOptimizer was given -> the optimizer, held weakly (the model must not keep it alive).
_OPTIMIZER_OF: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


def claimed(model: torch.nn.Module) -> bool:
    """Whether a ZeroOptimizer trains `model` or a module in it (holds their parameters)."""
    return any(m in _TRAINED for m in model.modules())


def trained_by(model: torch.nn.Module) -> Any:
    """The ZeroOptimizer that was built over `model` (the very module given to it), or None."""
    ref = _OPTIMIZER_OF.get(model)
    return ref() if ref is not None else None


def claim(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Marks `model` as trained by `optimizer`, refusing it if a ZeroOptimizer already trains part of it."""
    if claimed(model):
        raise ValueError(
            "this model (or a module in it) is already trained by a ZeroOptimizer, which holds its parameters "
            "in its own buffers; keep using that optimizer (change its param_groups' lr, load_state_dict), "
            "or build the model again for a new one"
        )
    _TRAINED.update(model.modules())
    _OPTIMIZER_OF[model] = weakref.ref(optimizer)


def validate(model: torch.nn.Module, optimizer_class: Any, stage: Any, qwz_block: Any) -> None:
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
    check_stage(stage, "stage")
    if qwz_block is not None and (
        stage == 0 or isinstance(qwz_block, bool) or not isinstance(qwz_block, int) or qwz_block <= 0
    ):
        raise ValueError(
            f"qwz_block={qwz_block!r} with stage={stage}: quantized parameter gathering (ZeRO++ qwZ) needs stage 1-3 "
            "(stage 0 gathers nothing) and a positive block size such as 2048"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "ZeroOptimizer needs torch.distributed initialized: launch with torchrun and call "
            "dist.init_process_group() first (world_size=1 is fine)"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameter (every parameter has requires_grad=False)")


def check_stage(stage: Any, name: str) -> None:
    """ZeRO stage 0, 1, 2 or 3 (the argument called `name`)."""
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"{name}={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")


def check_zero_plus_plus(
    stage: int,
    hpz: bool,
    qgz_bits: Any,
    node_groups: tuple[dist.ProcessGroup, dist.ProcessGroup | None] | None,
    group: dist.ProcessGroup | None,
) -> None:
    """ZeRO++'s switches against the stage, and `node_groups` against the shard group: rank
    s = a·k + j of the shard group is rank j of its node group (k ranks) and a of its cross group."""
    if hpz and stage != 3:
        raise ValueError(f"hpz=True with stage={stage}: the secondary parameter partition (ZeRO++ hpZ) needs stage=3")
    if qgz_bits is not None and (qgz_bits not in (4, 8) or isinstance(qgz_bits, bool) or stage < 2):
        raise ValueError(
            f"qgz_bits={qgz_bits!r} with stage={stage}: quantized gradient reduce-scatter (ZeRO++ qgZ) takes 4 or 8 "
            "bits and needs stage 2 or 3 (sharded gradients)"
        )
    if node_groups is None:
        return
    intra, inter = node_groups
    n, k = dist.get_world_size(group), dist.get_world_size(intra)
    m = dist.get_world_size(inter) if inter is not None else 1
    at = (dist.get_rank(inter) if inter is not None else 0) * k + dist.get_rank(intra)
    problem = None
    if k * m != n or at != dist.get_rank(group):
        problem = (
            f"node_groups of {k} and {m} ranks do not split the shard group of {n} as node × rank in node "
            "(shard rank = node · k + rank in node): pass ParallelDims.dp_shard_node_groups"
        )
    agree(problem, group)  # raised on every rank, so none waits for the others


def check_experts(model: torch.nn.Module, hpz: bool, qgz_bits: int | None) -> None:
    """ZeRO++ hpZ and qgZ follow the shard group's split into nodes, which expert parameters
    (sharded over their own groups) do not have yet: refused, one sentence."""
    if (hpz or qgz_bits is not None) and any(m.expert is not None for m in marks.param_marks(model).values()):
        raise ValueError(
            "ZeRO++ hpZ and qgZ split the data-parallel group by node, which the expert parameters of this model "
            "(parallel.marks.mark_expert) are not split by: drop hpz / qgz_bits for a model with experts (qwZ composes)"
        )


def param_names(model: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    """The first name of each parameter (a tied parameter keeps the first)."""
    names: dict[torch.nn.Parameter, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(p, name)
    return names


def user_groups(
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
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is in param groups {assigned[p]} and {i}; list it once"
                )
            if not any(p is q for q in trainable):
                raise ValueError(
                    f"param group {i} lists a tensor of shape {tuple(p.shape)} that is not a trainable parameter of the model"
                )
            assigned[p] = i
        groups.append({k: v for k, v in g.items() if k != "params"})
    rest = [p for p in trainable if p not in assigned]
    if rest:
        groups.append({})
        for p in rest:
            assigned[p] = len(groups) - 1
    return groups, {p: assigned[p] for p in trainable}


def torch_order(
    param_groups: list[dict[str, Any]] | None, group_of: dict[torch.nn.Parameter, int], n_groups: int
) -> list[list[torch.nn.Parameter]]:
    """The parameters of each group in the order a torch.optim optimizer built with the same
    `param_groups` numbers them (the ungrouped rest, last, in registration order)."""
    listed = [[g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]) for g in param_groups or []]
    rest = [p for p, g in group_of.items() if g == len(listed)]
    return ([*listed, rest])[:n_groups]


def check_same_model_on_all_ranks(
    model: torch.nn.Module, stage: int, group_of: dict, group: dist.ProcessGroup | None
) -> None:
    """One all_gather_object of each rank's parameter signature; every rank raises the same
    error when they differ, so a mismatch can never turn into a hang."""
    signature = (
        stage,
        [
            (name, tuple(p.shape), str(p.dtype), p.requires_grad, group_of.get(p))
            for name, p in model.named_parameters()
        ],
    )
    everyone = comm.all_gather_object(signature, group=group)
    for r, other in enumerate(everyone):
        if other != everyone[0]:
            diff = first_difference(everyone[0], other)
            raise ValueError(
                f"the model differs between group ranks 0 and {r} at construction ({diff}); build the same model on every rank"
            )


def first_difference(a: tuple, b: tuple) -> str:
    if a[0] != b[0]:
        return f"stage {a[0]} vs {b[0]}"
    if len(a[1]) != len(b[1]):
        return f"{len(a[1])} vs {len(b[1])} parameters"
    for x, y in zip(a[1], b[1]):
        if x != y:
            return f"parameter {x[0]}: {x[1:]} vs {y[0]}: {y[1:]}"
    return "unknown"
