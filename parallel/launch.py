"""Run a function on N local gloo processes: a tiny torchrun for tests and single-machine
benchmarks (training jobs are launched with torchrun itself).

The parent hosts the rendezvous TCPStore on a free port (port 0, so no race for it) and
each rank joins it the way torchrun workers do (``TORCHELASTIC_USE_AGENT_STORE``), so the
code sees torchrun's environment and a plain ``dist.init_process_group("gloo")`` works.
Ranks are forks of a "forkserver" that imported torch once: a clean, single-threaded
parent (no OpenMP pool to deadlock on, as forking a busy process would risk), and no rank
pays the heavy imports again. A forkserver child inherits the server's environment, not
the caller's current one; the server's preload list is fixed by the first call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

_CTX = mp.get_context("forkserver")
# torch._dynamo (~4 s) is pulled in by torch.optim, torch.distributed.tensor, CommDebugMode.
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo")


class RankFailure(RuntimeError):
    """A rank raised, died or did not finish in time; the message has its traceback."""


class _RendezvousFailure(RankFailure):
    """A rank could not join the process group (a transient socket error on a busy host)."""


def _worker(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    threads: int,
    conn: Connection,
) -> None:
    """One rank: join the group, run ``fn``, send back (ok, value or traceback)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    try:
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    except BaseException:
        conn.send_bytes(pickle.dumps((False, "rendezvous\n" + traceback.format_exc())))
        conn.close()
        return
    try:
        result = fn(*args, **kwargs)
        dist.destroy_process_group()
        # Plain pickle: tensors go by value, not through torch's shared-memory reductions,
        # which would need this process alive after it exits.
        message = pickle.dumps((True, result))
    except BaseException:  # every failure goes back to the parent
        message = pickle.dumps((False, traceback.format_exc()))
    conn.send_bytes(message)
    conn.close()


def _receive(conn: Connection, proc: BaseProcess) -> tuple[bool, Any]:
    try:
        return pickle.loads(conn.recv_bytes())
    except EOFError:
        proc.join()
        return False, f"process exited with code {proc.exitcode} before sending a result"


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads: int = 1,
    preload: Sequence[str] = DEFAULT_PRELOAD,
    **kwargs: Any,
) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``world_size`` gloo ranks (each after
    ``torch.set_num_threads(threads)`` and ``torch.manual_seed(0)``); their results in rank
    order. ``fn`` must be picklable (module level). If a rank raises or dies, the others are
    killed and RankFailure carries its rank and traceback; past ``timeout`` seconds every
    rank is killed ("timed out after ..."). A failure to join the process group (before
    ``fn`` runs) is retried once with a fresh rendezvous."""
    _CTX.set_forkserver_preload(list(preload))
    try:
        return _launch(fn, world_size, args, kwargs, timeout, threads)
    except _RendezvousFailure:
        return _launch(fn, world_size, args, kwargs, timeout, threads)


def _launch(
    fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float, threads: int
) -> list[Any]:
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    procs: list[BaseProcess] = []
    conns: list[Connection] = []
    try:
        for rank in range(world_size):
            reader, writer = _CTX.Pipe(duplex=False)
            proc = _CTX.Process(
                target=_worker,
                name=f"rank{rank}",
                args=(fn, args, kwargs, rank, world_size, store.port, timeout, threads, writer),
            )
            proc.start()
            writer.close()
            procs.append(proc)
            conns.append(reader)
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        while len(results) < world_size:
            waiting = [r for r in range(world_size) if r not in results]
            handles = [conns[r] for r in waiting] + [procs[r].sentinel for r in waiting]
            if not wait(handles, timeout=max(0.0, deadline - time.monotonic())):
                raise RankFailure(f"timed out after {timeout:g}s on ranks {waiting}")
            for r in waiting:
                if conns[r].poll() or not procs[r].is_alive():
                    ok, value = _receive(conns[r], procs[r])
                    if not ok:
                        failure = _RendezvousFailure if value.startswith("rendezvous\n") else RankFailure
                        raise failure(f"rank {r} of {world_size} failed:\n{value}")
                    results[r] = value
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        return [results[r] for r in range(world_size)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in conns:
            conn.close()
