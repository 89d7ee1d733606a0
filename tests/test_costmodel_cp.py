"""The planner's context parallelism (`Layout.cp`, `cp_mode`, `cp_a2a`), against its formulas
by hand: a rank's activations and logits ÷ cp plus a ring's K/V blocks in flight, ZeRO over
dp × cp, compute ÷ cp, the ring's time t_0 + Σ max(t_j, t_kv) with the first transfer under
the local block, the all-to-alls' bytes, the layouts refused and why, and the search at 128K
tokens choosing cp where cp = 1 does not fit. (The top-k pruning with cp in the space:
tests/test_costmodel.py::test_plan_top_estimates_only_what_can_rank.)"""

from __future__ import annotations

import dataclasses

import pytest

from research import costmodel
from research.costmodel import GPUS, Cluster, GiB, Layout
from research.costmodel.dpcomm import dp_traffic
from research.costmodel.steptime import MATMUL_EFFICIENCY, _micro_batch
from research.model import GPTConfig

# the 1.31B GPT of experiments/configs/gpt-1.3b.yaml, with RoPE (no position table to grow)
GPT_1B = GPTConfig(vocab_size=256, n_layers=26, n_heads=16, d_model=2048, bias=False, position="rope")
LONG = 131072


def _model(seq_len: int, **changes: object) -> GPTConfig:
    return dataclasses.replace(GPT_1B, max_seq_len=seq_len, **changes)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
def test_activations_per_rank_divide_by_cp(recompute: str, tp: int, sp: bool) -> None:
    """A rank holds s/cp of each sequence: every layer's saved bytes, the MoE layer's (but the
    router's fp32 weight copy) and the logits at the head are the cp = 1 rank's ÷ cp;
    all-to-all holds nothing more, a
    ring (and hybrid's ring) the K/V block it computes on and the one arriving, 2 × 2A·(s/cp)·b·h/t."""
    model, s, b = _model(8192), 8192, 2
    one = Layout(tp=tp, micro_batch_size=b, recompute=recompute, sequence_parallel=sp)
    moe = _model(8192, moe_experts=4, moe_every=2)
    for cp in (2, 4, 8):
        split = dataclasses.replace(one, cp=cp, cp_mode="all-to-all")
        for m in (model, moe):
            assert costmodel.layer_activation_bytes(m, s, split) == pytest.approx(
                costmodel.layer_activation_bytes(m, s, one) / cp
            )
        weight = 4 * moe.d_model * moe.moe_experts  # the router's fp32 copy of its weight: not per token
        assert costmodel.moe_mlp_bytes(moe, s, split) - weight == pytest.approx(
            (costmodel.moe_mlp_bytes(moe, s, one) - weight) / cp
        )
        whole, part = (costmodel.predict_memory(model, lo, s) for lo in (one, split))
        assert part.activations == pytest.approx(whole.activations / cp)  # logits at the head included
        # ZeRO (stage 1 here) shards over the cp ranks as over dp ranks: below
        assert part.model_states == costmodel.predict_model_states(model, dataclasses.replace(one, dp=cp))
        block = 2 * 2 * (s / cp) * b * model.d_model / tp  # keys and values, bf16
        kv = 2 * block
        for mode, a in (("ring", None), ("hybrid", 2)):
            if a is None or a < cp:
                ring = dataclasses.replace(split, cp_mode=mode, cp_a2a=a)
                assert costmodel.kv_block_bytes(model, s, ring) == pytest.approx(block)
                assert costmodel.ring_kv_bytes(model, s, ring) == pytest.approx(kv)
                assert costmodel.predict_memory(model, ring, s).activations == pytest.approx(part.activations + kv)
        assert costmodel.ring_kv_bytes(model, s, split) == 0.0


def test_zero_shards_and_reduces_over_dp_times_cp() -> None:
    """cp ranks hold the same parameters: ZeRO's shard group is dp_shard × cp (Megatron's and
    the runtime's dp_cp group), so model states and data-parallel bytes at dp = 2, cp = 4 are
    those of dp = 8; hybrid sharding replicates over dp / dp_shard."""
    model = _model(8192)
    for zero in range(4):
        split, wide = Layout(dp=2, cp=4, zero=zero), Layout(dp=8, zero=zero)
        assert split.shard == wide.shard == 8 and split.gpus == 8
        assert costmodel.predict_model_states(model, split) == costmodel.predict_model_states(model, wide)
        cluster = Cluster(GPUS["h100"], 16)
        assert dp_traffic(split, cluster, 1e9) == dp_traffic(wide, cluster, 1e9)
    hybrid = Layout(dp=4, cp=2, zero=3, dp_shard=2)
    assert (hybrid.shard, hybrid.replicas, hybrid.global_batch_size) == (4, 2, 4)
    # under cp a shard group of the cp ranks alone (dp_shard = 1) is offered: it stays in a node
    offered = {v.dp_shard for v in costmodel.comm_variants(Layout(dp=8, cp=8, zero=1), Cluster(GPUS["h100"], 64))}
    assert offered == {None, 1}


