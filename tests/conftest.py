"""What the test files share: the flags of the smallest training run (`TINY_RUN`, a 2-layer
GPT of width 32 on 32-token sequences, global batch 4, no wandb, quiet console), and the
markers (pyproject.toml): `slow` for tests over about ten seconds, `bench` for the
benchmarks' smoke runs. A test appends its own flags; the last of a repeated flag wins."""

from __future__ import annotations

TINY_RUN = [
    *("--n-layers", "2", "--n-heads", "2", "--d-model", "32", "--max-seq-len", "32", "--seq-len", "32"),
    *("--global-batch-size", "4", "--wandb", "disabled", "--log-every", "1000"),
]


def pytest_collection_modifyitems(items: list) -> None:
    """A benchmark's smoke run is slow too, so `-m "not slow"` leaves it out."""
    import pytest

    for item in items:
        if item.get_closest_marker("bench") is not None:
            item.add_marker(pytest.mark.slow)
