"""Config resolution: YAML + command line, batch arithmetic, and one-sentence errors that
name the flag, all before any process group exists."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import yaml

from research.config import ConfigError, RunConfig, build_parser, check_value, field_specs, parse_args, save_yaml
from research.trainer import load_data, lr_multiplier, weight_decay_groups
from tests.conftest import slow_except

TINY = "experiments/configs/tiny.yaml"


def test_the_tiny_config_with_the_issue_command() -> None:
    cfg = parse_args(
        [
            "--config",
            TINY,
            "--tp",
            "2",
            "--pp",
            "2",
            "--zero",
            "2",
            "--schedule",
            "1f1b",
            "--micro-batches",
            "4",
            "--steps",
            "50",
            "--seed",
            "0",
            "--precision",
            "fp32",
        ],
        8,
    )
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero) == (2, 2, 2, 2)
    assert (cfg.train.global_batch_size, cfg.train.micro_batches, cfg.train.micro_batch_size) == (16, 4, 2)
    assert cfg.model.n_layers == 8 and cfg.model.init_seed == 0


@pytest.mark.parametrize("pp, v", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_the_tiny_model_splits_evenly(pp: int, v: int) -> None:
    schedule = "interleaved-1f1b" if v > 1 else "1f1b"
    parse_args(
        [
            "--config",
            TINY,
            "--pp",
            str(pp),
            "--virtual-stages",
            str(v),
            "--schedule",
            schedule,
            "--micro-batches",
            str(2 * pp),
        ],
        2 * pp,
    )


@pytest.mark.parametrize(
    "argv, world, expected",
    [
        (["--global-batch-size", "32", "--micro-batch-size", "2"], 4, (32, 2, 4)),
        (["--global-batch-size", "32", "--micro-batches", "2"], 4, (32, 4, 2)),
        (["--micro-batch-size", "3", "--micro-batches", "2"], 4, (24, 3, 2)),
        (["--global-batch-size", "8"], 2, (8, 1, 4)),
        ([], 2, (2, 1, 1)),
    ],
)
def test_any_two_batch_sizes_give_the_third(argv: list[str], world: int, expected: tuple) -> None:
    tr = parse_args(argv, world).train
    assert (tr.global_batch_size, tr.micro_batch_size, tr.micro_batches) == expected
    assert tr.global_batch_size == tr.micro_batch_size * tr.micro_batches * world


def test_the_command_line_wins_over_the_file(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"train": {"global_batch_size": 16, "micro_batch_size": 2, "lr": 0.5}, "model": {"d_model": 64}})
    )
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
    for flag in (
        "--tp",
        "--pp",
        "--dp",
        "--zero",
        "--schedule",
        "--micro-batches",
        "--steps",
        "--seed",
        "--precision",
        "--out",
        "--save",
        "--save-every",
        "--load",
        "--virtual-stages",
        "--micro-batch-size",
        "--global-batch-size",
        "--seq-len",
        "--sequence-parallel",
        "--recompute",
        "--lr",
        "--clip-grad",
        "--data",
        "--tokenizer",
        "--wandb",
        "--wandb-project",
        "--n-layers",
        "--d-model",
        "--n-heads",
        "--export",
        "--lr-decay-steps",
        "--warmup-steps",
    ):
        assert flag in text, flag
    assert "(default: 0.25)" in text


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (["--tp", "3"], 8, "--tp=3 × --pp=1 = 3 does not divide the world size 8"),
        (["--tp", "2", "--pp", "2", "--dp", "3"], 8, "--tp=2 × --pp=2 × --dp=3 = 12 does not equal the world size 8"),
        (["--qgz-bits", "8"], 2, "--qgz-bits=8 quantizes the gradient reduce-scatter of --zero 2 or 3, not 1"),
        (["--hpz"], 2, "--hpz keeps a secondary partition of ZeRO-3's parameters: use it with --zero 3, not 1"),
        (
            ["--tp", "2", "--dp-shard", "3"],
            8,
            "--dp-shard=3 does not divide --dp=4: hybrid sharding needs dp = replicas × dp_shard",
        ),
        (
            ["--global-batch-size", "10", "--micro-batch-size", "3"],
            2,
            "--global-batch-size=10 is not divisible by --micro-batch-size=3 × dp=2",
        ),
        (
            ["--global-batch-size", "16", "--micro-batch-size", "2", "--micro-batches", "3"],
            2,
            "must equal --micro-batch-size × --micro-batches × dp",
        ),
        (["--data", "no/such/dir"], 1, "--data path 'no/such/dir' does not exist"),
        (["--data", "missing.jsonl"], 1, "--data path 'missing.jsonl' does not exist"),
        (
            ["--pp", "2", "--micro-batches", "1", "--micro-batch-size", "1"],
            2,
            "--micro-batches=1: 1f1b with pp=2 needs at least 2 micro-batches",
        ),
        (
            ["--virtual-stages", "2", "--pp", "2", "--micro-batches", "2"],
            2,
            "--virtual-stages=2: 1f1b does not interleave",
        ),
        (["--tp", "3", "--n-heads", "4", "--d-model", "48"], 3, "n_heads=4 is not divisible by tp=3"),
        (
            ["--pp", "3", "--n-layers", "4", "--micro-batches", "3"],
            3,
            "4 layers do not split evenly into 3 pipeline stages",
        ),
        (["--seq-len", "512"], 1, "--seq-len=512 must be between 1 and --max-seq-len=256"),
        (
            ["--tp", "2", "--sequence-parallel", "--seq-len", "33", "--max-seq-len", "64"],
            2,
            "--sequence-parallel needs --seq-len=33 divisible by --tp=2",
        ),
        (["--save-every", "5"], 1, "--save-every=5 needs --save DIR"),
        (["--export", "w.safetensors"], 1, "--export=w.safetensors needs --save DIR"),
        (["--tokenizer", "nope.json"], 1, "--tokenizer 'nope.json' is neither"),
        (["--load", "no/such/ckpt"], 1, "--load=no/such/ckpt is not a directory"),
        (["--resume", "r", "--load", "r"], 1, "--resume=r loads its own latest checkpoint; drop --load=r"),
        (["--resume", "r", "--save", "s"], 1, "--resume=r saves there too; drop --save=s"),
        (["--d-model", "30", "--n-heads", "4"], 1, "d_model=30 is not divisible by n_heads=4"),
        (["--moe-experts", "6", "--ep", "4"], 4, "--moe-experts=6 is not divisible by --ep=4"),
        (["--moe-experts", "4", "--ep", "3"], 4, "--ep=3 does not divide --dp=4: expert parallelism splits"),
        (["--moe-experts", "4", "--ep", "4", "--dp-shard", "2"], 4, "--ep=4 does not divide --dp-shard=2"),
        (["--moe-experts", "4", "--moe-top-k", "5"], 1, "--moe-top-k=5 must be between 1 and --moe-experts=4"),
        (["--moe-experts", "4", "--moe-top-k", "0"], 1, "--moe-top-k=0 must be at least 1"),
        (["--moe-experts", "4", "--moe-capacity-factor", "0"], 1, "--moe-capacity-factor=0 must be greater than 0"),
        (["--ep", "2"], 2, "--ep=2 splits the experts of MoE blocks: set --moe-experts"),
        (["--moe-experts", "4", "--moe-every", "5", "--n-layers", "4"], 1, "--moe-every=5 leaves no MoE block"),
        (
            ["--moe-experts", "4", "--ep", "2", "--zero", "3", "--hpz"],
            2,
            "--hpz and --qgz-bits split the dp group by node, which the experts' own groups under --ep are not",
        ),
    ],
)
def test_bad_input_fails_with_one_sentence_naming_the_flag(argv: list[str], world: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_args(argv, world)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_yaml_keys_are_errors(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"learning_rate": 1.0}}))
    with pytest.raises(ConfigError, match=r"train\.learning_rate is not a config key"):
        parse_args(["--config", str(path)], 1)
    path.write_text(yaml.safe_dump({"optimizer": {"lr": 1.0}}))
    with pytest.raises(ConfigError, match="unknown section 'optimizer'"):
        parse_args(["--config", str(path)], 1)


def test_lr_warms_up_then_decays_to_min_lr_by_the_decay_step() -> None:
    cfg = RunConfig()
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.lr, cfg.train.min_lr = 20, 4, 1.0, 0.1
    f = lr_multiplier(cfg.train)
    assert [f(t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and math.isclose(f(19), 0.1) and f(4) > f(10) > f(19)
    cfg.train.lr_decay_steps = 40
    g = lr_multiplier(cfg.train)
    assert g(19) > 0.1 and math.isclose(g(39), 0.1) and math.isclose(g(100), 0.1)


def test_weight_decay_skips_vectors() -> None:
    from research.model import GPT, GPTConfig

    model = GPT(GPTConfig(n_layers=1, d_model=16, n_heads=2, max_seq_len=8))
    decay, no_decay = weight_decay_groups(model, 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


A1, A0, POS, FRAC, SEED = "at least 1", "at least 0", "greater than 0", "in [0, 1)", "in [0, 2**32)"
# (field, bad value, what the one sentence says is allowed): each is tried as a flag and as a YAML value.
BAD_VALUES = [
    # model
    ("vocab_size", 0, A1),
    ("n_layers", 0, A1),
    ("n_heads", 0, A1),
    ("d_model", 0, A1),
    ("d_model", -64, A1),
    ("d_ff", -1, A1 + " or none"),
    ("d_ff", 0, A1 + " or none"),
    ("max_seq_len", 0, A1),
    ("position", "alibi", "one of learned, rope"),
    ("norm", "batchnorm", "one of layernorm, rmsnorm"),
    ("activation", "relu", "one of gelu, swiglu"),
    ("dropout", 1.5, FRAC),
    ("dropout", 1.0, FRAC),
    ("dropout", -0.1, FRAC),
    ("sliding_window", 0, A1 + " or none"),
    ("sliding_window", -4, A1 + " or none"),
    ("vocab_multiple", 0, A1),
    ("recompute", "some", "one of none, selective, full"),
    ("rope_theta", 0.0, POS),
    ("norm_eps", -1.0, POS),
    ("norm_eps", 0.0, POS),
    ("init_seed", -1, SEED),
    ("init_seed", 2**32, SEED),
    # parallel
    ("tp", 0, A1),
    ("pp", 0, A1),
    ("dp", 0, A1 + " or none"),
    ("zero", 4, "one of 0, 1, 2, 3"),
    ("zero", -1, "one of 0, 1, 2, 3"),
    ("schedule", "zigzag", "one of gpipe, 1f1b, interleaved-1f1b, zb-h1"),
    ("virtual_stages", 0, A1),
    ("grad_sync", "sometimes", "one of last, every"),
    ("bucket_numel", 0, A1),
    ("unit_numel", 0, A1),
    ("comm_timeout", 0.0, POS + " or none"),
    ("comm_timeout", -5.0, POS + " or none"),
    ("comm_timeout", float("inf"), "a finite number or none"),
    # train
    ("steps", 0, A1),
    ("steps", 1.5, "an integer"),
    ("steps", "ten", "an integer"),
    ("seed", -1, SEED),
    ("precision", "fp8", "one of fp32, bf16, fp16"),
    ("reduce_dtype", "fp16", "one of fp32, bf16"),
    ("global_batch_size", 0, A1 + " or none"),
    ("micro_batch_size", 0, A1 + " or none"),
    ("micro_batches", 0, A1 + " or none"),
    ("lr", float("nan"), "a finite number"),
    ("lr", float("inf"), "a finite number"),
    ("lr", 0.0, POS),
    ("lr", -1e-3, POS),
    ("lr", "abc", "a number"),
    ("min_lr", -1e-4, A0),
    ("min_lr", float("nan"), "a finite number"),
    ("warmup_steps", -1, A0),
    ("lr_decay_steps", 0, A1 + " or none"),
    ("lr_schedule", "linear", "one of cosine, constant"),
    ("weight_decay", -0.1, A0),
    ("beta1", 1.5, FRAC),
    ("beta1", -0.1, FRAC),
    ("beta2", 1.0, FRAC),
    ("eps", -1e-8, POS),
    ("eps", 0.0, POS),
    ("clip_grad", -1.0, A0),
    ("clip_grad", float("inf"), "a finite number"),
    ("max_nonfinite_steps", 0, A1),
    # data, log, checkpoint
    ("seq_len", 0, A1),
    ("num_proc", 0, A1),
    ("log_every", 0, A1),
    ("wandb", "maybe", "one of offline, online, disabled"),
    ("save_every", -1, A0),
]


@pytest.mark.parametrize("name, value, allowed", BAD_VALUES, ids=[f"{n}={v}" for n, v, _ in BAD_VALUES])
def test_a_bad_flag_value_is_one_sentence_naming_the_flag(name: str, value, allowed: str) -> None:
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ConfigError) as info:
        parse_args([f"{flag}={value}"], 1)
    assert str(info.value) == f"{flag}={value} must be {allowed}"


@pytest.mark.parametrize("name, value, allowed", BAD_VALUES, ids=[f"{n}={v}" for n, v, _ in BAD_VALUES])
def test_a_bad_yaml_value_is_one_sentence_naming_the_key(tmp_path, name: str, value, allowed: str) -> None:
    section = field_specs()[name].section
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({section: {name: value}}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(path)], 1)
    assert str(info.value) == f"{path}: {section}.{name}={value!r} must be {allowed}"


@pytest.mark.parametrize(
    "section, name, value, allowed",
    [
        ("model", "bias", "yes please", "true or false"),
        ("model", "tie_embeddings", 1, "true or false"),
        ("model", "n_layers", [2, 4], "an integer"),
        ("train", "steps", True, "an integer"),
        ("train", "lr", {"peak": 1.0}, "a number"),
        ("log", "wandb_name", 3, "a string or none"),
        ("data", "text_field", ["text"], "a string"),
        ("train", "precision", 16, "one of fp32, bf16, fp16"),
        ("parallel", "zero", 2.0, "an integer"),
    ],
)
def test_a_yaml_value_of_the_wrong_type_is_one_sentence(tmp_path, section: str, name: str, value, allowed: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({section: {name: value}}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(path)], 1)
    assert str(info.value) == f"{path}: {section}.{name}={value!r} must be {allowed}"


@pytest.mark.parametrize("name", ["text_field", "out", "data", "wandb_project"])
def test_an_empty_string_is_refused(name: str) -> None:
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ConfigError, match=f"^{flag}= must not be empty$"):
        parse_args([f"{flag}="], 1)


def test_every_number_has_a_range_and_every_default_passes() -> None:
    """A new int or float field must declare its range (`arg(..., rule=)`, or MODEL_FLAGS)."""
    for name, spec in field_specs().items():
        if spec.kind in (int, float):
            assert spec.rule is not None, f"{name} declares no range"
        default = RunConfig().to_dict()[spec.section][name]
        assert check_value(name, default, "default") == default, name


@pytest.mark.parametrize(
    "text",
    [
        "model: [n_layers: 2\n",  # malformed: unclosed flow sequence
        "model:\n  n_layers: 2\n d_model: 3\n",  # bad indentation
        "- model\n- train\n",  # a list at the top level
        "just a string\n",
        "model: 4\n",  # a section that is not a mapping
        "train:\n  - lr: 1.0\n",
    ],
)
def test_a_yaml_file_of_the_wrong_shape_is_one_sentence_naming_it(tmp_path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(path)], 1)
    assert str(info.value).startswith(str(path)) and "\n" not in str(info.value)


def test_a_yaml_file_that_is_not_text_is_one_sentence(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"model:\n  n_layers: \xff\xfe\x00\n")
    with pytest.raises(ConfigError, match=f"^{path} is not valid YAML"):
        parse_args(["--config", str(path)], 1)


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (["--min-lr", "0.1", "--lr", "0.01"], 1, "--min-lr=0.1 must not exceed --lr=0.01"),
        (["--warmup-steps", "10", "--lr-decay-steps", "10"], 1, "--lr-decay-steps=10 must exceed --warmup-steps=10"),
        (["--save-every", "5"], 1, "--save-every=5 needs --save DIR"),
        (["--precision", "fp8"], 1, "--precision=fp8 must be one of fp32, bf16, fp16"),
    ],
)
def test_bad_combinations_fail_with_one_sentence(argv: list[str], world: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_args(argv, world)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (
            ["--tp", "4", "--vocab-multiple", "2"],
            4,
            "--vocab-multiple=2 pads the vocabulary of 257 tokens to 258, which --tp=4 does not divide; "
            "make --vocab-multiple a multiple of 4",
        ),
        (
            ["--tp", "2", "--vocab-multiple", "1"],
            2,
            "pads the vocabulary of 257 tokens to 257, which --tp=2 does not divide",
        ),
    ],
)
def test_a_vocabulary_tp_does_not_split_fails_where_the_tokenizer_is_loaded(
    tmp_path, argv: list[str], world: int, message: str
) -> None:
    """Validation reads no tokenizer; loading the data loads it and checks its vocabulary
    before any tokenizing."""
    cfg = parse_args([*argv, "--data-cache", str(tmp_path / "cache")], world)
    with pytest.raises(ConfigError) as info:
        load_data(cfg)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "cache").exists()


def test_the_vocabulary_check_uses_the_tokenizers_vocabulary(tmp_path) -> None:
    """The byte tokenizer has 257 ids: vocab_size 256 with vocab_multiple 2 pads to 258 (not 256)."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"vocab_size": 256, "vocab_multiple": 2}, "parallel": {"tp": 4}}))
    with pytest.raises(ConfigError, match="to 258, which --tp=4 does not divide"):
        load_data(parse_args(["--config", str(path)], 4))
    (tmp_path / "a.txt").write_text("some text to train on " * 8)
    argv = ["--config", str(path), "--vocab-multiple", "4", "--data", str(tmp_path / "a.txt"), "--seq-len", "8"]
    model, _ = load_data(parse_args([*argv, "--data-cache", str(tmp_path / "cache")], 4))
    assert (model.vocab_size, model.padded_vocab) == (257, 260)  # 260 = 4 × 65


