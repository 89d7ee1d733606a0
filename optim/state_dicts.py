"""ZeroOptimizer's state dicts, in one place: the canonical sharded one for
torch.distributed.checkpoint (per parameter, in its true shape, loadable under any layout;
its tensors are built by optim.sharded_state), the full weights, and the other formats users
reach for, made safe.

`ZeroOptimizer.state_dict()` is sharded: each rank holds its own pieces. Two habits meet it:

* `torch.save(opt.state_dict(), path)` then `torch.load` + `load_state_dict`. Pickled, the
  state dict becomes a `RankLocalState`: this rank's pieces as plain tensors, with the rank,
  the group size and a fingerprint of the layout. Loading it is a collective check that
  every rank got the file its own rank saved under the same layout; otherwise every rank
  raises the same sentence (the usual mistake, saving on rank 0 only, can never hang).
* a plain `torch.optim` state dict (`{"state": {index: {...}}, "param_groups": [{"params":
  [indices], ...}]}`) of the same model: parameters are numbered as a torch optimizer built
  with the same param groups numbers them, each tensor is checked against its parameter's
  shape and its owned part copied in.
* torch's `ZeroRedundancyOptimizer` convention, which Lightning and Fabric follow for
  sharded optimizers: `consolidate_state_dict(to)` (a collective) gathers that plain
  `torch.optim` state dict, whole and on the CPU, onto rank `to` of the shard group, and the
  next `state_dict()` there returns it (until then, or after a step, `state_dict()` is the
  sharded one); every rank loads it with `load_state_dict`.
"""

from __future__ import annotations

import copy
import hashlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from optim import sharded_state
from optim.buffers import FlatBucket
from optim.collectives import gather_flat
from optim.shard_step import ShardStep
from parallel import comm
from parallel.marks import ExpertMark

if TYPE_CHECKING:
    from optim.zero_state import ZeroState

RANK_LOCAL = "zero3d_rank_local"


class ShardedStateDict(dict):
    """What `ZeroOptimizer.state_dict()` returns: a dict for DCP that pickles (torch.save)
    to this rank's pieces only, as a `RankLocalState`."""

    layout: dict[str, Any]

    def __reduce_ex__(self, protocol: int) -> tuple:
        return restore_rank_local, ({**self.layout, "state": _local(dict(self))},)

    def __deepcopy__(self, memo: dict) -> dict:
        return copy.deepcopy(dict(self), memo)


def restore_rank_local(payload: dict[str, Any]) -> dict[str, Any]:
    """Unpickled `ShardedStateDict`: a plain dict marked with RANK_LOCAL."""
    return {RANK_LOCAL: {k: v for k, v in payload.items() if k != "state"}, **payload["state"]}


torch.serialization.add_safe_globals([restore_rank_local])


def _local(value: Any) -> Any:
    """The nested state with each sharded tensor replaced by its local pieces (a list)."""
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and hasattr(value, "local_shards"):
        return [s.tensor.detach().clone() for s in value.local_shards()]
    return value


def fingerprint(stage: int, names_and_shapes: list[tuple[str, tuple[int, ...]]], buckets: list[list[str]]) -> str:
    """A short hash of everything that decides which pieces a rank holds."""
    return hashlib.sha256(repr((stage, names_and_shapes, buckets)).encode()).hexdigest()[:16]


