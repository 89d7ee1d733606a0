"""ZeroOptimizer's options, grouped as the papers group the knobs: `MixedPrecision` (what
dtype each copy is held in), `Communication` (how gradients and parameters travel: buckets,
stage-3 units, overlap, the unused-parameter agreement, the watchdog) and `ZeroPlusPlus`
(Wang et al. 2023: qwZ, hpZ, qgZ). Each field is documented here once; docs/optimizer.md
renders these docstrings, and the trainer's flags take their defaults from these fields.

`from_flat_kwargs` keeps the flat keyword names of the previous release working for one
release, with a deprecation warning that names the policy to use instead.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from optim.quantize import QuantizedGather
from optim.scaler import DynamicLossScaler

# The one map from the precision names of flags and configs to torch dtypes.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PARAM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
REDUCE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class MixedPrecision:
    """Mixed precision (Micikevicius et al. 2018): the model computes in `param_dtype`, the
    optimizer steps fp32 masters, gradients are accumulated and reduced in `reduce_dtype`.

    Attributes:
        param_dtype: dtype of the model's compute copy: None (fp32), torch.bfloat16 or
            torch.float16; frozen parameters and floating buffers are cast to it too, and
            the fp32 masters stay with the optimizer. fp16 needs a loss-scaled backward
            (`ZeroOptimizer.backward` or `scale_loss`).
        reduce_dtype: dtype in which gradients are accumulated and reduced: torch.float32
            or torch.bfloat16 (half the bytes).
        loss_scaler: dynamic loss scaler for fp16 (None: a default `DynamicLossScaler()`
            when `param_dtype` is fp16, none otherwise).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    loss_scaler: DynamicLossScaler | None = None

    def __post_init__(self) -> None:
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(
                f"param_dtype={self.param_dtype} is not supported; use None (fp32), torch.bfloat16 or torch.float16"
            )
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype={self.reduce_dtype} is not supported; use torch.float32 or torch.bfloat16")

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param_dtype or torch.float32


@dataclass(frozen=True)
class Communication:
    """How gradients and parameters travel between the data-parallel ranks.

    Attributes:
        bucket_numel: target elements per flat bucket at stages 0-2; each bucket's gradients
            are reduced as one collective as soon as its last gradient arrives in backward.
        last_bucket_numel: stages 0-2: the bucket whose gradients arrive last in backward is
            reduced with no backward left to overlap it, so it holds about this many
            elements (more only when its own parameters fill less than half of it and the next
            one is large); buckets are filled from it towards the first to arrive with caps
            that double up to bucket_numel, so what is left to reduce when backward ends stays
            under about twice this (None: bucket_numel // 16; DDP's small first bucket, reversed).
        unit_numel: stage 3: a module claims its not-yet-claimed parameters as one gather
            unit once they reach this many elements (FSDP's wrapping unit).
        resident_numel: stage 3: units smaller than this stay gathered, like stage 2 (None:
            unit_numel // 16).
        overlap_param_gather: stages 1-2 (and resident stage-3 units): `step()` returns
            with the all-gathers of the updated parameters in flight (Megatron's
            overlap-param-gather); each bucket's is finished just before the first forward
            of a module holding its parameters, or before anything else reads them (the
            model's `state_dict()`, the optimizer's state dicts, the next step). Code that
            reads parameters directly in between (an EMA update, weight logging) calls
            `opt.wait_params()` first: until then other ranks' shards hold the old values.
        find_unused_parameters: True: which parameters got a gradient is agreed over the
            ranks (one max all-reduce of a flag per parameter after the last backward and
            one at the step), so parameters unused in a step, on some or all ranks, behave
            as in torch. False: DDP's default promise that every trained parameter gets a
            gradient in every step on every rank; both all-reduces are skipped, and a
            parameter without a gradient raises on the rank that misses it.
        timeout_s: the collective watchdog (`parallel.desync.watch`): a collective that waits
            this long for a rank that never issued it (or issued another in its place) ends
            every rank with one sentence naming each rank and the call it is in. None: no
            watchdog.
    """

    bucket_numel: int = 2**24
    last_bucket_numel: int | None = None
    unit_numel: int = 2**22
    resident_numel: int | None = None
    overlap_param_gather: bool = False
    find_unused_parameters: bool = True
    timeout_s: float | None = 300.0

    def __post_init__(self) -> None:
        for name in ("bucket_numel", "unit_numel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive number of elements, such as {2**22}")

    @property
    def last_bucket(self) -> int:
        """The most elements of the bucket completed last in backward (`last_bucket_numel`)."""
        return self.bucket_numel // 16 if self.last_bucket_numel is None else self.last_bucket_numel

    @property
    def resident(self) -> int:
        """Stage-3 units smaller than this stay gathered."""
        return default_resident_numel(self.unit_numel) if self.resident_numel is None else self.resident_numel