def test_compute_divides_by_cp() -> None:
    """Each rank computes its s/cp tokens (matmuls and element-wise work ÷ cp; the attention
    core's FLOPs per token stay those of the whole sequence, balanced by the zigzag), and its
    TP all-reduces carry s/cp tokens."""
    model, s, cluster = _model(LONG), LONG, Cluster(GPUS["h100"], 8)
    for mode in ("ring", "all-to-all"):
        one, split = Layout(tp=2), Layout(tp=2, cp=4, cp_mode=mode)
        c1, b1, tp_f1, tp_b1, *_ = _micro_batch(model, one, s, cluster)
        c4, b4, tp_f4, tp_b4, *_ = _micro_batch(model, split, s, cluster)
        assert (c4, b4) == (pytest.approx(c1 / 4), pytest.approx(b1 / 4))
        assert tp_f4 < tp_f1 / 3 and tp_b4 < tp_b1 / 3  # bytes ÷ 4, the same steps' latency


def test_ring_time_is_the_first_block_and_each_later_step_s_slower_part() -> None:
    """t_ring = t_0 + Σ_{j≥1} max(t_j, t_kv): the first transfer runs under the local block;
    compute-bound the ring costs its blocks, bandwidth-bound the first block and cp − 1
    transfers, and what it adds to the blocks is Σ_{j≥1} max(0, t_kv − t_j)."""
    ring = costmodel.ring_attention_seconds
    assert ring([1.0] * 4, 0.5) == 4.0  # compute-bound: hidden
    assert ring([1.0] * 4, 3.0) == 1.0 + 3 * 3.0  # bandwidth-bound
    assert ring([1.0, 1.0], 5.0) == 6.0  # cp = 2: one transfer, exposed beyond the local block
    assert ring([2.0, 1.0, 3.0], 2.5) == 2.0 + 2.5 + 3.0
    assert ring([4.0], 9.0) == 4.0  # no ring: nothing to receive
    assert costmodel.ring_exposed_seconds([2.0, 1.0, 3.0], 2.5) == 1.5
    assert costmodel.ring_exposed_seconds([1.0] * 4, 0.5) == 0.0


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_ring_in_the_step_time(recompute: str) -> None:
    """Per layer, blocks t_j = the rank's attention core / cp at η·peak, K/V transfers of
    2A·(s/cp)·b·h/t bytes: over NVLink while tp·cp ranks share a node, hidden under 16K-token
    blocks; across nodes and with 1K-token blocks exposed, (cp − 1)(t_kv − t_j) per layer
    forward; backward blocks 2t_j against K/V and the fp32 dK/dV sums at once (3× the bf16
    K/V bytes, as `parallel.context.ring` sends them), plus the sums' last hop home, and the
    forward ring once more with the core recomputed (selective)."""
    gpu = GPUS["h100"]
    rate = MATMUL_EFFICIENCY * gpu.peak_flops
    model = _model(LONG)
    near, node = Layout(cp=8, recompute=recompute), Cluster(gpu, 8)
    home = 2 * 2 * 2 * (LONG / 8) * model.d_model / gpu.intra_node_bandwidth + node.intra_node_latency
    # hidden but for the backward's last hop of the fp32 dK/dV sums
    assert costmodel.context_parallel_seconds(model, near, LONG, node, 26) == (0.0, pytest.approx(26 * home))
    s, cp, h = 8192, 8, model.d_model
    model, cluster, layout = _model(s), Cluster(gpu, 64, gpus_per_node=4), Layout(cp=cp, recompute=recompute)
    block = 4 * s * h * (s / cp) / rate / cp  # core FLOPs per token (4sh) × the rank's tokens, in cp blocks

    def transfer(nbytes: float) -> float:
        return nbytes / cluster.inter_node_bandwidth + cluster.inter_node_latency

    kv_bytes = 2 * 2 * (s / cp) * h  # keys and values of the rank's chunk, bf16
    kv = transfer(kv_bytes)
    assert costmodel.kv_transfer_seconds(model, layout, s, cluster) == pytest.approx(kv)
    assert kv > 2 * block  # bandwidth-bound
    forward, backward = costmodel.context_parallel_seconds(model, layout, s, cluster, 26)
    assert forward == pytest.approx(26 * (cp - 1) * (kv - block))
    redo = forward if recompute == "selective" else 0.0
    both, home = transfer(kv_bytes + 2 * kv_bytes), transfer(2 * kv_bytes)  # + the sums, fp32
    assert backward == pytest.approx(26 * ((cp - 1) * (both - 2 * block) + home) + redo)
    step = costmodel.predict_step_time(model, layout, s, cluster)
    assert step.cp_comm == pytest.approx(forward + backward)
    assert step.pipeline == pytest.approx(step.forward + step.backward)
    # t_f = compute ÷ cp + the ring's exposed transfers
    compute_f = _micro_batch(model, Layout(recompute=recompute), s, cluster)[0] / cp
    assert step.forward == pytest.approx(compute_f + forward)


