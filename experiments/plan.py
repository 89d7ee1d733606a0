"""Plan a training layout: every (tp, cp, pp, dp, v, ZeRO stage, micro-batch size, recompute,
SP; with long sequences context parallelism's cp and mode) of a model on a cluster, each with its fastest data-parallel communication (hybrid
sharding, ZeRO++ qwZ / hpZ / qgZ), ranked by predicted step time, where the bytes go (NVLink
or network), and why the others are out.

    python -m experiments.plan --model gpt-1t --gpus 3072 --gpu a100-80gb
    python -m experiments.plan --config experiments/configs/tiny.yaml --gpus 8 --gpu h100
    python -m experiments.plan --model gpt-70b --gpus 512 --gpu h100 --inter-node-gbps 400
    python -m experiments.plan --scale-table   # ZeRO-3 / hybrid / ZeRO++ for 7B-175B on H100s
    python -m experiments.plan --config experiments/configs/gpt-1.3b.yaml --gpus 64 --gpu h100 --seq-len 131072

The model is a preset (the GPT models of Narayanan et al. 2021, Table 1: vocabulary 51,200,
sequence 2048, their global batch and GPU count as defaults; and GPT 7B / 70B / 175B of the
usual shapes) or the `model` section of a zero3d YAML config (with its `data.seq_len` and
`train.global_batch_size`). Memory and time come from `research.costmodel` (bf16
parameters, fp32 gradient reduction, AdamW).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

from research import costmodel
from research.costmodel import Cluster, Collective, Estimate, GiB, Layout, Plan
from research.costmodel.hardware import NETWORK_STEP_LATENCY, NVLINK_STEP_LATENCY, SYSTEMS, load_system
from research.costmodel.search import CP_MIN_TOKENS, CP_MODES
from research.model import GPTConfig


@dataclass(frozen=True)
class Preset:
    n_heads: int
    d_model: int
    n_layers: int
    gpus: int  # the paper's GPU count and global batch, the defaults
    global_batch_size: int

    def model(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=51200,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            d_model=self.d_model,
            max_seq_len=2048,
            qkv_bias=True,
        )


# Narayanan et al. 2021, Table 1 (tests/data/ptdp_table1.csv).
PRESETS = {
    "gpt-1.7b": Preset(24, 2304, 24, 32, 512),
    "gpt-3.6b": Preset(32, 3072, 30, 64, 512),
    "gpt-7.5b": Preset(32, 4096, 36, 128, 512),
    "gpt-18.4b": Preset(48, 6144, 40, 256, 1024),
    "gpt-39.1b": Preset(64, 8192, 48, 512, 1536),
    "gpt-76.1b": Preset(80, 10240, 60, 1024, 1792),
    "gpt-145.6b": Preset(96, 12288, 80, 1536, 2304),
    "gpt-310.1b": Preset(128, 16384, 96, 1920, 2160),
    "gpt-529.6b": Preset(128, 20480, 105, 2520, 2520),
    "gpt-1t": Preset(160, 25600, 128, 3072, 3072),
    # the usual shapes, in GPT form (learned positions, GELU, vocabulary 51,200): 6.7B, 64.9B, 174.6B
    "gpt-7b": Preset(32, 4096, 32, 128, 2048),
    "gpt-70b": Preset(64, 8192, 80, 512, 2048),
    "gpt-175b": Preset(96, 12288, 96, 1024, 2048),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=list(PRESETS), help="a preset model")
    source.add_argument("--config", help="a zero3d YAML config (its model, seq_len and global batch)")
    source.add_argument(
        "--scale-table",
        action="store_true",
        help="docs/planner.md's table: GPT 7B / 70B / 175B on 128 / 512 / 1024 H100s at 100 / 400 / 3200 Gb/s per node, "
        "ZeRO-3 vs hybrid vs ZeRO++ (markdown)",
    )
    p.add_argument("--gpus", type=int, help="GPUs in all (default: the preset's)")
    _hardware_args(p)
    p.add_argument("--global-batch-size", type=int, help="sequences per step (default: the preset's or config's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: 2048 or the config's)")
    p.add_argument("--top", type=int, default=10, help="layouts to show")
    p.add_argument(
        "--cp",
        type=int,
        help="pin context parallelism to this many ranks per sequence (default: searched where each rank keeps at "
        f"least {CP_MIN_TOKENS} tokens of a sequence)",
    )
    p.add_argument("--cp-mode", choices=CP_MODES, help="pin how context-parallel ranks attend (default: searched)")
    p.add_argument("--cp-a2a", type=int, help="pin --cp-mode hybrid's all-to-all group size (default: searched)")
    p.add_argument(
        "--comm",
        choices=list(costmodel.COMM_SCHEMES),
        default="exact",
        help="data-parallel communication: exact (the fastest without quantization: plain, hybrid, hpZ), "
        "any (the fastest, quantized too), zero (plain), hybrid (--dp-shard), "
        "zero++ (qwZ, hpZ at stage 3, int4 qgZ at stages 2-3)",
    )
    _one_layout_args(p)
    return p.parse_args(argv)


def _hardware_args(p: argparse.ArgumentParser) -> None:
    """The system (--gpu or --hardware) and overrides of its figures."""
    hardware = p.add_mutually_exclusive_group()
    hardware.add_argument(
        "--gpu", choices=list(SYSTEMS), default="a100-80gb", help="a built-in system (research/costmodel/systems)"
    )
    hardware.add_argument(
        "--hardware",
        metavar="FILE.yaml",
        help="a hardware file (research/costmodel/hardware.py; experiments.calibrate)",
    )
    p.add_argument("--gpus-per-node", type=int, help="devices per node (default: the system's)")
    p.add_argument("--memory-gib", type=float, help="override the GPU's memory")
    p.add_argument("--peak-tflops", type=float, help="override the GPU's dense 16-bit peak")
    p.add_argument("--intra-node-gbs", type=float, help="override NVLink GB/s per GPU and direction")
    network = p.add_mutually_exclusive_group()
    network.add_argument("--inter-node-gbs", type=float, help="override network GB/s per GPU and direction")
    network.add_argument(
        "--inter-node-gbps", type=float, help="a node's network, Gb/s per direction, all NICs together (DGX H100: 3200)"
    )
    p.add_argument(
        "--intra-node-latency-us",
        type=float,
        help=f"override µs per ring step inside a node ({NVLINK_STEP_LATENCY * 1e6:g})",
    )
    p.add_argument(
        "--inter-node-latency-us",
        type=float,
        help=f"override µs per ring step across nodes ({NETWORK_STEP_LATENCY * 1e6:g})",
    )


def _one_layout_args(p: argparse.ArgumentParser) -> None:
    """--layout and --json: one layout's prediction instead of a search."""
    p.add_argument(
        "--layout",
        help="predict this one layout instead of searching: comma-separated key=value of "
        f"{', '.join(LAYOUT_KEYS)} (e.g. tp=2,pp=1,dp=2,zero=3,mbs=1,recompute=none,sp=1)",
    )
    p.add_argument("--json", action="store_true", help="with --layout: print its prediction as one JSON object")