def test_a_hub_dataset_while_offline_is_one_sentence(monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"^--data .someone/corpus. is not a local path, .* while it is offline"):
        parse_args(["--data", "someone/corpus"], 1)


def test_yaml_values_are_converted_like_flags(tmp_path) -> None:
    """YAML 1.1 reads `1e-3` as text; it is a number here as it is on the command line."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "train:\n  lr: 1e-3\n  min_lr: 0\n  lr_schedule: constant\nparallel:\n  comm_timeout: 60\n"
        "model:\n  d_ff: null\n  sliding_window: 16\n  bias: false\n"
    )
    cfg = parse_args(["--config", str(path)], 1)
    assert cfg.train.lr == 1e-3 and cfg.train.min_lr == 0.0 and isinstance(cfg.train.min_lr, float)
    assert cfg.train.lr_schedule == "constant" and cfg.parallel.comm_timeout == 60.0
    assert cfg.model.d_ff is None and cfg.model.sliding_window == 16 and not cfg.model.bias
    cfg = parse_args(["--config", str(path), "--lr", "0.5", "--d-ff", "96", "--sliding-window", "none", "--bias"], 1)
    assert cfg.train.lr == 0.5 and cfg.model.d_ff == 96 and cfg.model.sliding_window is None and cfg.model.bias


def test_an_abbreviated_flag_counts_as_given(tmp_path) -> None:
    """Two batch sizes on the command line win over the file's global batch size."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"global_batch_size": 16}}))
    cfg = parse_args(["--config", str(path), "--micro-batches", "2", "--micro-batch-s", "1"], 4)
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.micro_batches) == (8, 1, 2)


