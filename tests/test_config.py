"""Config resolution: YAML + command line, batch arithmetic, and one-sentence errors that
name the flag, all before any process group exists."""
from __future__ import annotations

import math

import pytest
import yaml

from research.config import ConfigError, RunConfig, build_parser, parse_args, save_yaml
from research.trainer import lr_multiplier, weight_decay_groups

TINY = "experiments/configs/tiny.yaml"


def test_the_tiny_config_with_the_issue_command() -> None:
    cfg = parse_args(["--config", TINY, "--tp", "2", "--pp", "2", "--zero", "2", "--schedule", "1f1b",
                      "--micro-batches", "4", "--steps", "50", "--seed", "0", "--precision", "fp32"], 8)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero) == (2, 2, 2, 2)
    assert (cfg.train.global_batch_size, cfg.train.micro_batches, cfg.train.micro_batch_size) == (16, 4, 2)
    assert cfg.model.n_layers == 8 and cfg.model.init_seed == 0


@pytest.mark.parametrize("pp, v", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_the_tiny_model_splits_evenly(pp: int, v: int) -> None:
    schedule = "interleaved-1f1b" if v > 1 else "1f1b"
    parse_args(["--config", TINY, "--pp", str(pp), "--virtual-stages", str(v), "--schedule", schedule,
                "--micro-batches", str(2 * pp)], 2 * pp)


@pytest.mark.parametrize("argv, world, expected", [
    (["--global-batch-size", "32", "--micro-batch-size", "2"], 4, (32, 2, 4)),
    (["--global-batch-size", "32", "--micro-batches", "2"], 4, (32, 4, 2)),
    (["--micro-batch-size", "3", "--micro-batches", "2"], 4, (24, 3, 2)),
    (["--global-batch-size", "8"], 2, (8, 1, 4)),
    ([], 2, (2, 1, 1)),
])
def test_any_two_batch_sizes_give_the_third(argv: list[str], world: int, expected: tuple) -> None:
    tr = parse_args(argv, world).train
    assert (tr.global_batch_size, tr.micro_batch_size, tr.micro_batches) == expected
    assert tr.global_batch_size == tr.micro_batch_size * tr.micro_batches * world


def test_the_command_line_wins_over_the_file(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"global_batch_size": 16, "micro_batch_size": 2, "lr": 0.5},
                                    "model": {"d_model": 64}}))
    cfg = parse_args(["--config", str(path), "--micro-batches", "8", "--lr", "0.1"], 1)
    assert (cfg.train.global_batch_size, cfg.train.micro_batches, cfg.train.micro_batch_size) == (16, 8, 2)
    assert cfg.train.lr == 0.1 and cfg.model.d_model == 64
    cfg = parse_args(["--config", str(path), "--micro-batches", "4"], 2)
    assert (cfg.train.global_batch_size, cfg.train.micro_batches, cfg.train.micro_batch_size) == (16, 4, 2)


def test_a_saved_config_loads_back_identically(tmp_path) -> None:
    cfg = parse_args(["--config", TINY, "--tp", "2", "--sequence-parallel", "--d-ff", "96", "--no-bias"], 2)
    save_yaml(cfg, tmp_path / "config.yaml")
    again = parse_args(["--config", str(tmp_path / "config.yaml")], 2)
    assert again.to_dict() == cfg.to_dict()
    assert again.parallel.sequence_parallel and not again.model.bias and again.model.d_ff == 96


def test_help_lists_every_key_with_its_default() -> None:
    text = build_parser({"train": {"lr": 0.25}}).format_help()
    for flag in ("--tp", "--pp", "--dp", "--zero", "--schedule", "--micro-batches", "--steps", "--seed", "--precision",
                 "--out", "--save", "--save-every", "--load", "--virtual-stages", "--micro-batch-size",
                 "--global-batch-size", "--seq-len", "--sequence-parallel", "--recompute", "--lr", "--clip-grad",
                 "--data", "--tokenizer", "--wandb", "--wandb-project", "--n-layers", "--d-model", "--n-heads",
                 "--export", "--lr-decay-steps", "--warmup-steps"):
        assert flag in text, flag
    assert "(default: 0.25)" in text


