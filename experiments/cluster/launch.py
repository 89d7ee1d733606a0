"""Running one job on the emulated cluster: a torchrun agent per host namespace, joined by
static rendezvous at host 0's address (torchrun's c10d rendezvous does not start its store
inside a namespace: the machine's hostname resolves outside it), gloo and NCCL bound to the
host's `eth0`. Each host's output is streamed with a `[host i]` prefix; the exit code is the
worst of the hosts'. Link events (a rate change, a cut) happen at given seconds into the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from experiments.cluster.network import ClusterError, Network, rate_bits
from experiments.process_tree import stop

MASTER_PORT = 29500


@dataclass(frozen=True)
class LinkEvent:
    """At `at_s` seconds into the run, host `host`'s link changes to `rate` ("down": cut)."""

    at_s: float
    host: int
    rate: str

    @classmethod
    def parse(cls, text: str, hosts: int) -> LinkEvent:
        """'SECONDS:HOST:RATE' or 'SECONDS:HOST:down', e.g. '20:1:20mbit'."""
        try:
            at, host, rate = text.split(":")
            event = cls(float(at), int(host), rate.strip().lower())
        except ValueError:
            raise ClusterError(
                f"--event {text!r} is not SECONDS:HOST:RATE or SECONDS:HOST:down (e.g. 20:1:20mbit)"
            ) from None
        if not 0 <= event.host < hosts or event.at_s < 0:
            raise ClusterError(f"--event {text!r}: the host must be 0..{hosts - 1} and the time not negative")
        if event.rate != "down":
            rate_bits(event.rate)
        return event

    def apply(self, network: Network) -> None:
        if self.rate == "down":
            network.cut(self.host)
        else:
            network.shape(self.host, self.rate)


def host_command(network: Network, host: int, procs: int, command: list[str], port: int) -> list[str]:
    """The torchrun agent of `host`, run inside its namespace."""
    return [
        *("ip", "netns", "exec", network.host(host)),
        *(sys.executable, "-m", "torch.distributed.run"),
        *("--nnodes", str(len(network.rates)), "--nproc-per-node", str(procs), "--node-rank", str(host)),
        *("--master-addr", network.address(0), "--master-port", str(port)),
        *command,
    ]


def _stream(host: int, pipe, lock: threading.Lock) -> None:
    for line in iter(pipe.readline, ""):
        with lock:
            sys.stdout.write(f"[host {host}] {line}")
            sys.stdout.flush()


def _schedule(events: list[LinkEvent], network: Network, start: float, say: Callable[[str], None]) -> threading.Thread:
    def run() -> None:
        for event in sorted(events, key=lambda e: e.at_s):
            time.sleep(max(0.0, start + event.at_s - time.monotonic()))
            if not network.made:
                return
            event.apply(network)
            say(f"t={event.at_s:g} s: host {event.host}'s link is {'cut' if event.rate == 'down' else event.rate}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def run_job(
    network: Network,
    procs: int,
    command: list[str],
    events: list[LinkEvent] = (),  # type: ignore[assignment]
    timeout_s: float | None = None,
    port: int = MASTER_PORT,
) -> int:
    """Run `command` under torchrun on every host of `network`; the worst exit code (124 on timeout)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1"}
    # The hosts share this machine's cores: each process its even share of them (torchrun
    # sets 1 only where a host runs several), unless the caller chose.
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // (len(network.rates) * procs))))
    lock = threading.Lock()

    def say(text: str) -> None:
        with lock:
            print(f"[cluster] {text}", flush=True)

    hosts, streams = [], []
    start = time.monotonic()
    try:
        for i in range(len(network.rates)):
            proc = subprocess.Popen(
                host_command(network, i, procs, command, port),
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )  # fmt: skip
            hosts.append(proc)
            streams.append(threading.Thread(target=_stream, args=(i, proc.stdout, lock), daemon=True))
            streams[-1].start()
        _schedule(list(events), network, start, say)
        deadline = None if timeout_s is None else start + timeout_s
        codes = [_wait(proc, deadline) for proc in hosts]
    finally:
        for proc in hosts:
            if proc.poll() is None:
                stop(proc)
        for thread in streams:
            thread.join(timeout=5)
    if None in codes:
        say(f"the job ran past --timeout {timeout_s:g} s and was stopped")
        return 124
    for i, code in enumerate(codes):
        if code:
            say(f"host {i} exited with {code}")
    return max(_severity(code) for code in codes)


def _wait(proc: subprocess.Popen, deadline: float | None) -> int | None:
    try:
        return proc.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _severity(code: int) -> int:
    """Killed by a signal (negative) counts as 128 + signal, as a shell reports it."""
    return 128 - code if code < 0 else code
