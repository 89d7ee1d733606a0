"""torch's ZeroRedundancyOptimizer conventions on ZeroOptimizer: `consolidate_state_dict(to)`
then `state_dict()` on that rank gives the whole state in torch.optim's format, equal to what
ZeroRedundancyOptimizer consolidates after the same training; either optimizer loads the
other's on every rank and trains on exactly as before (Lightning and Fabric save sharded
optimizers this way)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from optim import ZeroOptimizer
from optim.policies import Communication
from tests.dist_utils import dp_by_mp_groups, run_distributed
from tests.models import batches, make_model, no_decay_groups

WORLD, LR = 2, 3e-3
SMALL = Communication(bucket_numel=1500, unit_numel=500, resident_numel=100)  # several buckets and units


def train(model: torch.nn.Module, opt: Any, steps: range) -> None:
    """AdamW steps on this rank's half of each global batch; `model` is the ZeroOptimizer's
    bare model or a DDP-wrapped one."""
    rank = dist.get_rank()
    for step, (idx, tgt) in enumerate(batches(max(steps) + 1, 8)):
        if step in steps:
            rows = slice(4 * rank, 4 * rank + 4)
            model(idx[rows], tgt[rows]).backward()
            opt.step()
            opt.zero_grad()


def zero_redundancy(model: torch.nn.Module) -> tuple[DistributedDataParallel, ZeroRedundancyOptimizer]:
    ddp = DistributedDataParallel(model)
    return ddp, ZeroRedundancyOptimizer(no_decay_groups(model), torch.optim.AdamW, lr=LR)


def everyone(obj: Any) -> Any:
    """A copy of rank 0's object on every rank (ZeroRedundancyOptimizer's load_state_dict
    changes the dict it is given)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return copy.deepcopy(box[0])


def round_trip(stage: int) -> dict[str, Any]:
    """3 steps under ZeroOptimizer at `stage` and under DDP + ZeroRedundancyOptimizer; both
    consolidated on rank 0; each loaded into a fresh instance of the other (a ZeroOptimizer at
    the next stage, its model's weights loaded after it was built, as Fabric's load does); all
    four train 2 more steps."""
    model = make_model()
    opt = ZeroOptimizer(
        model, torch.optim.AdamW, stage=stage, param_groups=no_decay_groups(model), communication=SMALL, lr=LR
    )
    ddp, zro = zero_redundancy(make_model())
    train(model, opt, range(3))
    train(ddp, zro, range(3))
    opt.consolidate_state_dict(to=0)
    zro.consolidate_state_dict(to=0)
    ours = opt.state_dict()
    theirs = copy.deepcopy(zro.state_dict()) if dist.get_rank() == 0 else None  # it views the live state
    out: dict[str, Any] = {"ours": ours, "theirs": theirs, "sharded_after": "params" in opt.state_dict()}

    fresh = make_model(seed=5)
    loaded = ZeroOptimizer(
        fresh, torch.optim.AdamW, stage=(stage + 1) % 4, param_groups=no_decay_groups(fresh), communication=SMALL, lr=LR
    )
    fresh.load_state_dict(everyone(ddp.module.state_dict()))
    loaded.load_state_dict(everyone(theirs))
    ddp2, zro2 = zero_redundancy(make_model(seed=5))
    ddp2.module.load_state_dict(everyone(opt.full_state_dict()))
    zro2.load_state_dict(everyone(ours))

    for m, o in [(model, opt), (ddp, zro), (fresh, loaded), (ddp2, zro2)]:
        train(m, o, range(3, 5))
    out["weights"] = {
        "ZeroOptimizer": opt.full_state_dict(),
        "ZeroRedundancyOptimizer": ddp.module.state_dict(),
        "ZeroOptimizer from ZeroRedundancyOptimizer's": loaded.full_state_dict(),
        "ZeroRedundancyOptimizer from ZeroOptimizer's": ddp2.module.state_dict(),
    }
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_consolidated_state_is_zero_redundancy_optimizers_and_loads_both_ways(stage: int) -> None:
    results = run_distributed(round_trip, WORLD, stage, timeout=180)
    ours, theirs = results[0]["ours"], results[0]["theirs"]
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys() and len(ours["state"]) > 10
    for index, entries in theirs["state"].items():
        assert ours["state"][index].keys() == entries.keys()
        for key, value in entries.items():
            mine = ours["state"][index][key]
            assert mine.dtype == value.dtype and mine.device == torch.device("cpu"), (index, key)
            torch.testing.assert_close(
                mine, value, rtol=1e-5, atol=1e-7, msg=lambda m, i=index, k=key: f"#{i} {k}: {m}"
            )
    assert results[0]["sharded_after"] and results[1]["sharded_after"]
    for rank in results:
        want = rank["weights"]["ZeroRedundancyOptimizer"]
        for name, got in rank["weights"].items():
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, n=name, k=k: f"{n} {k}: {m}")


def consolidate_model_parallel() -> str:
    """2 data-parallel × 2 model-parallel ranks: consolidate_state_dict's error."""
    dp, mp = dp_by_mp_groups()
    model = make_model()
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=1, process_group=dp, model_parallel_group=mp)
    try:
        opt.consolidate_state_dict()
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_consolidated_save_of_a_split_model_is_refused_on_every_rank() -> None:
    """Each tensor-parallel rank's consolidated state holds its own slices, in the same shapes:
    saved from rank 0 alone it would load silently wrong on the others, so consolidating is
    refused before any communication, naming the sharded save."""
    for message in run_distributed(consolidate_model_parallel, 4):
        assert "split over tensor, pipeline or expert ranks" in message and "dcp.save(opt.state_dict()" in message
