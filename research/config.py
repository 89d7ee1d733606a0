"""One config tree for a training run: dataclasses, YAML files, command-line overrides,
and validation that names the flag at fault before any process group exists.

A YAML file mirrors the tree (sections `model`, `parallel`, `train`, `data`, `log`,
`checkpoint`); every field is also a flag, `--field-name` (underscores become dashes),
which overrides the file. `--help` shows each flag with the value it would take.
Every value, from the file or a flag, is checked once where it enters (`check_value`):
its type, then its range or choices (`RULES`); an error is one sentence naming the flag
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
from collections.abc import Callable
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
from research.data import load_tokenizer, require_hub, resolve_source
from research.errors import ConfigError
from research.model import GPTConfig

BATCH_KEYS = ("global_batch_size", "micro_batch_size", "micro_batches")


@dataclass
class ParallelConfig:
    """Degrees of parallelism and how the pipeline runs."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    dp_shard: int | None = None
    ep: int = 1
    zero: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    grad_sync: Literal["last", "every"] = "last"
    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    unit_numel: int = DEFAULT_UNIT_NUMEL
    qwz_block: int | None = None
    qwz_float8: bool = False
    hpz: bool = False
    qgz_bits: int | None = None
    overlap_param_gather: bool = False
    find_unused_parameters: bool = False
    comm_timeout: float | None = None


@dataclass
class TrainConfig:
    """Optimization: steps, batch sizes, AdamW with linear warm-up then cosine (or
    constant) decay to min_lr at step lr_decay_steps (None: steps), global-norm clipping
    (0 disables), precision."""

    steps: int = 50
    seed: int = 0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    micro_batches: int | None = None
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 0
    lr_decay_steps: int | None = None
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    max_nonfinite_steps: int = 3


@dataclass
class DataConfig:
    """Text source (None: the embedded corpus), tokenizer (None: bytes) and packing."""

    data: str | None = None
    text_field: str = "text"
    tokenizer: str | None = None
    seq_len: int = 128
    num_proc: int = 1
    data_cache: str | None = None


def wandb_mode_from_env() -> str:
    """WANDB_MODE when it names one of our modes, else offline."""
    mode = os.environ.get("WANDB_MODE", "offline")
    return mode if mode in ("offline", "online", "disabled") else "offline"


@dataclass
class LogConfig:
    """Where the run writes and how it reports."""

    out: str = "runs/default"
    overwrite: bool = False
    log_every: int = 1
    wandb: Literal["offline", "online", "disabled"] = field(default_factory=wandb_mode_from_env)
    wandb_project: str = "zero3d"
    wandb_group: str | None = None
    wandb_name: str | None = None


@dataclass
class CheckpointConfig:
    """Saving every `save_every` steps (and at the end) under `save`; `load` resumes (and
    fails when there is nothing to load); `resume` is the one flag of a job that may be
    restarted: it loads the root's latest checkpoint when there is one, starts fresh when
    there is none, and saves there; `export` writes the final weights as one full-precision
    file (.safetensors or .pt)."""

    save: str | None = None
    save_every: int = 0
    load: str | None = None
    resume: str | None = None
    reschedule: bool = False
    export: str | None = None

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


