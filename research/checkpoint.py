"""Checkpoints in a canonical layout: any (tp, pp, dp, zero, schedule) loads any other.

On disk (one folder per save, `ROOT/step_00000025/`, and `ROOT/latest` naming the newest):
- a `torch.distributed.checkpoint` (DCP) of `model/<name>` (fp32 master weights) and
  `optim/<name>/<key>` (optimizer state), where <name> and the tensor's shape are those of
  the tp = pp = dp = 1 model. Each rank writes the boxes it owns: its ZeRO flat ranges
  (`optim.sharded_state`), shifted into its TP slice (`tile_sharded_tensor`); TP-replicated
  parameters are written by TP rank 0 only and the last stage's copy of a tied embedding
  not at all. DCP then loads the overlap of what was saved with what each rank needs;
- `rng/rank_<r>.pt`: each rank's RNG streams, restored when the layout is unchanged (a
  new layout re-seeds from (seed, step), which only matters with dropout);
- `meta.json`, written last: step, data position, scheduler, loss scaler, param groups,
  layout and config. Its presence marks the checkpoint complete.

A save goes to `step_N.tmp/` and is renamed when complete, so a crash leaves the previous
checkpoint intact; a failed save (disk full) removes its `.tmp` and is one sentence, and
the next successful save removes the `.tmp` of an interrupted one. `meta.json` records
every file's SHA-256 and is sealed by its own; a load checks them (`checkpoint_files`) and
reads DCP's pickled `.metadata` with an unpickler that builds DCP metadata types only.
Tensors are read with `weights_only=True`, the rest is JSON: nothing can run code.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from optim import ZeroOptimizer
from optim.sharded_state import tile_sharded_tensor
from parallel import comm
from parallel.dims import ParallelDims
from parallel.marks import NO_MARKS, ParamMarks, param_marks
from parallel.random import get_rng_tracker
from research import checkpoint_files as files
from research.errors import CheckpointError, raise_together
from research.model import GPTConfig

META = files.META
LATEST = "latest"


def canonical_name(name: str) -> str:
    """`3.blocks.5.mlp.fc.weight` (chunk 3 of a rank's ModuleList) -> `blocks.5.mlp.fc.weight`."""
    return name.split(".", 1)[1]


def full_shapes(model: nn.Module, opt: ZeroOptimizer, tp: int) -> dict[str, list[int]]:
    """Canonical name -> shape in the tp = 1, ep = 1 model, of each parameter `opt` names: from
    the optimizer's record of the parameters' shapes (a stage-3 parameter is empty between uses)."""
    marks_of = param_marks(model)
    trained = opt.param_shapes()
    shapes = {}
    for p, name in opt.names.items():
        shape, marks = list(trained.get(p, p.shape)), marks_of.get(p, NO_MARKS)
        if marks.partition_dim is not None:
            shape[marks.partition_dim] *= tp
        if marks.expert is not None:  # this rank's experts of all of them
            shape[marks.expert.dim] *= dist.get_world_size(marks.expert.ep)
        shapes[canonical_name(name)] = shape
    return shapes


def canonical_state(model: nn.ModuleList, opt: ZeroOptimizer, dims: ParallelDims, saving: bool) -> dict[str, Any]:
    """{"model": {name: sharded master}, "optim": {name: {key: state}}} in canonical names
    and shapes, as views of the optimizer's storage (so `dcp.load` writes into it). With
    `saving`, copies that another rank writes too are left out."""
    sd = opt.state_dict()
    params = {name: p for p, name in opt.names.items()}

    marks_of = param_marks(model)

    def lift(value: Any, m: ParamMarks) -> Any:
        dim = m.partition_dim
        if dim is None or dims.tp == 1 or not hasattr(value, "local_shards"):
            return value
        return tile_sharded_tensor(value, dim, dims.tp, dims.tp_rank, dims.with_tp_rank)

    out: dict[str, Any] = {"model": {}, "optim": {}}
    for name, master in sd["params"].items():
        p = params[name]
        chunk = model[int(name.split(".", 1)[0])]
        m = marks_of.get(p, NO_MARKS)
        tied_copy = bool(m.tied) and not chunk.pre
        replicated_copy = m.partition_dim is None and dims.tp_rank != 0
        if saving and (tied_copy or replicated_copy):
            continue
        canon = canonical_name(name)
        out["model"][canon] = lift(master, m)
        out["optim"][canon] = {k: lift(v, m) for k, v in sd["state"].get(name, {}).items()}
    return out


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_rng_tracker().state_dict(),
    }


