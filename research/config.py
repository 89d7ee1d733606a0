"""One config tree for a training run: dataclasses, YAML files, command-line overrides,
and validation that names the flag at fault before any process group exists.

A YAML file mirrors the tree (sections `model`, `parallel`, `train`, `data`, `log`,
`checkpoint`); every field is also a flag, `--field-name` (underscores become dashes),
which overrides the file. `--help` shows each flag with the value it would take.
Every value, from the file or a flag, is checked once where it enters (`check_value`):
its type, then its range or choices (`Spec.rule`); an error is one sentence naming the flag
(`--lr=abc must be a number`) or the file's key (`c.yaml: train.lr_schedule='linear' must
be one of cosine, constant`). `validate` then checks the combinations.

Batch arithmetic (as in Megatron): global_batch_size = micro_batch_size × micro_batches
× dp. Any two of the three determine the third; values given on the command line win
over values from the file, and the first two known in the order (command line, file;
global, micro-batch size, micro-batches) are used.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import yaml

from optim.policies import DEFAULT_BUCKET_NUMEL, DEFAULT_UNIT_NUMEL
from parallel.desync import CPU_TIMEOUT_S, CUDA_TIMEOUT_S
from parallel.dims import LayoutError, ParallelDims
from parallel.pipeline.partition import layer_ranges
from parallel.pipeline.schedules import SCHEDULES, ScheduleError
from parallel.pipeline.schedules import validate as validate_schedule
from research import cli
from research.cli import Rule, about, arg, one_of
from research.data import require_hub, resolve_source, tokenizer_file
from research.errors import ConfigError
from research.model import GPTConfig

BATCH_KEYS = ("global_batch_size", "micro_batch_size", "micro_batches")

# Ranges of the fields (every int and float field has one; tests check this); a Literal
# field allows its choices.
AT_LEAST_1 = Rule(lambda v: v >= 1, "at least 1")
AT_LEAST_0 = Rule(lambda v: v >= 0, "at least 0")
POSITIVE = Rule(lambda v: v > 0, "greater than 0")
FRACTION = Rule(lambda v: 0 <= v < 1, "in [0, 1)")
SEED = Rule(lambda v: 0 <= v < 2**32, "in [0, 2**32)")

# The help and range of each field of research.model.GPTConfig, which declares its type and default.
MODEL_FLAGS: dict[str, dict[str, Any]] = {
    "vocab_size": about("vocabulary size (raised to the tokenizer's)", AT_LEAST_1),
    "n_layers": about("transformer blocks", AT_LEAST_1),
    "n_heads": about("attention heads", AT_LEAST_1),
    "d_model": about("hidden size", AT_LEAST_1),
    "d_ff": about("MLP width (None: 4·d_model, or 8/3·d_model rounded to 64 for swiglu)", AT_LEAST_1),
    "max_seq_len": about("longest sequence (size of the learned position table)", AT_LEAST_1),
    "position": about("position encoding"),
    "norm": about("normalization"),
    "activation": about("MLP activation"),
    "tie_embeddings": about("share the input embedding with the output head"),
    "dropout": about("dropout probability", FRACTION),
    "sliding_window": about("attend to at most this many previous tokens (None: all)", AT_LEAST_1),
    "bias": about("biases in linear layers and norms"),
    "qkv_bias": about("bias on the QKV projection"),
    "vocab_multiple": about("pad the vocabulary to a multiple of this (tp must divide the result)", AT_LEAST_1),
    "recompute": about("activation recomputation: none, selective (attention core) or full (whole blocks)"),
    "rope_theta": about("RoPE base", POSITIVE),
    "norm_eps": about("epsilon of the norms", POSITIVE),
    "init_seed": about("weight init seed (default: --seed)", SEED),
    "moe_experts": about("Mixture-of-Experts: routed experts per MoE block (0: dense MLPs)", AT_LEAST_0),
    "moe_top_k": about("experts each token is sent to", AT_LEAST_1),
    "moe_every": about("every N-th block is an MoE block (1: all)", AT_LEAST_1),
    "moe_d_ff": about("width of each expert's MLP (None: --d-ff's width)", AT_LEAST_1),
    "moe_shared_experts": about(
        "always-on shared experts per MoE block, as one MLP this many experts wide", AT_LEAST_0
    ),
    "moe_capacity_factor": about(
        "each expert takes at most factor·tokens·k/E of a rank's slots, the rest are dropped and counted "
        "(None: dropless)",
        POSITIVE,
    ),
    "moe_aux_loss_coeff": about("coefficient of the Switch load-balancing loss E·Σ f·P", AT_LEAST_0),
    "moe_z_loss_coeff": about("coefficient of the router z-loss mean(logsumexp(logits)²)", AT_LEAST_0),
    "moe_renormalize": about("renormalize the top-k router weights to sum to 1"),
    "fp8": about(
        "float8 matmuls in the attention and MLP linear layers (not the head, router or experts): "
        "tensorwise dynamic scaling (needs --precision bf16)"
    ),
    "fp8_filter": about(
        "which linears --fp8 casts: auto leaves those too small to gain in bf16 (per rank in ≤ 2048, "
        "out ≤ 1024, or in ≤ 4096 with out ≤ 2048 features), none casts all of them"
    ),
}


@dataclass
class ParallelConfig:
    """Degrees of parallelism and how the pipeline runs."""

    tp: int = arg(1, "tensor-parallel degree", rule=AT_LEAST_1)
    pp: int = arg(1, "pipeline-parallel degree", rule=AT_LEAST_1)
    dp: int | None = arg(None, "data-parallel degree (None: world size / (tp·pp))", rule=AT_LEAST_1)
    dp_shard: int | None = arg(
        None,
        "hybrid sharding: ZeRO shards over groups of this many dp ranks (keep dp_shard·tp within a node) "
        "and the dp/dp_shard replicas all-reduce the sharded gradients (None: dp, no replicas)",
        rule=AT_LEAST_1,
    )
    ep: int = arg(
        1,
        "expert parallelism: MoE experts split over this many consecutive dp ranks (it divides dp, and dp_shard), "
        "tokens exchanged by all-to-all; ZeRO shards each expert over the dp/ep ranks holding it",
        rule=AT_LEAST_1,
    )
    cp: int = arg(
        1,
        "context parallelism: each sequence split over this many ranks (2·cp load-balanced chunks under the ring); "
        "world = tp × cp × pp × dp, and ZeRO shards over dp × cp",
        rule=AT_LEAST_1,
    )
    cp_mode: str = arg(
        "ring",
        "context-parallel attention: ring (keys/values passed around the cp ranks), all-to-all (Ulysses: heads "
        "split over cp), hybrid (all-to-all inside groups of --cp-a2a ranks, ring across them)",
        rule=one_of("ring", "all-to-all", "hybrid"),
    )
    cp_a2a: int | None = arg(None, "--cp-mode hybrid: ranks of each all-to-all group (it divides cp)", rule=AT_LEAST_1)
    zero: int = arg(
        1, "ZeRO stage 0-3 over the dp group (over each dp_shard group with --dp-shard)", rule=one_of(0, 1, 2, 3)
    )
    schedule: str = arg("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1", rule=one_of(*SCHEDULES))
    virtual_stages: int = arg(1, "model chunks per pipeline rank (interleaved-1f1b)", rule=AT_LEAST_1)
    sequence_parallel: bool = arg(False, "shard norms/dropout along the sequence across the tp group")
    grad_sync: Literal["last", "every"] = arg(
        "last",
        "reduce dp gradients after the rank's last backward of the step (last: one reduction; "
        "ZeRO-2/3 hold full gradients while accumulating) or after every micro-batch's backward "
        "(every: m reductions; ZeRO-2/3 hold only shards and a chunk's buckets in flight)",
    )
    bucket_numel: int = arg(
        DEFAULT_BUCKET_NUMEL,
        "elements per gradient bucket (ZeRO stages 0-2; stage 3 buckets by unit)",
        rule=AT_LEAST_1,
    )
    unit_numel: int = arg(
        DEFAULT_UNIT_NUMEL,
        "ZeRO-3 gathers a module's parameters as one unit once its subtree holds this many "
        "elements (below a block's size: one unit per transformer block)",
        rule=AT_LEAST_1,
    )
    qwz_block: int | None = arg(
        None,
        "ZeRO++ qwZ: all-gather parameters as int8 with an fp32 scale per block of this many elements "
        "(e.g. 2048; None: exact)",
        rule=AT_LEAST_1,
    )
    qwz_float8: bool = arg(
        False, "with --qwz-block, the blocks travel as float8 e4m3 instead of int8 (the gather of --fp8 runs)"
    )
    hpz: bool = arg(
        False,
        "ZeRO++ hpZ (--zero 3): after a unit's first all-gather in a step each rank keeps its node's 1/k slice "
        "of it, so the step's later all-gathers stay inside the node (k = shard ranks per node)",
    )
    qgz_bits: int | None = arg(
        None,
        "ZeRO++ qgZ (--zero 2, 3): reduce-scatter gradients as 4- or 8-bit blocks through all-to-alls, "
        "inside the node then across nodes, summed in fp32 (None: exact)",
        rule=one_of(4, 8),
    )
    overlap_param_gather: bool = arg(
        False,
        "ZeRO-1/2: leave the all-gather of updated parameters in flight after the step and "
        "wait for each bucket's just before the first forward that uses it (Megatron's overlap-param-gather)",
    )
    find_unused_parameters: bool = arg(
        False,
        "agree over the ranks, each step, which parameters got a gradient (two small "
        "all-reduces), so a parameter unused in a step is not stepped, as in torch; off: every parameter must get a "
        "gradient in every step (DDP's default promise), and one that does not stops the run with its name",
    )
    comm_timeout: float | None = arg(
        None,
        "seconds a collective may wait for the other ranks before the run stops with a report of "
        f"which rank did not arrive (None: {CPU_TIMEOUT_S:g} on CPU/gloo, {CUDA_TIMEOUT_S:g} on CUDA/NCCL)",
        rule=POSITIVE,
    )

    @property
    def a2a_ranks(self) -> int:
        """Ranks of each all-to-all group inside a cp group: 1 for the ring, cp for
        all-to-all, --cp-a2a for hybrid."""
        return {"ring": 1, "all-to-all": self.cp, "hybrid": self.cp_a2a or 1}[self.cp_mode]

    def dims(self, world_size: int | None = None) -> ParallelDims:
        """The layout these degrees make (validated; no process group yet)."""
        return ParallelDims(
            self.tp,
            self.pp,
            self.dp,
            world_size,
            self.dp_shard,
            ep=self.ep,
            cp=self.cp,
            cp_a2a=self.a2a_ranks,
        )


@dataclass
class TrainConfig:
    """Optimization: steps, batch sizes, AdamW with linear warm-up then cosine (or
    constant) decay to min_lr at step lr_decay_steps (None: steps), global-norm clipping
    (0 disables), precision."""

    steps: int = arg(50, "total optimizer steps of the run (also when resuming)", rule=AT_LEAST_1)
    seed: int = arg(0, "seed of data order, init and dropout", rule=SEED)
    precision: Literal["fp32", "bf16", "fp16"] = arg("fp32", "compute dtype (masters and optimizer state stay fp32)")
    reduce_dtype: Literal["fp32", "bf16"] = arg("fp32", "dtype of the gradient reduction")
    compile: bool | None = arg(
        None,
        "compile each transformer block on its own (regional torch.compile: one graph for all alike blocks; the "
        "optimizer's hooks and collectives between graphs); None: on with CUDA, off on the CPU",
    )
    global_batch_size: int | None = arg(
        None, "sequences per step = micro-batch size × micro-batches × dp", rule=AT_LEAST_1
    )
    micro_batch_size: int | None = arg(None, "sequences per micro-batch per dp rank", rule=AT_LEAST_1)
    micro_batches: int | None = arg(None, "micro-batches per step", rule=AT_LEAST_1)
    lr: float = arg(1e-3, "peak learning rate", rule=POSITIVE)
    min_lr: float = arg(1e-4, "learning rate at the end of the decay", rule=AT_LEAST_0)
    warmup_steps: int = arg(0, "linear warm-up steps", rule=AT_LEAST_0)
    lr_decay_steps: int | None = arg(None, "step at which the decay reaches min_lr (None: --steps)", rule=AT_LEAST_1)
    lr_schedule: Literal["cosine", "constant"] = arg("cosine", "after warm-up")
    weight_decay: float = arg(0.1, "AdamW weight decay of matrices", rule=AT_LEAST_0)
    beta1: float = arg(0.9, "AdamW beta1", rule=FRACTION)
    beta2: float = arg(0.95, "AdamW beta2", rule=FRACTION)
    eps: float = arg(1e-8, "AdamW epsilon", rule=POSITIVE)
    clip_grad: float = arg(1.0, "clip the global gradient norm to this (0: off)", rule=AT_LEAST_0)
    max_nonfinite_steps: int = arg(
        3,
        "stop the run after this many consecutive steps with a NaN/Inf loss (fp16 overflow skips do not count)",
        rule=AT_LEAST_1,
    )


@dataclass
class DataConfig:
    """Text source (None: the embedded corpus), tokenizer (None: bytes) and packing."""

    data: str | None = arg(
        None, "text files, folder, glob, save_to_disk folder or hub name (None: the embedded corpus)"
    )
    text_field: str = arg("text", "column holding the text in jsonl/parquet/datasets")
    tokenizer: str | None = arg(None, "'byte' or a tokenizer.json")
    seq_len: int = arg(128, "tokens per training sequence", rule=AT_LEAST_1)
    num_proc: int = arg(1, "processes for tokenization", rule=AT_LEAST_1)
    data_cache: str | None = arg(None, "token cache folder (None: $ZERO3D_DATA_CACHE or ~/.cache/zero3d/tokens)")


def wandb_mode_from_env() -> str:
    """WANDB_MODE when it names one of our modes, else offline."""
    mode = os.environ.get("WANDB_MODE", "offline")
    return mode if mode in ("offline", "online", "disabled") else "offline"


@dataclass
class LogConfig:
    """Where the run writes and how it reports."""

    out: str = arg("runs/default", "run folder: config.yaml, metrics.jsonl, summary.json, wandb/")
    overwrite: bool = arg(
        False, "start afresh in an --out that holds a run, replacing its files (without it such an --out is refused)"
    )
    log_every: int = arg(1, "console line every N steps", rule=AT_LEAST_1)
    wandb: Literal["offline", "online", "disabled"] = arg(
        help="wandb mode (default: $WANDB_MODE or offline)", factory=wandb_mode_from_env
    )
    wandb_project: str = arg("zero3d", "wandb project")
    wandb_group: str | None = arg(None, "wandb group (None: the run folder's name)")
    wandb_name: str | None = arg(None, "wandb run name")


@dataclass
class CheckpointConfig:
    """Saving every `save_every` steps (and at the end) under `save`; `load` resumes (and
    fails when there is nothing to load); `resume` is the one flag of a job that may be
    restarted: it loads the root's latest checkpoint when there is one, starts fresh when
    there is none, and saves there; `export` writes the final weights as one full-precision
    file (.safetensors or .pt)."""

    save: str | None = arg(None, "checkpoint root: ROOT/step_N/ and ROOT/latest")
    save_every: int = arg(0, "save every N steps (0: only at the end)", rule=AT_LEAST_0)
    load: str | None = arg(None, "resume from a checkpoint folder or root (its latest); an error when it holds none")
    resume: str | None = arg(
        None,
        "a restartable job's one flag: load ROOT's latest checkpoint if it has one, else start fresh; save to ROOT",
    )
    reschedule: bool = arg(
        False,
        "on --resume / --load, apply a changed LR schedule (--steps, --lr, --min-lr, --warmup-steps, "
        "--lr-decay-steps, --lr-schedule) from the checkpoint's step, saying so; without it a change is refused",
    )
    export: str | None = arg(None, "write the final weights as one .safetensors/.pt file (needs --save)")

    @property
    def root(self) -> str | None:
        """Where checkpoints are saved: `save`, or `resume`'s root."""
        return self.save or self.resume