# --layout's keys -> (Layout field, type); micro-batches follow from the global batch
LAYOUT_KEYS = {
    "tp": ("tp", int),
    "cp": ("cp", int),
    "cp_mode": ("cp_mode", str),
    "cp_a2a": ("cp_a2a", int),
    "pp": ("pp", int),
    "dp": ("dp", int),
    "zero": ("zero", int),
    "mbs": ("micro_batch_size", int),
    "recompute": ("recompute", str),
    "sp": ("sequence_parallel", lambda v: bool(int(v))),
    "v": ("virtual_stages", int),
    "schedule": ("schedule", str),
    "dp_shard": ("dp_shard", int),
    "qwz_block": ("qwz_block", int),
    "hpz": ("hpz", lambda v: bool(int(v))),
    "qgz_bits": ("qgz_bits", int),
    "ep": ("ep", int),
    "grad_sync": ("grad_sync", str),
}


def parse_layout(text: str, global_batch_size: int, fp8: bool) -> Layout:
    """The Layout that `--layout`'s key=value list names (one sentence on a bad key or value)."""
    fields: dict[str, object] = {"fp8": fp8}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in LAYOUT_KEYS or not value:
            sys.exit(f"error: --layout {item!r}: expected key=value with key one of {', '.join(LAYOUT_KEYS)}")
        name, kind = LAYOUT_KEYS[key]
        try:
            fields[name] = kind(value)
        except ValueError:
            sys.exit(f"error: --layout {item!r}: {value!r} is not a valid {key}")
    fields.setdefault("schedule", "interleaved-1f1b" if int(fields.get("virtual_stages", 1)) > 1 else "1f1b")
    share = int(fields.get("dp", 1)) * int(fields.get("micro_batch_size", 1))
    if global_batch_size % share:
        sys.exit(f"error: --layout: the global batch {global_batch_size} is not divisible by dp × mbs = {share}")
    return Layout(**fields, micro_batches=global_batch_size // share)


def predict_one(model: GPTConfig, layout: Layout, seq_len: int, cluster: Cluster) -> dict[str, object]:
    """One layout's prediction: step time, memory per GPU and its parts, throughput, and
    whether it fits (`error`: why it cannot run or fit, else None)."""
    if layout.gpus != cluster.gpus:
        return {
            "layout": layout.describe(),
            "error": f"tp × cp × pp × dp = {layout.gpus} is not --gpus={cluster.gpus}",
        }
    problem = costmodel.layout_problem(model, layout, seq_len)
    if problem is not None:
        return {"layout": layout.describe(), "error": problem}
    try:
        e = costmodel.estimate(model, layout, seq_len, cluster)
    except ValueError as err:
        return {"layout": layout.describe(), "error": str(err)}
    fits = e.memory.total <= cluster.gpu.memory_bytes
    return {
        "layout": layout.describe(),
        "step_s": e.time.total,
        "memory_bytes": e.memory.total,
        "model_state_bytes": e.memory.model_states.total,
        "activation_bytes": e.memory.activations,
        "buffer_bytes": e.memory.buffers,
        "tflops_per_gpu": e.tflops_per_gpu,
        "mfu": e.mfu,
        "error": None if fits else f"needs {e.memory.total / GiB:.2f} GiB > {cluster.gpu.memory_bytes / GiB:.2f} GiB",
    }


def from_config(path: str) -> tuple[GPTConfig, int, int | None]:
    """(model, seq_len, global batch or None) of a YAML config; the vocabulary is raised to
    the tokenizer's, as the Trainer does."""
    from research.config import DataConfig, load_yaml
    from research.data import load_tokenizer

    sections = load_yaml(path)
    data = DataConfig(**sections.get("data", {}))
    model = GPTConfig(**sections.get("model", {}))
    vocab = load_tokenizer(data.tokenizer).vocab_size
    if model.vocab_size < vocab:
        model = dataclasses.replace(model, vocab_size=vocab)
    return model, data.seq_len, sections.get("train", {}).get("global_batch_size")


def cluster_of(args: argparse.Namespace, gpus: int) -> Cluster:
    """The system of --gpu or --hardware, with the command's overrides, at `gpus` devices."""
    try:
        system = load_system(args.hardware) if args.hardware else SYSTEMS[args.gpu]
    except (OSError, ValueError) as e:
        sys.exit(f"error: --hardware: {e}")
    gpu = system.gpu
    overrides = {
        "memory_bytes": args.memory_gib and int(args.memory_gib * GiB),
        "peak_flops": args.peak_tflops and args.peak_tflops * 1e12,
        "intra_node_bandwidth": args.intra_node_gbs and args.intra_node_gbs * 1e9,
        "inter_node_bandwidth": args.inter_node_gbs and args.inter_node_gbs * 1e9,
    }
    gpu = dataclasses.replace(gpu, **{k: v for k, v in overrides.items() if v})
    latencies = {"intra_node_latency": args.intra_node_latency_us, "inter_node_latency": args.inter_node_latency_us}
    latencies = {k: us * 1e-6 for k, us in latencies.items() if us is not None}  # 0: bandwidth only
    per_node = {"gpus_per_node": args.gpus_per_node} if args.gpus_per_node else {}
    return dataclasses.replace(system, gpu=gpu).cluster(
        gpus, inter_node_gbps=args.inter_node_gbps, **per_node, **latencies
    )


def _count(n: int) -> str:
    return next(
        f"{n / scale:.3g}{unit}"
        for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"), (1, ""))
        if n >= scale or unit == ""
    )


def _sig(x: float) -> str:
    """Three significant digits, without an exponent from 1000 up."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _gib(n: float) -> str:
    return f"{round(n / GiB, 1):g} GiB"


def report(
    plan: Plan, name: str, model: GPTConfig, cluster: Cluster, global_batch_size: int, seq_len: int, top: int
) -> str:
    """The table of the `top` fastest fitting layouts, the best one's breakdown, and the
    rejected layouts by reason with one example each."""
    lines = [_title(name, model, cluster, global_batch_size, seq_len)]
    rejected = sum(count for count, _ in plan.rejected.values())
    lines.append(f"{plan.fits + rejected} layouts: {plan.fits} fit, {rejected} do not")
    if plan.ranked:
        context = any(e.layout.cp > 1 for e in plan.ranked)
        table = _ranked_table(plan, top, bool(model.moe_experts), context)
        lines += ["", *table, "", *_best_breakdown(plan.ranked[0], cluster, context)]
    else:
        lines += ["", "No layout fits."]
    if plan.rejected:
        lines += ["", "Rejected:"]
        for reason, (count, example) in sorted(plan.rejected.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"  {count:>7} {reason}, e.g. {example}")
    return "\n".join(lines)


def _title(name: str, model: GPTConfig, cluster: Cluster, global_batch_size: int, seq_len: int) -> str:
    """The model and its batch on the cluster, in one line."""
    gpu = cluster.gpu
    network = cluster.inter_node_bandwidth * 8 * cluster.gpus_per_node / 1e9
    return (
        f"{name}: {_count(costmodel.num_params(model))} parameters, seq {seq_len}, global batch {global_batch_size} "
        f"on {cluster.gpus} × {gpu.name} ({_gib(gpu.memory_bytes)}, {gpu.peak_flops / 1e12:g} TFLOP/s, "
        f"{cluster.gpus_per_node} per node, {network:g} Gb/s per node)"
    )


def _zeropp(layout: Layout) -> str:
    """The ZeRO++ switches of a layout, e.g. qwZ+hpZ+qgZ4, or -."""
    parts = ["qwZ"] * (layout.qwz_block is not None) + ["hpZ"] * layout.hpz
    parts += [f"qgZ{layout.qgz_bits}"] if layout.qgz_bits else []
    return "+".join(parts) or "-"


def _cp(layout: Layout) -> str:
    """The context parallelism of a layout: cp ranks per sequence, with /a2a (all-to-all) or
    /hA (hybrid: all-to-all in groups of A, ring across them); a ring is cp alone."""
    if layout.cp == 1 or layout.cp_mode == "ring":
        return str(layout.cp)
    return f"{layout.cp}/" + ("a2a" if layout.cp_mode == "all-to-all" else f"h{layout.cp_a2a}")


def _network_bytes(e: Estimate) -> float:
    return sum(c.inter_bytes for c in e.time.collectives)


# The layout columns of the table: header -> (width, cell).
LAYOUT_COLUMNS: dict[str, tuple[int, Callable[[Layout], object]]] = {
    "tp": (3, lambda lo: lo.tp),
    "cp": (6, _cp),
    "pp": (4, lambda lo: lo.pp),
    "dp": (5, lambda lo: lo.dp),
    "shard": (5, lambda lo: lo.shard),
    "ep": (3, lambda lo: lo.ep),
    "v": (2, lambda lo: lo.virtual_stages),
    "zero": (4, lambda lo: lo.zero),
    "mbs": (4, lambda lo: lo.micro_batch_size),
    "recompute": (9, lambda lo: lo.recompute),
    "sp": (2, lambda lo: int(lo.sp)),
    "sync": (5, lambda lo: lo.grad_sync),
    "zero++": (12, _zeropp),
}


def _differences(row: Layout, other: Layout) -> str:
    """`other` as the columns in which it differs from `row`, e.g. zero=2."""
    cells = ((name, cell(row), cell(other)) for name, (_, cell) in LAYOUT_COLUMNS.items())
    return " ".join(f"{name}={theirs}" for name, ours, theirs in cells if ours != theirs)


def _ranked_table(plan: Plan, top: int, experts: bool = False, context: bool = False) -> list[str]:
    """The header and one row per distinct prediction of the `top` fastest (`Plan.alike`):
    the first layout's, and in `same prediction` how the others differ from it (with
    `experts`, an ep column: the ranks that split each MoE layer's experts; with `context`,
    a cp column: the ranks that split each sequence, and how they attend)."""
    shown = {"ep": experts, "cp": context}
    columns = {k: c for k, c in LAYOUT_COLUMNS.items() if shown.get(k, True)}
    lines = [
        f"{'#':>3} "
        + " ".join(f"{name:>{width}}" for name, (width, _) in columns.items())
        + f" {'mem GiB':>8} {'net GB':>7} {'step s':>9} {'TFLOP/s/GPU':>11} {'MFU':>6}  same prediction"
    ]
    for i, (e, *twins) in enumerate(plan.alike()[:top], 1):
        cells = " ".join(f"{cell(e.layout)!s:>{width}}" for width, cell in columns.values())
        lines.append(
            f"{i:>3} {cells} {e.memory.total / GiB:>8.1f} {_sig(_network_bytes(e) / 1e9):>7} {e.time.total:>9.3g} "
            f"{e.tflops_per_gpu:>11.1f} {e.mfu:>6.1%}  " + "; ".join(_differences(e.layout, t.layout) for t in twins)
        )
    return [line.rstrip() for line in lines]


CP_LEGEND = (
    "cp: ranks that split each sequence, attending by ring (cp alone), all-to-all (/a2a) or hybrid "
    "(/hA: all-to-all in groups of A, ring across them); shard counts them: dp_shard × cp."
)


def _best_breakdown(best: Estimate, cluster: Cluster, context: bool = False) -> list[str]:
    """What the columns mean (with `context`, the cp column too), and the best layout's memory,
    step time and DP bytes by part."""
    mem, t = best.memory, best.time
    return [
        "shard: ranks ZeRO shards over (dp_shard; dp / shard replicas); net GB: data-parallel (and tied-embedding) "
        "bytes each GPU sends across nodes per step.",
        *([CP_LEGEND] if context else []),
        "TFLOP/s/GPU: model FLOPs (no recomputation) per second per GPU, as the trainer reports; MFU = that / peak.",
        (
            f"#1 memory (pipeline rank {mem.pp_rank}): model states {_gib(mem.model_states.total)} + "
            f"activations {_gib(mem.activations)} + buffers {_gib(mem.buffers)}"
        ),
        (
            f"#1 step: {t.pipeline:.3g} s pipeline (bubble {t.bubble:.3g}, TP comm {t.tp_comm:.3g}, "
            f"PP comm {t.pp_comm:.3g}{f', EP all-to-all {t.ep_comm:.3g}' if t.ep_comm else ''}"
            f"{f', CP comm {t.cp_comm:.3g}' if best.layout.cp > 1 else ''}) + "
            f"{t.dp_comm:.3g} s exposed DP comm + {t.optimizer:.3g} s optimizer"
        ),
        *_where_the_bytes_go(t.collectives, cluster),
    ]


FAMILIES = {
    "gather_fwd": "param all-gather, forward",
    "gather_bwd": "param all-gather, backward",
    "gather_hpz": "param all-gather in node (hpZ)",
    "gather_step": "param all-gather after step",
    "reduce": "gradient reduction",
    "replicate": "replica all-reduce",
    "tied_embedding": "tied-embedding all-reduce",
}


def _where_the_bytes_go(collectives: tuple[Collective, ...], cluster: Cluster) -> list[str]:
    """#1's data-parallel (and tied-embedding) bytes and seconds per family: transfers over
    NVLink and the network, latency, quantization kernels, busy and exposed; the exposed
    total is the step's exposed DP comm."""
    lines = [
        f"#1 data-parallel communication per GPU and step (NVLink {cluster.gpu.intra_node_bandwidth / 1e9:g} GB/s, "
        f"network {cluster.inter_node_bandwidth / 1e9:.3g} GB/s per GPU; {cluster.intra_node_latency * 1e6:g} / "
        f"{cluster.inter_node_latency * 1e6:g} µs per ring step in / across nodes):",
        f"  {'':30} {'NVLink GB':>10} {'s':>8} {'network GB':>11} {'s':>8} {'latency s':>9} {'kernels s':>9} "
        f"{'busy s':>8} {'exposed s':>9}",
    ]
    rows = [(FAMILIES[c.name], c) for c in collectives]
    if len(rows) > 1:
        numbers = [f.name for f in dataclasses.fields(Collective)][1:]
        rows.append(("total", Collective("total", *(sum(getattr(c, f) for c in collectives) for f in numbers))))
    for label, c in rows:
        lines.append(
            f"  {label:30} {_sig(c.intra_bytes / 1e9):>10} {_sig(c.intra_seconds):>8} {_sig(c.inter_bytes / 1e9):>11} "
            f"{_sig(c.inter_seconds):>8} {_sig(c.latency):>9} {_sig(c.kernels):>9} {_sig(c.seconds):>8} {_sig(c.exposed):>9}"
        )
    return lines