def save(
    root: str, step: int, model: nn.ModuleList, opt: ZeroOptimizer, dims: ParallelDims, meta: dict[str, Any]
) -> str:
    """Write the checkpoint after `step` completed steps to ROOT/step_<step>; a collective.
    `meta` (JSON-serializable: data position, scheduler, layout, config) goes to meta.json
    with the digest of every file. A failed write (disk full) is a CheckpointError on every
    rank; the partial folder is removed and ROOT/latest still names the previous checkpoint."""
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    rank, world = dist.get_rank(), dist.get_world_size()

    def guard(work: Callable[[], Any]) -> Callable[[], Any]:
        """`work` with an OSError turned into the failed-save sentence."""

        def guarded() -> Any:
            try:
                return work()
            except OSError as e:
                reason = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
                raise CheckpointError(_save_failed(root, final, reason)) from None

        return guarded

    try:
        raise_together(guard(lambda: _fresh_folder(tmp) if rank == 0 else None))
        try:
            dcp.save(canonical_state(model, opt, dims, saving=True), storage_writer=dcp.FileSystemWriter(tmp))
        except CheckpointException as e:
            raise CheckpointError(_save_failed(root, final, _reason(e))) from None
        raise_together(guard(lambda: torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))))
        names = comm.all_gather_object(files.file_names(tmp) if rank == 0 else None)[0]
        mine = raise_together(guard(lambda: files.digests(tmp, names[rank::world])))
        recorded = {k: v for part in comm.all_gather_object(mine) for k, v in part.items()}
        if rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            body = {
                **meta,
                "step": step,
                "param_groups": groups,
                "files": recorded,
                "loss_scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
            }
        raise_together(guard(lambda: _publish(root, tmp, final, files.seal(body)) if rank == 0 else None))
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _save_failed(root: str, final: str, reason: str) -> str:
    """The sentence for a failed save: why, and which checkpoint still stands."""
    previous = _read_latest(root)
    stands = f"{os.path.join(root, LATEST)} still names {previous}" if previous else "there is no earlier checkpoint"
    return f"saving the checkpoint {final} failed ({reason}); {stands}; free space on the disk or choose another --save"


def _fresh_folder(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "rng"))


def _publish(root: str, tmp: str, final: str, meta: dict[str, Any]) -> None:
    """Write meta.json, rename `tmp` to `final`, point ROOT/latest at it, then remove the
    `.tmp` folders of saves that were interrupted."""
    _write_json(os.path.join(tmp, META), meta)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    _write_text(os.path.join(root, LATEST), os.path.basename(final))
    for name in os.listdir(root):
        if name.startswith("step_") and name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _read_latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _write_json(path: str, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=1))


def _write_text(path: str, text: str) -> None:
    """Atomically: a reader sees the old file or the new one, never a partial one."""
    try:
        with open(path + ".part", "w") as f:
            f.write(text)
        os.replace(path + ".part", path)
    finally:
        if os.path.exists(path + ".part"):
            os.remove(path + ".part")


def _complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, META))


def resolve(path: str) -> str:
    """The checkpoint folder `path` names: itself, the one its `latest` file names, or its
    newest complete step_* folder (also when `latest` names a missing or incomplete one,
    with a warning). CheckpointError when there is none."""
    if _complete(path):
        return path
    steps = (
        sorted(
            d
            for d in os.listdir(path)
            if d.startswith("step_") and not d.endswith(".tmp") and _complete(os.path.join(path, d))
        )
        if os.path.isdir(path)
        else []
    )
    named = _read_latest(path)
    if named is not None:
        if _complete(os.path.join(path, named)):
            return os.path.join(path, named)
        if steps:
            _warn(
                f"{os.path.join(path, LATEST)} names {named}, which is missing or incomplete; "
                f"loading the newest complete checkpoint, {steps[-1]}"
            )
    if steps:
        return os.path.join(path, steps[-1])
    if os.path.isfile(os.path.join(path, ".metadata")) or path.endswith(".tmp"):
        raise CheckpointError(
            f"--load={path} is incomplete (no {META}: its save was interrupted); load an earlier checkpoint"
        )
    raise CheckpointError(f"--load={path} holds no checkpoint (no {META}, no {LATEST} file, no step_* folder)")


def latest(root: str) -> str | None:
    """`--resume`: the newest complete checkpoint under `root` (as `resolve` finds it), or
    None when `root` does not exist yet or holds none (an interrupted first save included)."""
    if not os.path.isdir(root):
        return None
    try:
        return resolve(root)
    except CheckpointError:
        return None


