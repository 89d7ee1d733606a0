"""`python -m experiments.bench` merges every benchmark's ratios into one table."""

from __future__ import annotations

from experiments.bench.__main__ import ratio_rows


def test_ratio_rows_cover_every_pairing_of_every_benchmark() -> None:
    zero = {
        "worlds": {
            "2": {
                "ratios": [
                    {"ours": "zero0", "theirs": "ddp", "ratio": 0.95, "goal": "<=", "met": True},
                    {"ours": "zero2", "theirs": "ddp_zero", "ratio": 0.9, "goal": None, "met": None},
                ]
            }
        }
    }
    pipe = {"config": {"pp": 4}, "rows": [{"schedule": "1f1b", "v": 1, "m": 8, "ratio": 1.1}]}
    one = {
        "rows": [
            {"method": "torch", "ratio": 1.0, "met": None},
            {"method": "zero1", "ratio": 1.02, "met": True},
            {"method": "zero2", "ratio": 1.2, "met": False},
        ]
    }
    rows = ratio_rows(zero, pipe, one)
    assert rows == [
        ["zero_vs_torch", "dp=2", "zero0", "ddp", "0.950", "<= 1 (met)"],
        ["zero_vs_torch", "dp=2", "zero2", "ddp_zero", "0.900", "-"],
        ["one_process", "1 process", "zero1", "AdamW(fused=True)", "1.020", "<= 1.1 (met)"],
        ["one_process", "1 process", "zero2", "AdamW(fused=True)", "1.200", "<= 1.1 (missed)"],
        ["pipeline_bubble", "pp=4 v=1 m=8", "ours 1f1b", "torch.distributed.pipelining", "1.100", "-"],
    ]
    assert ratio_rows(zero, pipe) == [rows[0], rows[1], rows[4]]