HELP = {
    "vocab_size": "vocabulary size (raised to the tokenizer's)",
    "n_layers": "transformer blocks",
    "n_heads": "attention heads",
    "d_model": "hidden size",
    "d_ff": "MLP width (None: 4·d_model, or 8/3·d_model rounded to 64 for swiglu)",
    "max_seq_len": "longest sequence (size of the learned position table)",
    "position": "position encoding",
    "norm": "normalization",
    "activation": "MLP activation",
    "tie_embeddings": "share the input embedding with the output head",
    "dropout": "dropout probability",
    "sliding_window": "attend to at most this many previous tokens (None: all)",
    "bias": "biases in linear layers and norms",
    "qkv_bias": "bias on the QKV projection",
    "vocab_multiple": "pad the vocabulary to a multiple of this (tp must divide the result)",
    "recompute": "activation recomputation: none, selective (attention core) or full (whole blocks)",
    "rope_theta": "RoPE base",
    "norm_eps": "epsilon of the norms",
    "init_seed": "weight init seed (default: --seed)",
    "moe_experts": "Mixture-of-Experts: routed experts per MoE block (0: dense MLPs)",
    "moe_top_k": "experts each token is sent to",
    "moe_every": "every N-th block is an MoE block (1: all)",
    "moe_d_ff": "width of each expert's MLP (None: --d-ff's width)",
    "moe_shared_experts": "always-on shared experts per MoE block, as one MLP this many experts wide",
    "moe_capacity_factor": "each expert takes at most factor·tokens·k/E of a rank's slots, the rest are dropped "
    "and counted (None: dropless)",
    "moe_aux_loss_coeff": "coefficient of the Switch load-balancing loss E·Σ f·P",
    "moe_z_loss_coeff": "coefficient of the router z-loss mean(logsumexp(logits)²)",
    "moe_renormalize": "renormalize the top-k router weights to sum to 1",
    "fp8": "float8 matmuls in the attention and MLP linear layers (not the head, router or experts): "
    "tensorwise dynamic scaling (needs --precision bf16)",
    "tp": "tensor-parallel degree",
    "pp": "pipeline-parallel degree",
    "dp": "data-parallel degree (None: world size / (tp·pp))",
    "dp_shard": "hybrid sharding: ZeRO shards over groups of this many dp ranks (keep dp_shard·tp within a node) "
    "and the dp/dp_shard replicas all-reduce the sharded gradients (None: dp, no replicas)",
    "ep": "expert parallelism: MoE experts split over this many consecutive dp ranks (it divides dp, and dp_shard), "
    "tokens exchanged by all-to-all; ZeRO shards each expert over the dp/ep ranks holding it",
    "zero": "ZeRO stage 0-3 over the dp group (over each dp_shard group with --dp-shard)",
    "schedule": "pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1",
    "virtual_stages": "model chunks per pipeline rank (interleaved-1f1b)",
    "sequence_parallel": "shard norms/dropout along the sequence across the tp group",
    "grad_sync": "reduce dp gradients after the rank's last backward of the step (last: one reduction; "
    "ZeRO-2/3 hold full gradients while accumulating) or after every micro-batch's backward "
    "(every: m reductions; ZeRO-2/3 hold only shards and a chunk's buckets in flight)",
    "bucket_numel": "elements per gradient bucket (ZeRO stages 0-2; stage 3 buckets by unit)",
    "unit_numel": "ZeRO-3 gathers a module's parameters as one unit once its subtree holds this many "
    "elements (below a block's size: one unit per transformer block)",
    "qwz_block": "ZeRO++ qwZ: all-gather parameters as int8 with an fp32 scale per block of this many elements "
    "(e.g. 2048; None: exact)",
    "qwz_float8": "with --qwz-block, the blocks travel as float8 e4m3 instead of int8 (the gather of --fp8 runs)",
    "hpz": "ZeRO++ hpZ (--zero 3): after a unit's first all-gather in a step each rank keeps its node's 1/k slice "
    "of it, so the step's later all-gathers stay inside the node (k = shard ranks per node)",
    "qgz_bits": "ZeRO++ qgZ (--zero 2, 3): reduce-scatter gradients as 4- or 8-bit blocks through all-to-alls, "
    "inside the node then across nodes, summed in fp32 (None: exact)",
    "overlap_param_gather": "ZeRO-1/2: leave the all-gather of updated parameters in flight after the step and "
    "wait for each bucket's just before the first forward that uses it (Megatron's overlap-param-gather)",
    "find_unused_parameters": "agree over the ranks, each step, which parameters got a gradient (two small "
    "all-reduces), so a parameter unused in a step is not stepped, as in torch; off: every parameter must get a "
    "gradient in every step (DDP's default promise), and one that does not stops the run with its name",
    "comm_timeout": "seconds a collective may wait for the other ranks before the run stops with a report of "
    f"which rank did not arrive (None: {CPU_TIMEOUT_S:g} on CPU/gloo, {CUDA_TIMEOUT_S:g} on CUDA/NCCL)",
    "steps": "total optimizer steps of the run (also when resuming)",
    "seed": "seed of data order, init and dropout",
    "precision": "compute dtype (masters and optimizer state stay fp32)",
    "reduce_dtype": "dtype of the gradient reduction",
    "global_batch_size": "sequences per step = micro-batch size × micro-batches × dp",
    "micro_batch_size": "sequences per micro-batch per dp rank",
    "micro_batches": "micro-batches per step",
    "lr": "peak learning rate",
    "min_lr": "learning rate at the end of the decay",
    "warmup_steps": "linear warm-up steps",
    "lr_decay_steps": "step at which the decay reaches min_lr (None: --steps)",
    "lr_schedule": "after warm-up",
    "weight_decay": "AdamW weight decay of matrices",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "eps": "AdamW epsilon",
    "clip_grad": "clip the global gradient norm to this (0: off)",
    "max_nonfinite_steps": "stop the run after this many consecutive steps with a NaN/Inf loss "
    "(fp16 overflow skips do not count)",
    "data": "text files, folder, glob, save_to_disk folder or hub name (None: the embedded corpus)",
    "text_field": "column holding the text in jsonl/parquet/datasets",
    "tokenizer": "'byte' or a tokenizer.json",
    "seq_len": "tokens per training sequence",
    "num_proc": "processes for tokenization",
    "data_cache": "token cache folder (None: $ZERO3D_DATA_CACHE or ~/.cache/zero3d/tokens)",
    "out": "run folder: config.yaml, metrics.jsonl, summary.json, wandb/",
    "overwrite": "start afresh in an --out that holds a run, replacing its files (without it such an --out is refused)",
    "log_every": "console line every N steps",
    "wandb": "wandb mode (default: $WANDB_MODE or offline)",
    "wandb_project": "wandb project",
    "wandb_group": "wandb group (None: the run folder's name)",
    "wandb_name": "wandb run name",
    "save": "checkpoint root: ROOT/step_N/ and ROOT/latest",
    "save_every": "save every N steps (0: only at the end)",
    "load": "resume from a checkpoint folder or root (its latest); an error when it holds none",
    "resume": "a restartable job's one flag: load ROOT's latest checkpoint if it has one, else start fresh; save to ROOT",
    "reschedule": "on --resume / --load, apply a changed LR schedule (--steps, --lr, --min-lr, --warmup-steps, "
    "--lr-decay-steps, --lr-schedule) from the checkpoint's step, saying so; without it a change is refused",
    "export": "write the final weights as one .safetensors/.pt file (needs --save)",
}
_CLASSES = {
    "model": GPTConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "log": LogConfig,
    "checkpoint": CheckpointConfig,
}


