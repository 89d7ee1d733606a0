"""What the planner needs, measured on every rank of a job at once (run under torchrun, on
the emulated cluster by `python -m experiments.calibrate`), written by rank 0 as a hardware
file (research/costmodel/hardware.py):

- matmul FLOP/s of one process while every process multiplies (square matmuls of the run's
  dtype: the cores and the memory are shared as in training);
- η, the share of it the model reaches: training FLOPs of the config's model
  (`GPTConfig.flops_per_token`) over one forward + backward of a micro-batch, every rank at
  once, divided by the matmul rate;
- memory bandwidth: a copy, bytes read + written over the time;
- collectives inside a host (the ranks of one host) and across hosts (one rank per host,
  the same local rank): all-reduces of a small and a large tensor; with a ring's 2(n-1)
  steps and 2(n-1)/n·S bytes per rank, the small one's time per step is the latency α and
  the large one's bytes over its time beyond α·steps the bandwidth.

    python -m experiments.cluster --hosts 2 --procs-per-host 2 --link 200mbit -- \\
        -m experiments.calibrate.measure --config C --out FILE.yaml
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import yaml

from experiments.bench.common import median
from parallel import comm
from research import data
from research.config import parse_args as parse_run_args
from research.model import GPT

SMALL, LARGE = 2**12, 2**24  # bytes of the latency and the bandwidth all-reduces


def _seconds(fn: Callable[[], object], repeats: int, group: dist.ProcessGroup | None = None) -> float:
    """Median seconds of `fn` over `repeats` calls after one warm-up, every rank of `group`
    starting each call together."""
    times = []
    for i in range(repeats + 1):
        comm.barrier(group)
        start = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - start)
    return median(times)


def matmul_flops(dtype: torch.dtype, n: int = 1024) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _seconds(lambda: a @ b, 10)


def copy_bandwidth(nbytes: int = 64 * 2**20) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _seconds(lambda: dst.copy_(src), 10)


def model_efficiency(config: str, matmul: float) -> tuple[float, str]:
    """(η, a description): the config's model's training FLOP/s over one micro-batch's
    forward + backward, as a share of `matmul`."""
    cfg = parse_run_args(["--config", config], 1)
    model_cfg = cfg.model.with_vocab_of(data.load_tokenizer(cfg.data.tokenizer).vocab_size)
    model = GPT(model_cfg)
    b, s = cfg.train.micro_batch_size, cfg.data.seq_len
    ids = torch.randint(0, model_cfg.vocab_size, (b, s + 1))

    def step() -> None:
        model(ids[:, :-1], ids[:, 1:]).backward()

    flops = model_cfg.flops_per_token(s) * b * s
    return flops / _seconds(step, 3) / matmul, f"{config}: micro-batch {b} × {s} tokens"


def ring_fit(group: dist.ProcessGroup) -> tuple[float, float]:
    """(bytes/s, seconds per step) of all-reduces over `group`: latency from the small one,
    bandwidth from the large one's time beyond it."""
    n = dist.get_world_size(group)
    steps = 2 * (n - 1)
    small, large = torch.zeros(SMALL // 4), torch.zeros(LARGE // 4)
    alpha = _seconds(lambda: comm.all_reduce(small, group=group), 20, group) / steps
    t_large = _seconds(lambda: comm.all_reduce(large, group=group), 5, group)
    wire = 2 * (n - 1) / n * LARGE
    return wire / max(t_large - alpha * steps, 1e-9), alpha


def groups(hosts: int, per_host: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's host, its peers at the same local rank on the other hosts); None where
    a group would have one rank. Every rank makes every group (a collective)."""
    rank = dist.get_rank()
    intra = inter = None
    for h in range(hosts):
        g = dist.new_group(list(range(h * per_host, (h + 1) * per_host)))
        if rank // per_host == h and per_host > 1:
            intra = g
    for local in range(per_host):
        g = dist.new_group([h * per_host + local for h in range(hosts)])
        if rank % per_host == local and hosts > 1:
            inter = g
    return intra, inter


def _worst(value: float, worst: str) -> float:
    """`value` over ranks: the slowest (min rate) or the largest (max latency)."""
    t = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(t, op=dist.ReduceOp.MIN if worst == "min" else dist.ReduceOp.MAX)
    return float(t)


def measure(config: str, name: str) -> dict:
    """The hardware file's contents, the same on every rank."""
    hosts, per_host = int(os.environ.get("GROUP_WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    matmul = _worst(matmul_flops(torch.float32), "min")
    eta, described = model_efficiency(config, matmul)
    eta = _worst(eta, "min")
    hbm = _worst(copy_bandwidth(), "min")
    intra, inter = groups(hosts, per_host)
    links = {}
    for key, group in (("intra_node", intra), ("inter_node", inter)):
        bw, alpha = ring_fit(group) if group is not None else (None, None)
        bw = _worst(bw if bw is not None else float("inf"), "min")
        alpha = _worst(alpha if alpha is not None else 0.0, "max")
        links[key] = {"gbs": round(bw / 1e9, 6), "latency_us": round(alpha * 1e6, 3)} if bw != float("inf") else None
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // per_host
    fallback = links["inter_node"] or links["intra_node"] or {"gbs": 1.0, "latency_us": 0.0}
    return {
        "name": name,
        "memory_mib": memory // 2**20,
        "devices_per_node": per_host,
        "intra_node": links["intra_node"] or fallback,
        "inter_node": links["inter_node"] or fallback,
        "peak_tflops": {"bf16": round(matmul / 1e12, 6)},
        "hbm_gbs": round(hbm / 1e9, 3),
        "matmul_efficiency": round(eta, 4),
        "_measured": f"{hosts} hosts × {per_host} processes, fp32 on the CPU; η of {described}",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the run's config (its model and micro-batch)")
    p.add_argument("--out", required=True, help="the hardware file to write")
    p.add_argument("--name", default="calibrated", help="the system's name in the file")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        found = measure(args.config, args.name)
        if dist.get_rank() == 0:
            note = found.pop("_measured")
            with open(args.out, "w") as f:
                f.write(f"# experiments.calibrate: {note}.\n# peak_tflops.bf16 holds the run's matmul rate.\n")
                yaml.safe_dump(found, f, sort_keys=False)
            print(f"wrote {args.out}: " + ", ".join(f"{k} {v}" for k, v in found.items() if k != "name"), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
