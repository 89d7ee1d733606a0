"""The marks of parallel.comm, written where the model is built, survive copy.deepcopy, and a
deep-copied GPT trains as the original (its sequence-parallel gradient hooks come back)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from parallel import marks
from parallel.dims import ParallelDims
from parallel.marks import NO_MARKS, param_marks
from parallel.random import seed_everything
from research.model import GPTConfig, pipeline_chunks
from tests.dist_utils import run_distributed

CONFIG = GPTConfig(vocab_size=61, n_layers=2, n_heads=4, d_model=32, max_seq_len=16, vocab_multiple=64)


def by_name(model: nn.Module) -> dict[str, tuple]:
    """name -> (replicated, tied, partition dim, sequence-parallel) with groups by identity."""
    found = param_marks(model)
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        m = found.get(p, NO_MARKS)
        ids = (tuple(map(id, m.replicated)), tuple(map(id, m.tied)), m.partition_dim)
        out[name] = (*ids, tuple(map(id, m.sequence_parallel)))
    return out


def test_marks_on_the_owning_module() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    a, b = object(), object()  # stand-ins for process groups
    marks.mark_replicated(model, "1.weight", a)
    marks.mark_replicated(model[1], "weight", b)
    marks.mark_replicated(model, "1.weight", a)  # same group again: no-op
    marks.mark_tied(model, "0.bias", b)
    marks.mark_partitioned(model[0], "weight", 1)
    found = param_marks(model)
    assert found[model[1].weight].replicated == (a, b)
    assert found[model[0].bias].tied == (b,) and found[model[0].bias].replicated == (b,)
    assert found[model[0].weight].partition_dim == 1
    assert model[1].bias not in found
    clone = copy.deepcopy(model)
    assert by_name(clone) == by_name(model)
    assert param_marks(clone)[clone[1].weight].replicated[0] is a  # groups are shared, not copied
    with pytest.raises(ValueError, match=r"Sequential has no parameter '1\.scale' to mark"):
        marks.mark_replicated(model, "1.scale", a)


def _deepcopied_gpt(tp: int, pp: int) -> dict:
    """Marks of a rank's chunks and of their deep copy, and the gradients of both after one
    backward on the same batch (tp: sequence parallelism on, so norms sync their gradients)."""
    dims = ParallelDims(tp=tp, pp=pp).build()
    config = CONFIG if pp == 1 else GPTConfig(**{**CONFIG.__dict__, "tie_embeddings": True})
    seed_everything(0)
    chunks = pipeline_chunks(config, dims.pp_rank, dims.pp, 1, dims.tp_group, dims.embedding_group, tp > 1)
    model = nn.ModuleList(chunks)
    clone = copy.deepcopy(model)
    out = {"original": by_name(model), "copy": by_name(clone)}
    if pp == 1:
        ids = torch.randint(0, config.vocab_size, (2, config.max_seq_len), generator=torch.Generator().manual_seed(0))
        for name, m in (("original", model), ("copy", clone)):
            m[0](ids, ids).backward()
            out[name + "_grads"] = {n: p.grad.clone() for n, p in m.named_parameters()}
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_deepcopied_gpt_keeps_its_marks_and_trains_the_same(tp: int, pp: int) -> None:
    """tp 2 with SP: norms, positions and row biases stay replicated and sequence-parallel,
    TP weights partitioned, and the copy's gradients equal the original's (its norm gradients
    summed over TP, not left per shard). pp 2 with tied embeddings: the embedding stays tied
    over the embedding group on both stages."""
    for result in run_distributed(_deepcopied_gpt, 2, tp, pp):
        assert result["copy"] == result["original"]
        marked = [k for k, v in result["original"].items() if v[0] or v[2] is not None]
        assert marked, "nothing was marked"
        if tp > 1:
            assert all(result["original"][k][3] for k in result["original"] if "norm" in k)
            for n, g in result["original_grads"].items():
                torch.testing.assert_close(result["copy_grads"][n], g, rtol=0, atol=0, msg=n)
        else:
            assert any(v[1] for v in result["original"].values()), "the tied embedding is not marked"
