"""Runs a test function in a fresh process under TRITON_INTERPRET=1: Triton reads the
variable when it is imported, so the kernels run on CPU tensors only in a new process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(module: str, function: str, timeout: float = 300.0) -> Any:
    """`module.function()` in a TRITON_INTERPRET=1 process; its JSON-encoded result."""
    pytest.importorskip("triton")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    code = f"import json; from {module} import {function}; print(json.dumps({function}()))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
