"""The cost model and planner (`research.costmodel`, `experiments.plan`), validated two ways:

1. against runs here: the predicted model-state bytes (params, grads, master + optimizer)
   of every rank of six small training runs (ZeRO 0-3, tp / pp / dp / interleaving / SP,
   fp32 and bf16, tied and untied) are within 5% of what `summary.json` measured;
2. against Narayanan et al. 2021, Table 1 (tests/data/ptdp_table1.csv, 1.7B to 1T
   parameters on up to 3072 A100s): with the one calibrated constant
   (`MATMUL_EFFICIENCY`) every row's predicted TFLOP/s per GPU is within 15% of the
   published figure, and every published layout fits in 80 GB.

3. against Wang et al. 2023 (ZeRO++): qwZ + hpZ + qgZ cut the bytes that cross nodes from
   3M to 0.75M, and on 384 V100s the predicted gain over ZeRO-3 lands in a stated band
   around its current value, each set against the published one (100 and 400 Gb/s per
   node, 1K and 2K tokens per GPU: close at 400 Gb/s and 1K, off elsewhere).

Plus the pieces: the planner's parameters and stage-3 units against the real model's (tp 1,
2 and 4), the FLOP terms
against `GPTConfig.flops_per_token`, the bubble against the pipeline simulator, the
activation counts against Korthikanti et al. 2022, the data-parallel bytes, ring steps and
kernel bytes of hybrid sharding and ZeRO++ against the formulas by hand, the collectives
charged per step against those ZeroOptimizer issues, and the plan command.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch

from parallel import accounting
from parallel.pipeline import simulate
from parallel.tensor import fp8 as fp8_linear
from research import costmodel
from research.costmodel import GPU, GPUS, Cluster, Layout
from research.costmodel.dpcomm import dp_traffic, expert_layout
from research.model import GPTConfig, pipeline_chunks
from tests.conftest import slow_except
from tests.dist_utils import run_distributed

TABLE1 = Path(__file__).parent / "data" / "ptdp_table1.csv"
GiB = 2**30

# --------------------------------------------------------------------------------------
# 1. Model states against measured runs
# --------------------------------------------------------------------------------------

MODEL = ["--n-layers", "8", "--n-heads", "4", "--d-model", "64", "--max-seq-len", "32", "--vocab-multiple", "128"]
MOE = ["--moe-experts", "8", "--moe-every", "2", "--moe-top-k", "2"]
RUNS = {
    "tp2-pp2-dp2-zero0-fp32": ["--tp", "2", "--pp", "2", "--zero", "0", "--micro-batches", "2"],
    "tp2-pp2-dp2-zero1-bf16-interleaved": [
        "--tp",
        "2",
        "--pp",
        "2",
        "--zero",
        "1",
        "--schedule",
        "interleaved-1f1b",
        "--virtual-stages",
        "2",
        "--micro-batches",
        "2",
        "--precision",
        "bf16",
    ],
    "tp2-pp2-dp2-zero2-bf16-sp-bf16-grads": [
        "--tp",
        "2",
        "--pp",
        "2",
        "--zero",
        "2",
        "--sequence-parallel",
        "--micro-batches",
        "2",
        "--precision",
        "bf16",
        "--reduce-dtype",
        "bf16",
    ],
    # units below the resident size stay whole at stage 3
    "tp2-pp2-dp2-zero3-fp32": ["--tp", "2", "--pp", "2", "--zero", "3", "--micro-batches", "2"],
    # MoE in every other block, its experts split over 4 and over 2 of the dp ranks
    "dp8-ep4-zero1-bf16-moe": ["--ep", "4", "--zero", "1", "--precision", "bf16", *MOE],
    "tp2-pp2-dp2-ep2-zero2-moe": [
        *("--tp", "2", "--pp", "2", "--ep", "2", "--zero", "2", "--micro-batches", "2", *MOE)
    ],
    "dp8-ep2-zero3-moe-units": ["--ep", "2", "--zero", "3", "--unit-numel", "2000", *MOE],
    # a capacity: every all-to-all has the same size, which the planner predicts to the byte
    "dp8-ep4-zero1-moe-capacity": ["--ep", "4", "--zero", "1", "--moe-capacity-factor", "1.0", *MOE],
    # one 427K-parameter unit: sharded
    "dp8-zero3-bf16": ["--zero", "3", "--precision", "bf16"],
    "tp2-pp4-zero1-bf16-untied-swiglu-rope": [
        "--tp",
        "2",
        "--pp",
        "4",
        "--zero",
        "1",
        "--micro-batches",
        "4",
        "--precision",
        "bf16",
        "--no-tie-embeddings",
        "--activation",
        "swiglu",
        "--norm",
        "rmsnorm",
        "--position",
        "rope",
        "--no-bias",
    ],
}


def _train_all(base: str, data: str) -> None:
    """Every run of RUNS in sequence, in one set of 8 processes (2 steps each)."""
    from experiments.train import run

    for name, argv in RUNS.items():
        run(
            [
                *MODEL,
                "--seq-len",
                "32",
                "--global-batch-size",
                "8",
                "--steps",
                "2",
                "--seed",
                "0",
                "--wandb",
                "disabled",
                "--log-every",
                "1000",
                "--data",
                data,
                "--data-cache",
                os.path.join(base, "cache"),
                "--out",
                os.path.join(base, name),
                *argv,
            ]
        )


@pytest.fixture(scope="module")
def summaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    base = tmp_path_factory.mktemp("costmodel")
    data = base / "text.txt"
    data.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(400)))
    run_distributed(_train_all, 8, str(base), str(data), timeout=300)
    return {name: json.loads((base / name / "summary.json").read_text()) for name in RUNS}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_predicted_model_states_match_every_rank_of_a_run(summaries: dict[str, dict], name: str) -> None:
    """Measured: bucket padding and Adam's step counters (4 bytes a bucket) are all the
    prediction leaves out; the error is below 1e-4."""
    model, layout, _ = costmodel.run_spec(summaries[name]["config"])
    for rank in summaries[name]["ranks"]:
        measured = rank["memory_bytes"]
        predicted = costmodel.predict_model_states(model, layout, rank["coords"]["pp"])
        for key in ("params", "grads", "master_and_optimizer"):
            assert getattr(predicted, key) == pytest.approx(measured[key], rel=0.05), (rank["rank"], key)
        total = measured["params"] + measured["grads"] + measured["master_and_optimizer"]
        assert predicted.total == pytest.approx(total, rel=0.05)


def test_model_states_follow_the_zero_table() -> None:
    """bf16 parameters and gradients, Ψ per rank, N = 4: (2+2+12)Ψ, 2Ψ+2Ψ+12Ψ/N,
    2Ψ+14Ψ/N, 16Ψ/N; in fp32 the master is the parameter (4 + 4 + 8)."""
    model = GPTConfig(vocab_size=51200, n_layers=4, n_heads=16, d_model=1024, max_seq_len=2048)
    psi = costmodel.rank_params(model, 1, 1, 1, 0).aligned
    expected = {0: 16 * psi, 1: 4 * psi + 12 * psi / 4, 2: 2 * psi + 14 * psi / 4, 3: 16 * psi / 4}
    for stage, total in expected.items():
        layout = Layout(dp=4, zero=stage, precision="bf16", reduce_dtype="bf16")
        assert costmodel.predict_model_states(model, layout).total == pytest.approx(total)
    fp32 = costmodel.predict_model_states(model, Layout(dp=4, zero=1, precision="fp32"))
    assert (fp32.params, fp32.grads, fp32.master_and_optimizer) == (4 * psi, 4 * psi, 8 * psi / 4)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {
            "tie_embeddings": False,
            "norm": "rmsnorm",
            "activation": "swiglu",
            "bias": False,
            "position": "rope",
            "qkv_bias": True,
        },
        {"moe_experts": 4, "moe_every": 2},  # dense and MoE blocks alternate
        {"moe_experts": 4, "moe_shared_experts": 1, "activation": "swiglu", "moe_every": 3},
    ],
)
@pytest.mark.parametrize("pp, v", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_parameter_tree_is_the_models(options: dict, pp: int, v: int) -> None:
    """Per pipeline rank, the stage-3 units of the model built on the meta device equal the
    tree's, for unit sizes that claim single layers, blocks or whole chunks."""
    from optim.stage3 import stage3_units

    model = GPTConfig(vocab_size=257, n_layers=8, n_heads=4, d_model=64, max_seq_len=64, **options)
    for rank in range(pp):
        with torch.device("meta"):
            chunks = torch.nn.ModuleList(pipeline_chunks(model, rank, pp, v))
        params = set(chunks.parameters())
        for unit_numel in (2**10, 2**14, 2**30):
            real = sorted(sum(p.numel() for p in ps) for _, ps in stage3_units(chunks, params, unit_numel))
            assert sorted(n for n, _ in costmodel.unit_sizes(model, 1, pp, v, rank, unit_numel)) == real


TREE_OPTIONS = [
    {},
    {"tie_embeddings": False, "norm": "rmsnorm", "activation": "swiglu", "bias": False, "position": "rope"},
]
TREE_LAYOUTS = [(1, 1), (1, 2), (3, 1), (3, 2)]  # (pp, v): one stage, two chunks on one rank, first / middle / last
UNIT_NUMELS = (2**10, 2**14, 2**30)


