"""The main job: a 3D-parallel (tensor × pipeline × data) GPT training run on text.

    torchrun --standalone --nproc_per_node=8 -m experiments.train \\
        --config experiments/configs/tiny.yaml --tp 2 --pp 2 --zero 2 \\
        --schedule 1f1b --micro-batches 4 --steps 50 --seed 0 --precision fp32 --out runs/demo

Every option is in `--help` (with the value it would take); a YAML `--config` sets any of
them and the command line overrides it. Without torchrun it runs as one process.
Writes OUT/config.yaml, OUT/metrics.jsonl (a line per step), OUT/summary.json and, unless
`--wandb disabled`, a wandb run under OUT/wandb (offline by default; `wandb sync` it).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from experiments import launcher
from parallel import desync
from research.config import RunConfig, parse_args
from research.errors import RunError, report
from research.trainer import Trainer

JOINED = (
    "rank {rank} of {world} could not join its process group (torchrun attempt {attempt}) within "
    "{timeout:g} s: {reason}; if the job's hosts are up, raise --comm-timeout"
)


def _world_size() -> int:
    """The number of processes: the initialized group's, torchrun's, or 1 (which then
    gets a single-process rendezvous on a free local port)."""
    if dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    return int(os.environ["WORLD_SIZE"])


def join(argv: list[str] | None = None) -> RunConfig:
    """Parse and validate `argv` (before any process group exists), then join the process
    group (one process without torchrun) with --comm-timeout on every group: the config."""
    cfg = parse_args(argv, _world_size())
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    timeout_s = cfg.parallel.comm_timeout or desync.default_timeout_s(device_type)
    cfg.parallel.comm_timeout = timeout_s
    if not dist.is_initialized():
        _join(timeout_s)
    desync.set_timeout(timeout_s, [None])
    return cfg


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Join (`join`) and train; the run's summary. A collective that waits longer than
    --comm-timeout ends the process with a desync report."""
    cfg = join(argv)
    with desync.report_timeouts(cfg.parallel.comm_timeout):
        return Trainer(cfg).train()


def _join(timeout_s: float) -> None:
    """init_process_group. Under torchrun's agent store the workers of each restart attempt
    share a store of their own: torchrun keeps one rendezvous store across restarts and gives
    the workers no per-attempt prefix, so a restarted worker would read the dead workers'
    addresses (gloo's connectFullMesh: "Connection refused") and their keys (a stale error
    report). A rank that cannot join ends with one sentence (RunError)."""
    timeout = timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
            dist.init_process_group(timeout=timeout)
            return
        agent = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        store = dist.PrefixStore(f"zero3d/attempt_{attempt}", agent)
        dist.init_process_group(store=store, rank=rank, world_size=world, timeout=timeout)
    except (RuntimeError, dist.DistError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RunError(
            JOINED.format(rank=rank, world=world, attempt=attempt, timeout=timeout_s, reason=reason), origin=rank
        ) from None


def main() -> None:
    if launcher.wants_launch(sys.argv[1:]):
        raise SystemExit(launcher.launch(sys.argv[1:]))
    as_rank(run)


def as_rank(job: Callable[[], object]) -> None:
    """Run `job` as this process's part of a run: a RunError ends it with its one sentence
    (rank 0 under torchrun) and exit code 2; the watchdog and the process group are closed
    however it ends."""
    try:
        job()
    except RunError as e:
        report(e)
        raise SystemExit(2) from None
    finally:
        desync.unwatch()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
