"""The config base of the benchmarks and their command line: a benchmark's config is a dataclass
extending `Bench` and the groups of fields it shares with others (`Rounds`, `GPTSizes`, `GPTRun`,
`MoESizes`, `TinyGPTRun`); its fields are its flags (research.cli), then `--quick` (the smoke
run: the class's QUICK values) and `--json PATH` (`parse_config`)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from experiments.bench.common import TinyGPT, make_model
from research.cli import arg, config_from, config_parser, flag_name

C = TypeVar("C", bound="Bench")


@dataclass
class Bench:
    """A benchmark's config; QUICK: the values its `--quick` smoke run sets."""

    QUICK: ClassVar[dict[str, Any]] = {}

    def quick(self: C) -> C:
        """This config with the smoke run's values."""
        return dataclasses.replace(self, **self.QUICK)

    def problem(self) -> str | None:
        """Why this config cannot run, or None."""
        return None


@dataclass
class Rounds(Bench):
    """Methods that take turns step by step (common.take_turns): `rounds` rounds of fresh
    methods, each `warmup` untimed and `steps` timed steps."""

    steps: int = arg(10, "timed steps per method per round")
    warmup: int = arg(2, "untimed steps before them")
    rounds: int = arg(2, "rounds of fresh models; within a round the methods take turns step by step")

    QUICK: ClassVar[dict[str, Any]] = {"steps": 3, "warmup": 1, "rounds": 1}

    def problem(self) -> str | None:
        if self.steps < 1 or self.rounds < 1 or self.warmup < 0:
            return "--steps and --rounds must be >= 1 and --warmup >= 0"
        return None

    def schedule(self) -> str:
        return f"{self.rounds} rounds x {self.warmup} warm-up + {self.steps} timed steps, interleaved"


@dataclass
class GPTSizes(Bench):
    """The sizes of a small GPT (TinyGPT, or research.model's) and its micro-batches."""

    layers: int = arg(4, "transformer blocks")
    heads: int = arg(4, "attention heads")
    seq: int = arg(64, "tokens per sequence")
    vocab: int = arg(1024, "vocabulary size")
    micro_batch: int = arg(2, "sequences per micro-batch (of a data-parallel rank)")


@dataclass
class GPTRun(GPTSizes):
    """research.model's GPT of these sizes."""

    d_model: int = arg(128, "hidden size")

    def gpt_config(self, **fields: Any) -> Any:
        """Its GPTConfig, with further `fields`."""
        from research.model import GPTConfig

        sizes = {"n_layers": self.layers, "n_heads": self.heads, "d_model": self.d_model, "max_seq_len": self.seq}
        return GPTConfig(vocab_size=self.vocab, **sizes, **fields)


@dataclass
class MoESizes(Bench):
    """The experts of a Mixture-of-Experts layer and how many each token is routed to."""

    experts: int = arg(8, "experts E")
    top_k: int = arg(2, "experts per token (top-k routing)")


@dataclass
class TinyGPTRun(GPTSizes, Rounds):
    """TinyGPT (common.py) in fp32, trained with AdamW on `micro_batch` sequences per rank
    (the global batch grows with the world size)."""

    dim: int = arg(256, "TinyGPT hidden size")
    lr: float = arg(1e-3, "AdamW learning rate")
    weight_decay: float = arg(0.1, "AdamW weight decay (every parameter)")

    QUICK: ClassVar[dict[str, Any]] = Rounds.QUICK | {"dim": 64, "layers": 2, "heads": 2, "seq": 32, "vocab": 256}

    def model(self, seed: int = 0) -> TinyGPT:
        """The same weights on every rank and for every method."""
        return make_model(seed, self.vocab, self.dim, self.layers, self.heads, self.seq)

    def block_numel(self) -> int:
        return 12 * self.dim * self.dim + 4 * self.dim  # qkv + proj + fc1 + fc2 weights, two LayerNorms

    def numel(self) -> int:
        return sum(p.numel() for p in dict.fromkeys(self.model().parameters()))

    def describe(self) -> str:
        """The model in a few words, with its parameter count."""
        return (
            f"TinyGPT dim={self.dim} layers={self.layers} heads={self.heads} seq={self.seq} vocab={self.vocab} "
            f"({self.numel():,} params, fp32)"
        )

    def problem(self) -> str | None:
        if self.dim % self.heads:
            return f"--dim={self.dim} is not divisible by --heads={self.heads}"
        return super().problem()


def parse_config(
    cls: type[C], doc: str | None, argv: list[str] | None, *flags: tuple[str, dict[str, Any]]
) -> tuple[C, argparse.Namespace]:
    """The config `argv` gives (with --quick, its QUICK values) and all the parsed flags;
    `flags`: further (flag, add_argument keywords). A config with a problem is a usage error."""
    p = config_parser(cls, doc)
    quick = " ".join(
        f"{flag_name(k)} {' '.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in cls.QUICK.items()
    )
    p.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    for flag, kwargs in flags:
        p.add_argument(flag, **kwargs)
    args = p.parse_args(argv)
    cfg = config_from(cls, args)
    if args.quick:
        cfg = cfg.quick()
    if problem := cfg.problem():
        p.error(problem)
    return cfg, args