def test_all_to_all_bytes_and_time() -> None:
    """All-to-all (Ulysses): per layer forward q, k, v in (one all-to-all of the three stacked,
    as `parallel.context` sends them) and the output back, 4·A·b·(s/cp)·(h/t)·(cp − 1)/cp
    bytes per rank, the same backward (twice with full recompute), not overlapped: in a node
    each call costs its bytes over NVLink and one α. Hybrid: groups of cp_a2a ranks, and the
    ring over cp / cp_a2a with the same K/V block bytes."""
    model, s, b, t, h = _model(LONG), LONG, 2, 2, GPT_1B.d_model
    for cp in (2, 4):
        layout = Layout(tp=t, cp=cp, cp_mode="all-to-all", micro_batch_size=b)
        per_layer = 4 * costmodel.cp_all_to_all_bytes(model, layout, s)
        assert per_layer == pytest.approx(4 * b * (s / cp) * (h / t) * 2 * (cp - 1) / cp)
    hybrid = Layout(tp=t, cp=8, cp_mode="hybrid", cp_a2a=2, micro_batch_size=b)
    assert costmodel.cp_all_to_all_bytes(model, hybrid, s) == pytest.approx(b * (s / 8) * (h / t) * 2 / 2)
    assert (hybrid.cp_a2a_size, hybrid.cp_ring_size) == (2, 4)
    cluster = Cluster(GPUS["h100"], 8)
    layout = Layout(tp=2, cp=4, cp_mode="all-to-all", micro_batch_size=b)
    pass_ = 4 * costmodel.cp_all_to_all_bytes(model, layout, s) / cluster.gpu.intra_node_bandwidth
    pass_ += 2 * cluster.intra_node_latency  # a layer's two calls
    for recompute, passes in (("none", 1), ("selective", 1), ("full", 2)):
        lo = dataclasses.replace(layout, recompute=recompute)
        f, bwd = costmodel.context_parallel_seconds(model, lo, s, cluster, 26)
        assert (f, bwd) == (pytest.approx(26 * pass_), pytest.approx(26 * passes * pass_))


