"""A cluster's network on one Linux machine: each host is a network namespace with one
interface, `eth0`, at 10.200.0.(i+1); every host's link goes to a bridge (the switch) in a
namespace of its own. A link's rate is shaped in both directions by a token bucket (`tc
qdisc ... tbf`) on the host's `eth0` (what it sends) and on the switch's port (what it
receives), holding 1 ms of the rate (`Network.shape`), so a host's link is a NIC of that
rate. Latency cannot be added (no `netem`).

Processes of one host talk through the host's loopback, unshaped: the fast link inside a
node. Nothing is made outside the namespaces, and deleting them removes every link, so the
names (`z3d-<launcher pid>-<its start time>-...`) are all there is to clean up; a launcher killed by SIGKILL
leaves them behind and the next one removes them (`remove_stale`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from experiments.process_tree import start_time

PREFIX = "z3d-"
ETC = Path("/etc/netns")  # `ip netns exec NAME` sees /etc/netns/NAME/hosts as /etc/hosts
SUBNET = "10.200.0"
INTERFACE = "eth0"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNIT = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class ClusterError(RuntimeError):
    """The emulated cluster could not be made or driven; the message says why."""


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as '200mbit' or '1gbit'."""
    m = _RATE.match(rate.strip().lower())
    if m is None:
        raise ClusterError(f"link rate {rate!r} is not a rate like 100mbit, 1gbit or 500kbit (tc's units, bits/s)")
    return float(m[1]) * _UNIT[m[2]]


def why_unavailable() -> str | None:
    """None where namespaces, veth links and tc shaping can be made here, else the reason."""
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN): run it as root or with sudo"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2 (Debian: apt-get install iproute2)"
    probe = f"{PREFIX}probe-{uuid.uuid4().hex[:6]}"
    done = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        return f"cannot make a network namespace here ({done.stderr.strip()}): run as root on a host or privileged container"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def _in(namespace: str, *command: str) -> None:
    _ip("netns", "exec", namespace, *command)


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _owner_tag() -> str:
    """`z3d-<pid>-<start time>-<random>`: the launcher's pid and start time name its namespaces,
    so a later process that reuses the pid is not taken for it."""
    return f"{PREFIX}{os.getpid()}-{start_time(os.getpid())}-{uuid.uuid4().hex[:4]}"


def _owner_alive(name: str) -> bool:
    """Whether the launcher that made namespace `name` still runs (a name of another form: yes)."""
    m = re.match(rf"^{PREFIX}(\d+)-(\d+)-", name)
    return m is None or start_time(int(m[1])) == m[2]


def delete_namespace(name: str) -> None:
    """Kill every process left inside namespace `name`, then delete it (and its links)."""
    pids = subprocess.run(["ip", "netns", "pids", name], check=False, capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
    shutil.rmtree(ETC / name, ignore_errors=True)


def remove_stale() -> list[str]:
    """Delete the namespaces of launchers that are gone (killed before they could clean up)."""
    stale = [name for name in _namespaces() if name.startswith(PREFIX) and not _owner_alive(name)]
    for name in stale:
        delete_namespace(name)
    return stale


@dataclass
class Network:
    """`hosts` namespaces on one switch, host i's link at `rates[i]` (tc rate strings)."""

    rates: list[str]
    tag: str = field(default_factory=_owner_tag)
    made: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def host(self, i: int) -> str:
        return f"{self.tag}-h{i}"

    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def create(self) -> None:
        """Make the switch, the hosts and their shaped links (undone by `destroy`)."""
        for rate in self.rates:
            rate_bits(rate)
        self._namespace(self.switch)
        _in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        _in(self.switch, "ip", "link", "set", "br0", "up")
        for i, rate in enumerate(self.rates):
            host, port = self.host(i), f"p{i}"
            self._namespace(host, self.address(i))
            _ip("link", "add", INTERFACE, "netns", host, "type", "veth", "peer", "name", port, "netns", self.switch)
            _in(host, "ip", "addr", "add", f"{self.address(i)}/24", "dev", INTERFACE)
            _in(host, "ip", "link", "set", INTERFACE, "up")
            _in(self.switch, "ip", "link", "set", port, "master", "br0")
            _in(self.switch, "ip", "link", "set", port, "up")
            self.shape(i, rate)

    def _namespace(self, name: str, address: str = "127.0.0.1") -> None:
        """Namespace `name` with its loopback up, where the machine's hostname resolves to
        `address` and every host's name and address resolve both ways (torchrun and gloo look
        them up)."""
        _ip("netns", "add", name)
        self.made.append(name)
        _in(name, "ip", "link", "set", "lo", "up")
        names = ["127.0.0.1 localhost", f"{address} {socket.gethostname()}"]
        names += [f"{self.address(i)} {self.host(i)}" for i in range(len(self.rates))]
        (ETC / name).mkdir(parents=True, exist_ok=True)
        (ETC / name / "hosts").write_text("\n".join(names) + "\n")

    def shape(self, i: int, rate: str) -> None:
        """Host i's link at `rate`, both ways: a token bucket on each end's egress. The bucket
        holds 1 ms of the rate, at least 16 KiB (tbf cuts a veth's 64 KiB segments to fit).
        What the bucket holds passes at memory speed after an idle spell, so a larger one lets
        pipeline messages and small collectives beat the rate (measured with 128 KiB: 262 KB
        in 12 ms at 100 Mbit/s, where the rate allows 21 ms); below 1 ms tbf's timer cannot
        keep 1 Gbit/s."""
        burst = max(int(rate_bits(rate) / 8 / 1000), 16 * 1024)
        for namespace, dev in ((self.host(i), INTERFACE), (self.switch, f"p{i}")):
            _in(namespace, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", rate, "burst", str(burst), "latency", "200ms")  # fmt: skip

    def cut(self, i: int) -> None:
        """Host i's link goes down (its switch port, as a pulled cable: both ends lose carrier)."""
        _in(self.switch, "ip", "link", "set", f"p{i}", "down")

    def destroy(self) -> None:
        """Delete every namespace made (with whatever still runs inside), in reverse."""
        while self.made:
            delete_namespace(self.made.pop())