@pytest.mark.parametrize(
    "argv, message",
    slow_except(
        [(["--config", "{yaml}"], "error: {yaml}: train.lr_schedule='linear' must be one of cosine, constant")],
        [
            (["--d-model", "0"], "error: --d-model=0 must be at least 1"),
            (["--weight-decay", "-0.1"], "error: --weight-decay=-0.1 must be at least 0"),
        ],
    ),
)
def test_the_command_prints_one_error_line_and_exits_2(tmp_path, argv: list[str], message: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr_schedule: linear\n")
    argv = [a.format(yaml=bad) for a in argv]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            *argv,
            "--steps",
            "1",
            "--wandb",
            "disabled",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [message.format(yaml=bad)]
    assert proc.stderr.strip().splitlines()[-1] == message.format(yaml=bad)


def test_resume_saves_to_its_root() -> None:
    cfg = parse_args(["--resume", "runs/job", "--save-every", "5", "--export", "w.pt"], 1)
    assert cfg.checkpoint.root == "runs/job" and cfg.checkpoint.load is None


def test_resume_finds_the_latest_complete_checkpoint_or_none(tmp_path) -> None:
    from research import checkpoint

    root = tmp_path / "job"
    assert checkpoint.latest(str(root)) is None  # not made yet
    (root / "step_00000005.tmp").mkdir(parents=True)
    assert checkpoint.latest(str(root)) is None  # only an interrupted save
    for step in (5, 10):
        (root / f"step_{step:08d}").mkdir()
        (root / f"step_{step:08d}" / checkpoint.META).write_text("{}")
    assert checkpoint.latest(str(root)) == str(root / "step_00000010")


CP_ERRORS = [
    (["--cp", "3"], 4, "--tp=1 × --cp=3 × --pp=1 = 3 does not divide the world size 4"),
    (
        ["--cp", "2", "--seq-len", "66", "--max-seq-len", "128"],
        2,
        "--seq-len=66 is not divisible by 2 × --cp=2 = 4: the ring splits each sequence into 2·cp equal chunks",
    ),
    (
        ["--cp", "4", "--cp-mode", "all-to-all", "--seq-len", "66", "--max-seq-len", "128"],
        4,
        "--seq-len=66 is not divisible by --cp=4 = 4: each cp rank holds an equal share",
    ),
    (
        ["--cp", "4", "--cp-mode", "all-to-all", "--n-heads", "2", "--d-model", "32"],
        4,
        "--cp-mode all-to-all splits each rank's 2 attention heads (--n-heads=2 / --tp=1) over --cp=4 ranks, "
        "which does not divide them",
    ),
    (
        ["--cp", "4", "--cp-mode", "hybrid", "--cp-a2a", "4"],
        4,
        "--cp-mode hybrid needs --cp-a2a between 2 and --cp=4 that divides it (got 4): all-to-all inside groups "
        "of that many ranks, the ring across them",
    ),
    (["--cp", "2", "--cp-a2a", "2"], 2, "--cp-a2a=2 sizes the all-to-all groups of --cp-mode hybrid, not ring"),
    (
        ["--cp", "2", "--dropout", "0.1"],
        2,
        "--cp-mode ring cannot drop attention weights (--dropout=0.1): use --cp-mode all-to-all, or --dropout 0",
    ),
    (
        ["--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-len", "12", "--max-seq-len", "128"],
        8,
        "--sequence-parallel splits each cp rank's 6 tokens (--seq-len=12 / --cp=2) over --tp=4, which does not "
        "divide them",
    ),
]


@pytest.mark.parametrize("argv, world, message", CP_ERRORS, ids=[" ".join(a) for a, _, _ in CP_ERRORS])
def test_a_cp_layout_that_cannot_run_is_one_sentence(argv: list[str], world: int, message: str) -> None:
    """Before any process group: the sequence, the heads, the world and the attention."""
    with pytest.raises(ConfigError) as info:
        parse_args(argv, world)
    assert str(info.value) == message


def test_cp_mode_sets_the_all_to_all_groups() -> None:
    cfgs = {
        mode: parse_args(["--cp", "4", "--cp-mode", mode, *extra], 8)
        for mode, extra in (("ring", []), ("all-to-all", []), ("hybrid", ["--cp-a2a", "2"]))
    }
    assert {mode: cfg.parallel.a2a_ranks for mode, cfg in cfgs.items()} == {"ring": 1, "all-to-all": 4, "hybrid": 2}
    assert {cfg.parallel.dp for cfg in cfgs.values()} == {2}
    assert str(cfgs["hybrid"].parallel.dims(8)) == "tp=1 cp=4 (all-to-all 2) pp=1 dp=2 (world 8)"