@pytest.mark.parametrize("argv, world, message", [
    (["--tp", "3"], 8, "--tp=3 × --pp=1 = 3 does not divide the world size 8"),
    (["--tp", "2", "--pp", "2", "--dp", "3"], 8, "--tp=2 × --pp=2 × --dp=3 = 12 does not equal the world size 8"),
    (["--global-batch-size", "10", "--micro-batch-size", "3"], 2, "--global-batch-size=10 is not divisible by --micro-batch-size=3 × dp=2"),
    (["--global-batch-size", "16", "--micro-batch-size", "2", "--micro-batches", "3"], 2, "must equal --micro-batch-size × --micro-batches × dp"),
    (["--data", "no/such/dir"], 1, "--data path 'no/such/dir' does not exist"),
    (["--data", "missing.jsonl"], 1, "--data path 'missing.jsonl' does not exist"),
    (["--schedule", "zigzag"], 1, "--schedule='zigzag' is unknown"),
    (["--pp", "2", "--micro-batches", "1", "--micro-batch-size", "1"], 2, "needs at least 2 micro-batches"),
    (["--virtual-stages", "2", "--pp", "2", "--micro-batches", "2"], 2, "1f1b does not interleave"),
    (["--zero", "4"], 1, "--zero=4 is not a ZeRO stage"),
    (["--tp", "3", "--n-heads", "4", "--d-model", "48"], 3, "n_heads=4 is not divisible by tp=3"),
    (["--pp", "3", "--n-layers", "4", "--micro-batches", "3"], 3, "4 layers do not split evenly into 3 pipeline stages"),
    (["--seq-len", "512"], 1, "--seq-len=512 must be between 1 and --max-seq-len=256"),
    (["--tp", "2", "--sequence-parallel", "--seq-len", "33", "--max-seq-len", "64"], 2, "--sequence-parallel needs --seq-len=33 divisible by --tp=2"),
    (["--save-every", "5"], 1, "--save-every=5 needs --save DIR"),
    (["--export", "w.safetensors"], 1, "--export=w.safetensors needs --save DIR"),
    (["--tokenizer", "nope.json"], 1, "--tokenizer 'nope.json' is neither"),
    (["--load", "no/such/ckpt"], 1, "--load=no/such/ckpt is not a directory"),
    (["--steps", "0"], 1, "--steps=0 must be at least 1"),
    (["--d-model", "30", "--n-heads", "4"], 1, "d_model=30 is not divisible by n_heads=4"),
])
def test_bad_input_fails_with_one_sentence_naming_the_flag(argv: list[str], world: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_args(argv, world)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_yaml_keys_are_errors(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"learning_rate": 1.0}}))
    with pytest.raises(ConfigError, match="train.learning_rate is not a config key"):
        parse_args(["--config", str(path)], 1)
    path.write_text(yaml.safe_dump({"optimizer": {"lr": 1.0}}))
    with pytest.raises(ConfigError, match="unknown section 'optimizer'"):
        parse_args(["--config", str(path)], 1)


def test_lr_warms_up_then_decays_to_min_lr_by_the_decay_step() -> None:
    cfg = RunConfig()
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.lr, cfg.train.min_lr = 20, 4, 1.0, 0.1
    f = lr_multiplier(cfg)
    assert [f(t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and math.isclose(f(19), 0.1) and f(4) > f(10) > f(19)
    cfg.train.lr_decay_steps = 40
    g = lr_multiplier(cfg)
    assert g(19) > 0.1 and math.isclose(g(39), 0.1) and math.isclose(g(100), 0.1)


def test_weight_decay_skips_vectors() -> None:
    from research.model import GPT, GPTConfig

    model = GPT(GPTConfig(n_layers=1, d_model=16, n_heads=2, max_seq_len=8))
    decay, no_decay = weight_decay_groups(model, 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