def _warn(message: str) -> None:
    """One line on stderr, from rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


_META_FIELDS: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "data": dict,
    "scheduler": dict,
    "layout": dict,
    "model": dict,
    "param_groups": list,
    "files": dict,
    "loss_scaler": (dict, type(None)),
}


def read_meta(path: str) -> dict[str, Any]:
    """meta.json of the checkpoint folder `path` (after `resolve`), its seal and fields checked."""
    try:
        with open(os.path.join(path, META)) as f:
            sealed = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"--load={path}: {META} is unreadable ({e}); the checkpoint is corrupt") from None
    meta = files.unseal(sealed, path)
    for key, kind in _META_FIELDS.items():
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"--load={path}: {META} has no valid {key!r}; the checkpoint is corrupt")
    return meta


def verify_files(path: str, meta: dict[str, Any]) -> None:
    """Check every file of the checkpoint against the digests recorded at save, each rank a
    share of them; CheckpointError on every rank naming the first damaged file. A
    collective when torch.distributed is initialized."""
    names = sorted(meta["files"])
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    raise_together(lambda: files.verify(path, meta["files"], names[rank::world]))


SHAPE_FIELDS = (
    "vocab_size",
    "vocab_multiple",
    "n_layers",
    "n_heads",
    "d_model",
    "d_ff",
    "max_seq_len",
    "position",
    "norm",
    "activation",
    "tie_embeddings",
    "bias",
    "qkv_bias",
)


def check_compatible(path: str, meta: dict[str, Any], config: GPTConfig, expected: dict[str, list[int]]) -> None:
    """CheckpointError unless the checkpoint holds exactly the tensors of this model shape."""
    saved_cfg = meta.get("model", {})
    diff = [
        f"{k}={saved_cfg.get(k)!r} there, {getattr(config, k)!r} here"
        for k in SHAPE_FIELDS
        if k in saved_cfg and saved_cfg[k] != getattr(config, k)
    ]
    if diff:
        raise CheckpointError(f"--load={path} is of another model shape: {'; '.join(diff)}")
    stored = files.read_dcp_metadata(path).state_dict_metadata
    for name, shape in expected.items():
        entry = stored.get(f"model.{name}")
        if entry is None:
            raise CheckpointError(f"--load={path} has no weight {name}; it is of another model")
        if list(entry.size) != shape:
            raise CheckpointError(f"--load={path} has {name} of shape {list(entry.size)}, this model {shape}")


def load(path: str, meta: dict[str, Any], model: nn.ModuleList, opt: ZeroOptimizer, dims: ParallelDims) -> bool:
    """Load the checkpoint folder `path` (already `resolve`d and checked; `meta` its
    meta.json) into the optimizer (hence the model) and, under the same layout, the RNG
    streams; returns whether the RNG streams were restored."""
    state = canonical_state(model, opt, dims, saving=False)
    try:
        dcp.load(state, storage_reader=files.SafeReader(path))
    except (Exception, CheckpointException) as e:  # any DCP failure means bad files
        raise CheckpointError(f"--load={path} is corrupt or incomplete: {_reason(e)}") from None
    names = {canonical_name(n): n for n in opt.names.values()}
    groups = tuple({k: tuple(v) if isinstance(v, list) else v for k, v in g.items()} for g in meta["param_groups"])
    opt.load_state_dict(
        {
            "params": {names[c]: v for c, v in state["model"].items()},
            "state": {names[c]: v for c, v in state["optim"].items()},
            "param_groups": groups,
            **({"loss_scaler": meta["loss_scaler"]} if meta.get("loss_scaler") else {}),
        }
    )
    layout = meta.get("layout", {})
    same_layout = [layout.get(k) for k in ("tp", "pp", "dp")] == [dims.tp, dims.pp, dims.dp]
    rng_file = os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")
    restored = same_layout and os.path.isfile(rng_file)
    if restored:
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        get_rng_tracker().load_state_dict(rng["tracker"])
    return restored


def _reason(e: BaseException) -> str:
    """The first sentence of the first underlying error of a (DCP) exception."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0].split(". ")[0].rstrip(".")


def export(path: str, out_file: str) -> list[str]:
    """Write the checkpoint's weights as one full fp32 state dict of the tp = 1 model
    (`GPT(config).load_state_dict` takes it; a tied head gets its own copy) to
    `out_file`: .safetensors (config in its metadata) or .pt. Runs in one process;
    returns the names written."""
    path = resolve(path)
    meta = read_meta(path)
    files.verify(path, meta["files"], sorted(meta["files"]))
    reader = files.SafeReader(path)
    stored = reader.read_metadata().state_dict_metadata
    weights = {
        k.split(".", 1)[1]: torch.empty(list(v.size), dtype=v.properties.dtype)
        for k, v in stored.items()
        if k.startswith("model.")
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": weights}, storage_reader=reader, no_dist=True)
    if meta["model"].get("tie_embeddings"):
        weights["head.weight"] = weights["embed.weight"].clone()
    tmp = out_file + ".part"
    if out_file.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(weights, tmp, metadata={"model": json.dumps(meta["model"]), "step": str(meta["step"])})
    else:
        torch.save(weights, tmp)
    os.replace(tmp, out_file)
    return sorted(weights)