@dataclass(frozen=True)
class Rule:
    """The values a field allows beyond its type, as a test and as words ("at least 1")."""

    allows: Callable[[Any], bool]
    text: str


def one_of(*choices: Any) -> Rule:
    """The rule allowing exactly `choices`."""
    return Rule(lambda v: v in choices, "one of " + ", ".join(map(str, choices)))


AT_LEAST_1 = Rule(lambda v: v >= 1, "at least 1")
AT_LEAST_0 = Rule(lambda v: v >= 0, "at least 0")
POSITIVE = Rule(lambda v: v > 0, "greater than 0")
FRACTION = Rule(lambda v: 0 <= v < 1, "in [0, 1)")
SEED = Rule(lambda v: 0 <= v < 2**32, "in [0, 2**32)")

# Every int and float field has a rule (tests check this); Literal fields get one_of(their choices).
RULES: dict[str, Rule] = {
    **dict.fromkeys(
        (
            "vocab_size",
            "n_layers",
            "n_heads",
            "d_model",
            "d_ff",
            "max_seq_len",
            "sliding_window",
            "vocab_multiple",
            "moe_top_k",
            "moe_every",
            "moe_d_ff",
            "ep",
            "tp",
            "pp",
            "dp",
            "dp_shard",
            "virtual_stages",
            "bucket_numel",
            "unit_numel",
            "qwz_block",
            "steps",
            "global_batch_size",
            "micro_batch_size",
            "micro_batches",
            "lr_decay_steps",
            "max_nonfinite_steps",
            "seq_len",
            "num_proc",
            "log_every",
        ),
        AT_LEAST_1,
    ),
    **dict.fromkeys(
        (
            "warmup_steps",
            "min_lr",
            "weight_decay",
            "clip_grad",
            "save_every",
            "moe_experts",
            "moe_shared_experts",
            "moe_aux_loss_coeff",
            "moe_z_loss_coeff",
        ),
        AT_LEAST_0,
    ),
    **dict.fromkeys(("rope_theta", "norm_eps", "comm_timeout", "lr", "eps", "moe_capacity_factor"), POSITIVE),
    **dict.fromkeys(("dropout", "beta1", "beta2"), FRACTION),
    **dict.fromkeys(("init_seed", "seed"), SEED),
    "zero": one_of(0, 1, 2, 3),
    "qgz_bits": one_of(4, 8),
    "schedule": one_of(*SCHEDULES),
}