@dataclass
class RunConfig:
    """The whole run. `model.vocab_size` follows the tokenizer; `model.init_seed` follows
    `train.seed` unless set."""

    model: GPTConfig = field(default_factory=GPTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


_CLASSES = {
    "model": GPTConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "log": LogConfig,
    "checkpoint": CheckpointConfig,
}


@dataclass(frozen=True)
class Spec:
    """A config field: its section, dataclass field, base type (bool, int, float or str),
    whether None is allowed, its help, its rule (a Literal's: its choices) and its choices
    when its type is a Literal."""

    section: str
    field: dataclasses.Field
    kind: type
    optional: bool
    help: str
    rule: Rule | None
    choices: tuple[str, ...] = ()


@functools.cache
def field_specs() -> dict[str, Spec]:
    """field name -> Spec; names are unique across sections."""
    out: dict[str, Spec] = {}
    for section, cls in _CLASSES.items():
        types_of = cli.field_types(cls)
        for f in dataclasses.fields(cls):
            assert f.name not in out, f"config field {f.name} appears in two sections"
            t, flag = types_of[f.name], MODEL_FLAGS[f.name] if cls is GPTConfig else f.metadata
            rule = one_of(*t.choices) if t.choices else flag["rule"]
            out[f.name] = Spec(section, f, t.kind, t.optional, flag["help"], rule, t.choices)
    return out


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def check_value(name: str, value: Any, where: str) -> Any:
    """Field `name`'s `value` converted to its type, or a ConfigError "`where` must be ...".
    Checked: the type (text, i.e. a flag's value or a quoted YAML scalar, is parsed; an
    integer may stand for a float; "none"/"null" is None where None is allowed), strings
    not empty, floats finite, then the field's rule (range or choices)."""
    spec = field_specs()[name]
    if spec.optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    try:
        value = _as(spec.kind, value)
    except ValueError:
        _reject(spec, where, spec.rule.text if spec.choices else _KINDS[spec.kind])
    if value == "":
        raise ConfigError(f"{where} must not be empty")
    if isinstance(value, float) and not math.isfinite(value):
        _reject(spec, where, "a finite number")
    if spec.rule and not spec.rule.allows(value):
        _reject(spec, where, spec.rule.text)
    return value


def _as(kind: type, value: Any) -> Any:
    """`value` as `kind` (ValueError if it is not one): text is parsed, an int may be a float,
    true/false is no number."""
    if isinstance(value, bool) and kind is not bool:
        raise ValueError(value)
    if isinstance(value, kind):
        return value
    if isinstance(value, str) and kind in (int, float):
        return kind(value)
    if isinstance(value, int) and kind is float:
        return float(value)
    raise ValueError(value)


def _reject(spec: Spec, where: str, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{where} must be {allowed}" + (" or none" if spec.optional else ""))


def load_yaml(path: str) -> dict[str, dict[str, Any]]:
    """The sections of a YAML config file, every value checked and converted by
    `check_value`. A file that is not YAML, not a mapping of sections to mappings, or has
    an unknown section or key is one ConfigError naming the file."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config={path} does not exist")
    try:
        with open(path, "rb") as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(
            f"{path} is not valid YAML: {problem}" + (f" (line {mark.line + 1})" if mark else "")
        ) from None
    if not isinstance(raw, dict | None):
        raise ConfigError(f"{path} must be a mapping of sections ({', '.join(_CLASSES)}), not a {type(raw).__name__}")
    known = field_specs()
    out: dict[str, dict[str, Any]] = {}
    for section, values in (raw or {}).items():
        if section not in _CLASSES:
            raise ConfigError(f"{path}: unknown section {section!r}; sections are {', '.join(_CLASSES)}")
        if not isinstance(values, dict | None):
            raise ConfigError(
                f"{path}: section {section} must be a mapping of keys to values, not a {type(values).__name__}"
            )
        for key in values or {}:
            if key not in known or known[key].section != section:
                raise ConfigError(f"{path}: {section}.{key} is not a config key (see --help)")
        out[section] = {
            key: check_value(key, value, f"{path}: {section}.{key}={value!r}") for key, value in (values or {}).items()
        }
    return out


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    """The flags with which `python -m experiments.train` launches its own workers: torchrun's,
    meaning what they mean there (one node without --rdzv-endpoint runs --standalone)."""
    g = p.add_argument_group(
        "launch", "python -m experiments.train starts its workers itself, once the flags are valid"
    )
    g.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, metavar="N",
                   help="worker processes on this node (one per GPU); without it this process is the one worker "
                   "(or one of torchrun's)")  # fmt: skip
    g.add_argument("--nnodes", default="1", help="nodes, N or MIN:MAX (elastic)")
    g.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0, help="this node's rank")
    g.add_argument(
        "--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default="", help="HOST:PORT of the rendezvous"
    )
    g.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default="c10d", help="rendezvous backend")
    g.add_argument(
        "--rdzv-id", "--rdzv_id", dest="rdzv_id", default="zero3d", help="the job's id, the same on every node"
    )
    g.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                   help="times torch's elastic agent restarts the workers after a failure")  # fmt: skip


def build_parser(
    file_values: dict[str, dict[str, Any]] | None = None, defaults: bool = True
) -> argparse.ArgumentParser:
    """The command line: `--config` plus one flag per field, defaults from the (checked) file
    (`defaults=False`: a parsed namespace holds only the flags given). Flags keep their text;
    `parse_args` checks it with `check_value`, as `load_yaml` checks the file's values."""
    file_values = file_values or {}
    p = argparse.ArgumentParser(
        prog="python -m experiments.train",
        description=__doc__,
        formatter_class=cli.HelpFormatter,
        argument_default=None if defaults else argparse.SUPPRESS,
    )
    p.add_argument("--config", help="YAML file with sections model/parallel/train/data/log/checkpoint")
    add_launch_flags(p)
    groups = {s: p.add_argument_group(s, (_CLASSES[s].__doc__ or "").split("\n")[0]) for s in _CLASSES}
    for name, spec in field_specs().items():
        default = (
            file_values.get(spec.section, {}).get(name, cli.default_of(spec.field)) if defaults else argparse.SUPPRESS
        )
        if spec.kind is bool:
            groups[spec.section].add_argument(
                cli.flag_name(name), default=default, action=argparse.BooleanOptionalAction, help=spec.help
            )
        else:
            metavar = "{" + ",".join(spec.choices) + "}" if spec.choices else name.upper()
            groups[spec.section].add_argument(cli.flag_name(name), default=default, metavar=metavar, help=spec.help)
    return p


def parse_args(argv: list[str] | None, world_size: int) -> RunConfig:
    """The validated config of `argv` on `world_size` processes (ConfigError if invalid).
    Each value is checked once where it enters (`load_yaml` for the file, `check_value` for a
    flag); then the batch sizes are resolved, the combinations validated (`validate`) and the
    paths looked up (`check_paths`); the vocabulary waits for the tokenizer (`check_vocab`)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    file_values = load_yaml(known.config) if known.config else {}
    build_parser(file_values).parse_args(argv)  # --help, an unknown flag or a flag without its value ends here
    flags = vars(build_parser(defaults=False).parse_args(argv))  # the flags given, as typed
    flags.pop("config", None)
    sections: dict[str, dict[str, Any]] = {s: dict(file_values.get(s, {})) for s in _CLASSES}
    for name, spec in field_specs().items():
        if name in flags:
            sections[spec.section][name] = check_value(name, flags[name], f"{cli.flag_name(name)}={flags[name]}")
        sections[spec.section].setdefault(name, cli.default_of(spec.field))
    given_cli = set(flags)
    given_file = {k for values in file_values.values() for k in values if values[k] is not None}
    if "init_seed" not in given_cli | given_file:
        sections["model"]["init_seed"] = sections["train"]["seed"]
    try:
        model = GPTConfig(**sections.pop("model"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cfg = RunConfig(model=model, **{s: _CLASSES[s](**v) for s, v in sections.items()})
    resolve_batch(cfg, world_size, given_cli, given_file)
    validate(cfg)
    check_paths(cfg)
    return cfg


def resolve_batch(cfg: RunConfig, world_size: int, given_cli: set[str], given_file: set[str]) -> None:
    """Fill dp (`parallel.dims.ParallelDims` checks tp · pp · dp against the world size) and
    the one batch size not given (see the module docstring)."""
    par, tr = cfg.parallel, cfg.train
    try:
        par.dp = par.dims(world_size).dp
    except LayoutError as e:
        raise ConfigError(e.worded(lambda size: cli.flag_name(size) if size in field_specs() else size)) from None
    order = [k for k in BATCH_KEYS if k in given_cli] + [k for k in BATCH_KEYS if k in given_file - given_cli]
    known = [k for k in order if getattr(tr, k) is not None][:2]
    if len(known) < 2 and "micro_batch_size" not in known:
        known.append("micro_batch_size")
        tr.micro_batch_size = tr.micro_batch_size or 1
    if len(known) < 2:
        known.append("micro_batches")
        tr.micro_batches = tr.micro_batches or 1
    (missing,) = set(BATCH_KEYS) - set(known)
    stated = getattr(tr, missing) if missing in given_cli else None
    if missing == "global_batch_size":
        tr.global_batch_size = tr.micro_batch_size * tr.micro_batches * par.dp
    else:
        other = "micro_batches" if missing == "micro_batch_size" else "micro_batch_size"
        per = getattr(tr, other) * par.dp
        if tr.global_batch_size % per:
            raise ConfigError(
                f"--global-batch-size={tr.global_batch_size} is not divisible by "
                f"{cli.flag_name(other)}={getattr(tr, other)} × dp={par.dp}"
            )
        setattr(tr, missing, tr.global_batch_size // per)
    if stated is not None and stated != getattr(tr, missing):
        raise ConfigError(
            f"--global-batch-size={tr.global_batch_size if missing != 'global_batch_size' else stated} "
            f"must equal --micro-batch-size × --micro-batches × dp = {tr.micro_batch_size} × "
            f"{tr.micro_batches} × {par.dp}"
        )


def validate_zero_options(par: ParallelConfig) -> None:
    """ZeRO++'s switches against the ZeRO stage they need."""
    if par.hpz and par.zero != 3:
        raise ConfigError(
            f"--hpz keeps a secondary partition of ZeRO-3's parameters: use it with --zero 3, not {par.zero}"
        )
    if par.qgz_bits is not None and par.zero < 2:
        raise ConfigError(
            f"--qgz-bits={par.qgz_bits} quantizes the gradient reduce-scatter of --zero 2 or 3, not {par.zero}"
        )
    if par.qwz_float8 and par.qwz_block is None:
        raise ConfigError("--qwz-float8 sends qwZ's blocks as float8: set --qwz-block too (e.g. 2048)")
    if par.qwz_block is not None and par.zero == 0:
        raise ConfigError(
            f"--qwz-block={par.qwz_block} quantizes ZeRO's parameter all-gather: use it with --zero 1, 2 or 3"
        )


def validate_moe(m: GPTConfig, par: ParallelConfig) -> None:
    """The MoE keys against each other, the model and the layout (ep dividing dp is
    `parallel.dims.ParallelDims`' check)."""
    if not m.moe_experts:
        if par.ep > 1:
            raise ConfigError(f"--ep={par.ep} splits the experts of MoE blocks: set --moe-experts (0 means dense)")
        return
    if m.moe_experts % par.ep:
        raise ConfigError(f"--moe-experts={m.moe_experts} is not divisible by --ep={par.ep}")
    if not any(map(m.is_moe, range(m.n_layers))):
        raise ConfigError(f"--moe-every={m.moe_every} leaves no MoE block among --n-layers={m.n_layers}")
    if m.moe.d_ff % par.tp:
        raise ConfigError(f"the experts' width {m.moe.d_ff} (--moe-d-ff) is not divisible by --tp={par.tp}")
    if par.ep > 1 and (par.hpz or par.qgz_bits is not None):
        raise ConfigError(
            "--hpz and --qgz-bits split the dp group by node, which the experts' own groups under --ep are not: "
            "drop them with --ep > 1 (--qwz-block composes)"
        )


def validate_context(m: GPTConfig, par: ParallelConfig, seq_len: int) -> None:
    """--cp and its mode against the sequence, the heads and the attention (cp dividing the
    world is `parallel.dims.ParallelDims`' check)."""
    mode, cp, a2a = par.cp_mode, par.cp, par.cp_a2a
    if mode == "hybrid" and not (a2a and 1 < a2a < cp and cp % a2a == 0):
        raise ConfigError(
            f"--cp-mode hybrid needs --cp-a2a between 2 and --cp={cp} that divides it (got {a2a}): "
            "all-to-all inside groups of that many ranks, the ring across them"
        )
    if a2a is not None and mode != "hybrid":
        raise ConfigError(f"--cp-a2a={a2a} sizes the all-to-all groups of --cp-mode hybrid, not {mode}")
    if cp == 1:
        return
    ring = mode != "all-to-all"
    pieces = 2 * cp if ring else cp
    if seq_len % pieces:
        raise ConfigError(
            f"--seq-len={seq_len} is not divisible by {'2 × ' if ring else ''}--cp={cp} = {pieces}: "
            + ("the ring splits each sequence into 2·cp equal chunks" if ring else "each cp rank holds an equal share")
        )
    heads = m.n_heads // par.tp
    split = par.a2a_ranks
    if split > 1 and heads % split:
        by = "--cp" if mode == "all-to-all" else "--cp-a2a"
        raise ConfigError(
            f"--cp-mode {mode} splits each rank's {heads} attention heads (--n-heads={m.n_heads} / --tp={par.tp}) "
            f"over {by}={split} ranks, which does not divide them"
        )
    if ring and m.dropout:
        raise ConfigError(
            f"--cp-mode {mode} cannot drop attention weights (--dropout={m.dropout}): use --cp-mode all-to-all, "
            "or --dropout 0"
        )
    if par.sequence_parallel and (seq_len // cp) % par.tp:
        raise ConfigError(
            f"--sequence-parallel splits each cp rank's {seq_len // cp} tokens (--seq-len={seq_len} / --cp={cp}) "
            f"over --tp={par.tp}, which does not divide them"
        )


def validate_fp8(m: GPTConfig, par: ParallelConfig, precision: str, tokens: int = 16) -> None:
    """--fp8 needs bf16 compute, a CUDA (not ROCm) build, and matmul sizes `torch._scaled_mm`
    takes: the local widths and the `tokens` of a micro-batch (seq_len × micro-batch size)
    multiples of 16."""
    if m.fp8 == "none":
        return
    if precision != "bf16":
        raise ConfigError(f"--fp8={m.fp8} casts bf16 activations and weights to float8: use it with --precision bf16")
    if torch.version.hip:
        raise ConfigError(
            "--fp8 uses the OCP float8 types, while ROCm's torch._scaled_mm on MI300 takes the fnuz ones: "
            "train in bf16 on ROCm"
        )
    if tokens % 16:
        raise ConfigError(
            f"--fp8 needs --seq-len × --micro-batch-size divisible by 16 (torch._scaled_mm), got {tokens}"
        )
    cast = m.float8_linears(par.tp)
    if not cast:
        raise ConfigError(
            f"--fp8={m.fp8} would cast no linear layer: at --d-model={m.d_model}, --d-ff={m.ffn_dim} and "
            f"--tp={par.tp} every one is too small for float8 to gain (--fp8-filter auto): "
            "pass --fp8-filter none to cast them anyway, or drop --fp8"
        )
    shapes = m.linear_shapes(par.tp)
    odd = {name: shapes[name] for name in sorted(cast) if any(n % 16 for n in shapes[name])}
    if odd:
        raise ConfigError(
            "--fp8 needs the float8 linear layers' local sizes divisible by 16 (torch._scaled_mm), but "
            + ", ".join(f"{name} is {i} -> {o}" for name, (i, o) in odd.items())
        )


def validate(cfg: RunConfig) -> None:
    """Reject every invalid combination with one sentence naming the flags, reading nothing.
    Each field's own type and range were checked where it entered (`check_value`); here: the
    pipeline schedule against pp, micro-batches and virtual stages; the model's split over tp
    and pp (its vocabulary over tp once the tokenizer is loaded: `check_vocab`); sequence
    length and parallelism; the LR schedule; the checkpoint flags; the ZeRO++ switches
    against the stage."""
    m, par, tr, data = cfg.model, cfg.parallel, cfg.train, cfg.data
    try:
        validate_schedule(par.schedule, par.pp, tr.micro_batches, par.virtual_stages)
    except ScheduleError as e:
        field = "micro_batches" if e.field == "microbatches" else e.field
        value = getattr(tr, field) if field == "micro_batches" else getattr(par, field)
        raise ConfigError(f"{cli.flag_name(field)}={value}: {e}") from None
    if par.virtual_stages > 1 and par.pp == 1:
        raise ConfigError(f"--virtual-stages={par.virtual_stages} needs --pp > 1")
    validate_zero_options(par)
    validate_moe(m, par)
    validate_context(m, par, data.seq_len)
    validate_fp8(m, par, tr.precision, data.seq_len // par.cp * (tr.micro_batch_size or 1))
    try:  # heads and widths; the vocabulary padded here to a multiple of tp, as `check_vocab` checks the real one
        dataclasses.replace(m, vocab_multiple=m.vocab_multiple * par.tp).validate_tp(par.tp)
    except ValueError as e:
        raise ConfigError(f"--tp={par.tp} does not split the model: {e}") from None
    try:
        layer_ranges(m.n_layers, par.pp * par.virtual_stages)
    except ValueError as e:
        chunks = f" × --virtual-stages={par.virtual_stages}" if par.virtual_stages > 1 else ""
        raise ConfigError(f"--pp={par.pp}{chunks} does not split the model: {e}") from None
    if data.seq_len > m.max_seq_len:
        raise ConfigError(f"--seq-len={data.seq_len} must be between 1 and --max-seq-len={m.max_seq_len}")
    if par.sequence_parallel and data.seq_len % par.tp:
        raise ConfigError(f"--sequence-parallel needs --seq-len={data.seq_len} divisible by --tp={par.tp}")
    if tr.min_lr > tr.lr:
        raise ConfigError(f"--min-lr={tr.min_lr} must not exceed --lr={tr.lr}")
    if tr.lr_decay_steps is not None and tr.lr_decay_steps <= tr.warmup_steps:
        raise ConfigError(f"--lr-decay-steps={tr.lr_decay_steps} must exceed --warmup-steps={tr.warmup_steps}")
    _validate_checkpoint(cfg.checkpoint)


def _validate_checkpoint(ck: CheckpointConfig) -> None:
    """--save-every and --export need --save (or --resume); an export is .safetensors or .pt;
    --resume goes alone."""
    if ck.resume and ck.load:
        raise ConfigError(
            f"--resume={ck.resume} loads its own latest checkpoint; drop --load={ck.load} (or drop --resume for a strict load)"
        )
    if ck.resume and ck.save and ck.save != ck.resume:
        raise ConfigError(f"--resume={ck.resume} saves there too; drop --save={ck.save}")
    if ck.save_every and not ck.root:
        raise ConfigError(f"--save-every={ck.save_every} needs --save DIR (or --resume ROOT)")
    if ck.export and not ck.root:
        raise ConfigError(f"--export={ck.export} needs --save DIR (the export is written from the final checkpoint)")
    if ck.export and not ck.export.endswith((".safetensors", ".pt")):
        raise ConfigError(f"--export={ck.export} must end in .safetensors or .pt")


def check_paths(cfg: RunConfig) -> None:
    """The files and folders the flags name, looked up, none of them read: --data (a Hub
    dataset only while the Hub is not offline) and --tokenizer exist, --load is a folder,
    and --out holds no run that this one would replace unasked."""
    try:
        source = resolve_source(cfg.data.data)
        if isinstance(source, str):
            require_hub(source)
        tokenizer_file(cfg.data.tokenizer)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ck = cfg.checkpoint
    if ck.load and not os.path.isdir(ck.load):
        raise ConfigError(f"--load={ck.load} is not a directory")
    _check_out(cfg.log, ck)


def _check_out(log: LogConfig, ck: CheckpointConfig) -> None:
    """A fresh run never silently replaces another: an --out that holds one (its metrics or
    summary) is refused unless the run continues it (--resume, --load, or torchrun restarting
    this job's workers) or --overwrite replaces it."""
    held = [name for name in RUN_FILES if os.path.isfile(os.path.join(log.out, name))]
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if held and not (log.overwrite or ck.resume or ck.load or restarted):
        raise ConfigError(
            f"--out={log.out} holds a run ({held[0]}); continue it with --resume ROOT (the --save-every "
            "checkpoints it saved), replace it with --overwrite, or choose another --out"
        )


def check_vocab(model: GPTConfig, tp: int) -> None:
    """The run's vocabulary (`model`'s, raised to the tokenizer's) padded to --vocab-multiple
    against --tp; checked where the tokenizer is loaded (`research.trainer.load_data`)."""
    if model.padded_vocab % tp:
        raise ConfigError(
            f"--vocab-multiple={model.vocab_multiple} pads the vocabulary of {model.vocab_size} tokens to "
            f"{model.padded_vocab}, which --tp={tp} does not divide; make --vocab-multiple a "
            f"multiple of {tp}"
        )


RUN_FILES = ("summary.json", "metrics.jsonl")  # what makes a folder a run's


def save_yaml(cfg: RunConfig, path: str) -> None:
    """The resolved config, loadable again with --config."""
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
