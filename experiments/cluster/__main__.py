"""python -m experiments.cluster --hosts H --procs-per-host P --link RATE [--link-host I=RATE]
[--event SECONDS:HOST:RATE|down] [--timeout S] -- <what torchrun runs, e.g. -m experiments.train ...>

Makes H hosts (network namespaces) on one switch, each host's link shaped to RATE (tc units:
100mbit, 1gbit), runs torchrun with P processes on each host as one job, streams every host's
output with a `[host i]` prefix, exits with the worst host's code, and removes every namespace
it made, also on Ctrl-C, a crash or a timeout. A launcher killed by SIGKILL is cleaned up by
a watcher process it starts, and in any case by the next launch (or `--cleanup`).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from experiments.cluster.launch import MASTER_PORT, LinkEvent, run_job
from experiments.cluster.network import ClusterError, Network, rate_bits, remove_stale, why_unavailable


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(options, the command after `--`)."""
    ours, command = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m experiments.cluster", description=__doc__.split("\n\n")[1])
    p.add_argument("--hosts", type=int, default=2, help="hosts (network namespaces)")
    p.add_argument("--procs-per-host", type=int, default=1, help="torchrun processes per host")
    p.add_argument("--link", default="1gbit", help="every host's link rate (tc units: 100mbit, 1gbit)")
    p.add_argument("--link-host", action="append", default=[], metavar="I=RATE", help="host I's link rate instead")
    p.add_argument(
        "--event", action="append", default=[], metavar="S:I:RATE", help="at S s host I's link: RATE or down"
    )
    p.add_argument("--timeout", type=float, default=None, help="stop the job after this many seconds (exit 124)")
    p.add_argument("--master-port", type=int, default=MASTER_PORT, help="host 0's rendezvous port")
    p.add_argument("--cleanup", action="store_true", help="only remove namespaces left by killed launchers")
    p.add_argument("--watch", type=int, default=None, help=argparse.SUPPRESS)  # the watcher of a launcher's pid
    args = p.parse_args(ours)
    if args.hosts < 1 or args.procs_per_host < 1:
        p.error("--hosts and --procs-per-host must be at least 1")
    if not command and not (args.cleanup or args.watch):
        p.error("give the job after `--`, e.g. -- -m experiments.train --config experiments/configs/tiny.yaml")
    return args, command


def link_rates(hosts: int, link: str, overrides: list[str]) -> list[str]:
    """Each host's link rate: `link`, or its `I=RATE` override."""
    rates = [link] * hosts
    for text in overrides:
        host, _, rate = text.partition("=")
        if not host.isdigit() or not 0 <= int(host) < hosts:
            raise ClusterError(f"--link-host {text!r} is not I=RATE with I in 0..{hosts - 1}")
        rates[int(host)] = rate
    for rate in rates:
        rate_bits(rate)
    return rates


def watch(pid: int) -> None:
    """Wait for launcher `pid` to end, then remove what it left (it may have been SIGKILLed)."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    remove_stale()


def _start_watcher() -> None:
    subprocess.Popen(
        [sys.executable, "-m", "experiments.cluster", "--watch", str(os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def _raise_on_term(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    if args.watch:
        watch(args.watch)
        return 0
    reason = why_unavailable()
    if reason is not None:
        print(f"experiments.cluster: {reason}", file=sys.stderr)
        return 2
    for name in remove_stale():
        print(f"[cluster] removed {name}, left by a launcher that was killed", flush=True)
    if args.cleanup:
        return 0
    try:
        rates = link_rates(args.hosts, args.link, args.link_host)
        events = [LinkEvent.parse(text, args.hosts) for text in args.event]
    except ClusterError as e:
        print(f"experiments.cluster: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_on_term)
    network = Network(rates)
    _start_watcher()
    try:
        network.create()
        print(f"[cluster] {args.hosts} hosts × {args.procs_per_host} processes, links {', '.join(rates)}", flush=True)
        return run_job(network, args.procs_per_host, command, events, args.timeout, args.master_port)
    except ClusterError as e:
        print(f"experiments.cluster: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[cluster] interrupted: stopping every host", flush=True)
        return 130
    finally:
        network.destroy()


if __name__ == "__main__":
    sys.exit(main())
