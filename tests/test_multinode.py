"""Multi-node for real, on one machine: two torchrun agents joined by a c10d rendezvous
(`--nnodes 2`, the launch of experiments/slurm/train.sbatch) form one 4-rank job whose
"nodes" are the agents. Its tp 2 × dp 2 run trains exactly as the same run under one
`--standalone` agent: the same loss at every step, bit for bit.

What each agent assigned (group rank, local ranks, global ranks) is read from its own log
(LOGLEVEL=INFO prints torchrun's "Rendezvous complete" result); torchrun sets each worker's
GROUP_RANK, LOCAL_WORLD_SIZE and RANK from exactly these values.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from experiments.process_tree import descendants, stop
from tests.conftest import read_run

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 240  # both launches together; a hang fails here, before pytest's timeout
TRAIN = [
    "-m",
    "experiments.train",
    "--config",
    "experiments/configs/tiny.yaml",
    *("--n-layers", "2", "--n-heads", "4", "--d-model", "32", "--max-seq-len", "32"),
    *("--seq-len", "32", "--global-batch-size", "8"),
    *("--tp", "2", "--dp", "2", "--dp-shard", "1", "--zero", "2"),
    *("--steps", "3", "--seed", "0", "--precision", "fp32", "--wandb", "disabled", "--log-every", "1"),
    *("--comm-timeout", "60"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*flags: str) -> list[str]:
    """torchrun of the Python running the tests."""
    return [sys.executable, "-m", "torch.distributed.run", *flags]


def launch(jobs: dict[str, tuple[list[str], Path]]) -> dict[str, str]:
    """Start every command at once (output to its log file), wait for all of them, and
    return each one's log. A non-zero exit, or anything still running after
    JOB_TIMEOUT_S, fails the test; every process tree started here is ended."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO", "HF_DATASETS_OFFLINE": "1"}
    procs: dict[str, subprocess.Popen] = {}
    timed_out: set[str] = set()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        for name, (cmd, log) in jobs.items():
            with open(log, "w") as f:
                procs[name] = subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                )
        for name, proc in procs.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out.add(name)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                stop(proc)  # torchrun's workers have sessions of their own: the whole tree
    logs = {name: log.read_text() for name, (_, log) in jobs.items()}
    for name, proc in procs.items():
        why = f"still running after {JOB_TIMEOUT_S} s" if name in timed_out else f"exit code {proc.returncode}"
        assert name not in timed_out and proc.returncode == 0, f"{name}: {why}\n{logs[name][-4000:]}"
    return logs


def rendezvous_result(log: str) -> dict[str, object]:
    """The fields of the agent's "Rendezvous complete for workers. Result:" message, one
    `key=value` a line after the logger's prefix (`I1124 17:21:19.709000 28495 .../api.py:553]`)."""
    assert "Rendezvous complete for workers. Result:" in log, log[-4000:]
    block = log.split("Rendezvous complete for workers. Result:", 1)[1]
    fields = {}
    for line in block.splitlines()[1:]:
        m = re.search(r"(?:^|\s)(\w+)=(.*)$", line)
        if not m:
            break
        try:
            fields[m[1]] = ast.literal_eval(m[2])
        except (ValueError, SyntaxError):
            fields[m[1]] = m[2]
    return fields


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run under two agents (nnodes 2 × 2 processes) and under one (4 processes),
    all three agents at once; each job has its own token cache, so nothing is shared."""
    base = tmp_path_factory.mktemp("multinode")
    port, rdzv_id = free_port(), f"zero3d-test-{uuid.uuid4().hex[:8]}"
    agent = torchrun(
        *("--nnodes", "2", "--nproc-per-node", "2"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id),
        *("--rdzv-conf", "join_timeout=60"),
        *TRAIN,
        *("--out", str(base / "two_agents"), "--data-cache", str(base / "cache_two")),
    )
    single = torchrun(
        *("--standalone", "--nproc-per-node", "4"),
        *TRAIN,
        *("--out", str(base / "one_agent"), "--data-cache", str(base / "cache_one")),
    )
    logs = launch(
        {
            "agent A": (agent, base / "agent_a.log"),
            "agent B": (agent, base / "agent_b.log"),
            "standalone": (single, base / "standalone.log"),
        }
    )
    return {
        "two": read_run(base / "two_agents"),
        "one": read_run(base / "one_agent"),
        "agents": [rendezvous_result(logs["agent A"]), rendezvous_result(logs["agent B"])],
    }


def test_two_agents_train_exactly_as_one(runs) -> None:
    two, _ = runs["two"]
    one, _ = runs["one"]
    assert len(two) == len(one) == 3
    assert two == one  # bitwise: same layout, same groups, same reduction order


@pytest.mark.parametrize("run", ["two", "one"])
def test_both_jobs_are_one_world_of_four(runs, run: str) -> None:
    _, summary = runs[run]
    assert [r["rank"] for r in summary["ranks"]] == [0, 1, 2, 3]
    assert {k: summary["config"]["parallel"][k] for k in ("tp", "pp", "dp")} == {"tp": 2, "pp": 1, "dp": 2}
    comm = summary["comm_per_step"]
    # --dp-shard 1: 2 replicas of 1 shard, so gradients are all-reduced across the replicas
    assert comm["tp"]["total"]["calls"] > 0 and comm["dp_replicate"]["total"]["calls"] > 0


def test_the_agents_are_nodes_0_and_1_of_one_rendezvous(runs) -> None:
    a, b = runs["agents"]
    assert sorted([a["group_rank"], b["group_rank"]]) == [0, 1]
    first, second = sorted((a, b), key=lambda r: r["group_rank"])
    for node in (first, second):
        assert node["group_world_size"] == 2
        assert node["local_ranks"] == [0, 1]  # LOCAL_WORLD_SIZE = 2
        assert node["global_world_sizes"] == [4, 4]
        assert node["restart_count"] == 0
    assert first["global_ranks"] == [0, 1] and second["global_ranks"] == [2, 3]
    assert (first["master_addr"], first["master_port"]) == (second["master_addr"], second["master_port"])


def test_tp_stays_inside_a_node_and_dp_crosses_nodes(runs) -> None:
    """The mesh puts tp innermost: each tp pair is one agent's two workers, and each dp
    pair (here the replicate group of hybrid sharding) has one worker on each agent. The
    run's node of each rank (from torchrun's LOCAL_WORLD_SIZE) is the agent's."""
    _, summary = runs["two"]
    node_of = {rank: node["group_rank"] for node in runs["agents"] for rank in node["global_ranks"]}
    groups: dict[tuple, set[int]] = {}
    for r in summary["ranks"]:
        assert r["node"] == node_of[r["rank"]]
        c = r["coords"]
        groups.setdefault(("tp", c["pp"], c["dp"]), set()).add(node_of[r["rank"]])
        groups.setdefault(("dp", c["pp"], c["tp"]), set()).add(node_of[r["rank"]])
    assert all(len(nodes) == (1 if key[0] == "tp" else 2) for key, nodes in groups.items()), groups


