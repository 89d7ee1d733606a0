"""`python -m tests.under_load`: pytest's exit code comes back, and the busy loops end with it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def busy_loops() -> int:
    """Processes running the harness's busy loop (their command lines, read from /proc)."""
    count = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # ended meanwhile
            count += b"while True: pass" in cmdline.read_bytes()
    return count


@pytest.mark.slow
def test_pytest_runs_beside_busy_loops_that_end_with_it() -> None:
    before = busy_loops()
    passed = subprocess.run(
        [sys.executable, "-m", "tests.under_load", "--busy", "2", "--", "-q", "-p", "no:cacheprovider",
         "tests/test_code_rules.py", "-k", "cycle"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert passed.returncode == 0, passed.stdout[-2000:]
    assert "beside 2 busy loops" in passed.stdout
    failed = subprocess.run(
        [sys.executable, "-m", "tests.under_load", "--busy", "1", "--", "-q", "-p", "no:cacheprovider",
         "tests/test_code_rules.py", "-k", "no_test_has_this_name"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert failed.returncode == 5  # pytest's "no tests collected", passed through
    assert busy_loops() == before
