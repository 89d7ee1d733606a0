"""`python -m experiments.train --nproc-per-node N ...`: check the whole configuration in this one
process, then start the workers through torch's own elastic launcher.

A bad value costs one line (`error: ...`) and exit code 2 before any worker exists, where
torchrun would start N workers that each find it, print it and fail, and then add its own
report of the failed workers. The launch flags are torchrun's and mean what they mean there
(`--nnodes`, `--node-rank`, `--rdzv-*`, `--max-restarts`; one node without an endpoint is
`--standalone`); everything else goes to the workers unchanged, which run
`-m experiments.train` under `torch.distributed.run`. A worker's own error sentence is printed
by the worker (rank 0, or the rank that found it); the launcher then exits with its code,
adding one line only for a worker that died of something else.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from research.config import add_launch_flags, parse_args
from research.errors import ConfigError, RunError, report

LAUNCH_FLAGS = ("--nproc-per-node", "--nproc_per_node")


def wants_launch(argv: list[str]) -> bool:
    """Whether `argv` asks this process to launch workers rather than be one."""
    return any(a == f or a.startswith(f + "=") for a in argv for f in LAUNCH_FLAGS)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_launch_flags(p)
    return p


def _max_nodes(nnodes: str) -> int:
    """torchrun's --nnodes: N or MIN:MAX (elastic); the configuration is checked at the most."""
    try:
        return int(nnodes.split(":")[-1])
    except ValueError:
        raise ConfigError(f"--nnodes={nnodes} must be a number of nodes N or a range MIN:MAX") from None


def checked(argv: list[str]) -> list[str]:
    """torch.distributed.run's arguments that start the workers of `argv`, once the workers'
    configuration is valid for the most processes the job can have (ConfigError if not)."""
    if "LOCAL_RANK" in os.environ:
        raise ConfigError(
            "--nproc-per-node starts workers, but this process is already one of torchrun's; drop the launch "
            "flags from the workers' command (or run python -m experiments.train --nproc-per-node N alone)"
        )
    launch, rest = _parser().parse_known_args(argv)
    if launch.nproc_per_node is None or launch.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node={launch.nproc_per_node} must be a positive number of processes")
    world = launch.nproc_per_node * _max_nodes(launch.nnodes)
    args = [
        f"--nproc-per-node={launch.nproc_per_node}",
        f"--nnodes={launch.nnodes}",
        f"--max-restarts={launch.max_restarts}",
    ]
    if launch.nnodes == "1" and not launch.rdzv_endpoint:
        args.append("--standalone")
    else:
        args += [
            f"--node-rank={launch.node_rank}",
            f"--rdzv-backend={launch.rdzv_backend}",
            f"--rdzv-endpoint={launch.rdzv_endpoint}",
            f"--rdzv-id={launch.rdzv_id}",
        ]
    parse_args(rest, world)
    return [*args, "--module", "experiments.train", *rest]


def launch(argv: list[str]) -> int:
    """Check, then run the workers; the exit code (2: an error sentence was printed)."""
    try:
        args = checked(argv)
    except RunError as e:
        report(e)
        return 2
    from torch.distributed import run as elastic
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for name in ("torch.distributed.run", "torch.distributed.elastic"):  # the workers speak for themselves
        logging.getLogger(name).setLevel(logging.CRITICAL)
    nproc = _parser().parse_known_args(argv)[0].nproc_per_node
    # A store of its own for each rendezvous round: with the store shared across rounds, a host
    # joining a later round waits for an address its rank-0 agent wrote only in the first, and
    # the agents' rank assignment times out after 60 s (docs/training.md, "A lost host").
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    print(f"launch: the configuration is valid; starting {nproc} workers on this node", flush=True)
    try:
        elastic.run(elastic.parse_args(args))
    except ChildFailedError as e:
        rank, failure = min(e.failures.items())
        if failure.exitcode != 2:  # not a reported error sentence: say which worker died
            print(
                f"error: worker rank {rank} exited with code {failure.exitcode}; its output is above", file=sys.stderr
            )
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