def kill_tree(proc: subprocess.Popen) -> None:
    """A host lost at once: SIGKILL to the agent and every worker of it, nothing shuts down."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


LOST_HOST_JOB = [
    "-m",
    "experiments.train",
    "--config",
    "experiments/configs/tiny.yaml",
    *("--n-layers", "2", "--n-heads", "4", "--d-model", "32", "--max-seq-len", "32", "--seq-len", "32"),
    *("--global-batch-size", "8", "--micro-batch-size", "2", "--tp", "2", "--zero", "2"),
    *("--steps", "14", "--seed", "0", "--precision", "fp32", "--wandb", "disabled", "--log-every", "1"),
    *("--comm-timeout", "30", "--save-every", "2"),
]


def _steps_on_both_hosts(log: str, steps: int) -> bool:
    """Whether rank 0 (on agent A) has logged `steps` steps since the run started on both
    hosts (its start-up line: tp 2 × pp 1 × dp 2)."""
    _, both, after = log.rpartition("tp 2 × pp 1 × dp 2")
    return bool(both) and len(re.findall(r"\bstep \d+/\d+ \|", after)) >= steps


def test_a_lost_host_leaves_the_job_running_on_the_rest(tmp_path: Path) -> None:
    """Two agents (`--nnodes 1:2`, 2 workers each: tp 2 × dp 2); agent B and its workers are
    killed mid-run. Agent A restarts its workers alone: tp 2 × dp 1, the global batch kept
    (4 micro-batches per rank instead of 2), resumed from the last checkpoint by --resume. It
    finishes with exit 0, every step once, on the uninterrupted run's loss curve (fp32;
    only the reduction order changed)."""
    port, rdzv_id = free_port(), f"zero3d-lost-{uuid.uuid4().hex[:8]}"
    # as docs/training.md says for torchrun on several hosts: a fresh store per round
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    out, ckpt, cache = tmp_path / "job", tmp_path / "job" / "ckpt", tmp_path / "cache"
    agent = torchrun(
        *("--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id),
        *("--rdzv-conf", "join_timeout=60,last_call_timeout=5"),
        *LOST_HOST_JOB,
        *("--out", str(out), "--resume", str(ckpt), "--data-cache", str(cache)),
    )
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "whole")}
    procs = {}
    try:
        # the uninterrupted run alongside: it computes while the lost host's job waits on
        # rendezvous and timeouts
        with open(logs["whole"], "w") as f:
            procs["whole"] = subprocess.Popen(
                torchrun(
                    *("--standalone", "--nproc-per-node", "4", *LOST_HOST_JOB, "--out", str(tmp_path / "whole")),
                    *("--resume", str(tmp_path / "whole" / "ckpt"), "--data-cache", str(tmp_path / "whole-cache")),
                ),
                cwd=ROOT,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        for name in ("a", "b"):  # A first: it hosts the rendezvous, which must outlive B
            with open(logs[name], "w") as f:
                procs[name] = subprocess.Popen(agent, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
            time.sleep(2 if name == "a" else 0)
        # B is lost once both hosts train together: on a busy machine B's agent may reach the
        # rendezvous after A has started alone (its last call over) and join at A's next round
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not _steps_on_both_hosts(logs["a"].read_text(), 5):  # past a save (every 2 steps)
            assert time.monotonic() < deadline and procs["a"].poll() is None, logs["a"].read_text()[-3000:]
            time.sleep(0.2)
        kill_tree(procs["b"])
        procs["a"].wait(timeout=JOB_TIMEOUT_S)
        procs["whole"].wait(timeout=JOB_TIMEOUT_S)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                stop(proc)
    text = logs["a"].read_text()
    assert procs["a"].returncode == 0, text[-4000:]
    assert "--resume: resuming from" in text, text[-4000:]
    assert procs["whole"].returncode == 0, logs["whole"].read_text()[-3000:]
    lost, _ = read_run(out)
    uninterrupted, _ = read_run(tmp_path / "whole")
    assert len(lost) == len(uninterrupted) == 14
    assert lost == pytest.approx(uninterrupted, rel=1e-5)
    _, summary = read_run(out)
    assert summary["config"]["parallel"]["dp"] == 1 and summary["config"]["train"]["micro_batches"] == 4
