"""Errors a user can fix, and how every rank of a run agrees on one.

A `RunError`'s message is one sentence: what was wrong, where, and what to do. The
training command prints it once (from the rank that found it, or from rank 0 when every
rank found it alike) and exits 2 on every rank, with no traceback.

`report(e)` prints it on the reporting rank; once the process group exists, the other ranks
wait (a few seconds at most) until it has, so a launcher that ends the job at the first exit
(torchrun) cannot end the reporter before the sentence is out. Before it exists (an invalid
configuration, found alike by every rank, or a rank that cannot join) the reporting rank is
known from torchrun's RANK, and the others exit quietly.

`raise_together(check)` is the rule for a check that may fail on some ranks only (rank 0
reading a data file, one rank's checkpoint shard): every rank runs its part, then one
all-gather tells every rank whether any failed, and every rank raises the first failure
(lowest rank). A check that fails on one rank can then never leave the others waiting
in a collective.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from parallel import comm

T = TypeVar("T")
REPORTED_KEY = "zero3d/run_error_reported"
REPORT_WAIT_S = 5.0


class RunError(ValueError):
    """A problem the user can fix. `origin`: the global rank that found it (None: every rank
    found it alike); the command prints it on that rank only."""

    def __init__(self, message: str, origin: int | None = None) -> None:
        super().__init__(message)
        self.origin = origin

    def reported_here(self) -> bool:
        """Whether this process prints the message (the finder, or rank 0 for a shared one)."""
        initialized = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if initialized else int(os.environ.get("RANK", "0"))
        return rank == (self.origin if self.origin is not None else 0)


class ConfigError(RunError):
    """An invalid configuration; the message names the flag or YAML key."""


class CheckpointError(RunError):
    """A checkpoint that cannot be saved or loaded; the message says which file and why."""


class DataError(RunError):
    """Training data that cannot be used; the message names the file and what to do."""


class NonFiniteLossError(RunError):
    """The loss stayed NaN/Inf for too many consecutive steps."""


def report(e: RunError) -> None:
    """Print `error: <message>` on the rank that reports `e`; on the others, wait until it
    has (through the rendezvous store), and print it themselves if it has not within
    REPORT_WAIT_S (a rank that failed alone must not fail silently)."""
    store = dist.distributed_c10d._get_default_store() if dist.is_available() and dist.is_initialized() else None
    if store is None and not e.reported_here():
        return
    if store is not None and not e.reported_here():
        try:
            store.wait([REPORTED_KEY], timedelta(seconds=REPORT_WAIT_S))
            return
        except RuntimeError:
            pass
    print(f"error: {e}", file=sys.stderr, flush=True)
    if store is not None:
        store.set(REPORTED_KEY, "1")


def raise_together(check: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """`check()` on this rank; if it raised a RunError on any rank of `group`, raise the
    lowest such rank's error (same class and message, `origin` = that rank) on every rank.
    A collective when torch.distributed is initialized; plain `check()` otherwise."""
    if not (dist.is_available() and dist.is_initialized()):
        return check()
    failure: tuple[str, str] | None = None
    result: T | None = None
    try:
        result = check()
    except RunError as e:
        failure = (type(e).__name__, str(e))
    failures = comm.all_gather_object(failure, group=group)
    for group_rank, found in enumerate(failures):
        if found is not None:
            kind, message = found
            origin = dist.get_global_rank(group, group_rank) if group is not None else group_rank
            raise _ERRORS[kind](message, origin=origin)
    return result  # type: ignore[return-value]


_ERRORS: dict[str, type[RunError]] = {
    cls.__name__: cls for cls in (RunError, ConfigError, CheckpointError, DataError, NonFiniteLossError)
}
