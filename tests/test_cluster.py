"""A cluster over a real network, on one machine (experiments.cluster): hosts are network
namespaces joined through a switch by links shaped with tc. A 2-host × 2-process hybrid
ZeRO-3 run trains exactly as the same run on one host, and the bytes it sends across hosts
(counted by parallel/comm.py) are the planner's; every namespace is gone after a run, also
after the launcher is killed with SIGKILL. Skipped where namespaces cannot be made (not
root); CI runs as root."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.cluster import network
from experiments.cluster.__main__ import link_rates
from experiments.cluster.__main__ import main as cluster_main
from experiments.cluster.launch import LinkEvent
from experiments.cluster.network import PREFIX, ClusterError, Network, rate_bits, why_unavailable
from experiments.process_tree import stop
from research import costmodel
from research.costmodel import Cluster
from research.costmodel.hardware import GPUS
from tests.conftest import read_run
from tests.timing import allow

ROOT = Path(__file__).resolve().parents[1]
UNAVAILABLE = why_unavailable() if sys.platform == "linux" else "network namespaces are Linux only"
needs_namespaces = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no emulated cluster: {UNAVAILABLE}")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"}
COMM_TIMEOUT_S = 5  # the faulty run's --comm-timeout: the cut link is found this long after it
HYBRID = [
    *("-m", "experiments.train", "--config", "experiments/configs/tiny.yaml"),
    *("--n-layers", "2", "--n-heads", "4", "--d-model", "32", "--max-seq-len", "32", "--seq-len", "32"),
    *("--global-batch-size", "8", "--dp", "4", "--dp-shard", "2", "--zero", "3", "--unit-numel", "4000"),
    *("--steps", "3", "--seed", "0", "--precision", "fp32", "--wandb", "disabled", "--log-every", "1"),
    *("--comm-timeout", "60"),
]


def cluster(*args: str) -> list[str]:
    return [sys.executable, "-m", "experiments.cluster", *args]


def ours() -> list[str]:
    """The namespaces of experiments.cluster launchers on this machine."""
    listed = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(PREFIX)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The hybrid run on 2 hosts × 2 processes over 200 Mbit/s links, and on one host, at
    the same time."""
    base = tmp_path_factory.mktemp("cluster")
    two = cluster("--hosts", "2", "--procs-per-host", "2", "--link", "200mbit", "--timeout", "200", "--")
    jobs = {
        "two": [*two, *HYBRID, "--out", str(base / "two"), "--data-cache", str(base / "cache_two")],
        "one": [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"),
            *(*HYBRID, "--out", str(base / "one"), "--data-cache", str(base / "cache_one")),
        ],
    }
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True) for name, cmd in jobs.items()}  # fmt: skip
    logs = {}
    try:
        for name, proc in procs.items():
            logs[name] = proc.communicate(timeout=240)[0]
            assert proc.returncode == 0, logs[name][-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                stop(proc)
    return {"two": read_run(base / "two"), "one": read_run(base / "one"), "log": logs["two"]}


@needs_namespaces
@pytest.mark.timeout(300)
@pytest.mark.slow  # its module fixture runs jobs on the emulated cluster
def test_two_hosts_train_exactly_as_one(runs) -> None:
    (two, _), (one, _) = runs["two"], runs["one"]
    assert len(two) == 3 and two == one
    assert "[host 0] " in runs["log"] and "[host 1] " in runs["log"]
    assert not ours()


@needs_namespaces
@pytest.mark.timeout(300)
@pytest.mark.slow  # its module fixture runs jobs on the emulated cluster
def test_cross_host_bytes_are_the_planners(runs) -> None:
    """Shard groups inside a host (ranks 0-1 and 2-3): only the replicas' all-reduce of the
    gradient shards crosses hosts, at the bytes the planner predicts for it on a 2-per-node
    cluster; the dp group crosses too, with at most a few scalars (under 64 B)."""
    _, summary = runs["two"]
    model, layout, seq_len = costmodel.run_spec(summary["config"])
    step = costmodel.predict_step_time(model, layout, seq_len, Cluster(GPUS["h100"], 4, 2))
    predicted = {c.name: c.inter_bytes for c in step.collectives if c.inter_bytes}
    assert set(predicted) == {"replicate"}
    for rank in summary["ranks"]:
        groups = {name: g["total"]["bytes"] for name, g in rank["comm_per_step"].items() if g["total"]["bytes"]}
        assert groups["dp_replicate"] == pytest.approx(predicted["replicate"], rel=1e-9)
        assert groups.get("dp", 0) < 64
        assert set(groups) <= {"dp_shard", "dp_shard-side", "dp_replicate", "dp"}, groups


FAULTY = [
    *HYBRID[: HYBRID.index("--dp")],
    *("--dp", "4", "--zero", "3", "--steps", "100000", "--seed", "0", "--precision", "fp32"),
    *("--wandb", "disabled", "--log-every", "1", "--comm-timeout", str(COMM_TIMEOUT_S)),
]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """A dp 4 ZeRO-3 run on 2 hosts × 2 processes: host 1's link is slowed 10× (20 → 2
    Mbit/s) after step 6, then cut after step 14. Returns (exit code, seconds from the cut
    to the launcher's end, its output, the metrics rows)."""
    out = tmp_path_factory.mktemp("faulty")
    command = cluster("--hosts", "2", "--procs-per-host", "2", "--link", "20mbit", "--timeout", "240", "--")
    proc = subprocess.Popen([*command, *FAULTY, "--out", str(out / "run"), "--data-cache", str(out / "cache")],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines, cut_at = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if "] step 6/" in line or "] step 14/" in line:
                tag = next(n for n in ours() if n.startswith(f"{PREFIX}{proc.pid}-")).rsplit("-", 1)[0]  # less "-h0"
                link = Network(["20mbit"] * 2, tag=tag)
                if "step 6/" in line:
                    link.shape(1, "2mbit")
                else:
                    link.cut(1)
                    cut_at = time.monotonic()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            stop(proc)
    assert cut_at is not None, "".join(lines[-40:])
    with open(out / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return proc.returncode, time.monotonic() - cut_at, "".join(lines), rows


@needs_namespaces
@pytest.mark.timeout(300)
@pytest.mark.slow  # its module fixture runs jobs on the emulated cluster
def test_a_cut_link_ends_every_rank_naming_the_lost_ones(faulty) -> None:
    """Every rank on both hosts exits within --comm-timeout + 60 s of the cut, non-zero; host
    0's report names ranks 2 and 3, each rank of host 1 names ranks 0 and 1."""
    code, seconds, output, _ = faulty
    assert code != 0 and seconds < COMM_TIMEOUT_S + allow(60), (code, seconds)
    said = [line for line in output.splitlines() if "error: " in line]
    assert any(line.startswith("[host 0]") and "rank(s) 2, 3" in line for line in said), said
    # by its collective's timeout, or by the store's silence if that came first (a store call blocks)
    assert sum(line.count("lost rank(s) 0, 1") for line in said if line.startswith("[host 1]")) == 2, "\n".join(said)
    assert not ours()


@needs_namespaces
@pytest.mark.timeout(300)
@pytest.mark.slow  # its module fixture runs jobs on the emulated cluster
def test_a_slowed_link_shows_in_the_ranks_comm_wait(faulty) -> None:
    """After host 1's link is slowed 10× the run goes on, and every rank's comm_wait_s rises
    (each collective of dp 4 crosses that link: the ranks of both hosts wait for it). The base
    link is slow enough (20 Mbit/s) that moving the bytes, not the collectives' fixed costs,
    is most of the wait."""
    _, _, _, rows = faulty
    before = [r["comm_wait_s"] for r in rows if 2 <= r["step"] <= 6]
    after = [r["comm_wait_s"] for r in rows if 9 <= r["step"] <= 14]
    assert len(after) == 6
    for rank in range(4):
        slow, fast = statistics.median(w[rank] for w in after), statistics.median(w[rank] for w in before)
        assert slow > 3 * fast, (rank, fast, slow)


def _start_sleeping_job() -> tuple[subprocess.Popen, list[str]]:
    """A launcher whose hosts sleep, once its namespaces exist: (launcher, its namespaces)."""
    before = set(ours())
    proc = subprocess.Popen(cluster("--hosts", "2", "--", "--no-python", "sleep", "60"), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        made = [n for n in ours() if n not in before and n.startswith(f"{PREFIX}{proc.pid}-")]
        if len(made) == 3:  # the switch and two hosts
            time.sleep(1)  # the agents are starting inside
            return proc, made
        time.sleep(0.2)
    stop(proc)
    pytest.fail("the launcher made no namespaces in 30 s")


def _gone_within(names: list[str], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not set(names) & set(ours()):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
@needs_namespaces
@pytest.mark.timeout(120)
def test_namespaces_are_gone_after_the_launcher_is_killed() -> None:
    """SIGKILL of the launcher: its watcher removes the namespaces (and what runs inside);
    SIGKILL of both: the next launch (here `--cleanup`) removes them."""
    proc, made = _start_sleeping_job()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _gone_within(made, 15), made
    proc, made = _start_sleeping_job()
    watchers = _cluster_pids(f"--watch\0{proc.pid}")
    for pid in [proc.pid, *watchers]:
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1)
    assert set(made) <= set(ours())  # left behind
    done = subprocess.run(
        cluster("--cleanup"), check=False, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and all(name in done.stdout for name in made), done.stdout + done.stderr
    assert not set(made) & set(ours())


def _cluster_pids(argument: str) -> list[int]:
    """Processes running experiments.cluster with `argument` ("\\0" between words)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if b"experiments.cluster" in cmdline and argument.encode() in cmdline:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_refused_in_one_sentence_without_privilege(monkeypatch, capsys) -> None:
    """As a user other than root the launcher says what it needs and exits 2, making nothing."""
    monkeypatch.setattr(network.os, "geteuid", lambda: 1000)
    assert cluster_main(["--", "-m", "experiments.train"]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and err.count("\n") == 1


def test_rates_and_events_are_checked() -> None:
    assert rate_bits("200mbit") == 200e6 and rate_bits("1gbit") == 1e9
    assert link_rates(3, "1gbit", ["2=100mbit"]) == ["1gbit", "1gbit", "100mbit"]
    assert LinkEvent.parse("20:1:down", 2) == LinkEvent(20.0, 1, "down")
    for bad in (lambda: rate_bits("200mb"), lambda: link_rates(2, "1gbit", ["2=1gbit"])):
        with pytest.raises(ClusterError):
            bad()
    for text in ("20:1", "x:1:down", "5:2:down", "5:0:fast"):
        with pytest.raises(ClusterError):
            LinkEvent.parse(text, 2)


LINK_PROBE = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
for nbytes in (262144, 4194304):
    x = torch.zeros(nbytes // 4)
    times = []
    for _ in range(4):
        dist.barrier()
        time.sleep(0.1)  # idle, so the link's token bucket is full
        start = time.perf_counter()
        dist.send(x, 1) if dist.get_rank() == 0 else dist.recv(x, 0)
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 1:
        print("probe", nbytes, sorted(times)[1], flush=True)
"""


@pytest.mark.slow
@needs_namespaces
def test_a_shaped_link_passes_messages_at_its_rate_not_faster() -> None:
    """A message crosses a 100 Mbit/s link in its bytes over the rate, however short the
    message: the token bucket holds only ~1 ms of the rate, so what it lets through at
    memory speed after an idle spell does not make a pipeline's activations faster than the
    link (a 128 KiB bucket sent 262 KB in 12 ms, where the rate allows 21)."""
    command = cluster("--hosts", "2", "--link", "100mbit", "--timeout", "120", "--", "--no-python", sys.executable)
    done = subprocess.run(
        [*command, "-c", LINK_PROBE], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    seconds = {int(w[-2]): float(w[-1]) for w in (line.split() for line in done.stdout.splitlines()) if "probe" in w}
    for nbytes, took in seconds.items():
        at_rate = nbytes * 8 / rate_bits("100mbit")
        assert 0.8 * at_rate < took < allow(1.3 * at_rate + 0.005), (nbytes, took, at_rate)
    assert len(seconds) == 2, done.stdout[-2000:]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A small `experiments.bench.planner_vs_cluster`: 2 hosts × 2 processes at 1 Gbit/s are
    calibrated, then ZeRO-3 over dp 4 (its gathers and reductions cross the link) and pp 2 ×
    dp 2 (only activations cross) each train 5 steps. Returns (rows, the hardware file)."""
    from experiments.bench import planner_vs_cluster

    work = tmp_path_factory.mktemp("planned")
    return planner_vs_cluster.compare(2, 2, "1gbit", ["zero3", "pp2"], 5, 2, work), work / "2x2-1gbit.yaml"


def test_a_calls_wait_is_fitted_as_a_line_in_the_block_before_it() -> None:
    """`fit_wait`: least squares through the (block, wait) points, neither part below 0."""
    from experiments.calibrate.measure import fit_wait

    assert fit_wait([(1e-3, 1.2e-3), (3e-3, 1.6e-3), (9e-3, 2.8e-3)]) == pytest.approx((1e-3, 0.2, 9e-3))
    assert fit_wait([(1e-3, 3e-3), (9e-3, 1e-3)]) == pytest.approx((2e-3, 0.0, 9e-3))  # shrinking: flat at the mean
    assert fit_wait([(1e-3, -1e-3), (2e-3, 1e-3)]) == pytest.approx((0.0, 0.2, 2e-3))  # through the origin
    assert fit_wait([(5e-3, 2e-3), (5e-3, 4e-3)]) == pytest.approx((3e-3, 0.0, 5e-3))  # one block length


@needs_namespaces
@pytest.mark.timeout(400)
@pytest.mark.slow  # its module fixture runs jobs on the emulated cluster
def test_calibrate_writes_a_hardware_file_of_the_emulated_cluster(planned, capsys) -> None:
    """2 hosts × 2 processes over 1 Gbit/s links: the file loads, names gloo and the compute
    the processes share, and its network across hosts is the link's 125 MB/s shared by the
    host's 2 processes (planner: per device and direction), within 30%, and a 2-rank exchange
    across the hosts at most about that, with a rate for each of ZeRO++'s quantizers; the
    planner predicts a layout on it."""
    from experiments import plan
    from research.costmodel.hardware import load_system

    _, hardware = planned
    system = load_system(hardware)
    assert system.gpus_per_node == 2 and 0 < system.gpu.matmul_efficiency < 1 and system.backend == "gloo"
    assert 0 < system.compute_units <= 1.5 * len(os.sched_getaffinity(0))  # the 4 processes share the cores
    assert system.gpu.inter_node_bandwidth == pytest.approx(1e9 / 8 / 2, rel=0.3)
    assert 0.2 * system.gpu.inter_node_bandwidth < system.gpu.pair_bandwidth < 1.3 * system.gpu.inter_node_bandwidth
    assert system.gpu.intra_node_bandwidth > 5 * system.gpu.inter_node_bandwidth  # loopback, unshaped
    assert {q for q, rate in system.gpu.quantize_bandwidths if rate > 0} == {"qwz", "qgz"}
    for wait in system.waits:  # inside a host, across, a pair: measured over blocks up to ~20 ms
        assert wait.base >= 0 and wait.growth >= 0 and 1e-3 < wait.reach < 0.2, system.waits
    plan.main(["--config", "experiments/configs/tiny.yaml", "--gpus", "4", "--hardware", str(hardware), "--json",
               "--layout", "tp=1,pp=1,dp=4,zero=3,mbs=1,recompute=none,sp=0"])  # fmt: skip
    assert json.loads(capsys.readouterr().out)["step_s"] > 0


@needs_namespaces
@pytest.mark.timeout(400)
@pytest.mark.slow  # its module fixture runs jobs on the emulated cluster
def test_the_calibrated_planner_predicts_the_measured_step_times(planned) -> None:
    """Every prediction of the small study is within 25% of the measured median step, and
    the planner's faster layout is the measured faster one."""
    from experiments.bench import planner_vs_cluster

    rows, _ = planned
    assert all("measured_s" in r for r in rows), rows
    assert all(0.75 < r["ratio"] < 1.25 for r in rows), planner_vs_cluster.table(rows)
    assert planner_vs_cluster.fastest(rows) == ["2 × 2 at 1gbit: fastest measured pp2, predicted pp2"]
