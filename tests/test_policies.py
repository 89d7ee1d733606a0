"""ZeroOptimizer's option policies (optim.policies): the flat keyword names of the previous
release still build the same optimizer, with one DeprecationWarning that names the policy to
use instead; a policy and a flat name of the same policy together are refused; each policy
validates its own fields. (pyproject.toml turns the deprecation into an error in the test
process, so that no other test spells an option the old way here; pytest.warns still sees it.)"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from optim import DynamicLossScaler, ZeroOptimizer
from optim.policies import FLAT_NAMES, Communication, MixedPrecision, ZeroPlusPlus
from tests.models import make_model

SCALER = DynamicLossScaler(init_scale=2.0**10)  # compared by identity: the same one on both sides

# (stage, the flat options, the same as policies)
CASES = {
    "precision": (
        2,
        {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16},
        {"precision": MixedPrecision(torch.bfloat16, torch.bfloat16)},
    ),
    "fp16 scaler": (
        1,
        {"param_dtype": torch.float16, "loss_scaler": SCALER},
        {"precision": MixedPrecision(torch.float16, loss_scaler=SCALER)},
    ),
    "communication": (
        2,
        {
            "bucket_numel": 1500,
            "unit_numel": 500,
            "resident_numel": 100,
            "overlap_param_gather": True,
            "find_unused_parameters": False,
            "comm_timeout_s": 30.0,
        },
        {
            "communication": Communication(
                bucket_numel=1500,
                unit_numel=500,
                resident_numel=100,
                overlap_param_gather=True,
                find_unused_parameters=False,
                timeout_s=30.0,
            )
        },
    ),
    "zero++": (
        3,
        {"qwz_block": 64, "hpz": True, "qgz_bits": 8},
        {"zero_plus_plus": ZeroPlusPlus(qwz_block=64, hpz=True, qgz_bits=8)},
    ),
    "all three": (
        3,
        {"param_dtype": torch.bfloat16, "unit_numel": 500, "resident_numel": 0, "qwz_block": 64},
        {
            "precision": MixedPrecision(torch.bfloat16),
            "communication": Communication(unit_numel=500, resident_numel=0),
            "zero_plus_plus": ZeroPlusPlus(qwz_block=64),
        },
    ),
}
POLICY_NAMES = {"precision": "MixedPrecision", "communication": "Communication", "zero_plus_plus": "ZeroPlusPlus"}


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """This process as the only rank of a gloo group (ZeroOptimizer needs a default group),
    destroyed after the module so that no other test sees it."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(stage: int, **options: Any) -> ZeroOptimizer:
    return ZeroOptimizer(make_model(), torch.optim.AdamW, stage=stage, lr=1e-3, **options)


def test_the_cases_spell_every_flat_name() -> None:
    assert {name for _, flat, _ in CASES.values() for name in flat} == set(FLAT_NAMES)


@pytest.mark.parametrize("case", list(CASES))
def test_flat_names_build_the_same_optimizer_with_one_warning(one_rank: None, case: str) -> None:
    stage, flat, policies = CASES[case]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explicit = build(stage, **policies)
    assert [w for w in caught if issubclass(w.category, DeprecationWarning)] == []
    with pytest.deprecated_call() as record:
        old = build(stage, **flat)
    deprecations = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in deprecations]
    message = str(deprecations[0].message)
    assert deprecations[0].filename == __file__, "the warning points at the caller's line"
    for name in flat:
        assert f"{name}=..." in message, message
    for argument in policies:
        assert f"{argument}={POLICY_NAMES[argument]}(" in message, message
    for argument in ("precision", "communication", "zero_plus_plus"):
        assert getattr(old, argument) == getattr(explicit, argument), argument
    assert old.param_dtype == explicit.param_dtype
    assert old.scaler is explicit.scaler
    assert [(b.numel, len(b.params)) for b in old.buckets] == [(b.numel, len(b.params)) for b in explicit.buckets]
    assert old.param_groups[0]["lr"] == explicit.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize(
    "options, sentence",
    [
        ({"communication": Communication(), "bucket_numel": 1500}, "got both communication= and the flat option"),
        ({"precision": MixedPrecision(), "param_dtype": torch.bfloat16}, "got both precision= and the flat option"),
        ({"zero_plus_plus": ZeroPlusPlus(), "qwz_block": 64}, "got both zero_plus_plus= and the flat option"),
        ({"communication": Communication(), "comm_timeout_s": 5.0}, "set timeout_s in communication"),
    ],
)
def test_a_policy_and_its_flat_name_together_are_refused(one_rank: None, options: dict, sentence: str) -> None:
    with pytest.raises(TypeError, match=sentence):
        build(2, **options)


@pytest.mark.parametrize(
    "make, sentence",
    [
        (lambda: MixedPrecision(param_dtype=torch.int8), "param_dtype=torch.int8 is not supported"),
        (lambda: MixedPrecision(reduce_dtype=torch.float16), "reduce_dtype=torch.float16 is not supported"),
        (lambda: Communication(bucket_numel=0), "bucket_numel=0 must be a positive number of elements"),
        (lambda: Communication(unit_numel=True), "unit_numel=True must be a positive number of elements"),
    ],
)
def test_each_policy_validates_its_fields(make: Any, sentence: str) -> None:
    with pytest.raises(ValueError, match=sentence):
        make()