def test_layouts_that_cannot_run_are_refused_with_a_reason() -> None:
    """The runtime's rules: seq_len divisible by 2·cp for ring and hybrid, by cp for
    all-to-all; all-to-all splits the heads of a TP rank over cp (hybrid: over cp_a2a);
    hybrid's cp_a2a divides cp, 1 < cp_a2a < cp; a ring cannot drop attention weights.
    Searched, a layout takes the modes that can run; pinned to one that cannot, the search
    says why."""
    model = _model(LONG, n_heads=16)
    problem = costmodel.layout_problem
    assert problem(model, Layout(cp=4), 4100).startswith("ring context parallelism needs seq_len divisible by 2·cp")
    assert problem(model, Layout(cp=4, cp_mode="all-to-all"), 4100) is None
    assert problem(model, Layout(cp=3, cp_mode="all-to-all"), 4100).startswith(
        "all-to-all context parallelism needs seq_len divisible by cp"
    )
    assert problem(model, Layout(tp=2, cp=16, cp_mode="all-to-all"), LONG) == (
        "all-to-all context parallelism needs the heads per TP rank divisible by cp "
        "(n_heads=16, tp=2: 8 heads per rank, cp=16)"
    )
    assert problem(model, Layout(tp=4, cp=16, cp_mode="hybrid", cp_a2a=8), LONG).startswith(
        "hybrid context parallelism needs the heads per TP rank divisible by cp_a2a"
    )
    assert problem(model, Layout(cp=4, cp_mode="hybrid", cp_a2a=4), LONG).startswith(
        "hybrid context parallelism needs cp_a2a dividing cp, 1 < cp_a2a < cp"
    )
    assert problem(model, Layout(cp=4, cp_a2a=2), LONG).startswith("cp_a2a sizes the all-to-all groups")
    assert problem(_model(LONG, dropout=0.1), Layout(cp=2), LONG).startswith(
        "ring context parallelism cannot drop attention weights"
    )
    pinned = costmodel.plan(model, Cluster(GPUS["h100"], 8), 8, 4100, top=3, tp=1, cp=4, cp_mode="ring")
    assert not pinned.ranked and "ring context parallelism needs seq_len divisible by 2·cp" in pinned.rejected
    cluster = Cluster(GPUS["h100"], 64)
    heads = costmodel.plan(model, cluster, 8, LONG, top=3, tp=2, cp=16, cp_mode="all-to-all")
    reason = "all-to-all context parallelism needs the heads per TP rank divisible by cp"
    assert not heads.ranked and heads.rejected[reason][1].endswith("8 heads per rank, cp=16")
    # free to choose, cp = 16 at tp = 2 attends by ring or hybrid (all-to-all in a node's 4 cp ranks)
    free = costmodel.plan(model, cluster, 8, LONG, tp=2, cp=16, recompute="none", zero=1, micro_batch_size=1)
    assert free.ranked and reason not in free.rejected
    assert {(e.layout.cp_mode, e.layout.cp_a2a) for e in free.ranked} <= {("ring", None), ("hybrid", 4)}


def test_the_search_splits_a_long_sequence_where_one_rank_cannot_hold_it() -> None:
    """The 1.31B GPT at 128K tokens, 8 sequences a step, on 8 H100s: with tp = 1 and no
    recomputation no cp = 1 layout fits (a sequence's activations alone are ~210 GiB), and
    the search splits the sequences over the ranks of the node; free to recompute, cp = 1
    needs full recomputation or TP, and a cp > 1 layout without either is faster. cp is
    searched over the divisors of the GPUs per tp that leave a rank ≥ `CP_MIN_TOKENS`
    tokens, so not at all at 2048 tokens."""
    model, cluster = _model(LONG), Cluster(GPUS["h100"], 8)
    pins = {"tp": 1, "recompute": "none"}
    alone = costmodel.plan(model, cluster, 8, LONG, top=3, cp=1, **pins)
    assert not alone.ranked and alone.rejected["does not fit in memory"][1].endswith("> 79.65 GiB")
    assert float(alone.rejected["does not fit in memory"][1].split("needs ")[1].split(" GiB")[0]) > 200
    split = costmodel.plan(model, cluster, 8, LONG, top=3, **pins)
    best = split.ranked[0]
    assert best.layout.cp > 1 and best.memory.total <= cluster.gpu.memory_bytes
    free = costmodel.plan(model, cluster, 8, LONG, top=5)
    one = costmodel.plan(model, cluster, 8, LONG, top=1, cp=1).ranked[0]
    assert one.layout.recompute == "full" or one.layout.tp > 1
    assert free.ranked[0].layout.cp > 1 and free.ranked[0].layout.recompute == "none"
    assert free.ranked[0].time.total < one.time.total
    assert costmodel.search.cp_choices(8, LONG) == [1, 2, 4, 8] and costmodel.search.cp_choices(64, 2048) == [1]
    assert costmodel.search.cp_choices(64, 16384) == [1, 2, 4]


