"""optim.scaler.DynamicLossScaler: Megatron's hysteresis / growth rule, floor, state round trip."""

from __future__ import annotations

import pytest
import torch

from optim.scaler import DynamicLossScaler


def _run(scaler: DynamicLossScaler, pattern: str) -> list[float]:
    """Feed steps ('x' overflow, '.' clean) and return the scale after each."""
    scales = []
    for c in pattern:
        scaler.update(found_inf=c == "x")
        scales.append(scaler.scale)
    return scales


def test_hysteresis_delays_backoff_until_growth_refills_it():
    s = DynamicLossScaler(init_scale=1024.0, hysteresis=2, growth_interval=3)
    # 1st overflow tolerated, 2nd and 3rd back off (the tracker is only refilled by growth).
    assert _run(s, "xxx") == [1024.0, 512.0, 256.0]
    # a clean run shorter than growth_interval refills nothing: the next overflow backs off
    assert _run(s, "..x") == [256.0, 256.0, 128.0]
    # growth after 3 clean steps refills the hysteresis: one overflow is tolerated again
    assert _run(s, "...x") == [128.0, 128.0, 256.0, 256.0]
    assert _run(s, "x") == [128.0]


def test_hysteresis_one_backs_off_on_every_overflow():
    s = DynamicLossScaler(init_scale=8.0, hysteresis=1, backoff_factor=0.25)
    assert _run(s, "xx") == [2.0, 1.0]


def test_growth_needs_consecutive_clean_steps():
    s = DynamicLossScaler(init_scale=4.0, growth_interval=2, growth_factor=3.0, hysteresis=5)
    assert _run(s, ".x.") == [4.0, 4.0, 4.0]  # a tolerated overflow still resets the growth count
    assert _run(s, ".") == [12.0]
    assert _run(s, "....") == [12.0, 36.0, 36.0, 108.0]


def test_min_scale_floor():
    s = DynamicLossScaler(init_scale=4.0, hysteresis=1, min_scale=1.5)
    assert _run(s, "xxxx") == [2.0, 1.5, 1.5, 1.5]


def test_state_dict_round_trip():
    s = DynamicLossScaler(init_scale=2.0**10, hysteresis=3, growth_interval=4)
    _run(s, "xx...")
    sd = s.state_dict()
    assert sd == {"scale": 2.0**10, "growth_tracker": 3, "hysteresis_tracker": 1}
    t = DynamicLossScaler(hysteresis=3, growth_interval=4)
    t.load_state_dict(sd)
    assert t.state_dict() == sd
    assert _run(t, ".x") == _run(s, ".x") == [2.0**11, 2.0**11]
    megatron_style = {**sd, "scale": torch.tensor([64.0])}
    t.load_state_dict(megatron_style)
    assert t.scale == 64.0 and isinstance(t.scale, float)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_scale": 2.0**17}, "min_scale"),
    ],
)
def test_rejects_invalid_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)
