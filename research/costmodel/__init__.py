"""Analytic memory and step-time model of a training run: the planner's core.

Legend: s = sequence length, b = micro-batch size, h = d_model, a = heads, V = padded
vocabulary, L = layers, t / c / p / d = tp / cp / pp / dp, v = virtual stages (chunks per pipeline
rank), m = micro-batches per step, P / G / A = bytes of a parameter (compute dtype), a
gradient (reduce dtype) and an activation (compute dtype). Ψ = parameters held by a rank.

Memory per GPU = model states + activations + buffers, for the fullest pipeline rank.

Modules: `hardware` (GPUs, clusters), `layout` (what is chosen), `params` (a rank's
parameters and stage-3 units, read off the model built on the meta device), `memory` (model
states per the ZeRO formulas, activations per Korthikanti et al. 2022, buffers), `steptime` (compute,
bubble, TP, pipeline and context-parallel communication, the step's total),
`dpcomm` (data-parallel bytes over NVLink and the network, alpha-beta latency, quantization
kernels, overlap per unit or bucket), `search` (enumerate, estimate, choose hybrid sharding /
ZeRO++ and the context-parallel mode per layout, rank, explain). Under context parallelism
(`Layout.cp` = c) a rank holds s/c tokens of each sequence and the same parameters.
"""

from research.costmodel.dpcomm import Collective, Traffic, dp_traffic
from research.costmodel.hardware import GPU, GPUS, Cluster, GiB, MiB
from research.costmodel.layout import Layout, run_spec
from research.costmodel.memory import (
    Memory,
    ModelStates,
    chunk_activation_bytes,
    in_flight,
    kv_block_bytes,
    layer_activation_bytes,
    moe_mlp_bytes,
    predict_memory,
    predict_model_states,
    ring_kv_bytes,
)
from research.costmodel.params import RankParams, active_params, num_params, rank_params, unit_sizes
from research.costmodel.search import (
    COMM_SCHEMES,
    CP_MIN_TOKENS,
    Estimate,
    Plan,
    candidate_layouts,
    comm_variants,
    cp_variants,
    estimate,
    layout_problem,
    plan,
)
from research.costmodel.steptime import (
    StepTime,
    context_parallel_seconds,
    cp_all_to_all_bytes,
    expert_all_to_all_bytes,
    forward_flops_per_token,
    kv_transfer_seconds,
    pipeline_bubble,
    predict_step_time,
    ring_attention_seconds,
    ring_exposed_seconds,
)

__all__ = [
    "COMM_SCHEMES",
    "CP_MIN_TOKENS",
    "GPU",
    "GPUS",
    "Cluster",
    "Collective",
    "Estimate",
    "GiB",
    "Layout",
    "Memory",
    "MiB",
    "ModelStates",
    "Plan",
    "RankParams",
    "StepTime",
    "Traffic",
    "active_params",
    "candidate_layouts",
    "chunk_activation_bytes",
    "comm_variants",
    "context_parallel_seconds",
    "cp_all_to_all_bytes",
    "cp_variants",
    "dp_traffic",
    "estimate",
    "expert_all_to_all_bytes",
    "forward_flops_per_token",
    "in_flight",
    "kv_block_bytes",
    "kv_transfer_seconds",
    "layer_activation_bytes",
    "layout_problem",
    "moe_mlp_bytes",
    "num_params",
    "pipeline_bubble",
    "plan",
    "predict_memory",
    "predict_model_states",
    "predict_step_time",
    "rank_params",
    "ring_attention_seconds",
    "ring_exposed_seconds",
    "ring_kv_bytes",
    "run_spec",
    "unit_sizes",
]
