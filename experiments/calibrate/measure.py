"""What the planner needs, measured on every rank of a job at once (run under torchrun, on
the emulated cluster by `python -m experiments.calibrate`), written by rank 0 as a hardware
file (research/costmodel/hardware.py). Rates of compute alone are the fastest of their
repeats, and the matmul and model rates are measured first and again after the links, the
faster kept: a spell of load on the machine only slows them, and a calibration that caught
one (the model's rate 20-30 % low) predicted the runs after it 10-30 % slow.

- matmul FLOP/s of one process computing alone (square matmuls of the run's dtype), and
  of each while every process multiplies at once: n times the second over the first is the
  compute the n processes share (`compute_units`: the cores of the machine the emulated
  hosts run on, as far as they scale);
- η, the share of the matmul rate the model reaches: training FLOPs of the config's model
  (`GPTConfig.flops_per_token`) over one forward + backward of a micro-batch, alone;
- memory bandwidth: a copy, bytes read + written over the time, alone; and the rates of
  ZeRO++'s quantization as the runtime runs it (qwZ's gather, and a qgZ hop with its
  padding, packing and summing, on a group of one), in the planner's bytes (`quantize_gbs`),
  alone;
- collectives inside a host (the ranks of one host) and across hosts (one rank per host,
  the same local rank): all-reduces of a small and a large tensor; with a ring's 2(n-1)
  steps and 2(n-1)/n·S bytes per rank, the small one's time per step between idle processes
  the latency α, the large one's bytes over its time beyond it the bandwidth, and what a
  small one waits beyond α·steps between blocks of compute of 0.5-20 ms (every process
  computing, as in training) the wait per call for the group's last rank, a line in the
  block's length (`wait_us`, `wait_growth`, `wait_reach_ms`);
- the exchange of two hosts (hosts 0-1, 2-3, ... at once, every local rank): a 2-rank
  all-gather of S/2 bytes per rank beyond a small one's time (`pair_gbs`), which on gloo
  over TCP runs at 0.5-0.85 of the ring's rate, and the pair's waits (`pair_wait_us`, ...).

    python -m experiments.cluster --hosts 2 --procs-per-host 2 --link 200mbit -- \\
        -m experiments.calibrate.measure --config C --out FILE.yaml
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial
from statistics import fmean

import torch
import torch.distributed as dist
import yaml

from experiments.bench.common import median
from optim.collectives import all_gather_shards
from optim.grads import QGZ_BLOCK
from optim.quantize import QuantizedGather, exchange_quantized
from parallel import comm
from research import data
from research.config import parse_args as parse_run_args
from research.costmodel.hardware import QUANTIZERS
from research.model import GPT

SMALL, LARGE = 2**12, 2**24  # bytes of the latency and the bandwidth all-reduces
QWZ_BLOCK = 2048  # qwZ's block in the planner's studies (`--qwz-block 2048`)


def _seconds(
    fn: Callable[[], object],
    repeats: int,
    group: dist.ProcessGroup | None = None,
    together: bool = True,
    statistic: Callable[[list[float]], float] = median,
) -> float:
    """`statistic` (the median, or `min`: the fastest, `fmean`) of the seconds of `fn` over
    `repeats` calls after one warm-up, every rank of `group` starting each call together
    (`together`), or this rank alone."""
    times = []
    for i in range(repeats + 1):
        if together:
            comm.barrier(group)
        start = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - start)
    return statistic(times)


def matmul_flops(dtype: torch.dtype, together: bool, n: int = 1024, burst: int = 8) -> float:
    """FLOP/s of `burst` n × n matmuls back to back: long enough that processes sharing cores
    are time-sliced fairly, as in training. Alone the fastest of 9; together (every rank
    at once) their median, as the fastest is the burst whose peers lagged most (4 processes
    on 2 cores then measured 2.1-2.3 cores' worth)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)

    def matmuls() -> None:
        for _ in range(burst):
            a @ b

    return burst * 2 * n**3 / _seconds(matmuls, 9, together=together, statistic=median if together else min)


def copy_bandwidth(nbytes: int = 64 * 2**20) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _seconds(lambda: dst.copy_(src), 10, together=False, statistic=min)


def quantize_bandwidth(own: dist.ProcessGroup, quantizer: str, numel: int = 2**22) -> float:
    """Bytes/s of ZeRO++'s `quantizer` as the runtime runs it, in the planner's bytes
    (`research.costmodel.dpcomm`: P + q per element quantized or dequantized): "qwz", the
    int8 gather of a shard (quantize, pack, unpack, dequantize, copy into place); "qgz", one
    int4 hop of the reduction (pad, quantize, pack, unpack, dequantize, sum); fp32 values, on
    `own`, a group of this rank alone, so the all-gather and the all-to-all are a local copy.
    On a CPU the hop moves its bytes at about half the gather's rate."""
    x, out = torch.randn(numel), torch.empty(numel)
    qwz = QuantizedGather(QWZ_BLOCK)

    def gather() -> None:
        all_gather_shards(out, x, own, qwz).finish()

    def hop() -> None:
        for works in exchange_quantized(x.view(1, -1), own, 4, QGZ_BLOCK):
            for w in works:
                w.wait()

    if quantizer == "qwz":
        return 2 * (4 + 1 + 4 / QWZ_BLOCK) * numel / _seconds(gather, 15, together=False, statistic=min)
    return 2 * (4 + 0.5 + 4 / QGZ_BLOCK) * numel / _seconds(hop, 15, together=False, statistic=min)


def alone(measure: Callable[[], float]) -> float:
    """`measure()` on rank 0 while the other ranks wait, then the same on every rank."""
    value = torch.tensor([measure() if dist.get_rank() == 0 else 0.0], dtype=torch.float64)
    comm.broadcast(value, src=0)
    return float(value)


def model_flops(config: str, own: dist.ProcessGroup) -> float:
    """The config's model's training FLOP/s over one micro-batch's forward + backward; the
    whole model on this rank (`own`: a group of this rank alone, not the default group,
    which would split it over every rank by tensor parallelism)."""
    cfg = parse_run_args(["--config", config], 1)
    model_cfg = cfg.model.with_vocab_of(data.load_tokenizer(cfg.data.tokenizer).vocab_size)
    model = GPT(model_cfg, tp_group=own)
    b, s = cfg.train.micro_batch_size, cfg.data.seq_len
    ids = torch.randint(0, model_cfg.vocab_size, (b, s + 1))

    def step() -> None:
        model(ids[:, :-1], ids[:, 1:]).backward()

    flops = model_cfg.flops_per_token(s) * b * s
    return flops / _seconds(step, 15, together=False, statistic=min)


def compute_rates(config: str, own: dist.ProcessGroup) -> tuple[float, float, float]:
    """FLOP/s of (matmuls of one process alone, of the slowest process while all multiply,
    the config's model alone: `model_flops`), the same on every rank."""
    matmul = alone(lambda: matmul_flops(torch.float32, together=False))
    together = _worst(matmul_flops(torch.float32, together=True), "min")
    return matmul, together, alone(lambda: model_flops(config, own))


def ring_fit(group: dist.ProcessGroup) -> tuple[float, float, list[tuple[float, float]]]:
    """(bytes/s, seconds per step, `loaded_waits`) of all-reduces over `group`: latency α from
    the fastest of the small ones between idle processes (a median caught stalls of 12 ms a
    step over a 100 Mbit/s link now and then), bandwidth from the large one's time beyond it,
    and the waits of calls between blocks of compute. Every rank measures a group of the same
    kind (every rank has one), and the large ones start together on every rank of the job, so
    groups that share a link measure their share of it, not the link alone."""
    n = dist.get_world_size(group)
    alpha, waits = latency_and_waits(group)
    large = torch.zeros(LARGE // 4)
    t_large = _seconds(lambda: comm.all_reduce(large, group=group), 5)
    wire = 2 * (n - 1) / n * LARGE
    return wire / max(t_large - alpha * 2 * (n - 1), 1e-9), alpha, waits


def latency_and_waits(group: dist.ProcessGroup) -> tuple[float, list[tuple[float, float]]]:
    """(seconds per ring step, `loaded_waits`) of a small all-reduce over `group`: the fastest
    of 20 between idle processes over its 2(n-1) steps."""
    steps = 2 * (dist.get_world_size(group) - 1)
    small = torch.zeros(SMALL // 4)
    alpha = _seconds(lambda: comm.all_reduce(small, group=group), 20, group, statistic=min) / steps
    return alpha, loaded_waits(group, small, alpha * steps)


WAIT_BLOCKS = (1, 3, 9, 27)  # 256² matmuls between calls: blocks of about 0.5-20 ms on 2 cores, 4 processes


def loaded_waits(
    group: dist.ProcessGroup, small: torch.Tensor, idle: float, calls: int = 20
) -> list[tuple[float, float]]:
    """(seconds of a block, seconds a call waits) of an all-reduce of `small` issued between
    blocks of compute, every process computing as in training, for each block of
    `WAIT_BLOCKS`: the block is the group's slowest rank's time alone / calls, the wait
    (`calls` blocks each followed by the all-reduce − those blocks alone) / calls − its
    time between idle processes (`idle`). The planner computes at the slowest process's
    rate (`compute_units`), so this is what the calls add beyond it: where processes share
    cores, the wait for the group's last rank to be scheduled and finish its block, once per
    call however many ring steps the call makes, growing with the block as the ranks drift
    apart (on 2 cores, 4 processes: 1.4-2 ms after 0.6 ms blocks, 4-6.5 after 22 ms).
    Measured from the fastest rank's blocks instead, it would also hold the spread of the
    ranks' speeds."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def blocks(size: int, sync: bool) -> None:
        for _ in range(calls):
            for _ in range(size):
                a @ b
            if sync:
                comm.all_reduce(small, group=group)

    points = []
    for size in WAIT_BLOCKS:
        alone = _seconds(partial(blocks, size, False), 7, group)
        synced = _seconds(partial(blocks, size, True), 7, group)
        slowest = _worst(alone, "max", group)
        points.append((slowest / calls, (_worst(synced, "max", group) - slowest) / calls - idle))
    return points


def fit_wait(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(ω₀, κ, reach) of a call's wait w after a block of B seconds (`hardware.Wait`): the
    least-squares line w = ω₀ + κB with both at least 0 (through the origin where ω₀ would
    be negative), reach the longest block."""
    blocks, waits = zip(*points)
    mean_b, mean_w = sum(blocks) / len(blocks), sum(waits) / len(waits)
    spread = sum((b - mean_b) ** 2 for b in blocks)
    growth = max(0.0, sum((b - mean_b) * (w - mean_w) for b, w in points) / spread) if spread else 0.0
    base = mean_w - growth * mean_b
    if base < 0:
        base, growth = 0.0, max(0.0, sum(b * w for b, w in points) / sum(b * b for b in blocks))
    return base, growth, max(blocks)


def pair_fit(pair: dist.ProcessGroup | None) -> tuple[float, list[tuple[float, float]]]:
    """(bytes/s, `loaded_waits`) of two hosts exchanging one message each way: a 2-rank
    all-gather of LARGE/2 bytes per rank beyond a small one's time, every pair of hosts at
    once (each call starts together on every rank of the job, so the pairs that share a
    host's link measure their share of it), and a small all-reduce's waits between blocks
    of compute; (inf, []) where this rank has no pair. On gloo over TCP such an exchange of
    megabytes runs below the rate a ring reaches (`Cluster.pair_bandwidth`): each call moves
    both ways at once or, by chance, about as often one way after the other (here, at 100
    Mbit/s and 1 Gbit/s alike), so the exchange is timed by the mean of 10 calls, what the
    exchanges of a run average; a median of 5 fell on either side."""
    times = []
    for nbytes in (SMALL, LARGE):
        shard = torch.zeros(nbytes // 8)
        whole = torch.empty(2 * shard.numel())
        exchange = (
            (lambda w=whole, s=shard: comm.all_gather_into_tensor(w, s, group=pair))
            if pair is not None
            else (lambda: None)
        )
        times.append(_seconds(exchange, 10, statistic=fmean))
    if pair is None:
        return float("inf"), []
    return LARGE / 2 / max(times[1] - times[0], 1e-9), latency_and_waits(pair)[1]


def host_pairs(hosts: int, per_host: int) -> dist.ProcessGroup | None:
    """This rank's group with the rank of the same local rank on the paired host (hosts 0-1,
    2-3, ...); None on an unpaired last host. Every rank makes every group (a collective)."""
    rank, mine = dist.get_rank(), None
    for h in range(0, hosts - 1, 2):
        for local in range(per_host):
            ranks = [h * per_host + local, (h + 1) * per_host + local]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine = g
    return mine


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


def _worst(value: float, worst: str, group: dist.ProcessGroup | None = None) -> float:
    """`value` over the ranks of `group` (the job's): the slowest (min rate) or the largest
    (max latency)."""
    t = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(t, op=dist.ReduceOp.MIN if worst == "min" else dist.ReduceOp.MAX, group=group)
    return float(t)


def _wait_keys(points: list[tuple[float, float]], prefix: str = "") -> dict[str, float]:
    """A link's `{prefix}wait_us`, `_growth`, `_reach_ms` (`fit_wait`) from each rank's
    `loaded_waits` (none where it has no such group), each point the job's largest."""
    mine = torch.tensor(points or [(0.0, 0.0)] * len(WAIT_BLOCKS), dtype=torch.float64)
    comm.all_reduce(mine, op=dist.ReduceOp.MAX)
    base, growth, reach = fit_wait([(float(b), float(w)) for b, w in mine])
    return {f"{prefix}wait_us": round(base * 1e6, 3), f"{prefix}wait_growth": round(growth, 4),
            f"{prefix}wait_reach_ms": round(reach * 1e3, 3)}  # fmt: skip


def measure(config: str, name: str) -> dict:
    """The hardware file's contents, the same on every rank."""
    hosts, per_host = int(os.environ.get("GROUP_WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    own = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    first = compute_rates(config, own)
    hbm = alone(copy_bandwidth)
    quantizers = {q: alone(lambda q=q: quantize_bandwidth(own, q)) for q in QUANTIZERS}
    intra, inter = groups(hosts, per_host)
    links = {}
    for key, group in (("intra_node", intra), ("inter_node", inter)):
        bw, alpha, waits = ring_fit(group) if group is not None else (float("inf"), 0.0, [])
        bw, alpha, wait = _worst(bw, "min"), _worst(alpha, "max"), _wait_keys(waits)
        if bw != float("inf"):
            links[key] = {"gbs": round(bw / 1e9, 6), "latency_us": round(alpha * 1e6, 3), **wait}
    if "inter_node" in links:
        bw, waits = pair_fit(host_pairs(hosts, per_host))
        links["inter_node"] |= {"pair_gbs": round(_worst(bw, "min") / 1e9, 6), **_wait_keys(waits, "pair_")}
    # again after the links, a minute later: a slow spell of the machine (the model's rate
    # 20-30 % low in 2 of 28 calibrations, the runs after it at their usual pace) rarely spans both
    matmul, together, model = map(max, first, compute_rates(config, own))
    units, eta = hosts * per_host * together / matmul, model / matmul
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // per_host
    fallback = links.get("inter_node") or links.get("intra_node") or {"gbs": 1.0, "latency_us": 0.0}
    return {
        "name": name,
        "memory_mib": memory // 2**20,
        "devices_per_node": per_host,
        "intra_node": links.get("intra_node") or {k: v for k, v in fallback.items() if not k.startswith("pair")},
        "inter_node": links.get("inter_node") or fallback,
        "peak_tflops": {"bf16": round(matmul / 1e12, 6)},
        "hbm_gbs": round(hbm / 1e9, 3),
        "matmul_efficiency": round(eta, 4),
        "quantize_gbs": {q: round(rate / 1e9, 4) for q, rate in quantizers.items()},
        "backend": "gloo",
        "compute_units": round(units, 3),
        "_measured": f"{hosts} hosts × {per_host} processes, fp32 on the CPU; η of one micro-batch of {config}",
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
                f.write(
                    f"# experiments.calibrate: {note}.\n# peak_tflops.bf16 holds one process's matmul rate, alone.\n"
                )
                yaml.safe_dump(found, f, sort_keys=False)
            print(f"wrote {args.out}: " + ", ".join(f"{k} {v}" for k, v in found.items() if k != "name"), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