def test_layout_of_a_cp_run_and_its_description() -> None:
    """run_spec reads cp, cp_mode, cp_a2a (absent: 1, ring, None); the description names cp
    and the mode only when cp > 1."""
    config = {
        "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 1, "virtual_stages": 1, "schedule": "1f1b"},
        "train": {"micro_batch_size": 1, "micro_batches": 1, "precision": "bf16", "reduce_dtype": "fp32"},
        "model": {"vocab_size": 128, "n_layers": 2, "n_heads": 4, "d_model": 32, "recompute": "none"},
        "data": {"seq_len": 64},
    }
    config["parallel"]["sequence_parallel"] = False
    plain = costmodel.run_spec(config)[1]
    assert (plain.cp, plain.cp_mode, plain.cp_a2a) == (1, "ring", None) and "cp" not in str(plain)
    config["parallel"] |= {"cp": 4, "cp_mode": "hybrid", "cp_a2a": 2}
    layout = costmodel.run_spec(config)[1]
    assert (layout.cp, layout.cp_mode, layout.cp_a2a, layout.gpus) == (4, "hybrid", 2, 8)
    assert str(layout).endswith(" cp=4 hybrid/2") and layout.describe() == str(layout)
    assert str(Layout(cp=2)).endswith(" cp=2") and str(Layout(cp=4, cp_mode="all-to-all")).endswith(" cp=4 all-to-all")


def test_layout_of_a_cp_run_config() -> None:
    """`Layout.from_run_config` of the trainer's own flags."""
    from research.config import parse_args

    cfg = parse_args(["--config", "experiments/configs/tiny.yaml", "--cp", "4", "--cp-mode", "all-to-all"], 8)
    layout = Layout.from_run_config(cfg)
    assert (layout.cp, layout.cp_mode, layout.dp, layout.gpus) == (4, "all-to-all", 2, 8)


def test_plan_command_with_context_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    """--seq-len past a config's max_seq_len plans the model with it raised (as a run with
    --max-seq-len would hold it); the table's cp column shows the ranks and the mode, the
    breakdown the exposed CP comm; --cp pins cp, and --layout takes cp, cp_mode, cp_a2a."""
    from experiments import plan

    argv = ["--config", "experiments/configs/gpt-1.3b.yaml", "--gpus", "8", "--gpu", "h100", "--top", "3"]
    plan.main([*argv, "--seq-len", str(LONG)])
    out = capsys.readouterr().out
    assert "parameters, seq 131072, global batch 8 on 8 × h100" in out
    header, *rows = out.split("\n\n")[1].splitlines()
    assert header.split()[:4] == ["#", "tp", "cp", "pp"] and int(rows[0].split()[2].split("/")[0]) > 1
    assert "cp: ranks that split each sequence" in out and ", CP comm " in out
    plan.main([*argv, "--seq-len", "8192", "--cp", "2", "--cp-mode", "all-to-all"])
    rows = capsys.readouterr().out.split("\n\n")[1].splitlines()[1:]
    assert {row.split()[2] for row in rows} == {"2/a2a"}
    plan.main([*argv, "--seq-len", "8192", "--layout", "tp=1,cp=4,cp_mode=hybrid,cp_a2a=2,dp=2,zero=1", "--json"])
    one = capsys.readouterr().out
    assert '"layout": "tp=1 pp=1 dp=2 v=1 zero=1 mbs=1 recompute=none sp=0 cp=4 hybrid/2"' in one
    assert '"error": null' in one
    with pytest.raises(SystemExit):
        plan.main([*argv, "--seq-len", "8192", "--layout", "tp=1,cp=2,dp=2,zero=1"])
    assert "tp × cp × pp × dp = 4 is not --gpus=8" in capsys.readouterr().out


def test_experts_borrow_context_parallel_ranks() -> None:
    """ep runs over the divisors of dp × cp that divide the experts (the runtime's folding),
    and each rank's all-to-all carries its s/cp tokens' rows."""
    model = _model(8192, moe_experts=8, moe_every=2)
    cluster = Cluster(GPUS["h100"], 8)
    eps = {
        lo.ep
        for lo, why, _ in costmodel.candidate_layouts(model, cluster, 8, 8192, tp=1, cp=4, pp=1, micro_batch_size=1)
        if why is None
    }
    assert eps == {1, 2, 4, 8}
    one, split = Layout(dp=8, ep=8), Layout(dp=2, cp=4, ep=8)
    bytes_one, bytes_split = (costmodel.expert_all_to_all_bytes(model, lo, 8192) for lo in (one, split))
    assert bytes_split == pytest.approx(bytes_one / 4)
    assert costmodel.layout_problem(model, Layout(dp=2, cp=4, ep=8), 8192) is None
    assert costmodel.layout_problem(model, Layout(dp=2, cp=2, ep=8), 8192).startswith("ep does not divide")
    memory = costmodel.predict_memory(model, split, 8192)
    assert memory.total < 80 * GiB