def default_resident_numel(unit_numel: int) -> int:
    """Stage-3 units smaller than this stay gathered when `resident_numel` is not given."""
    return unit_numel // 16


@dataclass(frozen=True)
class ZeroPlusPlus:
    """ZeRO++ (Wang et al. 2023): quantized and node-local communication. hpZ and qgZ use the
    optimizer's `node_groups` (`ParallelDims.dp_shard_node_groups`).

    Attributes:
        qwz_block: stages 1-3: all-gather parameters (stage 3 before use, stages 1-2 after
            the step) as int8 with one fp32 scale per block of this many elements, such as
            2048 (qwZ, `optim.quantize`: about a quarter of the bytes; each rank's own
            shard, the masters, the update and checkpoints stay exact). None: exact.
        qwz_float8: with `qwz_block`, the blocks travel as float8 e4m3 instead of int8 (the
            same bytes; an error relative to each value, at most 2^-4, instead of a fixed
            step): the parameter gather of float8 training (`--fp8`), whose matmuls cast the
            weights to e4m3 anyway.
        hpz: stage 3: after a unit's first all-gather in a step each rank keeps a 1/k slice
            of it until the step (2Ψ/k more bytes in bf16, k = ranks of the node group), and
            the step's later all-gathers (backward, further micro-batches) stay inside the
            node (hpZ, `optim.stage3`); exact.
        qgz_bits: stages 2-3: the gradient reduce-scatter becomes an all-to-all of 8- or
            4-bit blocks (2048 elements, fp32 scales) inside the node, then one across nodes
            among the ranks at the same place, each summing in fp32: (q + 4/2048)·Ψ·(k−1)/k
            bytes in the node and a k-th of that across, q = bits/8 (qgZ,
            `optim.quantize.reduce_scatter_quantized`). None: exact.
    """

    qwz_block: int | None = None
    qwz_float8: bool = False
    hpz: bool = False
    qgz_bits: int | None = None

    @property
    def qwz(self) -> QuantizedGather | None:
        """How parameter all-gathers are quantized (None: exact)."""
        return None if self.qwz_block is None else QuantizedGather(self.qwz_block, self.qwz_float8)


DEFAULT_BUCKET_NUMEL = Communication.bucket_numel
DEFAULT_UNIT_NUMEL = Communication.unit_numel
DEFAULT_COMM_TIMEOUT_S = Communication.timeout_s

# The flat keyword names of the previous release: name -> (policy argument, policy field).
FLAT_NAMES = {
    "param_dtype": ("precision", "param_dtype"),
    "reduce_dtype": ("precision", "reduce_dtype"),
    "loss_scaler": ("precision", "loss_scaler"),
    "bucket_numel": ("communication", "bucket_numel"),
    "unit_numel": ("communication", "unit_numel"),
    "resident_numel": ("communication", "resident_numel"),
    "overlap_param_gather": ("communication", "overlap_param_gather"),
    "find_unused_parameters": ("communication", "find_unused_parameters"),
    "comm_timeout_s": ("communication", "timeout_s"),
    "qwz_block": ("zero_plus_plus", "qwz_block"),
    "hpz": ("zero_plus_plus", "hpz"),
    "qgz_bits": ("zero_plus_plus", "qgz_bits"),
}
POLICY_CLASSES = {"precision": MixedPrecision, "communication": Communication, "zero_plus_plus": ZeroPlusPlus}


def from_flat_kwargs(kwargs: dict[str, Any], policies: dict[str, Any]) -> dict[str, Any]:
    """The policies with the previous release's flat options folded in (removed from
    `kwargs`, which keeps the optimizer's hyperparameters), warning once per construction."""
    flat = {k: kwargs.pop(k) for k in list(kwargs) if k in FLAT_NAMES}
    if not flat:
        return policies
    fields: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        policy, field = FLAT_NAMES[name]
        if policies[policy] is not None:
            raise TypeError(f"ZeroOptimizer got both {policy}= and the flat option {name}=; set {field} in {policy}")
        fields.setdefault(policy, {})[field] = value
    hint = ", ".join(
        f"{policy}={POLICY_CLASSES[policy].__name__}({', '.join(f'{f}=...' for f in fs)})"
        for policy, fs in fields.items()
    )
    warnings.warn(
        f"ZeroOptimizer({', '.join(f'{k}=...' for k in flat)}) is deprecated and goes in the next release; pass {hint}",
        DeprecationWarning,
        stacklevel=3,
    )
    return {**policies, **{policy: POLICY_CLASSES[policy](**fs) for policy, fs in fields.items()}}