def _units_of_real_tp_model() -> tuple[dict, list[int]]:
    """On each rank of a gloo TP group: per (options, pp, v, pipeline rank, unit_numel) the
    sorted (numel, aligned numel) of `stage3_units` of the chunks built whole with that
    group on the meta device; and `num_params` with torch.distributed initialized."""
    import torch.distributed as dist

    from optim.buffers import ALIGN
    from optim.stage3 import stage3_units

    def size(params: list) -> tuple[int, int]:
        return sum(p.numel() for p in params), sum(-(-p.numel() // ALIGN) * ALIGN for p in params)

    units, counts = {}, []
    for i, options in enumerate(TREE_OPTIONS):
        model = GPTConfig(vocab_size=257, n_layers=12, n_heads=4, d_model=64, max_seq_len=64, **options)
        counts.append(costmodel.num_params(model))
        for pp, v in TREE_LAYOUTS:
            for rank in range(pp):
                with torch.device("meta"):
                    chunks = torch.nn.ModuleList(pipeline_chunks(model, rank, pp, v, tp_group=dist.group.WORLD))
                params = set(chunks.parameters())
                for unit_numel in UNIT_NUMELS:
                    found = sorted(size(ps) for _, ps in stage3_units(chunks, params, unit_numel))
                    units[(i, pp, v, rank, unit_numel)] = found
    return units, counts


@pytest.mark.parametrize("tp", slow_except([4], [2]))
def test_rank_params_are_the_real_tp_models(tp: int) -> None:
    """With a real TP group of size tp: per pipeline rank (first, middle, last stage; two
    chunks on one rank), the planner's stage-3 units and parameter counts equal those of the
    model built whole on the meta device; `num_params` is the same inside a distributed run."""
    (units, counts), *_ = run_distributed(_units_of_real_tp_model, tp, timeout=300)
    for i, options in enumerate(TREE_OPTIONS):
        model = GPTConfig(vocab_size=257, n_layers=12, n_heads=4, d_model=64, max_seq_len=64, **options)
        assert counts[i] == costmodel.num_params(model)
        for pp, v in TREE_LAYOUTS:
            for rank in range(pp):
                for unit_numel in UNIT_NUMELS:
                    real = units[(i, pp, v, rank, unit_numel)]
                    assert sorted(costmodel.unit_sizes(model, tp, pp, v, rank, unit_numel)) == real
                    planned = costmodel.rank_params(model, tp, pp, v, rank, unit_numel)
                    assert (planned.numel, planned.aligned) == tuple(map(sum, zip(*real)))


# --------------------------------------------------------------------------------------
# 2. Throughput against Narayanan et al. 2021, Table 1
# --------------------------------------------------------------------------------------


def _table1() -> list[dict[str, float]]:
    with open(TABLE1) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(line for line in f if line[0] != "#")]


def _table1_model(row: dict[str, float]) -> GPTConfig:
    return GPTConfig(
        vocab_size=51200,
        n_layers=int(row["layers"]),
        n_heads=int(row["attention_heads"]),
        d_model=int(row["hidden_size"]),
        max_seq_len=2048,
        qkv_bias=True,
    )


@pytest.mark.parametrize("row", _table1(), ids=lambda row: f"{row['params_billion']:g}B")
def test_table1_throughput_and_fit(row: dict[str, float]) -> None:
    """The published (t, p, d) with the paper's setting (no ZeRO, full recomputation, no
    SP, fp16/bf16, attention that keeps its scores): the planner's best micro-batch size and interleaving for it predicts
    the published TFLOP/s per GPU (the paper's count, recomputation included) within 15%,
    and the layout fits in an 80 GB A100, also with micro-batch 1 and plain 1F1B."""
    model = _table1_model(row)
    tp, pp, gpus, batch = int(row["tp"]), int(row["pp"]), int(row["gpus"]), int(row["global_batch"])
    assert costmodel.num_params(model) / 1e9 == pytest.approx(row["params_billion"], rel=0.03)
    cluster = Cluster(GPUS["a100-80gb"], gpus)
    plan = costmodel.plan(
        model,
        cluster,
        batch,
        2048,
        tp=tp,
        pp=pp,
        zero=0,
        recompute="full",
        sequence_parallel=False,
        attention="unfused",
    )
    assert plan.ranked, plan.rejected
    best = plan.ranked[0]
    assert best.layout.dp == gpus // (tp * pp)
    assert best.hardware_tflops_per_gpu == pytest.approx(row["tflops_per_gpu"], rel=0.15)
    plain = Layout(
        tp,
        pp,
        gpus // (tp * pp),
        zero=0,
        micro_batch_size=1,
        micro_batches=batch * tp * pp // gpus,
        recompute="full",
        attention="unfused",
    )
    assert costmodel.predict_memory(model, plain, 2048).total <= GPUS["a100-80gb"].memory_bytes


def test_one_calibration_serves_every_row() -> None:
    """The 15% above holds for every row with the one η (`MATMUL_EFFICIENCY`); the largest
    error is 8.8% (529.6B, under-predicted)."""
    errors = []
    for row in _table1():
        cluster = Cluster(GPUS["a100-80gb"], int(row["gpus"]))
        plan = costmodel.plan(
            _table1_model(row),
            cluster,
            int(row["global_batch"]),
            2048,
            tp=int(row["tp"]),
            pp=int(row["pp"]),
            zero=0,
            recompute="full",
            sequence_parallel=False,
            attention="unfused",
        )
        errors.append(plan.ranked[0].hardware_tflops_per_gpu / row["tflops_per_gpu"] - 1)
    assert max(map(abs, errors)) < 0.10, errors


# --------------------------------------------------------------------------------------
# The pieces
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_flop_terms_are_flops_per_token(recompute: str) -> None:
    for options in ({}, {"activation": "swiglu"}):
        model = GPTConfig(vocab_size=1000, n_layers=6, n_heads=8, d_model=512, recompute=recompute, **options)
        layer, core, head = costmodel.forward_flops_per_token(model, 256)
        extra = {"none": 0, "selective": core, "full": layer}[recompute]
        assert 3 * (6 * layer + head) + 6 * extra == model.flops_per_token(256)


def _saved_bytes(model: GPTConfig, dtype: torch.dtype, tokens: tuple[int, int]) -> int:
    """Peak bytes one forward + backward of `model` saves for backward (parameters aside)."""
    from research import metrics
    from research.model import GPT

    torch.manual_seed(0)
    gpt = GPT(model).to(dtype)
    idx = torch.randint(0, model.vocab_size, tokens)
    with metrics.ActivationMeter([gpt]) as meter:
        gpt(idx, idx).backward()
    return meter.peak_bytes


MOE_SHAPES = [  # (MoE options, activation): top-k, widths, capacity (its padding included), shared experts
    ({"moe_experts": 4, "moe_top_k": 2, "moe_d_ff": 128}, "gelu"),
    ({"moe_experts": 8, "moe_top_k": 1, "moe_d_ff": 64}, "gelu"),
    ({"moe_experts": 8, "moe_top_k": 2, "moe_d_ff": 96}, "swiglu"),
    ({"moe_experts": 4, "moe_top_k": 2, "moe_d_ff": 64, "moe_capacity_factor": 1.5}, "gelu"),
    ({"moe_experts": 4, "moe_top_k": 1, "moe_d_ff": 64, "moe_shared_experts": 1}, "swiglu"),
]


@pytest.mark.parametrize("options, activation", MOE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_layer_activations_are_what_it_saves(options: dict, activation: str, dtype: torch.dtype) -> None:
    """An MoE layer saves, beyond a dense layer, `moe_mlp_bytes` less the dense MLP's input
    and hidden tensors: measured by the saved-tensor hooks of a one-process forward + backward
    (balanced routing is what the planner assumes; the tolerance is the router's imbalance
    on these few tokens, which moves only the dispatch's rows, not a capacity's)."""
    s, b, h = 64, 2, 64
    dense = GPTConfig(vocab_size=128, n_layers=1, n_heads=4, d_model=h, max_seq_len=s, activation=activation)
    moe = dataclasses.replace(dense, **options)
    measured = _saved_bytes(moe, dtype, (b, s)) - _saved_bytes(dense, dtype, (b, s))
    A = dtype.itemsize
    dense_mlp = A * s * b * (h + (2 if activation == "gelu" else 4) * dense.ffn_dim)
    layout = Layout(micro_batch_size=b, precision="fp32" if dtype == torch.float32 else "bf16")
    predicted = costmodel.moe_mlp_bytes(moe, s, layout) - dense_mlp
    assert measured == pytest.approx(predicted, rel=0.01 if options.get("moe_capacity_factor") else 0.02)


@pytest.mark.parametrize(
    "name, pp, m, v",
    [
        ("gpipe", 4, 4, 1),
        ("1f1b", 4, 8, 1),
        ("1f1b", 3, 7, 1),
        ("interleaved-1f1b", 4, 8, 2),
        ("interleaved-1f1b", 2, 6, 3),
        ("zb-h1", 4, 8, 1),
        ("zb-h1", 3, 6, 1),
    ],
)
def test_bubble_is_the_simulators(name: str, pp: int, m: int, v: int) -> None:
    for t_f, t_b in ((1.0, 2.5), (1.5, 2.0)):
        makespan = simulate(name, pp, m, v, t_f, t_b).makespan
        assert m * (t_f + t_b) + costmodel.pipeline_bubble(name, pp, v, t_f, t_b) == pytest.approx(makespan)


def test_1f1b_sends_are_the_simulators() -> None:
    """1F1B's exposed sends are the simulator's makespan with sends of c less without, over
    stage counts, micro-batch counts that p does and does not divide, and sends from far
    below to far above a micro-batch's compute (one at a time on a link)."""
    from research.costmodel.steptime import exposed_p2p

    for p in (2, 3, 4, 8):
        for m in sorted({p, p + 1, 2 * p, 2 * p + 1, 4 * p}):
            for t_f, t_b in ((1.0, 2.0), (2.0, 2.5)):
                for c in (0.05, 0.9, 2.5, 8.0, 50.0):
                    sends = (
                        simulate("1f1b", p, m, 1, t_f, t_b, t_comm=c).makespan
                        - simulate("1f1b", p, m, 1, t_f, t_b).makespan
                    )
                    assert exposed_p2p("1f1b", p, m, c, t_f, t_b) == pytest.approx(sends), (p, m, t_f, t_b, c)
    # at p = 2 a send costs c per micro-batch, not only the fill and drain's 2c
    assert exposed_p2p("1f1b", 2, 8, 0.1, 1.0, 2.0) == pytest.approx(8 * 0.1)


def test_a_link_carries_one_send_at_a_time() -> None:
    """GPipe on 2 stages, forwards of 1, backwards of 2, sends of 5: the second activation
    leaves once the first has arrived, at 6, and arrives at 11, not 7; the second gradient
    arrives at 24, not 21 (the first left at 14); the last backward ends at 26."""
    events = simulate("gpipe", 2, 2, 1, 1.0, 2.0, t_comm=5.0).events
    assert [(e[0], e[1], e[2], e[4]) for e in events if e[4] > 10] == [
        (1, "F", 1, 11.0), (1, "B", 0, 12.0), (1, "B", 1, 14.0), (0, "B", 0, 19.0), (0, "B", 1, 24.0)
    ]  # fmt: skip


def test_activations_follow_korthikanti() -> None:
    """Per layer, with attention that keeps its scores: 34sbh + 5as²b at t = 1; without SP
    sbh(10 + 24/t + 5as/(ht)); with SP everything / t; selective drops the scores; full
    keeps 2sbh (/t with SP). The model's own layer (`attention="fused"`) keeps no scores and no
    dropout masks at p = 0 (tests/test_activation_memory.py measures it)."""
    model = GPTConfig(vocab_size=51200, n_layers=8, n_heads=32, d_model=4096, max_seq_len=2048)
    s, b, h, a = 2048, 2, 4096, 32
    sbh = s * b * h

    def act(tp: int, sp: bool, recompute: str, attention: str = "unfused") -> float:
        return costmodel.layer_activation_bytes(
            model,
            s,
            Layout(tp=tp, micro_batch_size=b, recompute=recompute, sequence_parallel=sp, attention=attention),
        )

    assert act(1, False, "none") == pytest.approx(sbh * 34 + 5 * a * s * s * b)
    assert act(8, False, "none") == pytest.approx(sbh * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert act(8, True, "none") == pytest.approx(sbh * (34 / 8 + 5 * a * s / (h * 8)))
    assert act(8, True, "selective") == pytest.approx(sbh * 34 / 8)
    assert act(8, False, "full") == pytest.approx(2 * sbh)
    assert act(8, True, "full") == pytest.approx(2 * sbh / 8)
    for tp, sp in ((1, False), (8, False), (8, True)):
        rows = s * b / (tp if sp else 1)
        # zero3d's layer: no dropout (the paper's two sbh masks of 1 byte), LayerNorm's fp32
        # mean and rstd (16 B a row); the fused attention keeps its fp32 log-sum-exp (4 B per
        # head and token) instead of the scores, and selective recomputes it
        selective = act(tp, sp, "selective") - 2 * sbh / (tp if sp else 1) + 16 * rows
        assert act(tp, sp, "selective", "fused") == pytest.approx(selective)
        assert act(tp, sp, "none", "fused") == pytest.approx(selective + 4 * a * s * b / tp)
    fp32 = costmodel.layer_activation_bytes(model, s, Layout(precision="fp32", micro_batch_size=b))
    assert fp32 == pytest.approx(2 * act(1, False, "none", "fused") - (16 * s * b + 4 * a * s * b))  # fp32 either way


def test_in_flight_activations_per_schedule() -> None:
    """The first stage holds the whole model's activations of one micro-batch under 1F1B
    (p micro-batches × L/p layers), (1 + (p-1)/(p·v)) times that interleaved, m/p times it
    under GPipe: read off the repo's schedules."""
    model = GPTConfig(vocab_size=51200, n_layers=16, n_heads=32, d_model=4096, max_seq_len=2048)
    whole = 16 * costmodel.layer_activation_bytes(model, 2048, Layout(tp=8, sequence_parallel=True))
    p, m = 4, 16

    def first_stage(schedule: str, v: int) -> float:
        layout = Layout(tp=8, pp=p, schedule=schedule, virtual_stages=v, micro_batches=m, sequence_parallel=True)
        return costmodel.predict_memory(model, layout, 2048, pp_rank=0).activations

    assert first_stage("1f1b", 1) == pytest.approx(whole)
    assert first_stage("interleaved-1f1b", 2) == pytest.approx(whole * (1 + (p - 1) / (p * 2)))
    assert first_stage("gpipe", 1) == pytest.approx(whole * m / p)


def test_zero2_with_accumulation_keeps_full_gradient_buffers() -> None:
    """Every backward but the last runs under no_sync, so at stage 2 with m > 1 the full
    gradient buckets live through the step; with m = 1 they do not."""
    model = GPTConfig(vocab_size=51200, n_layers=4, n_heads=16, d_model=1024, max_seq_len=2048)
    psi = costmodel.rank_params(model, 1, 1, 1, 0).aligned
    one = costmodel.predict_memory(model, Layout(dp=8, zero=2, micro_batches=1), 2048)
    four = costmodel.predict_memory(model, Layout(dp=8, zero=2, micro_batches=4), 2048)
    assert four.buffers - one.buffers == pytest.approx(4 * psi * 7 / 8)
    every = costmodel.predict_memory(model, Layout(dp=8, zero=2, micro_batches=4, grad_sync="every"), 2048)
    assert every.buffers == one.buffers


def test_grad_sync_every_pays_a_reduction_per_micro_batch() -> None:
    """Reducing every micro-batch exposes m·max(0, reduce - t_b) of dp time (last: only what
    the last backward does not hide), and the planner offers it only where it changes
    something: ZeRO 2-3 with m > 1."""
    from experiments.plan import PRESETS

    model = PRESETS["gpt-1.7b"].model()
    cluster = Cluster(GPUS["a100-80gb"], 64)
    slow_net = Cluster(dataclasses.replace(GPUS["a100-80gb"], inter_node_bandwidth=1e9), 64)
    for c in (cluster, slow_net):
        last = costmodel.predict_step_time(model, Layout(tp=8, dp=8, zero=2, micro_batches=4), 2048, c)
        every = costmodel.predict_step_time(
            model, Layout(tp=8, dp=8, zero=2, micro_batches=4, grad_sync="every"), 2048, c
        )
        assert every.dp_comm >= last.dp_comm
        assert every.pipeline == last.pipeline
    assert every.dp_comm > last.dp_comm > 0  # a slow network: reductions exceed the backward
    layouts = [
        lo
        for lo, why, _ in costmodel.candidate_layouts(
            model, cluster, 64, 2048, tp=8, pp=1, micro_batch_size=1, recompute="none"
        )
    ]
    assert {(lo.zero, lo.grad_sync) for lo in layouts} == {
        (0, "last"),
        (1, "last"),
        (2, "last"),
        (2, "every"),
        (3, "last"),
        (3, "every"),
    }


def test_groups_inside_a_node_use_nvlink() -> None:
    cluster = Cluster(GPUS["h100"], 64)
    assert cluster.ring_bandwidth(8, 1) == GPUS["h100"].intra_node_bandwidth
    assert cluster.ring_bandwidth(8, 8) == GPUS["h100"].inter_node_bandwidth  # one GPU per node
    assert cluster.ring_bandwidth(16, 2) == 4 * GPUS["h100"].inter_node_bandwidth  # 4 per node, 4 rings


@pytest.mark.parametrize(
    "gbps, seq_len",
    # DP communication hidden / exposed: a tight and a loose floor; at 32K tokens cp 1-8 in
    # every mode are searched too (and reach the table)
    slow_except([(1600, 2048)], [(100, 2048), (1600, 32768)]),
)
def test_plan_top_estimates_only_what_can_rank(gbps: int, seq_len: int) -> None:
    """`plan(top=k)` estimates layouts in order of their step-time floor and stops once the
    floor passes the k-th distinct prediction: its first k groups of equal predictions, the
    fitting count and the rejections equal those of estimating every layout, with far fewer
    layouts estimated; every row of the report is a distinct prediction, and a row standing
    for several layouts names how the others differ."""
    from experiments.plan import PRESETS, report

    model = dataclasses.replace(PRESETS["gpt-1.7b"].model(), max_seq_len=seq_len)
    cluster = Cluster(GPUS["h100"], 32, 8, gbps)
    full = costmodel.plan(model, cluster, 512, seq_len, recompute="none")
    top = costmodel.plan(model, cluster, 512, seq_len, top=8, recompute="none")
    assert [[e.layout for e in g] for g in top.alike()[:8]] == [[e.layout for e in g] for g in full.alike()[:8]]
    assert top.fits == full.fits == len(full.ranked) and top.rejected == full.rejected
    assert len(top.ranked) < len(full.ranked) / 4
    header, *rows = report(top, "gpt-1.7b", model, cluster, 512, seq_len, 8).split("\n\n")[1].splitlines()
    assert len(rows) == 8
    at = header.split().index("mem")  # memory, network bytes, step time
    predictions = [tuple(row.split()[at : at + 3]) for row in rows]
    assert len(set(predictions)) == len(predictions)
    fields = {"cp": "cp", "pp": "pp", "dp": "dp", "shard": "shard", "zero": "zero", "mbs": "micro_batch_size"}
    for row, (first, *twins) in zip(rows, top.alike()):
        same = "; ".join(
            " ".join(f"{k}={getattr(t.layout, f)}" for k, f in fields.items()
                     if getattr(t.layout, f) != getattr(first.layout, f))
            for t in twins
        )  # fmt: skip
        assert row.endswith(f"%  {same}" if twins else "%"), row
    if gbps == 1600:
        assert any(twins for _, *twins in top.alike()[:8])  # ZeRO-1 and ZeRO-2 twins, in one row
    cps = {e.layout.cp for e in full.ranked}
    assert cps == ({1, 2, 4, 8} if seq_len == 32768 else {1})
    if seq_len == 32768:
        assert header.split()[:3] == ["#", "tp", "cp"] and {e.layout.cp for e in top.ranked[:8]} > {1}


def test_plan_ranks_and_explains(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's command: top layouts and rejected ones by reason (under 10 s here, with
    the interpreter's start-up on top)."""
    from experiments import plan

    started = time.perf_counter()
    plan.main(["--model", "gpt-1t", "--gpus", "3072", "--gpu", "a100-80gb", "--top", "5"])
    assert time.perf_counter() - started < 10
    out = capsys.readouterr().out
    assert out.startswith("gpt-1t: 1.01T parameters, seq 2048, global batch 3072 on 3072 × a100-80gb")
    table = out.split("\n\n")[1].splitlines()
    assert table[0].split() == [
        "#",
        "tp",
        "pp",
        "dp",
        "shard",
        "v",
        "zero",
        "mbs",
        "recompute",
        "sp",
        "sync",
        "zero++",
        "mem",
        "GiB",
        "net",
        "GB",
        "step",
        "s",
        "TFLOP/s/GPU",
        "MFU",
        "same",
        "prediction",
    ]
    assert len(table) == 6
    steps = [float(line.split()[14]) for line in table[1:]]
    assert steps == sorted(steps)
    assert (
        "#1 data-parallel communication per GPU and step (NVLink 300 GB/s, network 25 GB/s per GPU; "
        "3.4 / 14 µs per ring step in / across nodes):" in out
    )
    assert "does not fit in memory, e.g. " in out and "GiB > 80.00 GiB" in out
    assert "layers do not split evenly into pp × v stages, e.g. " in out


def test_plan_shows_where_the_bytes_go(capsys: pytest.CaptureFixture[str]) -> None:
    """A node's network in Gb/s; #1's data-parallel bytes per family over NVLink and the
    network, and their total; --comm restricts the choice. #1 is ZeRO-1 (pp 4: its sends
    hide under compute), gathering the parameters after the step."""
    from experiments import plan

    argv = ["--model", "gpt-7b", "--gpus", "128", "--gpu", "h100", "--inter-node-gbps", "100", "--top", "3"]
    argv += ["--memory-gib", "24"]
    plan.main([*argv, "--comm", "zero"])
    out = capsys.readouterr().out
    assert "8 per node, 100 Gb/s per node)" in out and "network 1.56 GB/s per GPU" in out
    rows = {line.split("  ")[1].strip(): line.split()[-6:] for line in out.splitlines() if line.startswith("  param")}
    assert set(rows) == {"param all-gather after step"}
    assert "  gradient reduction " in out and "  total " in out
    table = out.split("\n\n")[1].splitlines()[1:]
    assert all(line.split()[11] == "-" for line in table)  # no ZeRO++ switch under --comm zero
    plan.main([*argv, "--comm", "zero++"])
    table = capsys.readouterr().out.split("\n\n")[1].splitlines()[1:]
    assert all(line.split()[11] in ("qwZ+hpZ+qgZ4", "qwZ+qgZ4") for line in table)  # hpZ: stage 3 only


def test_scale_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """--scale-table prints a markdown row per (model, GPUs, network) with each scheme's best
    ZeRO-3 layout (here one small row; docs/planner.md's full table takes about 30 s)."""
    from experiments import plan

    monkeypatch.setattr(plan, "SCALE_MODELS", ("gpt-7b",))
    monkeypatch.setattr(plan, "SCALE_GPUS", (128,))
    monkeypatch.setattr(plan, "SCALE_GBPS", (100,))
    plan.main(["--scale-table"])
    header, _, row = capsys.readouterr().out.splitlines()
    assert header == "| model | GPUs | Gb/s per node | ZeRO-3 | hybrid | ZeRO++ | ZeRO++ / ZeRO-3 |"
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["7B", "128", "100"] and "N=" in cells[4] and cells[6].endswith("×")
    zero3, zeropp = (float(cells[i].split(" s,")[0]) for i in (3, 5))
    assert float(cells[6][:-1]) == pytest.approx(zero3 / zeropp, abs=0.01)


def test_plan_takes_a_yaml_config(capsys: pytest.CaptureFixture[str]) -> None:
    from experiments import plan

    plan.main(["--config", "experiments/configs/tiny.yaml", "--gpus", "8", "--gpu", "h100", "--top", "3"])
    out = capsys.readouterr().out
    assert out.startswith("experiments/configs/tiny.yaml: 427K parameters, seq 64, global batch 16 on 8 × h100")
    assert "tp does not divide the model, e.g. " in out and "n_heads=4 is not divisible by tp=8" in out


def test_cluster_overrides_and_a_plan_where_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    from experiments import plan

    plan.main(["--model", "gpt-18.4b", "--gpus", "8", "--gpu", "a100-80gb", "--memory-gib", "40"])
    out = capsys.readouterr().out
    assert "8 × a100-80gb (40 GiB" in out and "No layout fits." in out


def test_layout_of_a_run_config() -> None:
    from research.config import parse_args

    cfg = parse_args(
        [
            "--config",
            "experiments/configs/tiny.yaml",
            "--tp",
            "2",
            "--pp",
            "2",
            "--zero",
            "3",
            "--micro-batches",
            "4",
            "--precision",
            "bf16",
            "--grad-sync",
            "every",
            "--unit-numel",
            "5000",
        ],
        8,
    )
    layout = Layout.from_run_config(cfg)
    expected = (
        2,
        2,
        2,
        3,
        1,
        "1f1b",
        2,
        4,
        "none",
        False,
        "bf16",
        "fp32",
        "every",
        5000,
        None,
        None,
        False,
        None,
        1,
        "fused",
        False,
        1,
        "ring",
        None,
    )
    assert dataclasses.astuple(layout) == expected


def test_layout_of_a_hybrid_zeropp_run() -> None:
    """run_spec reads dp_shard and the ZeRO++ switches; hpz and qgz_bits may be absent."""
    config = {
        "parallel": {"tp": 1, "pp": 1, "dp": 16, "zero": 3, "virtual_stages": 1, "schedule": "1f1b"},
        "train": {"micro_batch_size": 1, "micro_batches": 1, "precision": "bf16", "reduce_dtype": "fp32"},
        "model": {"vocab_size": 128, "n_layers": 2, "n_heads": 2, "d_model": 32, "recompute": "none"},
        "data": {"seq_len": 32},
    }
    config["parallel"] |= {"sequence_parallel": False, "dp_shard": 8, "qwz_block": 2048}
    layout = costmodel.run_spec(config)[1]
    assert (layout.dp_shard, layout.qwz_block, layout.hpz, layout.qgz_bits) == (8, 2048, False, None)
    assert (layout.shard, layout.replicas) == (8, 2)
    assert layout.describe().endswith("dp_shard=8 qwz_block=2048")
    config["parallel"] |= {"hpz": True, "qgz_bits": 4}
    assert costmodel.run_spec(config)[1].describe().endswith("dp_shard=8 qwz_block=2048 hpz qgz_bits=4")


# --------------------------------------------------------------------------------------
# 3. Hybrid sharding and ZeRO++: bytes, memory, the planner's choice, Wang et al. 2023
# --------------------------------------------------------------------------------------


def test_cluster_network_per_node() -> None:
    """inter_node_gbps is a node's network shared by its GPUs: 3200 Gb/s over 8 H100s is
    each GPU's 50 GB/s; 100 Gb/s over 16 is 0.78 GB/s."""
    assert Cluster(GPUS["h100"], 64, 8, 3200).inter_node_bandwidth == GPUS["h100"].inter_node_bandwidth == 50e9
    assert Cluster(GPUS["h100"], 64, 16, 100).inter_node_bandwidth == pytest.approx(100e9 / 8 / 16)
    slow = Cluster(GPUS["h100"], 64, 8, 100)
    assert slow.ring_bandwidth(16, 2) == pytest.approx(4 * 100e9 / 8 / 8)  # 4 rings through 4 NICs
    assert slow.ring_bytes(16, 2, 1000.0) == (750.0, 250.0)  # 1/k of it leaves the node
    assert slow.ring_bytes(4, 2, 1000.0) == (1000.0, 0.0)


def _same_bytes(actual: dict[str, tuple[float, float]], expected: dict[str, tuple[float, float]]) -> None:
    """The same families with the same (NVLink, network) bytes, to rounding."""
    assert actual.keys() == expected.keys()
    for name, pair in expected.items():
        assert actual[name] == pytest.approx(pair), name


def test_dp_bytes_follow_the_formulas() -> None:
    """One collective per family, by hand: Ψ = 1000 on 4 nodes of 8 GPUs, tp 2, dp 16, so a
    shard group of N = 16 has k = 4 ranks per node on n = 4 nodes; bf16 parameters (P = 2),
    fp32 gradients (G = 4). A ring across nodes sends 1/k of its bytes over the network."""
    cluster, psi = Cluster(GPUS["h100"], 32), 1000.0

    def traffic(**kw: object) -> dict[str, tuple[float, float]]:
        layout = Layout(tp=2, dp=16, **{"zero": 3, **kw})
        return {k: (x.intra, x.inter) for k, x in costmodel.dp_traffic(layout, cluster, psi).items()}

    gather, reduce = 2 * psi * 15 / 16, 4 * psi * 15 / 16  # PΨ(N-1)/N, GΨ(N-1)/N
    assert traffic() == {
        "gather_fwd": (gather * 3 / 4, gather / 4),
        "gather_bwd": (gather * 3 / 4, gather / 4),
        "reduce": (reduce * 3 / 4, reduce / 4),
    }
    qwz = (1 + 4 / 2048) * psi * 15 / 16  # int8 + an fp32 scale per 2048
    q = 0.5 + 4 / 2048  # int4 + an fp32 scale per 2048
    zeropp = traffic(qwz_block=2048, hpz=True, qgz_bits=4)
    assert zeropp["gather_fwd"] == pytest.approx((qwz * 3 / 4, qwz / 4))
    assert zeropp["gather_hpz"] == pytest.approx((2 * psi * 3 / 4, 0.0))  # PΨ(k-1)/k in the node
    assert zeropp["reduce"] == pytest.approx((q * psi * 3 / 4, q * psi / 4 * 3 / 4))  # then (Ψ/k)(n-1)/n
    # hybrid: 4 replicas of N = 4 (N·tp = 8: one node); the replica all-reduce 2G(Ψ/N)(R-1)/R crosses
    _same_bytes(
        traffic(dp_shard=4),
        {
            "gather_fwd": (2 * psi * 3 / 4, 0.0),
            "gather_bwd": (2 * psi * 3 / 4, 0.0),
            "reduce": (4 * psi * 3 / 4, 0.0),
            "replicate": (0.0, 2 * 4 * psi / 4 * 3 / 4),
        },
    )
    _same_bytes(
        traffic(zero=2, qwz_block=2048), {"gather_step": (qwz * 3 / 4, qwz / 4), "reduce": (reduce * 3 / 4, reduce / 4)}
    )
    _same_bytes(  # stage 0: all-reduces; the replicas all-reduce the whole gradient
        traffic(zero=0, dp_shard=8),
        {"reduce": (2 * 4 * psi * 7 / 8 * 3 / 4, 2 * 4 * psi * 7 / 8 / 4), "replicate": (0.0, 2 * 4 * psi / 2)},
    )


def test_ring_steps_and_latency() -> None:
    """A ring over N ranks on n nodes takes N - 1 steps, n - 1 of them between nodes (NCCL's
    cost model); an all-reduce twice that; α_intra per step inside a node, α_inter across."""
    v100 = Cluster(V100, 384, 16, 400)
    assert v100.ring_steps(384, 1) == (360, 23)
    assert v100.ring_steps(384, 1, rounds=2) == (720, 46)
    assert v100.ring_steps(16, 1) == (15, 0)
    assert v100.ring_steps(1, 1) == (0, 0)
    h100 = Cluster(GPUS["h100"], 64)
    assert h100.ring_steps(16, 2) == (12, 3)  # 4 ranks on each of 4 nodes
    assert h100.ring_steps(8, 8) == (0, 7)  # one rank per node
    assert h100.latency(12, 3) == pytest.approx(12 * 3.4e-6 + 3 * 14e-6)


def test_dp_steps_and_kernels_follow_the_formulas() -> None:
    """Per collective on 4 nodes of 8 GPUs, tp 2, dp 16 (N = 16: k = 4 per node, n = 4):
    ring steps (N - n, n - 1); qwZ one all-gather (values and scales packed) and HBM bytes
    (P + 1 + 4/B)(Ψ/N + Ψ); hpZ k - 1 steps in the node; qgZ one all-to-all per hop,
    k - 1 and n - 1 steps, and (G + q)·2Ψ(1 + 1/k) bytes of kernels; all-reduces
    (stage 0, replicas) twice the steps."""
    cluster, psi = Cluster(GPUS["h100"], 32), 1000.0

    def traffic(**kw: object) -> dict[str, costmodel.Traffic]:
        return costmodel.dp_traffic(Layout(tp=2, dp=16, **{"zero": 3, **kw}), cluster, psi)

    plain = traffic()
    assert {k: (x.steps, x.kernel_bytes) for k, x in plain.items()} == {
        "gather_fwd": ((12, 3), 0.0),
        "gather_bwd": ((12, 3), 0.0),
        "reduce": ((12, 3), 0.0),
    }
    zeropp = traffic(qwz_block=2048, hpz=True, qgz_bits=4)
    assert zeropp["gather_fwd"].steps == (12, 3)
    assert zeropp["gather_fwd"].kernel_bytes == pytest.approx((2 + 1 + 4 / 2048) * (psi / 16 + psi))
    assert zeropp["gather_hpz"].steps == (3, 0)
    q = 0.5 + 4 / 2048
    assert zeropp["reduce"].steps == (3, 3)
    assert zeropp["reduce"].kernel_bytes == pytest.approx((4 + q) * 2 * psi * (1 + 1 / 4))
    hybrid = traffic(zero=0, dp_shard=8)  # 8 ranks × tp 2: 4 on each of 2 nodes; 2 replicas 2 nodes apart
    assert (hybrid["reduce"].steps, hybrid["replicate"].steps) == ((2 * 6, 2 * 1), (0, 2 * 1))


def _calls_of_a_step(stage: int, micro_batches: int, unit_numel: int, qwz_block: int | None) -> dict[str, int]:
    """On one gloo rank (a group of one still makes every call): the collectives ZeroOptimizer
    issues in one step of `micro_batches` micro-batches of TINY with the Trainer's param groups,
    every backward but the last under no_sync."""
    import contextlib

    from optim import ZeroOptimizer
    from optim.policies import Communication, ZeroPlusPlus
    from research.trainer import weight_decay_groups

    chunks = torch.nn.ModuleList(pipeline_chunks(TINY, 0, 1, 1))
    groups = weight_decay_groups(chunks, 0.1)
    opt = ZeroOptimizer(
        chunks,
        torch.optim.AdamW,
        stage=stage,
        param_groups=groups,
        communication=Communication(unit_numel=unit_numel),
        zero_plus_plus=ZeroPlusPlus(qwz_block=qwz_block),
    )
    ids = torch.randint(0, TINY.vocab_size, (1, TINY.max_seq_len))
    with accounting.tracking() as log:
        for i in range(micro_batches):
            with opt.no_sync() if i < micro_batches - 1 else contextlib.nullcontext():
                opt.backward(chunks[0](ids, ids))
        opt.step()
    return {op: log.calls(op=op) for op in ("all_gather_into_tensor", "reduce_scatter_tensor")}


TINY = GPTConfig(vocab_size=128, n_layers=3, n_heads=2, d_model=32, max_seq_len=16, tie_embeddings=False)


@pytest.mark.parametrize("stage, qwz_block", [(1, None), (2, 2048), (3, None), (3, 2048)])
def test_calls_per_step_are_the_runtimes(stage: int, qwz_block: int | None) -> None:
    """The collectives the step-time model charges latency for are those ZeroOptimizer issues:
    stage 3 gathers each unit's buckets before each forward and backward (qwZ: values and
    scales packed in one call) and reduce-scatters every unit's buckets once (grad_sync last); stages 1-2
    reduce and then gather each bucket once."""
    m, unit_numel = 2, 1024
    real = run_distributed(_calls_of_a_step, 1, stage, m, unit_numel, qwz_block)[0]
    rank = costmodel.rank_params(TINY, 1, 1, 1, 0, unit_numel)
    passes = rank.unit_passes if stage == 3 else rank.bucket_passes
    gathers = sum(n * slot.gathers for p in passes for (_, slot, _), n in p.windows)
    reductions = sum(n * slot.reductions for p in passes for (_, slot, _), n in p.windows)
    assert real == {
        "all_gather_into_tensor": gathers * (2 * m if stage == 3 else 1),
        "reduce_scatter_tensor": reductions,
    }


def test_exposed_communication_per_unit() -> None:
    """A pass's first gather is exposed whole: with the whole model one unit, all of the
    forward gather (one call per bucket, each paying the ring's latency) is exposed; with a unit per layer each
    later gather hides under the previous unit's compute, so less is exposed than gathered;
    with no data parallelism nothing is."""
    model = GPTConfig(vocab_size=64, n_layers=4, n_heads=4, d_model=256, max_seq_len=64, tie_embeddings=False)
    cluster = Cluster(GPUS["h100"], 64, 8, 400)
    layout = Layout(dp=64, zero=3, unit_numel=2**25)  # one unit, the whole model, gathered

    def gather_fwd(layout: Layout) -> costmodel.Collective:
        return next(
            c for c in costmodel.predict_step_time(model, layout, 64, cluster).collectives if c.name == "gather_fwd"
        )

    whole = gather_fwd(layout)
    ((none, unit, also_none), count), *others = costmodel.rank_params(model, 1, 1, 1, 0, 2**25).unit_passes[0].windows
    one = costmodel.dp_traffic(layout, cluster, costmodel.num_params(model))["gather_fwd"]
    assert (none, also_none, count, others) == (None, None, 1, []) and unit.gathers > 1  # a call per bucket key
    calls = unit.gathers
    assert whole.exposed == whole.seconds == pytest.approx(one.transfer_seconds(cluster) + calls * one.latency(cluster))
    per_layer = gather_fwd(dataclasses.replace(layout, unit_numel=2**16))
    assert 0 < per_layer.exposed < per_layer.seconds
    assert costmodel.predict_step_time(model, Layout(dp=1, zero=3), 64, cluster).dp_comm == 0


def test_tied_embedding_all_reduce_is_its_own_line() -> None:
    """With pp > 1 and tied embeddings, the all-reduce of the embedding's gradient between the
    first and last stage (GVh/t bytes, the 1/dp shard of it at ZeRO-1: what each rank holds
    of the reduced gradient; 2 steps, here across nodes) is a family of its own,
    exposed whole; the step's exposed DP comm is the sum over the families, and the plan
    prints the all-reduce as its own row of a table whose exposed total is that sum."""
    from experiments.plan import _where_the_bytes_go

    model = GPTConfig(vocab_size=51200, n_layers=8, n_heads=16, d_model=2048, max_seq_len=2048)
    cluster = Cluster(GPUS["h100"], 64)
    layout = Layout(tp=8, pp=4, dp=2, zero=1, micro_batches=8)
    time = costmodel.predict_step_time(model, layout, 2048, cluster)
    tied = next(c for c in time.collectives if c.name == "tied_embedding")
    volume = 4 * model.padded_vocab / 8 * 2048 / 2
    assert (tied.intra_bytes, tied.inter_bytes) == (0.0, pytest.approx(volume))
    unsharded = costmodel.predict_step_time(model, dataclasses.replace(layout, zero=0), 2048, cluster)
    assert next(c for c in unsharded.collectives if c.name == "tied_embedding").inter_bytes == pytest.approx(2 * volume)
    assert tied.exposed == tied.seconds == pytest.approx(volume / cluster.inter_node_bandwidth + 2 * 14e-6)
    assert time.dp_comm == pytest.approx(sum(c.exposed for c in time.collectives))
    rows = {line[:32].strip(): line.split() for line in _where_the_bytes_go(time.collectives, cluster)[2:]}
    assert set(rows) == {"gradient reduction", "param all-gather after step", "tied-embedding all-reduce", "total"}
    assert float(rows["total"][-1]) == pytest.approx(time.dp_comm, rel=5e-3)
    untied = costmodel.predict_step_time(dataclasses.replace(model, tie_embeddings=False), layout, 2048, cluster)
    assert "tied_embedding" not in {c.name for c in untied.collectives}


def test_collectives_per_step() -> None:
    """Stage 3 gathers before every forward and backward (m each); with hpZ only the first
    forward gather of a step crosses nodes, the 2m - 1 later ones come from the node's slices;
    a reduction per step, or per micro-batch with grad_sync every, and as many replica
    all-reduces."""
    model = GPTConfig(vocab_size=51200, n_layers=4, n_heads=16, d_model=1024, max_seq_len=2048)
    cluster, m = Cluster(GPUS["h100"], 32), 4
    psi = costmodel.rank_params(model, 1, 1, 1, 0).numel

    def per_step(**kw: object) -> dict[str, tuple[float, float]]:
        layout = Layout(dp=32, zero=3, micro_batches=m, **kw)
        time = costmodel.predict_step_time(model, layout, 2048, cluster)
        return {c.name: (c.intra_bytes, c.inter_bytes) for c in time.collectives}

    def once(**kw: object) -> dict[str, tuple[float, float]]:
        x = costmodel.dp_traffic(Layout(dp=32, zero=3, micro_batches=m, **kw), cluster, psi)
        return {k: (v.intra, v.inter) for k, v in x.items()}

    def times(n: int, bytes_: tuple[float, float]) -> tuple[float, float]:
        return (n * bytes_[0], n * bytes_[1])

    plain = once()
    _same_bytes(
        per_step(),
        {
            "gather_fwd": times(m, plain["gather_fwd"]),
            "gather_bwd": times(m, plain["gather_bwd"]),
            "reduce": plain["reduce"],
        },
    )
    hpz = once(hpz=True)
    _same_bytes(
        per_step(hpz=True),
        {
            "gather_fwd": plain["gather_fwd"],
            "gather_hpz": times(2 * m - 1, hpz["gather_hpz"]),
            "reduce": plain["reduce"],
        },
    )
    hybrid = once(dp_shard=8, grad_sync="every")
    assert per_step(dp_shard=8, grad_sync="every")["replicate"] == pytest.approx(times(m, hybrid["replicate"]))


def test_cross_node_volume_of_zeropp_is_a_quarter() -> None:
    """Wang et al. 2023, Table / Section 4: per step ZeRO-3 sends 3M across nodes (M = the
    fp16 model: forward gather, backward gather, gradient reduce-scatter), ZeRO++ 0.75M
    (0.5M int8 forward gather, 0 with hpZ's backward, 0.25M int4 gradients). Here: fp16
    parameters and gradients, one micro-batch, 8 GPUs per node, a shard group of 384 across
    48 nodes. The ratio is 0.25 within 0.01: the fp32 scales add 4/2048 of a byte per
    element (+0.2% and +0.4%) and qgZ's (n-1)/n = 47/48 against (N-1)/N trims 2% of 0.25M."""
    model = GPTConfig(vocab_size=51200, n_layers=8, n_heads=16, d_model=2048, max_seq_len=2048)
    cluster = Cluster(GPUS["h100"], 384, 8, 800)
    zero3 = Layout(dp=384, zero=3, precision="fp16", reduce_dtype="bf16")
    zeropp = dataclasses.replace(zero3, qwz_block=2048, hpz=True, qgz_bits=4)

    def inter(layout: Layout) -> float:
        return sum(c.inter_bytes for c in costmodel.predict_step_time(model, layout, 2048, cluster).collectives)

    assert inter(zeropp) / inter(zero3) == pytest.approx(0.25, abs=0.01)
    psi = costmodel.rank_params(model, 1, 1, 1, 0).numel
    assert inter(zero3) == pytest.approx(3 * 2 * psi * 383 / 384 / 8)  # 3M per rank, 1/k of it on its NIC


V100 = GPU("v100-32gb", 32 * GiB, 125e12, 900e9, 150e9, 25e9)  # DGX-2: NVSwitch 150 GB/s per direction


def _zeropp_gain(gbps: float, seq_len: int = 1024) -> tuple[float, float, float]:
    """(ZeRO-3 s, ZeRO++ s, gain) of GPT 18.4B (40 layers, h 6144: the paper's 18B) on 384 V100s,
    16 per node (24 DGX-2), pure data parallelism, fp16 parameters and gradients, one
    sequence of seq_len tokens per GPU and step, full recomputation (Megatron-DeepSpeed's
    activation checkpointing); ZeRO++ = qwZ (block 2048) + hpZ + qgZ int4."""
    from experiments.plan import PRESETS

    model = PRESETS["gpt-18.4b"].model()
    zero3 = Layout(dp=384, zero=3, recompute="full", precision="fp16", reduce_dtype="bf16")
    zeropp = dataclasses.replace(zero3, qwz_block=2048, hpz=True, qgz_bits=4)
    cluster = Cluster(V100, 384, 16, gbps)
    a, b = (costmodel.predict_step_time(model, lo, seq_len, cluster).total for lo in (zero3, zeropp))
    assert costmodel.predict_memory(model, zeropp, seq_len, gpus_per_node=16).total < V100.memory_bytes
    return a, b, a / b


def test_zeropp_gain_against_the_paper() -> None:
    """Wang et al. 2023 (and the DeepSpeed ZeRO++ blog), 384 V100s, against the model with
    ring latency (NCCL's 3.4 / 14 µs per step), per-unit overlap and quantization kernels:
    - 1K tokens per GPU, 100 Gb/s per node: up to 2.2× ZeRO-3's throughput (about 2× on
      average over model sizes). Predicted 2.88×, asserted within 2.6-3.1×: the model
      over-predicts the best published gain by 31% (it counts no congestion, and zero3d
      packs qwZ's values and scales into one call where DeepSpeed makes two).
    - 1K, 400 Gb/s (4 × 100 Gb/s IB): 1.28-1.36×. Predicted 1.49×, asserted within
      1.35-1.6×: 10% over the published range (1.10× without latency and per-unit overlap).
    - 2K, 400 Gb/s: 1.24-1.29×. Predicted 1.04×, asserted within 0.95-1.15×: the model
      disagrees; ZeRO-3's traffic hides under twice the compute.
    - ZeRO++ at 200 Gb/s matches ZeRO-3 at 800 Gb/s (the blog's Figure 8, 18B and 138B):
      predicted 7% slower, asserted 0-15% slower."""
    assert 2.6 < _zeropp_gain(100)[2] < 3.1
    assert 1.35 < _zeropp_gain(400)[2] < 1.6
    assert 0.95 < _zeropp_gain(400, seq_len=2048)[2] < 1.15
    _, zeropp_200, _ = _zeropp_gain(200)
    zero3_800, _, _ = _zeropp_gain(800)
    assert 1.0 < zeropp_200 / zero3_800 < 1.15


def test_hybrid_and_hpz_memory() -> None:
    """Model states follow the ZeRO table with N = dp_shard; hpZ adds each rank's 1/k slice
    of the sharded parameters, PΨ_sh/k, to the buffers (k = shard ranks per node)."""
    model = GPTConfig(vocab_size=51200, n_layers=4, n_heads=16, d_model=1024, max_seq_len=2048)
    rank = costmodel.rank_params(model, 1, 1, 1, 0)
    psi = rank.aligned
    layout = Layout(dp=32, zero=3, precision="bf16", reduce_dtype="bf16")
    assert costmodel.predict_model_states(model, dataclasses.replace(layout, dp_shard=8)).total == pytest.approx(
        2 * (rank.resident + (psi - rank.resident) / 8) + 14 * psi / 8
    )
    for gpus_per_node, k in ((8, 8), (4, 4)):
        plain = costmodel.predict_memory(model, layout, 2048, gpus_per_node=gpus_per_node)
        hpz = costmodel.predict_memory(model, dataclasses.replace(layout, hpz=True), 2048, gpus_per_node=gpus_per_node)
        assert hpz.buffers - plain.buffers == pytest.approx(2 * (psi - rank.resident) / k)


def test_planner_chooses_hybrid_and_zeropp_where_they_pay() -> None:
    """On a fast network plain ZeRO-3 of the 7B model over 128 ranks still exposes latency
    (127 ring steps per gathered bucket, the first gather of each pass whole), and the
    planner keeps the gathers inside a node instead (7 steps: hybrid sharding or hpZ's
    secondary copy), without quantizing; at 100 Gb/s per node,
    allowed to (`any`), it quantizes and the step is faster than plain ZeRO-3's best, while
    by default (`exact`) it never quantizes; each scheme restricts the choice; pins are
    honoured and invalid ones refused."""
    from experiments.plan import PRESETS

    model = PRESETS["gpt-7b"].model()
    fixed = {"tp": 1, "pp": 1, "zero": 3, "micro_batch_size": 4, "recompute": "selective"}
    fast, slow = Cluster(GPUS["h100"], 128, 8, 3200), Cluster(GPUS["h100"], 128, 8, 100)
    best = costmodel.plan(model, fast, 2048, 2048, **fixed).ranked[0]
    node_local = best.layout.shard == 8 or best.layout.hpz  # hybrid or hpZ: within 0.1% of each other here
    assert node_local and (best.layout.qwz_block, best.layout.qgz_bits) == (None, None)
    assert best.time.total < costmodel.plan(model, fast, 2048, 2048, "zero", **fixed).ranked[0].time.total
    chosen = costmodel.plan(model, slow, 2048, 2048, "any", **fixed).ranked[0]
    exact = costmodel.plan(model, slow, 2048, 2048, **fixed).ranked[0].layout
    assert (exact.qwz_block, exact.qgz_bits) == (None, None)
    plain = costmodel.plan(model, slow, 2048, 2048, "zero", **fixed).ranked[0]
    assert chosen.layout.qwz_block == 2048 and chosen.time.total < plain.time.total
    assert plain.layout.replicas == 1 and plain.layout.qwz_block is None
    hybrid = costmodel.plan(model, slow, 2048, 2048, "hybrid", **fixed).ranked[0].layout
    assert (hybrid.dp_shard, hybrid.qwz_block) == (8, None)
    zeropp = costmodel.plan(model, slow, 2048, 2048, "zero++", **fixed).ranked[0].layout
    assert (zeropp.replicas, zeropp.qwz_block, zeropp.hpz, zeropp.qgz_bits) == (1, 2048, True, 4)
    pinned = costmodel.plan(model, slow, 2048, 2048, "any", dp_shard=16, qgz_bits=8, **fixed).ranked[0].layout
    assert (pinned.dp_shard, pinned.qgz_bits) == (16, 8)
    refused = costmodel.plan(model, slow, 2048, 2048, "any", **{**fixed, "zero": 1}, qgz_bits=4)
    assert not refused.ranked and "qgZ reduces sharded gradients: stages 2-3" in refused.rejected
    refused = costmodel.plan(model, slow, 2048, 2048, dp_shard=3, **fixed)
    assert not refused.ranked and "dp_shard does not divide dp" in refused.rejected


# ---- Mixture-of-Experts ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "d_model, total_billion, dense_billion",
    [(1024, 13.0, 0.35), (2048, 52.0, 1.3)],
    ids=["350M+MoE-128", "1.3B+MoE-128"],
)
def test_moe_sizes_are_deepspeed_moes(d_model: int, total_billion: float, dense_billion: float) -> None:
    """DeepSpeed-MoE (Rajbhandari et al. 2022, Table 1): the 350M and 1.3B dense bases with
    128 experts in every other layer are 13B and 52B parameters; top-1 routing keeps the dense
    model's active parameters."""
    model = GPTConfig(
        vocab_size=50257,
        n_layers=24,
        n_heads=16,
        d_model=d_model,
        max_seq_len=2048,
        moe_experts=128,
        moe_top_k=1,
        moe_every=2,
    )
    assert costmodel.num_params(model) / 1e9 == pytest.approx(total_billion, rel=0.02)
    assert costmodel.active_params(model) / 1e9 == pytest.approx(dense_billion, rel=0.03)
    dense = dataclasses.replace(model, moe_experts=0)
    # 12 MoE blocks: + their routers, - their dense MLPs' biases (experts have none)
    assert costmodel.active_params(model) == costmodel.num_params(dense) + 12 * (128 * d_model - 5 * d_model)


@pytest.mark.slow
def test_predicted_all_to_all_bytes_are_a_runs(summaries: dict[str, dict]) -> None:
    """With a capacity every rank sends E·C rows per all-to-all; four per MoE layer and
    micro-batch (dispatch and combine, forward and backward): measured on every rank."""
    summary = summaries["dp8-ep4-zero1-moe-capacity"]
    model, layout, seq_len = costmodel.run_spec(summary["config"])
    moe_layers = sum(map(model.is_moe, range(model.n_layers)))
    predicted = 4 * moe_layers * layout.micro_batches * costmodel.expert_all_to_all_bytes(model, layout, seq_len)
    for rank in summary["ranks"]:
        assert rank["comm_per_step"]["ep"]["ops"]["all_to_all_single"]["bytes"] == predicted


MOE_MODEL = GPTConfig(vocab_size=51200, n_layers=8, n_heads=16, d_model=2048, max_seq_len=2048, moe_experts=8)


def test_expert_parallelism_in_the_step_time() -> None:
    """ep = 1: no all-to-all; ep > 1: four per MoE layer and micro-batch at the bytes above,
    over NVLink inside a node and the network beyond it; the experts' data-parallel bytes
    fall with ep (their group has N/ep ranks) and vanish at ep = N."""
    cluster = Cluster(GPUS["h100"], 16, inter_node_gbps=400)
    times = {ep: costmodel.predict_step_time(MOE_MODEL, Layout(dp=16, ep=ep), 2048, cluster) for ep in (1, 2, 8, 16)}
    assert times[1].ep_comm == 0
    sent = costmodel.expert_all_to_all_bytes(MOE_MODEL, Layout(dp=16, ep=8), 2048)  # all on one node
    assert times[8].ep_comm == pytest.approx(4 * 8 * (sent / cluster.gpu.intra_node_bandwidth + cluster.latency(1, 0)))
    assert times[16].ep_comm > 2 * times[8].ep_comm  # half the peers across the network

    def dp_bytes(ep: int) -> float:
        return sum(c.intra_bytes + c.inter_bytes for c in times[ep].collectives)

    assert dp_bytes(1) > dp_bytes(2) > dp_bytes(8) > dp_bytes(16)
    for_experts = dp_traffic(expert_layout(Layout(dp=16, ep=16)), cluster, 1 / 16)
    assert all(x.intra == x.inter == 0 for x in for_experts.values())


def test_moe_memory_and_search() -> None:
    """MoE layers' activations join the layer count (the fullest chunk's), the planner searches
    ep over the divisors of dp that divide the experts, and never offers hpZ or qgZ with them."""
    layout = Layout(dp=8, ep=4, micro_batch_size=1)
    mem = costmodel.predict_memory(MOE_MODEL, layout, 2048)
    dense = dataclasses.replace(MOE_MODEL, moe_experts=0)
    moe_layer = costmodel.layer_activation_bytes(MOE_MODEL, 2048, layout, moe=True)
    dense_layer = costmodel.layer_activation_bytes(dense, 2048, layout)
    assert mem.activations - costmodel.predict_memory(dense, layout, 2048).activations == pytest.approx(
        8 * (moe_layer - dense_layer)
    )
    plan = costmodel.plan(MOE_MODEL, Cluster(GPUS["h100"], 16), 64, 2048, tp=1, pp=1, zero=1, micro_batch_size=1)
    assert {e.layout.ep for e in plan.ranked} == {1, 2, 4, 8}
    assert not any(e.layout.hpz or e.layout.qgz_bits for e in plan.ranked)
    anything = costmodel.plan(MOE_MODEL, Cluster(GPUS["h100"], 16), 64, 2048, "any", tp=1, pp=1, zero=3)
    assert anything.ranked and not any(e.layout.hpz or e.layout.qgz_bits for e in anything.ranked)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_moe_model_states_are_megatrons_per_parameter_bytes(ep: int) -> None:
    """Megatron-Core's distributed optimizer (ZeRO-1, bf16 parameters, fp32 gradients): 6 +
    12/dp bytes per dense parameter and 6 + 12/edp per expert parameter a rank holds (edp =
    dp/ep ranks hold the same experts, each rank Ψ_e/ep of them)."""
    model = GPTConfig(vocab_size=1024, n_layers=4, n_heads=4, d_model=256, moe_experts=8, moe_every=2)
    with torch.device("meta"):
        experts = sum(p.numel() for n, p in _whole(model).named_parameters() if ".experts." in n)
    dense = costmodel.num_params(model) - experts
    states = costmodel.predict_model_states(model, Layout(dp=8, ep=ep, zero=1, precision="bf16", reduce_dtype="fp32"))
    edp = 8 // ep
    expected = dense * (6 + 12 / 8) + experts / ep * (6 + 12 / edp)
    assert states.total == pytest.approx(expected, rel=2e-3)  # parameters aligned to 16 elements


def _whole(model: GPTConfig) -> torch.nn.Module:
    from parallel.tensor import ShapeGroup
    from research.model import GPT

    return GPT(model, tp_group=ShapeGroup(1))


def test_plan_command_takes_a_moe_config(capsys: pytest.CaptureFixture[str]) -> None:
    """`experiments.plan --config` of an MoE model: the table has an ep column."""
    from experiments import plan

    plan.main(["--config", "experiments/configs/tiny-moe.yaml", "--gpus", "8", "--top", "3"])
    header, *rows = capsys.readouterr().out.split("\n\n")[1].splitlines()
    assert header.split()[5] == "ep" and len(rows) == 3
    assert all(int(row.split()[5]) in (1, 2, 4, 8) for row in rows)


@pytest.mark.parametrize("cast", ["every", "down"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_fp8_activations_are_what_the_layer_saves(activation: str, cast: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Float8 linear layers change a layer's saved bytes by `fp8_bytes`: measured by the
    saved-tensor hooks, to the scales' few bytes; with every linear in float8, and with the
    MLP's down projection alone (`fp8.pays` made to pass only its wider-in-than-out weight)."""
    if cast == "down":
        monkeypatch.setattr(fp8_linear, "pays", lambda in_features, out_features: in_features > out_features)
    s, b = 64, 2
    one = GPTConfig(
        vocab_size=128, n_layers=1, n_heads=4, d_model=64, max_seq_len=s, activation=activation,
        fp8_filter="none" if cast == "every" else "auto",
    )  # fmt: skip
    assert one.float8_linears(1) == ({"down"} if cast == "down" else {"qkv", "proj", "up", "down"})
    two = dataclasses.replace(one, n_layers=2)

    def layer(recipe: str) -> int:
        def cfg(m: GPTConfig) -> GPTConfig:
            return dataclasses.replace(m, fp8=recipe)

        return _saved_bytes(cfg(two), torch.bfloat16, (b, s)) - _saved_bytes(cfg(one), torch.bfloat16, (b, s))

    measured = layer("tensorwise") - layer("none")
    predicted = costmodel.memory.fp8_bytes(one, s, Layout(micro_batch_size=b, precision="bf16", fp8=True))
    assert measured == pytest.approx(predicted, abs=64)
    assert predicted < 0


def test_fp8_in_the_step_time_and_the_plan() -> None:
    """The linear layers' FLOPs at the float8 peak (H100: 1978.9 TFLOP/s, twice bf16's), the
    rest at bf16's; a GPU without float8 tensor cores is refused in one sentence."""
    assert GPUS["h100"].fp8_flops == pytest.approx(1978.9e12) and GPUS["a100-80gb"].fp8_flops is None
    model = GPTConfig(vocab_size=51200, n_layers=8, n_heads=32, d_model=4096, max_seq_len=2048)
    layouts = {f: Layout(dp=8, zero=1, precision="bf16", fp8=f) for f in (False, True)}
    cluster = Cluster(GPUS["h100"], 8)
    bf16, fp8 = (costmodel.predict_step_time(model, layouts[f], 2048, cluster) for f in (False, True))
    assert 0.5 * bf16.forward < fp8.forward < 0.8 * bf16.forward
    assert (
        costmodel.predict_memory(model, layouts[True], 2048).activations
        < costmodel.predict_memory(model, layouts[False], 2048).activations
    )
    plan = costmodel.plan(model, cluster, 64, 2048, zero=1, tp=1, pp=1, fp8=True)
    assert plan.ranked and all(e.layout.fp8 for e in plan.ranked)
    with pytest.raises(ValueError, match="has no float8 tensor cores"):
        costmodel.predict_step_time(model, layouts[True], 2048, Cluster(GPUS["a100-80gb"], 8))


def test_plan_predicts_one_given_layout_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    """`--layout ... --json`: the prediction of exactly that layout (micro-batches from the
    global batch), its memory parts and step time; a layout that cannot run or fit says why
    and exits 1."""
    from experiments import plan

    argv = ["--model", "gpt-7b", "--gpus", "16", "--gpu", "h100", "--json"]
    plan.main([*argv, "--layout", "tp=2,pp=1,dp=8,zero=3,mbs=1,recompute=none,sp=1"])
    got = json.loads(capsys.readouterr().out)
    model = plan.PRESETS["gpt-7b"].model()
    layout = Layout(tp=2, dp=8, zero=3, micro_batches=256, sequence_parallel=True)
    e = costmodel.estimate(model, layout, 2048, Cluster(GPUS["h100"], 16))
    assert got["error"] is None and got["step_s"] == pytest.approx(e.time.total)
    assert got["memory_bytes"] == pytest.approx(e.memory.total)
    assert got["activation_bytes"] + got["model_state_bytes"] + got["buffer_bytes"] == pytest.approx(e.memory.total)
    for bad, why in (
        ("tp=1,pp=2,dp=8,zero=0,mbs=4", "needs 9"),
        ("tp=2,pp=2,dp=4,zero=1,v=3", "layers do not split evenly"),
        ("tp=2,pp=1,dp=4,zero=1", "is not --gpus=16"),
    ):
        with pytest.raises(SystemExit) as exit_:
            plan.main([*argv, "--layout", bad])
        assert exit_.value.code == 1 and why in json.loads(capsys.readouterr().out)["error"], bad


# ---- hardware files ---------------------------------------------------------------------------
def test_built_in_systems_are_files_with_their_datasheets() -> None:
    """Each built-in system is a file of research/costmodel/systems; a Frontier node is 8
    MI250X GCDs sharing 4 × 25 GB/s Slingshot NICs; B200 and MI300X from their datasheets."""
    from research.costmodel.hardware import SYSTEMS, SYSTEMS_DIR, load_system

    assert set(SYSTEMS) == {p.stem for p in SYSTEMS_DIR.glob("*.yaml")} >= {"h100", "b200", "mi250x", "mi300x"}
    frontier = SYSTEMS["mi250x"]
    assert frontier.gpus_per_node == 8 and frontier.gpu.inter_node_bandwidth == 4 * 25e9 / 8
    assert (frontier.gpu.memory_bytes, frontier.gpu.peak_flops) == (64 * GiB, 191.5e12)
    b200, mi300x = SYSTEMS["b200"].gpu, SYSTEMS["mi300x"].gpu
    assert (b200.peak_flops, b200.fp8_flops, b200.hbm_bandwidth) == (2250e12, 4500e12, 8000e9)
    assert (mi300x.peak_flops, mi300x.hbm_bandwidth, mi300x.intra_node_bandwidth) == (1307.4e12, 5300e9, 448e9)
    assert load_system(SYSTEMS_DIR / "h100.yaml") == SYSTEMS["h100"]
    assert SYSTEMS["h100"].cluster(16) == Cluster(GPUS["h100"], 16)  # NCCL's latencies unless a file says


def test_plan_takes_a_hardware_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--hardware FILE predicts as the built-in system it copies; a measured η, peak and
    network in the file change the prediction; a broken file is one sentence and exit."""
    from experiments import plan

    layout = ["--json", "--layout", "tp=2,pp=1,dp=8,zero=3,mbs=1,recompute=none,sp=1"]

    def predict(*hardware: str) -> dict:
        plan.main(["--model", "gpt-7b", "--gpus", "16", *hardware, *layout])
        return json.loads(capsys.readouterr().out)

    h100 = Path(costmodel.hardware.SYSTEMS_DIR / "h100.yaml").read_text()
    (tmp_path / "same.yaml").write_text(h100)
    assert predict("--hardware", str(tmp_path / "same.yaml")) == predict("--gpu", "h100")
    slow = h100.replace("inter_node: {gbs: 50}", "inter_node: {gbs: 5, latency_us: 50}")
    (tmp_path / "slow.yaml").write_text(slow + "matmul_efficiency: 0.3\n")
    assert predict("--hardware", str(tmp_path / "slow.yaml"))["step_s"] > 2 * predict("--gpu", "h100")["step_s"]
    (tmp_path / "cpu.yaml").write_text(slow.replace("device: h100", "device: cpu"))
    with pytest.raises(
        SystemExit, match=r"is not in research\.costmodel\.datasheet's GPU table: give peak_tflops\.bf16 and hbm_gbs"
    ):
        predict("--hardware", str(tmp_path / "cpu.yaml"))


# Dash et al. 2023 (arXiv 2312.12705), "Optimizing Distributed Training on Frontier for
# Large Language Models": MFU of GPT 175B on 1024 and 1T on 3072 MI250X GCDs.
FRONTIER = (("gpt-175b", 1024, 0.3614), ("gpt-1t", 3072, 0.3196))


@pytest.mark.slow
def test_frontier_throughputs_with_one_measured_efficiency() -> None:
    """One η for the system (0.39, tests/data/frontier_2023.yaml) brings the planner's best
    layout of each within 10% of the published MFU; the datasheet node with the η fit to
    A100s (0.65) predicts that same layout 1.2x too fast or more (its own best layouts:
    1.5-1.7x, docs/planner.md)."""
    from experiments import plan
    from research.costmodel.hardware import SYSTEMS, load_system

    frontier = load_system(Path(__file__).parent / "data" / "frontier_2023.yaml")
    for name, gpus, published in FRONTIER:
        preset = plan.PRESETS[name]
        best = costmodel.plan(preset.model(), frontier.cluster(gpus), preset.global_batch_size, 2048).ranked[0]
        assert best.mfu == pytest.approx(published, rel=0.10), (name, best.layout.describe())
        datasheet = costmodel.estimate(preset.model(), best.layout, 2048, SYSTEMS["mi250x"].cluster(gpus))
        assert datasheet.mfu > 1.2 * published, name


# ---- the backend's collectives and shared compute (the emulated cluster) -------------------
def test_a_reduce_scatter_on_gloo_is_an_all_reduce() -> None:
    """gloo reduces-scatters by an all-reduce: twice the bytes and steps of NCCL's ring (as
    a shaped link counts them: a ZeRO-3 step of dp 4 on 2 hosts × 2 sends 1.5 gradient
    copies per host for the reduction); its all-gather is a ring, as NCCL's."""
    from research.costmodel.dpcomm import reduce_scatter

    gloo = Cluster(GPUS["h100"], 4, gpus_per_node=2, backend="gloo")
    nccl = dataclasses.replace(gloo, backend="nccl")
    assert reduce_scatter(gloo, 4, 1, 3.0) == dataclasses.replace(
        reduce_scatter(nccl, 4, 1, 6.0), steps=nccl.ring_steps(4, 1, rounds=2)
    )
    layout = Layout(dp=4, zero=3)
    on_gloo, on_nccl = dp_traffic(layout, gloo, 1.0), dp_traffic(layout, nccl, 1.0)
    assert on_gloo["reduce"].inter == 2 * on_nccl["reduce"].inter
    assert on_gloo["gather_fwd"] == on_nccl["gather_fwd"]


def test_shared_compute_stretches_compute_and_fills_the_pipeline_bubble() -> None:
    """4 devices on 2 compute units (σ = 2): without a pipeline every compute term doubles;
    a pipeline's bubble is filled by the ranks whose turn it is not: pp 2 with 2 micro-batches
    and free sends takes 4 (t_f + t_b), not 2·3 (a stage alone, 2 processes on 2 units, runs
    at one alone's rate). Units ≥ devices change nothing."""
    model = GPTConfig(vocab_size=512, n_layers=4, n_heads=16, d_model=2048, max_seq_len=2048)
    base = Cluster(GPUS["h100"], 4, gpus_per_node=2)
    shared = dataclasses.replace(base, compute_units=2)
    assert dataclasses.replace(base, compute_units=8).compute_share == 1.0 and shared.compute_share == 2.0

    def step(layout: Layout, cluster: Cluster) -> costmodel.StepTime:
        return costmodel.predict_step_time(model, layout, 2048, cluster)

    dp = Layout(dp=4, zero=0, precision="fp32")
    alone, two = step(dp, base), step(dp, shared)
    assert two.forward == pytest.approx(2 * alone.forward) and two.optimizer == pytest.approx(2 * alone.optimizer)
    pp = Layout(pp=2, dp=2, zero=1, micro_batches=2, precision="fp32")
    free_sends = dataclasses.replace(base, inter_node_gbps=1e12, intra_node_latency=0.0, inter_node_latency=0.0)
    alone, two = step(pp, free_sends), step(pp, dataclasses.replace(free_sends, compute_units=2))
    assert alone.bubble == pytest.approx(alone.forward + alone.backward) and two.bubble == pytest.approx(0.0, abs=1e-12)
    compute = alone.pipeline - alone.bubble  # m(t_f + t_b)
    assert two.pipeline == pytest.approx(2 * compute, rel=1e-9) and two.pp_comm == 0.0
    assert step(pp, dataclasses.replace(base, compute_units=4)) == step(pp, base)


@pytest.mark.parametrize(
    ("name", "pp", "m", "v"), [("gpipe", 3, 5, 1), ("1f1b", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2), ("zb-h1", 4, 8, 1)]
)
@pytest.mark.parametrize("t_comm", [0.0, 0.3])
def test_a_pipeline_on_cores_of_its_own_is_the_schedule_simulators(
    name: str, pp: int, m: int, v: int, t_comm: float
) -> None:
    """Processor sharing with every stage at one alone's rate is `parallel.pipeline.simulate`."""
    from parallel.pipeline.simulate import simulate
    from research.costmodel.sharing import shared_makespan

    shared = shared_makespan(name, pp, m, v, (1.0, 2.0), (0.0, 0.0), t_comm, lambda n: 1.0, True)
    assert shared == pytest.approx(simulate(name, pp, m, v, 1.0, 2.0, t_comm=t_comm).makespan, rel=1e-12)


def test_stages_that_take_turns_on_the_cores_compute_faster_alone() -> None:
    """1F1B, 2 stages, 2 micro-batches (t_f 1, t_b 2 alone), each stage 1.5 times slower
    while both compute: F0 alone 1; F1 ‖ F0 1.5; B0 on the last stage alone 2; its F1 ‖ the
    first's B0 1.5, then B1 ‖ the rest of B0 1.5; B1's rest alone 1; the first's B1 2:
    10.5, above both the critical path alone (9) and the cores' work (2 · 1.5 · 3 = 9).
    Calls that wait on the network leave the cores to the other stage: never slower."""
    from research.costmodel.sharing import shared_makespan

    def run(calls: tuple[float, float], on_cores: bool) -> float:
        return shared_makespan("1f1b", 2, 2, 1, (1.0, 2.0), calls, 0.0, lambda n: 1.5 if n > 1 else 1.0, on_cores)

    assert run((0.0, 0.0), True) == pytest.approx(10.5, rel=1e-12)
    assert run((0.5, 0.5), False) < run((0.5, 0.5), True)


@pytest.mark.parametrize("gbps", [1.0, 1000.0], ids=["slow-link", "fast-link"])
def test_a_tp_group_across_hosts_leaves_the_cores_to_the_others_while_it_waits(gbps: float) -> None:
    """4 devices on 2 compute units, tp 2 × dp 2. The two ranks of a TP group compute
    together (2 on 2 units: at one alone's rate). Where the group spans hosts, its calls wait
    on the network and the other group computes meanwhile: the step is the longer of the
    cores' work (σ = 2 times the compute) and one group's own path (its compute and calls).
    Inside a host the calls use the cores: their time adds to the cores' work."""
    model = GPTConfig(vocab_size=512, n_layers=4, n_heads=16, d_model=2048, max_seq_len=2048)
    layout = Layout(tp=2, dp=2, zero=1, micro_batches=2, precision="fp32")

    def step(per_node: int, units: float | None) -> costmodel.StepTime:
        cluster = Cluster(GPUS["h100"], 4, gpus_per_node=per_node, inter_node_gbps=gbps, compute_units=units)
        return costmodel.predict_step_time(model, layout, 2048, cluster)

    alone = step(1, None)
    compute = alone.pipeline - alone.tp_comm  # m(t_f + t_b) at one alone's rate, less the calls
    across = step(1, 2)
    assert across.pipeline == pytest.approx(max(2 * compute, compute + across.tp_comm), rel=1e-12)
    assert (across.pipeline > 2 * compute) == (gbps == 1.0)  # a slow link: the group's path binds
    inside = step(2, 2)
    assert inside.pipeline == pytest.approx(2 * compute + inside.tp_comm, rel=1e-12)


def test_a_hardware_file_names_its_backend_and_shared_compute(tmp_path: Path) -> None:
    """`backend`, `compute_units` and `quantize_gbs` load; each quantizer's kernels take its
    measured rate (qwZ's gather, qgZ's reduction), slowed by the shared compute, and HBM's
    where it is absent; a scalar rate, an unknown quantizer and an unknown backend are refused
    by name."""
    from research.costmodel.hardware import SYSTEMS_DIR, load_system

    h100 = (SYSTEMS_DIR / "h100.yaml").read_text()
    rates = "quantize_gbs: {qwz: 0.4, qgz: 0.25}\n"
    (tmp_path / "cpu.yaml").write_text(h100 + "backend: gloo\ncompute_units: 2.5\n" + rates)
    cluster = load_system(tmp_path / "cpu.yaml").cluster(5)
    assert (cluster.backend, cluster.compute_units, cluster.compute_share) == ("gloo", 2.5, 2.0)
    assert cluster.gpu.kernel_bandwidth("qwz") == 0.4e9 and cluster.gpu.kernel_bandwidth("qgz") == 0.25e9
    assert GPUS["h100"].kernel_bandwidth("qgz") == GPUS["h100"].hbm_bandwidth
    zpp = dp_traffic(Layout(dp=5, zero=3, qwz_block=2048, qgz_bits=4), cluster, 1.0)
    for family, rate in (("gather_fwd", 0.4e9), ("reduce", 0.25e9)):
        assert zpp[family].kernel_seconds(cluster) == pytest.approx(2.0 * zpp[family].kernel_bytes / rate)
    for bad, message in (
        ("quantize_gbs: 0.4\n", r"bad\.yaml: quantize_gbs is a mapping of qwz and qgz to GB/s, got 0\.4"),
        ("quantize_gbs: {qwz: 1, qgZ: 1}\n", r"quantize_gbs is a mapping of qwz and qgz"),
        ("quantize_gbs: {qgz: 0}\n", r"quantize_gbs must be positive"),
        ("backend: mpi\n", r"bad\.yaml: backend 'mpi' is not one of nccl, gloo"),
    ):
        (tmp_path / "bad.yaml").write_text(h100 + bad)
        with pytest.raises(ValueError, match=message):
            load_system(tmp_path / "bad.yaml")


def test_a_two_rank_exchange_across_nodes_takes_the_measured_pair_rate(tmp_path: Path) -> None:
    """`inter_node.pair_gbs` is the rate of two nodes exchanging one message each way: a
    2-rank all-gather across nodes (ZeRO-1's gather over dp 2, qgZ's cross-node hop) moves its
    network bytes at it; a ring over more ranks, an all-reduce and a file without the key keep
    the network's rate; an override of the network scales the pair rate with it."""
    from research.costmodel.hardware import SYSTEMS, SYSTEMS_DIR, load_system

    h100 = (SYSTEMS_DIR / "h100.yaml").read_text()
    (tmp_path / "pair.yaml").write_text(h100.replace("inter_node: {gbs: 50", "inter_node: {pair_gbs: 20, gbs: 50"))
    paired, plain = load_system(tmp_path / "pair.yaml").cluster(16), SYSTEMS["h100"].cluster(16)
    assert paired.pair_bandwidth == 20e9 and plain.pair_bandwidth == plain.inter_node_bandwidth
    pair = dp_traffic(Layout(tp=8, dp=2, zero=1), paired, 1.0)
    gather = pair["gather_step"]
    assert gather.exchange and gather.transfer_seconds(paired) == pytest.approx(2 / 2 / 20e9)
    assert not pair["reduce"].exchange  # a reduce-scatter ring (gloo: an all-reduce): at the network's rate
    ring = dp_traffic(Layout(tp=4, dp=4, zero=1), paired, 1.0)["gather_step"]
    assert not ring.exchange and ring.transfer_seconds(paired) == ring.transfer_seconds(plain)
    qgz = dp_traffic(Layout(tp=4, dp=4, zero=3, qgz_bits=4), paired, 1.0)["reduce"]
    assert qgz.exchange and qgz.transfer_seconds(paired) > qgz.transfer_seconds(plain)
    wider = load_system(tmp_path / "pair.yaml").cluster(16, inter_node_gbps=800)
    assert wider.pair_bandwidth == pytest.approx(wider.inter_node_bandwidth * 0.4)
    (tmp_path / "bad.yaml").write_text(h100.replace("inter_node: {gbs: 50", "inter_node: {pair_gbs: 0, gbs: 50"))
    with pytest.raises(ValueError, match="every bandwidth must be positive"):
        load_system(tmp_path / "bad.yaml")


def test_a_collective_waits_once_per_call_for_its_groups_last_rank(tmp_path: Path) -> None:
    """`wait_us` (inside a node, across nodes) and `pair_wait_us` (two ranks on two nodes) are
    paid once per call, on top of α per ring step: a ring across nodes waits as one across
    nodes however many steps it makes, qgZ once per hop, a TP all-reduce once; a built-in
    system (devices that arrive together) waits nothing."""
    from research.costmodel.dpcomm import ring
    from research.costmodel.hardware import SYSTEMS, SYSTEMS_DIR, load_system
    from research.costmodel.steptime import _tp_all_reduce

    h100 = (SYSTEMS_DIR / "h100.yaml").read_text()
    waits = "inter_node: {wait_us: 300, pair_wait_us: 500, latency_us: 10, gbs: 50"
    text = h100.replace("inter_node: {gbs: 50", waits).replace(
        "intra_node: {gbs: 450", "intra_node: {wait_us: 100, gbs: 450"
    )
    assert text.count("wait_us") == 3, "h100.yaml's links changed: update the replacements above"
    (tmp_path / "waits.yaml").write_text(text)
    cluster, plain = load_system(tmp_path / "waits.yaml").cluster(16), SYSTEMS["h100"].cluster(16)
    a_in = cluster.intra_node_latency
    assert ring(cluster, 8, 1, 1.0, rounds=2).latency(cluster) == pytest.approx(14 * a_in + 100e-6)
    assert ring(cluster, 16, 1, 1.0).latency(cluster) == pytest.approx(14 * a_in + 10e-6 + 300e-6)
    assert ring(cluster, 2, 8, 1.0, calls=3).latency(cluster) == pytest.approx(3 * (10e-6 + 500e-6))
    qgz = dp_traffic(Layout(tp=4, dp=4, zero=3, qgz_bits=4), cluster, 1.0)["reduce"]
    assert qgz.latency(cluster) == pytest.approx(a_in + 10e-6 + 100e-6 + 500e-6)
    assert _tp_all_reduce(0.0, 8, cluster) == pytest.approx(14 * a_in + 100e-6)
    assert _tp_all_reduce(0.0, 8, plain) == pytest.approx(14 * plain.intra_node_latency)
    assert _tp_all_reduce(1e6, 1, cluster) == 0.0  # no TP group: nothing to wait for
    assert plain.wait(True) == plain.wait(False) == plain.wait(True, pair=True) == 0.0
    (tmp_path / "bad.yaml").write_text(text.replace("wait_us: 100", "wait_us: -100"))
    with pytest.raises(ValueError, match=r"bad\.yaml: wait_us, wait_growth and wait_reach_ms must be zero or more"):
        load_system(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text(text.replace("pair_wait_us: 500", "pair_wait_us: 500, pair_wait_growth: 0.1"))
    with pytest.raises(ValueError, match=r"bad\.yaml: pair_wait_growth and pair_wait_reach_ms go together"):
        load_system(tmp_path / "bad.yaml")


def test_a_calls_wait_grows_with_the_compute_since_its_group_last_met(tmp_path: Path) -> None:
    """`wait_growth` κ and `wait_reach_ms`: calls in a row after w seconds of compute wait
    ω₀ each and κ·min(w, reach) once. A TP pass's calls share its compute (σ-shared), so they
    add κ·σ·compute in all; a stage-3 gather or reduction adds κ·min(w_s, reach) per slot."""
    from research.costmodel.hardware import SYSTEMS_DIR, load_system
    from research.costmodel.steptime import _micro_batch

    h100 = (SYSTEMS_DIR / "h100.yaml").read_text()
    model = GPTConfig(n_layers=4, n_heads=4, d_model=256, max_seq_len=128, vocab_size=256)
    grown = "intra_node: {wait_us: 100, wait_growth: 0.2, wait_reach_ms: 1000, gbs: 450"
    flat = grown.replace("wait_growth: 0.2", "wait_growth: 0")
    for name, link in (("grown", grown), ("flat", flat)):
        text = h100.replace("intra_node: {gbs: 450", link) + "backend: gloo\ncompute_units: 4\n"
        (tmp_path / f"{name}.yaml").write_text(text)
    cluster, base = (load_system(tmp_path / f"{n}.yaml").cluster(8) for n in ("grown", "flat"))
    assert cluster.compute_share == 2.0
    assert cluster.wait(False, calls=3, before=0.5) == pytest.approx(3 * 100e-6 + 0.2 * 0.5)
    assert cluster.wait(False, calls=3, before=5.0) == pytest.approx(3 * 100e-6 + 0.2 * 1.0)  # held past reach
    assert cluster.wait(False, calls=0, before=0.5) == 0.0
    layout = Layout(tp=8, dp=1, zero=0, micro_batch_size=1)
    c_f, c_b, tp_f, tp_b, *_ = _micro_batch(model, layout, 128, cluster)
    _, _, flat_f, flat_b, *_ = _micro_batch(model, layout, 128, base)
    assert tp_f - flat_f == pytest.approx(0.2 * 2.0 * c_f) and tp_b - flat_b == pytest.approx(0.2 * 2.0 * c_b)
    stage3 = Layout(tp=1, dp=8, zero=3, micro_batch_size=1, unit_numel=1)
    step, flat_step = (costmodel.predict_step_time(model, stage3, 128, x) for x in (cluster, base))
    grown_dp, flat_dp = ({c.name: c.latency for c in x.collectives} for x in (step, flat_step))
    for name, compute in (("gather_fwd", step.forward), ("gather_bwd", step.backward), ("reduce", step.backward)):
        # every layer is a gathered unit: the slots' compute sums to the pass's (σ-shared)
        assert grown_dp[name] - flat_dp[name] == pytest.approx(0.2 * compute, rel=0.02), name


def _tp_all_reduces(tie: bool) -> tuple[float, float]:
    """(activation-sized, token-sized) all-reduces one forward + backward of a tp 2 GPT makes
    (no SP), from the calls and bytes parallel.comm counts."""
    import torch.distributed as dist

    from research.model import GPT

    config = dataclasses.replace(TINY, tie_embeddings=tie)
    model = GPT(config, tp_group=dist.new_group([0, 1]))
    b, s = 2, config.max_seq_len
    ids = torch.randint(0, config.vocab_size, (b, s))
    with accounting.tracking() as log:
        model(ids, ids).backward()
    calls, payload = log.calls(op="all_reduce"), log.total_bytes(op="all_reduce") / (2 * (2 - 1) / 2)
    activation, token = 4 * s * b * config.d_model, 4 * s * b
    acts = (payload - calls * token) / (activation - token)
    return acts, calls - acts


@pytest.mark.parametrize("tie", [True, False])
def test_tp_collectives_of_a_micro_batch_are_the_models(tie: bool) -> None:
    """The planner's TP all-reduces of a micro-batch on one stage are the GPT's: two per layer
    each way, the embedding's output in forward, the head's input in backward, and the three
    token-sized ones of the vocabulary-parallel cross entropy."""
    from research.costmodel.steptime import _tp_ends

    acts, tokens = run_distributed(_tp_all_reduces, 2, tie)[0]
    ends = sum(_tp_ends(dataclasses.replace(TINY, tie_embeddings=tie), Layout(tp=2)))
    assert (acts, tokens) == (pytest.approx(4 * TINY.n_layers + ends), pytest.approx(3))
