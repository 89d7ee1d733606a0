"""Ending a job's whole process tree on Linux: torchrun starts each worker in its own
session, so a process-group kill misses them; the tree is read from /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


def stop(proc: subprocess.Popen) -> None:
    """End a job we started: SIGTERM to torchrun (it stops its workers), then SIGKILL to
    whatever of its process tree (as seen before) is still alive after 10 s. torchrun
    starts each worker in its own session, so a process-group kill would miss them."""
    tree = descendants(proc.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.terminate()
        proc.wait(timeout=10)
    for pid, start in tree.items():
        if start_time(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time; tells a process from a later one with its pid)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(root: int) -> dict[int, str]:
    """{pid: start time} of every process below `root` (Linux /proc; {} elsewhere)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int(Path(entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = {}, [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            start = start_time(child)
            if start is not None and child not in out:
                out[child] = start
                todo.append(child)
    return out
