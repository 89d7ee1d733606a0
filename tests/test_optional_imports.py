"""triton and NVIDIA apex are optional: in a process where neither can be imported (macOS, a
CPU-only environment, a trainer's own virtualenv), `optim`, the trainer and every integration
import, ZeroOptimizer trains at every stage like torch.optim.AdamW on the torch kernels, and the
training command runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import TINY_RUN

ROOT = Path(__file__).resolve().parents[1]

# sys.modules[name] = None makes `import name` raise ImportError, as when it is not installed
BLOCK = "import sys\nsys.modules['triton'] = sys.modules['apex'] = None\n"

TRAIN_LIKE_ADAMW = """
import torch, torch.distributed as dist
import optim.integrations.accelerate, optim.integrations.fabric, optim.integrations.hf, optim.integrations.lightning
import research.trainer
from optim import ZeroOptimizer
from optim.fused import available_backends
from optim.policies import Communication
from tests.models import batches, make_model

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
assert "triton" not in available_backends("cpu") and "apex" not in available_backends("cpu")
small = Communication(bucket_numel=1500, unit_numel=500, resident_numel=100)
for stage in range(4):
    model, reference = make_model(), make_model()
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, communication=small, lr=3e-3)
    ref = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=3e-3)
    for idx, tgt in batches(3, 4):
        for m, o in ((model, opt), (reference, ref)):
            m(idx, tgt).backward()
            o.step()
            o.zero_grad()
    want = reference.state_dict()
    for k, v in opt.full_state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6)
print("trained like AdamW at stages 0-3")
"""


def python(code: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code), *argv],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        check=False,
    )


@pytest.mark.slow
def test_optim_and_every_integration_work_without_triton_and_apex() -> None:
    proc = python(TRAIN_LIKE_ADAMW)
    assert proc.returncode == 0 and "trained like AdamW at stages 0-3" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_the_training_command_runs_without_triton_and_apex(tmp_path: Path) -> None:
    run = "import runpy\nrunpy.run_module('experiments.train', run_name='__main__')\n"
    argv = [
        *TINY_RUN,
        "--steps",
        "2",
        "--zero",
        "3",
        "--data-cache",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path / "run"),
    ]
    proc = python(run, *argv)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file()
