"""Plan a training layout: every (tp, pp, dp, v, ZeRO stage, micro-batch size, recompute,
SP) of a model on a cluster, ranked by predicted step time, and why the others are out.

    python -m experiments.plan --model gpt-1t --gpus 3072 --gpu a100-80gb
    python -m experiments.plan --config experiments/configs/tiny.yaml --gpus 8 --gpu h100

The model is a preset (the GPT models of Narayanan et al. 2021, Table 1: vocabulary 51,200,
sequence 2048, their global batch and GPU count as defaults) or the `model` section of a
zero3d YAML config (with its `data.seq_len` and `train.global_batch_size`). Memory and time
come from `research.costmodel` (bf16 parameters, fp32 gradient reduction, AdamW).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

from research import costmodel
from research.costmodel import Cluster, Estimate, GiB, Plan
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
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=list(PRESETS), help="a Table 1 model")
    source.add_argument("--config", help="a zero3d YAML config (its model, seq_len and global batch)")
    p.add_argument("--gpus", type=int, help="GPUs in all (default: the preset's)")
    p.add_argument("--gpu", choices=list(costmodel.GPUS), default="a100-80gb", help="GPU type")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, help="sequences per step (default: the preset's or config's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: 2048 or the config's)")
    p.add_argument("--top", type=int, default=10, help="layouts to show")
    p.add_argument("--memory-gib", type=float, help="override the GPU's memory")
    p.add_argument("--peak-tflops", type=float, help="override the GPU's dense 16-bit peak")
    p.add_argument("--intra-node-gbs", type=float, help="override NVLink GB/s per GPU and direction")
    p.add_argument("--inter-node-gbs", type=float, help="override network GB/s per GPU and direction")
    return p.parse_args(argv)


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
    gpu = costmodel.GPUS[args.gpu]
    overrides = {
        "memory_bytes": args.memory_gib and int(args.memory_gib * GiB),
        "peak_flops": args.peak_tflops and args.peak_tflops * 1e12,
        "intra_node_bandwidth": args.intra_node_gbs and args.intra_node_gbs * 1e9,
        "inter_node_bandwidth": args.inter_node_gbs and args.inter_node_gbs * 1e9,
    }
    gpu = dataclasses.replace(gpu, **{k: v for k, v in overrides.items() if v})
    return Cluster(gpu, gpus, args.gpus_per_node)


def _count(n: int) -> str:
    return next(
        f"{n / scale:.3g}{unit}"
        for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"), (1, ""))
        if n >= scale or unit == ""
    )


def _gib(n: float) -> str:
    return f"{round(n / GiB, 1):g} GiB"


def report(
    plan: Plan, name: str, model: GPTConfig, cluster: Cluster, global_batch_size: int, seq_len: int, top: int
) -> str:
    """The table of the `top` fastest fitting layouts, the best one's breakdown, and the
    rejected layouts by reason with one example each."""
    lines = [_title(name, model, cluster, global_batch_size, seq_len)]
    rejected = sum(count for count, _ in plan.rejected.values())
    lines.append(f"{len(plan.ranked) + rejected} layouts: {len(plan.ranked)} fit, {rejected} do not")
    if plan.ranked:
        lines += ["", *_ranked_table(plan, top), "", *_best_breakdown(plan.ranked[0])]
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
    return (
        f"{name}: {_count(model.num_params())} parameters, seq {seq_len}, global batch {global_batch_size} "
        f"on {cluster.gpus} × {gpu.name} ({_gib(gpu.memory_bytes)}, {gpu.peak_flops / 1e12:g} TFLOP/s, "
        f"{cluster.gpus_per_node} per node)"
    )


def _ranked_table(plan: Plan, top: int) -> list[str]:
    """The header and one row per layout of the `top` fastest fitting ones."""
    lines = [
        f"{'#':>3} {'tp':>3} {'pp':>4} {'dp':>5} {'v':>2} {'zero':>4} {'mbs':>4} {'recompute':>9} {'sp':>2} {'sync':>5} "
        f"{'mem GiB':>8} {'step s':>9} {'TFLOP/s/GPU':>11} {'MFU':>6}"
    ]
    for i, e in enumerate(plan.ranked[:top], 1):
        lo = e.layout
        lines.append(
            f"{i:>3} {lo.tp:>3} {lo.pp:>4} {lo.dp:>5} {lo.virtual_stages:>2} {lo.zero:>4} "
            f"{lo.micro_batch_size:>4} {lo.recompute:>9} {int(lo.sp):>2} {lo.grad_sync:>5} {e.memory.total / GiB:>8.1f} "
            f"{e.time.total:>9.3g} {e.tflops_per_gpu:>11.1f} {e.mfu:>6.1%}"
        )
    return lines


def _best_breakdown(best: Estimate) -> list[str]:
    """What TFLOP/s/GPU means, and the best layout's memory and step time by part."""
    mem, t = best.memory, best.time
    return [
        "TFLOP/s/GPU: model FLOPs (no recomputation) per second per GPU, as the trainer reports; MFU = that / peak.",
        (
            f"#1 memory (pipeline rank {mem.pp_rank}): model states {_gib(mem.model_states.total)} + "
            f"activations {_gib(mem.activations)} + buffers {_gib(mem.buffers)}"
        ),
        (
            f"#1 step: {t.pipeline:.3g} s pipeline (bubble {t.bubble:.3g}, TP comm {t.tp_comm:.3g}, "
            f"PP comm {t.pp_comm:.3g}) + {t.dp_comm:.3g} s exposed DP comm + {t.optimizer:.3g} s optimizer"
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model:
        preset = PRESETS[args.model]
        seq_len = args.seq_len or 2048
        model = dataclasses.replace(preset.model(), max_seq_len=seq_len)
        batch, gpus, name = preset.global_batch_size, preset.gpus, args.model
    else:
        model, seq_len, batch = from_config(args.config)
        seq_len, gpus, name = args.seq_len or seq_len, None, args.config
        if seq_len > model.max_seq_len:
            sys.exit(f"error: --seq-len={seq_len} exceeds the config's max_seq_len={model.max_seq_len}")
    batch = args.global_batch_size or batch
    gpus = args.gpus or gpus
    if gpus is None:
        sys.exit("error: --gpus is needed with --config")
    if batch is None:
        sys.exit("error: --global-batch-size is needed (the config does not give train.global_batch_size)")
    cluster = cluster_of(args, gpus)
    result = costmodel.plan(model, cluster, batch, seq_len)
    print(report(result, name, model, cluster, batch, seq_len, args.top))


if __name__ == "__main__":
    main()
