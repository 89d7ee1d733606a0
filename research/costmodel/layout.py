"""A training layout (tp, cp, pp, dp, v, ZeRO stage, micro-batching, recompute, SP, precision,
when gradients are reduced, hybrid sharding, the ZeRO++ switches and context parallelism)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from optim.policies import DEFAULT_UNIT_NUMEL, DTYPES
from optim.sharding import Sharding
from research.model import GPTConfig

if TYPE_CHECKING:
    from research.config import RunConfig

Recompute = Literal["none", "selective", "full"]
CPMode = Literal["ring", "all-to-all", "hybrid"]
DTYPE_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Layout:
    """How a run is laid out: parallel degrees, ZeRO stage, pipeline schedule, batching,
    recomputation, sequence parallelism, dtypes (global batch = b · m · dp), whether dp
    gradients are reduced after the last backward of a step or after every micro-batch, and
    how dp communicates: ZeRO over shard groups of `dp_shard` ranks (None: all dp) with
    dp / dp_shard replicas, and ZeRO++ (Wang et al. 2023): qwZ (parameters all-gathered as
    int8, one fp32 scale per `qwz_block` elements), hpZ (stage 3: the backward gathers from a
    copy partitioned inside the node) and qgZ (stages 2-3: gradients reduced as int4 / int8
    by a hierarchical all-to-all); and `ep`, the ranks of a shard group that split the
    experts of MoE blocks (each expert sharded over the shard group's N/ep ranks holding it).
    `attention`: the kernel of the attention core, "fused" as the model runs it (torch's
    scaled_dot_product_attention keeps no s x s scores), or "unfused" to predict a system
    that materializes scores and softmax, as Megatron-LM's kernels of 2021 did. `fp8`: the
    attention and MLP linear layers in float8 (`--fp8 tensorwise`).

    Context parallelism: `cp` ranks split each sequence (each holds s/cp of its tokens and
    the same parameters; ranks are laid out (pp, dp, cp, tp), tp innermost, then cp), and
    attend by `cp_mode`: "ring" (K/V blocks passed around the cp ranks, 2·cp zigzag chunks),
    "all-to-all" (Ulysses: heads split over cp) or "hybrid" (all-to-all inside groups of
    `cp_a2a` consecutive cp ranks, ring across the cp/cp_a2a groups). ZeRO shards and
    reduces gradients over dp × cp: the shard group is dp_shard × cp ranks."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"
    micro_batch_size: int = 1
    micro_batches: int = 1
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    grad_sync: Literal["last", "every"] = "last"
    unit_numel: int = DEFAULT_UNIT_NUMEL
    dp_shard: int | None = None
    qwz_block: int | None = None
    hpz: bool = False
    qgz_bits: int | None = None
    ep: int = 1
    attention: Literal["fused", "unfused"] = "fused"
    fp8: bool = False
    cp: int = 1
    cp_mode: CPMode = "ring"
    cp_a2a: int | None = None

    def but(self, **changes: Any) -> Layout:
        """This layout with `changes` to its fields: `dataclasses.replace` without the checks
        that make it slow (the planner makes one per variant of every layout it tries)."""
        new = object.__new__(Layout)
        new.__dict__.update(self.__dict__, **changes)
        return new

    @property
    def sharding(self) -> Sharding:
        """What the ZeRO stage shards over dp (`optim.sharding`)."""
        return Sharding.of_zero_stage(self.zero)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.dp

    @property
    def shard(self) -> int:
        """N: the ranks ZeRO shards over (a replica's shard group): dp_shard (None: all dp) × cp."""
        return (self.dp_shard or self.dp) * self.cp

    @property
    def replicas(self) -> int:
        """R = dp / dp_shard = dp·cp / N."""
        return self.dp // (self.dp_shard or self.dp)

    @property
    def cp_a2a_size(self) -> int:
        """Ranks of each all-to-all group of the context-parallel attention: cp (all-to-all),
        cp_a2a (hybrid), 1 (ring)."""
        return {"all-to-all": self.cp, "hybrid": self.cp_a2a or 1}.get(self.cp_mode, 1) if self.cp > 1 else 1

    @property
    def cp_ring_size(self) -> int:
        """Ranks of each ring of the context-parallel attention: cp / `cp_a2a_size`."""
        return self.cp // self.cp_a2a_size

    def tokens(self, seq_len: int) -> float:
        """T: tokens of a micro-batch that one rank holds, b·s/cp."""
        return seq_len * self.micro_batch_size / self.cp

    def float8_linears(self, model: GPTConfig) -> frozenset[str]:
        """The dense block's linears this layout runs in float8 (`GPTConfig.float8_linears` at
        its tp; none without `fp8`)."""
        return model.float8_linears(self.tp) if self.fp8 else frozenset()

    def describe_cp(self) -> str:
        """The context parallelism, e.g. cp=2 (ring), cp=4 all-to-all, cp=8 hybrid/2; "" at cp = 1."""
        if self.cp == 1:
            return ""
        mode = {"ring": "", "all-to-all": " all-to-all", "hybrid": f" hybrid/{self.cp_a2a}"}.get(self.cp_mode)
        return f"cp={self.cp}" + (f" {self.cp_mode}" if mode is None else mode)

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> Layout:
        """The layout of a resolved `research.config.RunConfig`."""
        return run_spec(cfg.to_dict())[1]

    def describe(self) -> str:
        return (
            f"tp={self.tp} pp={self.pp} dp={self.dp} v={self.virtual_stages} zero={self.zero} "
            f"mbs={self.micro_batch_size} recompute={self.recompute} sp={int(self.sp)}"
            + (" grad_sync=every" if self.grad_sync == "every" else "")
            + (f" dp_shard={self.dp_shard}" if self.dp_shard is not None else "")
            + (f" qwz_block={self.qwz_block}" if self.qwz_block is not None else "")
            + (" hpz" if self.hpz else "")
            + (f" qgz_bits={self.qgz_bits}" if self.qgz_bits is not None else "")
            + (f" ep={self.ep}" if self.ep > 1 else "")
            + (f" {self.describe_cp()}" if self.cp > 1 else "")
            + (" fp8" if self.fp8 else "")
        )

    __str__ = describe


def run_spec(config: Mapping[str, Mapping[str, Any]]) -> tuple[GPTConfig, Layout, int]:
    """(model, layout, sequence length) of a run's resolved config as a dict of sections
    (`RunConfig.to_dict()`: summary.json's "config", config.yaml)."""
    par, tr = config["parallel"], config["train"]
    layout = Layout(
        tp=par["tp"],
        pp=par["pp"],
        dp=par["dp"],
        zero=par["zero"],
        virtual_stages=par["virtual_stages"],
        schedule=par["schedule"],
        micro_batch_size=tr["micro_batch_size"],
        micro_batches=tr["micro_batches"],
        recompute=config["model"]["recompute"],
        sequence_parallel=par["sequence_parallel"],
        precision=tr["precision"],
        reduce_dtype=tr["reduce_dtype"],
        grad_sync=par.get("grad_sync", "last"),
        unit_numel=par.get("unit_numel", DEFAULT_UNIT_NUMEL),
        dp_shard=par.get("dp_shard"),
        qwz_block=par.get("qwz_block"),
        hpz=par.get("hpz", False),
        qgz_bits=par.get("qgz_bits"),
        ep=par.get("ep", 1),
        fp8=config["model"].get("fp8", "none") != "none",
        cp=par.get("cp", 1),
        cp_mode=par.get("cp_mode", "ring"),
        cp_a2a=par.get("cp_a2a"),
    )
    return GPTConfig(**config["model"]), layout, config["data"]["seq_len"]