SCALE_MODELS, SCALE_GPUS, SCALE_GBPS = ("gpt-7b", "gpt-70b", "gpt-175b"), (128, 512, 1024), (100, 400, 3200)
SCALE_BATCH = SCALE_SEQ = 2048  # sequences per step (4.2M tokens), tokens per sequence
SCALE_SCHEMES = {"ZeRO-3": "zero", "hybrid": "hybrid", "ZeRO++": "zero++"}


def _scale_cell(e: Estimate | None) -> str:
    """Step time, memory and layout of a scheme's best ZeRO-3 layout, or a dash."""
    if e is None:
        return "does not fit"
    lo = e.layout
    shard = f" N={lo.shard}" if lo.replicas > 1 else ""
    return f"{e.time.total:.2f} s, {e.memory.total / GiB:.0f} GiB ({lo.tp}·{lo.pp}·{lo.dp}{shard})"


def scale_table() -> str:
    """GPT 7B / 70B / 175B on 128 / 512 / 1024 H100s at 100 / 400 / 3200 Gb/s per node: the
    best ZeRO-3 layout (tp, pp, v, micro-batch, recompute, SP free) of plain ZeRO-3,
    hybrid sharding and ZeRO++, as a markdown table."""
    lines = [
        "| model | GPUs | Gb/s per node | " + " | ".join(SCALE_SCHEMES) + " | ZeRO++ / ZeRO-3 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in SCALE_MODELS:
        model = PRESETS[name].model()
        for gpus in SCALE_GPUS:
            for gbps in SCALE_GBPS:
                cluster = Cluster(costmodel.GPUS["h100"], gpus, 8, gbps)
                best = [
                    next(iter(costmodel.plan(model, cluster, SCALE_BATCH, SCALE_SEQ, comm, top=1, zero=3).ranked), None)
                    for comm in SCALE_SCHEMES.values()
                ]
                gain = f"{best[0].time.total / best[2].time.total:.2f}×" if best[0] and best[2] else "-"
                cells = " | ".join(map(_scale_cell, best))
                lines.append(f"| {name[4:].upper()} | {gpus} | {gbps} | {cells} | {gain} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.scale_table:
        print(scale_table())
        return
    if args.model:
        preset = PRESETS[args.model]
        seq_len = args.seq_len or 2048
        model = dataclasses.replace(preset.model(), max_seq_len=seq_len)
        batch, gpus, name = preset.global_batch_size, preset.gpus, args.model
    else:
        model, seq_len, batch = from_config(args.config)
        seq_len, gpus, name = args.seq_len or seq_len, None, args.config
        # a longer sequence plans the model as a run with --max-seq-len raised to it would have it
        model = dataclasses.replace(model, max_seq_len=max(model.max_seq_len, seq_len))
    batch = args.global_batch_size or batch
    gpus = args.gpus or gpus
    if gpus is None:
        sys.exit("error: --gpus is needed with --config")
    if batch is None:
        sys.exit("error: --global-batch-size is needed (the config does not give train.global_batch_size)")
    cluster = cluster_of(args, gpus)
    if args.layout:
        one = predict_one(model, parse_layout(args.layout, batch, model.fp8 != "none"), seq_len, cluster)
        print(json.dumps(one) if args.json else "\n".join(f"{k}: {v}" for k, v in one.items()))
        if one["error"]:
            sys.exit(1)
        return
    pins = {k: v for k, v in (("cp", args.cp), ("cp_mode", args.cp_mode), ("cp_a2a", args.cp_a2a)) if v is not None}
    result = costmodel.plan(model, cluster, batch, seq_len, args.comm, top=args.top, fp8=model.fp8 != "none", **pins)
    print(report(result, name, model, cluster, batch, seq_len, args.top))


if __name__ == "__main__":
    main()