def agree(problem: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise the lowest rank's problem on every rank of `group` (a collective), so a state
    dict that one rank cannot load never leaves the others waiting."""
    problems = comm.all_gather_object(problem, group=group)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise ValueError(first)


def check_rank_local(sd: dict[str, Any], layout: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """Every rank loads the pieces its own rank saved, under the same layout."""
    saved = sd[RANK_LOCAL]
    everyone = comm.all_gather_object((saved["rank"], saved["world"], saved["layout"]), group=group)
    ranks = [r for r, _, _ in everyone]
    problem = None
    if any(w != layout["world"] or fp != layout["layout"] for _, w, fp in everyone):
        problem = (
            f"this optimizer state was saved with torch.save under another layout (group size {everyone[0][1]}, or another "
            "stage, model or bucket size); such a file loads only under the same one, so save with "
            "torch.distributed.checkpoint (dcp.save(opt.state_dict(), ...)) to load under any layout"
        )
    elif ranks != list(range(layout["world"])):
        problem = (
            f"ranks {list(range(layout['world']))} loaded optimizer state that torch.save wrote on ranks {ranks}: "
            "opt.state_dict() holds only this rank's shard, so torch.save it on every rank to a file of its own "
            "(or use torch.distributed.checkpoint: dcp.save(opt.state_dict(), checkpoint_id=...))"
        )
    agree(problem, group)


def is_torch_format(sd: Any) -> bool:
    """A state dict of a plain torch.optim optimizer."""
    groups = sd.get("param_groups") if isinstance(sd, dict) else None
    return isinstance(groups, (list, tuple)) and bool(groups) and isinstance(groups[0], dict) and "params" in groups[0]


def torch_format_problem(sd: dict[str, Any], order: list[list[tuple[str, torch.Size]]]) -> str | None:
    """Why a torch.optim state dict does not fit a ZeroOptimizer whose param groups hold
    `order` ([(name, shape)] per group, in torch's numbering order); None if it fits."""
    groups = sd["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g) for g in order]:
        return (
            f"the torch optimizer state has param groups of {[len(g['params']) for g in groups]} parameters and this "
            f"ZeroOptimizer {[len(g) for g in order]}; build both with the same param groups of trainable parameters"
        )
    for group, mine in zip(groups, order):
        for index, (name, shape) in zip(group["params"], mine):
            for key, value in sd["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shape:
                    return (
                        f"torch optimizer state {key!r} of parameter #{index} has shape {tuple(value.shape)}, but "
                        f"ZeroOptimizer's parameter #{index} is {name!r} of shape {tuple(shape)}; the state belongs to another model"
                    )
    return None


class StateDicts:
    """ZeroOptimizer's state_dict / load_state_dict / full_state_dict / param_shapes (module
    docstring), on the optimizer's buckets, inner optimizer and per-parameter step counts."""

    def __init__(self, shared: ZeroState, shard_step: ShardStep) -> None:
        self.shared, self._shard_step = shared, shard_step
        self._ep_members: dict[ExpertMark, dict[int, list[int]]] = {}  # `_experts_tiled`
        self.state, self.param_groups = shared.inner.state, shared.inner.param_groups
        self._param_steps = shard_step.param_steps
        self.consolidated: dict[str, Any] | None = None  # for the next state_dict() (consolidate)

    def param_shapes(self) -> dict[torch.nn.Parameter, torch.Size]:
        """Each trained parameter's shape, also at stage 3, where it is empty between uses."""
        return {p: shape for b in self.shared.buckets for p, shape in zip(b.params, b.shapes)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights with the keys and shapes of `model.state_dict()`: trainable
        parameters from the fp32 masters (in their original dtype), the rest as they are.
        A collective: every rank must call it; every rank gets the whole dict."""
        self._shard_step.wait()
        full: dict[torch.nn.Parameter, torch.Tensor] = {}
        for b in self.shared.buckets:
            flat = gather_flat(b, b.master, b.group)
            for i, p in enumerate(b.params):
                full[p] = b.param_view(flat, i).to(self.shared.orig_dtypes[id(p)]).clone()
        return {
            k: full[v] if v in full else v.detach().to(self.shared.orig_dtypes.get(id(v), v.dtype)).clone()
            for k, v in self.shared.model.state_dict(keep_vars=True).items()
        }

    def consolidate(self, to: int) -> None:
        """Gather the plain `torch.optim` state dict onto rank `to` of the shard group, where
        the next `state_dict()` returns it (module docstring). A collective."""
        if not 0 <= to < self.shared.world:
            raise ValueError(f"consolidate_state_dict(to={to}): the shard group has ranks 0-{self.shared.world - 1}")
        self._shard_step.wait()
        self._materialize_state()
        index_of = {p: n for n, p in enumerate(p for group in self.shared.torch_order for p in group)}
        state: dict[int, dict[str, Any]] = {}
        for k, b in enumerate(self.shared.buckets):
            for key, value in self.state[b.master].items():
                whole = value.numel() == b.master.numel()
                flat = gather_flat(b, value, b.group) if whole else value
                if self.shared.rank != to:  # it took part in the gathers; only rank `to` keeps a copy
                    continue
                for i, p in enumerate(b.params):
                    if self._param_steps[k][i] == 0:
                        continue  # never stepped: no state, as in torch
                    if key == "step":
                        own = torch.tensor(float(self._param_steps[k][i]))
                    else:
                        own = b.param_view(flat, i) if whole else value
                    state.setdefault(index_of[p], {})[key] = own.detach().to("cpu", copy=True)
        if self.shared.rank != to:
            return
        groups, start = [], 0
        for group, params in zip(self.param_groups, self.shared.torch_order):
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": list(range(start, start + len(params)))})
            start += len(params)
        self.consolidated = {"state": dict(sorted(state.items())), "param_groups": groups}
        if self.shared.scaler is not None:
            self.consolidated["loss_scaler"] = self.shared.scaler.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """Sharded state for `torch.distributed.checkpoint`, canonical per parameter:
        {"params": {name: fp32 master}, "state": {name: {key: tensor}}, "param_groups":
        (hyperparameters per group), "loss_scaler"}, each sharded tensor in the parameter's true shape. It loads under
        any other data-parallel size and stage: `sd = opt.state_dict(); dcp.load(sd, ...);
        opt.load_state_dict(sd)`. Entries are views of the optimizer's own storage.
        Right after `consolidate` on its target rank: the consolidated torch.optim state dict, once."""
        if self.consolidated is not None:
            consolidated, self.consolidated = self.consolidated, None
            return consolidated
        self._shard_step.wait()
        self._materialize_state()
        params: dict[str, Any] = {}
        state: dict[str, dict[str, Any]] = {}
        for k, b in enumerate(self.shared.buckets):
            for name, sharded in self._sharded_views(b, b.master).items():
                params[name] = sharded
            for key, value in self.state[b.master].items():
                if value.numel() == b.master.numel():
                    for name, sharded in self._sharded_views(b, value).items():
                        state.setdefault(name, {})[key] = sharded
                else:
                    for i, p in enumerate(b.params):
                        own = torch.tensor(float(self._param_steps[k][i])) if key == "step" else value
                        state.setdefault(self.shared.names[p], {})[key] = own
        # a tuple is one opaque (pickled) entry for DCP, whose save and load traversals
        # disagree on how to flatten lists of plain dicts
        groups = tuple({k: v for k, v in g.items() if k != "params"} for g in self.param_groups)
        sd = ShardedStateDict(params=params, state=state, param_groups=groups)
        if self.shared.scaler is not None:
            sd["loss_scaler"] = self.shared.scaler.state_dict()
        sd.layout = self._layout()
        return sd

    def _layout(self) -> dict[str, Any]:
        """This rank's place in the sharding, recorded in a torch.save'd state dict."""
        names = [
            (self.shared.names[p], tuple(b.shapes[i])) for b in self.shared.buckets for i, p in enumerate(b.params)
        ]
        buckets = [[self.shared.names[p] for p in b.params] for b in self.shared.buckets]
        return {
            "rank": self.shared.rank,
            "world": self.shared.world,
            "layout": fingerprint(self.shared.stage, names, buckets),
        }

    def _sharded_views(self, bucket: FlatBucket, shard: torch.Tensor) -> dict[str, Any]:
        """name -> sharded tensor whose local pieces view `shard` (master-shaped)."""
        all_ranges = [{i: (s, e) for i, s, e, _ in bucket.shard_ranges(r)} for r in range(bucket.world)]
        out = {}
        for i, p in enumerate(bucket.params):
            piece = bucket.param_slice(shard, i, bucket.shard_range)
            ranges = [[rs[i]] if i in rs else [] for rs in all_ranges]
            st = sharded_state.sharded_tensor_from_flat(bucket.shapes[i], [piece], ranges, bucket.group)
            out[self.shared.names[p]] = self._experts_tiled(st, bucket.marks.expert) if bucket.marks.expert else st
        return out

    def _experts_tiled(self, st: Any, mark: ExpertMark) -> Any:
        """An expert parameter's sharded tensor as its block of the tensor of all E experts,
        stacked along `mark.dim` over the ranks of `mark.ep`: a checkpoint names each expert
        once, whatever ep it was saved under."""
        if mark not in self._ep_members:  # the ep group of each rank holding these experts
            mine = dist.get_process_group_ranks(mark.ep)
            everyone = comm.all_gather_object(mine, group=mark.shard)
            self._ep_members[mark] = {ranks[dist.get_rank(mark.ep)]: ranks for ranks in everyone}
        members = self._ep_members[mark]
        ep = dist.get_world_size(mark.ep)
        return sharded_state.tile_sharded_tensor(st, mark.dim, ep, dist.get_rank(mark.ep), lambda r, p: members[r][p])

    def _materialize_state(self) -> None:
        """Create the inner optimizer's state before its first step, so a checkpoint can be
        loaded into it: one step with zero gradients and lr 0, after which the masters are
        restored and every state tensor is zeroed (a fresh state for Adam-like optimizers)."""
        if all(self.state[b.master] for b in self.shared.buckets):
            return
        if self._shard_step.fusable():
            for b in self.shared.buckets:
                self._shard_step.init_adam_state(b.master)
            return
        saved = [(b.master.clone(), b.master.grad) for b in self.shared.buckets]  # .grad: placeholders shown
        lrs = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = 0.0
        for b in self.shared.buckets:
            b.master.grad = torch.zeros_like(b.master)
        self.shared.inner.step()
        for b, (m, grad), g, lr in zip(self.shared.buckets, saved, self.param_groups, lrs):
            b.master.copy_(m)
            b.master.grad = grad
            g["lr"] = lr
            for value in self.state[b.master].values():
                if isinstance(value, torch.Tensor):
                    value.zero_()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict filled by `torch.distributed.checkpoint.load` (or one returned
        by `state_dict()` under the same layout, also through torch.save / torch.load on every
        rank, the same with every tensor whole, or a plain torch.optim state dict of the same
        model), then republish the parameters. A collective: a state dict that does not fit raises on every rank."""
        self.consolidated = None
        self._materialize_state()
        if RANK_LOCAL in state_dict:
            check_rank_local(state_dict, self._layout(), self.shared.group)
            state_dict = self._fill_from_rank_local(state_dict)
        elif is_torch_format(state_dict):
            self._load_torch_format(state_dict)
            return
        else:
            agree(self._canonical_problem(state_dict), self.shared.group)
        mine = self.state_dict()
        _copy_into(mine["params"], state_dict["params"])
        for name, entries in mine["state"].items():
            _copy_into(entries, state_dict["state"][name])
        for k, b in enumerate(self.shared.buckets):
            for i, p in enumerate(b.params):
                step = state_dict["state"][self.shared.names[p]].get("step")
                if step is not None:
                    self._param_steps[k][i] = int(step)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the checkpoint has {len(saved_groups)} param groups and this optimizer {len(self.param_groups)}; build the optimizer with the same param_groups"
            )
        for group, saved in zip(self.param_groups, saved_groups):
            group.update(saved)
        if self.shared.scaler is not None and "loss_scaler" in state_dict:
            self.shared.scaler.load_state_dict(state_dict["loss_scaler"])
        if not self.shared.sharding.optimizer_state:
            self._replicate_stage0()
        for b in self.shared.buckets:
            b.write_master_to_params()
        self._shard_step.publish()

    def _canonical_problem(self, sd: Any) -> str | None:
        """Why `sd` is not a state dict of this optimizer's parameters; None if it is."""
        if not isinstance(sd, dict) or not {"params", "state", "param_groups"} <= set(sd):
            return (
                "this is not a ZeroOptimizer state dict (it lacks 'params', 'state' or 'param_groups'); load the dict "
                "opt.state_dict() returns, filled by dcp.load or saved by torch.save on every rank, or a torch.optim "
                "state dict of the same model"
            )
        for name, shape in ((self.shared.names[p], s) for b in self.shared.buckets for p, s in zip(b.params, b.shapes)):
            if name not in sd["params"] or name not in sd["state"]:
                return (
                    f"the optimizer state dict has no parameter {name!r}: it was saved for another model or optimizer"
                )
            whole = sd["params"][name]
            if not hasattr(whole, "local_shards") and tuple(whole.shape) != tuple(shape):
                return (
                    f"the optimizer state dict holds {name!r} of shape {tuple(whole.shape)}, but the parameter's shape "
                    f"is {tuple(shape)}: it was saved for another model"
                )
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
        return {
            **mine,
            "param_groups": local["param_groups"],
            **({"loss_scaler": local["loss_scaler"]} if "loss_scaler" in local else {}),
        }

    def _load_torch_format(self, sd: dict[str, Any]) -> None:
        """A torch.optim state dict of the same model: each parameter's state, numbered as a
        torch optimizer with the same param groups numbers it, copied into its owned part."""
        shape_of = self.param_shapes()
        order = [[(self.shared.names[p], shape_of[p]) for p in group] for group in self.shared.torch_order]
        problem = torch_format_problem(sd, order)
        keys = {key for b in self.shared.buckets for key in self.state[b.master]}
        extra = {key for entries in sd["state"].values() for key in entries} - keys
        extra |= {key for group in sd["param_groups"] for key in group} - {"params", *self.param_groups[0]}
        if problem is None and extra:
            problem = (
                f"the torch optimizer state has entries {sorted(extra)} that {self.shared.optimizer_class.__name__} does not "
                "have: it comes from another optimizer class; build ZeroOptimizer with the same one"
            )
        agree(problem, self.shared.group)
        index_of = {
            p: index
            for group, mine in zip(sd["param_groups"], self.shared.torch_order)
            for index, p in zip(group["params"], mine)
        }
        for k, b in enumerate(self.shared.buckets):
            state = self.state[b.master]
            for i, p in enumerate(b.params):
                self._param_steps[k][i] = int(sd["state"].get(index_of[p], {}).get("step", 0))
            for i, s, e, at in b.ranges_of(*b.opt_range):
                saved = sd["state"].get(index_of[b.params[i]], {})
                for key, target in state.items():
                    if key != "step" and isinstance(target, torch.Tensor) and target.shape == b.master.shape:
                        value = saved.get(key)  # none: never stepped in the saved run, a fresh state
                        target[at : at + e - s] = 0 if value is None else value.reshape(-1)[s:e]
        for group, saved in zip(self.param_groups, sd["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _replicate_stage0(self) -> None:
        """Stage 0 loads only its own shard of each replicated tensor; gather the rest."""
        for b in self.shared.buckets:
            lo, hi = b.shard_range
            for t in [b.master, *(v for v in self.state[b.master].values() if v.numel() == b.master.numel())]:
                comm.all_gather_into_tensor(t, t[lo:hi].clone(), group=b.group)


def _copy_into(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Copy loaded values into the optimizer's own views, unless they are the same storage; a
    whole tensor (a full state dict, as accelerate's save_state writes) gives each view its part."""
    for key, target in mine.items():
        source = theirs[key]
        if hasattr(target, "local_shards") and not hasattr(source, "local_shards"):
            sharded_state.fill_from_full(target, source)
            continue
        for dst, src in zip(_local_tensors(target), _local_tensors(source)):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)


def _local_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor) and hasattr(value, "local_shards"):
        return [s.tensor for s in value.local_shards()]
    return [value]