@dataclass(frozen=True)
class Spec:
    """A config field: its section, dataclass field, base type (bool, int, float or str),
    whether None is allowed, its rule, and its choices when its type is a Literal."""

    section: str
    field: dataclasses.Field
    kind: type
    optional: bool
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
            t = types_of[f.name]
            rule = one_of(*t.choices) if t.choices else RULES.get(f.name)
            out[f.name] = Spec(section, f, t.kind, t.optional, rule, t.choices)
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
                cli.flag_name(name), default=default, action=argparse.BooleanOptionalAction, help=HELP[name]
            )
        else:
            metavar = "{" + ",".join(spec.choices) + "}" if spec.choices else name.upper()
            groups[spec.section].add_argument(cli.flag_name(name), default=default, metavar=metavar, help=HELP[name])
    return p


def parse_args(argv: list[str] | None, world_size: int) -> RunConfig:
    """The validated config of `argv` on `world_size` processes (ConfigError if invalid).
    Each value is checked once where it enters (`load_yaml` for the file, `check_value` for a
    flag); then the batch sizes are resolved and the combinations validated."""
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
    validate(cfg, world_size)
    return cfg


def resolve_batch(cfg: RunConfig, world_size: int, given_cli: set[str], given_file: set[str]) -> None:
    """Fill dp (`parallel.dims.ParallelDims` checks tp · pp · dp against the world size) and
    the one batch size not given (see the module docstring)."""
    par, tr = cfg.parallel, cfg.train
    try:
        par.dp = ParallelDims(par.tp, par.pp, par.dp, world_size, par.dp_shard, ep=par.ep).dp
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
    widths = {
        "--d-model": m.d_model,
        "--d-model·3 / --tp": 3 * m.d_model // par.tp,
        "--d-ff / --tp": m.ffn_dim // par.tp,
    }
    odd = {name: w for name, w in widths.items() if w % 16}
    if odd:
        raise ConfigError(
            "--fp8 needs the linear layers' local sizes divisible by 16 (torch._scaled_mm), but "
            + ", ".join(f"{name} = {w}" for name, w in odd.items())
        )


def validate(cfg: RunConfig, world_size: int) -> None:
    """Reject every invalid combination with one sentence naming the flags. Each field's own
    type and range were checked where it entered (`check_value`); here: the pipeline
    schedule against pp, micro-batches and virtual stages; the model's split over tp and
    pp, with the vocabulary the run really has (raised to the tokenizer's, as the trainer
    does) padded to --vocab-multiple; sequence length and parallelism; the LR schedule;
    that --data and --tokenizer exist (a hub dataset only while the hub is reachable); the
    checkpoint flags; the ZeRO++ switches against the stage."""
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
    validate_fp8(m, par, tr.precision, data.seq_len * (tr.micro_batch_size or 1))
    try:
        source = resolve_source(data.data)
        if isinstance(source, str):
            require_hub(source)
        tokenizer = load_tokenizer(data.tokenizer)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    real = m.with_vocab_of(tokenizer.vocab_size)
    if real.padded_vocab % par.tp:
        raise ConfigError(
            f"--vocab-multiple={m.vocab_multiple} pads the vocabulary of {real.vocab_size} tokens to "
            f"{real.padded_vocab}, which --tp={par.tp} does not divide; make --vocab-multiple a "
            f"multiple of {par.tp}"
        )
    try:
        real.validate_tp(par.tp)
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
    _validate_out(cfg.log, cfg.checkpoint)


def _validate_out(log: LogConfig, ck: CheckpointConfig) -> None:
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


def _validate_checkpoint(ck: CheckpointConfig) -> None:
    """--save-every and --export need --save (or --resume); an export is .safetensors or .pt;
    --load exists; --resume goes alone."""
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
    if ck.load and not os.path.isdir(ck.load):
        raise ConfigError(f"--load={ck.load} is not a directory")


RUN_FILES = ("summary.json", "metrics.jsonl")  # what makes a folder a run's


def save_yaml(cfg: RunConfig, path: str) -> None:
    """The resolved config, loadable again with --config."""
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
