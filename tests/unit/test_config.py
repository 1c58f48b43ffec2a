import ast
import importlib
import os
import subprocess
import sys

import pytest
import tomllib
import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig, format_help
from torchtitan.preflight import run_preflight

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEGACY = os.path.join(ROOT, "tests", "assets", "torchtitan_2024")


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_defaults_without_file():
    c = JobConfig.parse_args([])
    assert c.training.data_parallel_shard_degree == -1
    assert c.model.flavor == "debugmodel"
    assert c.experimental.pipeline_parallel_split_points == []


@pytest.mark.parametrize("name", ["debug_model.toml", "llama3_8b.toml"])
def test_late_2024_torchtitan_files_load_unchanged(name):
    path = os.path.join(LEGACY, name)
    c = JobConfig.parse_args(["--job.config_file", path])
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    for section, values in raw.items():
        for key, value in values.items():
            assert getattr(getattr(c, section), key) == value, f"{section}.{key}"


@pytest.mark.parametrize(
    "name", sorted(n for n in os.listdir(os.path.join(ROOT, "train_configs")) if n.endswith(".toml"))
)
def test_shipped_configs_load(name):
    """Every shipped TOML parses; the CPU ones (shipped tokenizer) also pass the pre-launch check at 2 ranks (the
    configs as code of train_configs/recipes.py: tests/unit/test_config_as_code.py)."""
    config = JobConfig.parse_args(["--job.config_file", os.path.join(ROOT, "train_configs", name)])
    if os.path.isfile(os.path.join(ROOT, config.model.tokenizer_path)):
        run_preflight(config, 2)


def test_precedence_defaults_toml_cli(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[training]\nsteps = 7\nbatch_size = 3\n")
    c = JobConfig.parse_args(["--job.config_file", str(toml), "--training.steps", "9"])
    assert (c.training.steps, c.training.batch_size, c.training.seq_len) == (9, 3, 2048)
    c = JobConfig.parse_args(["--training.steps=11", "--job.config_file", str(toml)])
    assert c.training.steps == 11


def test_bare_bool_flag_and_explicit_false():
    c = JobConfig.parse_args(["--checkpoint.enable_checkpoint", "--training.compile", "false"])
    assert c.checkpoint.enable_checkpoint is True and c.training.compile is False


def test_cli_types():
    c = JobConfig.parse_args(
        [
            "--optimizer.lr",
            "1e-3",
            "--training.seed",
            "none",
            "--experimental.pipeline_parallel_split_points",
            "layers.2, layers.4",
            "--training.dataset_path=/x/y",
        ]
    )
    assert c.optimizer.lr == 1e-3 and c.training.seed is None
    assert c.experimental.pipeline_parallel_split_points == ["layers.2", "layers.4"]
    assert c.training.dataset_path == "/x/y"


def test_unknown_key_has_did_you_mean(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'training.tensor_paralel_degree' \(did you mean 'training.tensor_parallel_degree'\?\)",
    ):
        JobConfig.parse_args(["--training.tensor_paralel_degree", "2"])
    toml = tmp_path / "c.toml"
    toml.write_text("[trainig]\nsteps = 1\n")
    with pytest.raises(ConfigError, match="unknown config key 'trainig.steps'.*'training.steps'"):
        JobConfig.parse_args(["--job.config_file", str(toml)])


@pytest.mark.parametrize(
    "args, match",
    [
        (["--training.steps", "ten"], r"'training.steps': got 'ten' \(str\), expected int"),
        (["--training.compile", "maybe"], "'training.compile': got 'maybe'"),
        (["--optimizer.name", "SGD"], "expected 'AdamW' | 'Adam'"),
        (["--training.steps"], "flag --training.steps needs a value"),
        (["training.steps", "3"], "unexpected argument 'training.steps'"),
    ],
)
def test_bad_cli_values(args, match):
    with pytest.raises(ConfigError, match=match):
        JobConfig.parse_args(args)


def test_bad_toml_types_and_syntax(tmp_path):
    bad_type = tmp_path / "t.toml"
    bad_type.write_text('[training]\nsteps = "10"\n')
    with pytest.raises(ConfigError, match=r"'training.steps': got '10' \(str\), expected int"):
        JobConfig.parse_args(["--job.config_file", str(bad_type)])
    bad_syntax = tmp_path / "s.toml"
    bad_syntax.write_text("[training\nsteps = 1\n")
    with pytest.raises(ConfigError, match=r"s.toml: line 1, column 10: not valid TOML \(.*\); fix that line$"):
        JobConfig.parse_args(["--job.config_file", str(bad_syntax)])


def test_missing_config_file():
    with pytest.raises(FileNotFoundError, match="config file not found: 'nope.toml'"):
        JobConfig.parse_args(["--job.config_file", "nope.toml"])


def test_toml_round_trip(tmp_path):
    c = JobConfig.parse_args(["--training.steps", "5", "--experimental.pipeline_parallel_split_points", "layers.1"])
    path = tmp_path / "dumped.toml"
    path.write_text(c.to_toml())
    again = JobConfig.parse_args(["--job.config_file", str(path)]).to_dict()
    assert again["job"].pop("config_file") == str(path)
    expected = c.to_dict()
    expected["job"].pop("config_file")
    assert again == expected


def test_help_lists_every_key():
    text = format_help()
    c = JobConfig()
    for section, values in c.to_dict().items():
        for key in values:
            assert f"--{section}.{key} " in text
    assert "gradient-norm clipping threshold" in text


def test_config_check_cli_checks_and_exits_nonzero():
    env = dict(os.environ, PYTHONPATH=ROOT)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan.preflight",
            "--world_size",
            "4",
            "--training.data_parallel_shard_degree",
            "3",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "error: dp_replicate(1) * dp_shard(3) * cp(1) * tp(1) * pp(1) = 3 != world_size(4); "
        "set data_parallel_shard_degree = -1 to infer it"
    )
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan.preflight",
            "--world_size",
            "2",
            "--job.config_file",
            "train_configs/debug_model.toml",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    # The check's old home fails loudly (exit 2, naming the new command) instead of exiting 0 unchecked.
    moved = subprocess.run(
        [sys.executable, "-m", "torchtitan.config", "--job.config_file", "train_configs/debug_model.toml"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert moved.returncode == 2 and "python -m torchtitan.preflight" in moved.stderr, moved.stderr


@pytest.mark.parametrize(
    "args, code, stderr",
    [
        (["--world_size=2", "--job.config_file", "train_configs/debug_model.toml"], 0, ""),
        (
            ["--world_size", "two"],
            2,
            "error: --world_size needs a positive integer (the number of processes), got 'two'\n",
        ),
        (["--world_size"], 2, "error: --world_size needs a positive integer (the number of processes), got ''\n"),
    ],
)
def test_config_check_world_size(args, code, stderr, capsys):
    check = importlib.import_module("torchtitan.preflight.__main__")
    assert check.main(args) == code
    assert capsys.readouterr().err == stderr


def test_config_error_is_a_leaf_reexported_by_the_manager():
    from torchtitan.config import errors, manager

    tree = ast.parse(open(errors.__file__).read())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert manager.ConfigError is errors.ConfigError and issubclass(errors.ConfigError, ValueError)


@pytest.mark.parametrize(
    "toml, cli, loss_parallel, color",
    [
        ("[training]\ndisable_loss_parallel = true\n[metrics]\ndisable_color_printing = true\n", [], False, False),
        ("[training]\ndisable_loss_parallel = false\nenable_loss_parallel = true\n", [], True, True),
        ("", ["--training.disable_loss_parallel", "--metrics.disable_color_printing", "false"], False, True),
        ("[training]\ndisable_loss_parallel = true\n", ["--training.enable_loss_parallel", "true"], True, True),
    ],
    ids=["toml-alias", "toml-both-agree", "cli-alias", "cli-overrides-toml-alias"],
)
def test_deprecated_disable_spellings_map_onto_enable_keys(tmp_path, toml, cli, loss_parallel, color):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    c = JobConfig.parse_args(["--job.config_file", str(path), *cli])
    assert (c.training.enable_loss_parallel, c.loss_parallel, c.metrics.enable_color_printing) == (
        loss_parallel,
        loss_parallel,
        color,
    )
    assert "disable_loss_parallel" not in c.to_dict()["training"]  # only the canonical key is dumped


def test_deprecated_spelling_contradicting_the_canonical_key_is_an_error(tmp_path):
    match = (
        r"training.enable_loss_parallel = true and training.disable_loss_parallel = true contradict each other "
        r"\(training.disable_loss_parallel is the older spelling of training.enable_loss_parallel = false\); "
        r"keep only training.enable_loss_parallel"
    )
    with pytest.raises(ConfigError, match=match):
        JobConfig.parse_args(["--training.enable_loss_parallel", "--training.disable_loss_parallel"])
    path = tmp_path / "c.toml"
    path.write_text("[metrics]\ndisable_color_printing = true\nenable_color_printing = true\n")
    with pytest.raises(
        ConfigError, match="metrics.disable_color_printing = true and metrics.enable_color_printing = true"
    ):
        JobConfig.parse_args(["--job.config_file", str(path)])
    assert "--training.disable_loss_parallel (bool, deprecated)" in format_help()


def test_train_help_exits_zero():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan.train", "--help"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and "--training.data_parallel_shard_degree" in out.stdout


@pytest.mark.parametrize(
    "args, world, error, match",
    [
        (
            ["--training.tensor_parallel_degree", "3"],
            3,
            ConfigError,
            r"n_heads = 16 is not divisible by training.tensor_parallel_degree = 3",
        ),
        (
            ["--training.tensor_parallel_degree", "2", "--training.seq_len", "129"],
            2,
            ConfigError,
            r"training.seq_len \(sequence parallel\) = 129 is not divisible",
        ),
        (["--experimental.enable_async_tensor_parallel"], 2, ConfigError, "needs training.tensor_parallel_degree > 1"),
        (
            [
                "--training.tensor_parallel_degree",
                "2",
                "--experimental.enable_async_tensor_parallel",
                "--experimental.async_tensor_parallel_impl",
                "compiler",
            ],
            2,
            ConfigError,
            "needs training.compile = true",
        ),
        (
            [
                "--training.tensor_parallel_degree",
                "2",
                "--training.data_parallel_replicate_degree",
                "2",
                "--training.data_parallel_shard_degree",
                "1",
            ],
            4,
            NotImplementedError,
            "DDP .* with tensor parallel is not supported",
        ),
        (
            [
                "--training.tensor_parallel_degree",
                "2",
                "--experimental.enable_async_tensor_parallel",
                "--experimental.async_tensor_parallel_impl",
                "ring",
                "--training.compile",
            ],
            2,
            NotImplementedError,
            "cannot trace",
        ),
    ],
    ids=["heads", "seq-len", "async-without-tp", "compiler-without-compile", "ddp-tp", "ring-with-compile"],
)
def test_tp_validation(args, world, error, match):
    config = JobConfig.parse_args(["--job.config_file", "train_configs/debug_model.toml", *args])
    with pytest.raises(error, match=match):
        run_preflight(config, world)


def test_tp_valid_layout_passes():
    config = JobConfig.parse_args(
        ["--job.config_file", "train_configs/debug_model.toml", "--training.tensor_parallel_degree", "4"]
    )
    run_preflight(config, 8)


@pytest.mark.parametrize(
    "args, error, match",
    [
        (["--experimental.pipeline_parallel_schedule", "Zigzag"], ValueError, "Zigzag.*GPipe"),
        (["--experimental.pipeline_parallel_split_points", "layers.9"], ValueError, "layers.9"),
        (["--experimental.pipeline_parallel_microbatches", "3"], ValueError, "pipeline_parallel_microbatches"),
        (["--experimental.pipeline_parallel_schedule_csv", "./nope.csv"], FileNotFoundError, "nope.csv"),
        (["--model.flavor", "debugmodel_tied"], NotImplementedError, "ties the output head to the embedding"),
    ],
    ids=["schedule-name", "split-point", "microbatches", "csv-missing", "tied-embeddings"],
)
def test_pipeline_validation(args, error, match):
    config = JobConfig.parse_args(
        ["--job.config_file", "train_configs/debug_model.toml", "--experimental.pipeline_parallel_degree", "2", *args]
    )
    with pytest.raises(error, match=match):
        run_preflight(config, 2)


@pytest.mark.parametrize(
    "cp, args, world, error, match",
    [
        (
            4,
            ["--training.seq_len", "100"],
            4,
            ConfigError,
            r"seq_len = 100 is not divisible by 2 x context_parallel_degree",
        ),
        (
            8,
            ["--training.seq_len", "36", "--experimental.context_parallel_load_balance", "false"],
            8,
            ConfigError,
            r"seq_len = 36 is not divisible by context_parallel_degree = 8",
        ),
        (
            2,
            ["--training.seq_len", "36", "--training.tensor_parallel_degree", "4"],
            8,
            ConfigError,
            r"seq_len / context_parallel_degree = 18 is not divisible by training.tensor_parallel_degree = 4",
        ),
        (2, ["--training.compile"], 2, NotImplementedError, "context_parallel_degree > 1 with training.compile"),
    ],
    ids=["seq-len-load-balanced", "seq-len-plain", "seq-len-with-sp", "compile"],
)
def test_context_parallel_validation(cp, args, world, error, match):
    config = JobConfig.parse_args(
        [
            "--job.config_file",
            "train_configs/debug_model.toml",
            "--experimental.context_parallel_degree",
            str(cp),
            *args,
        ]
    )
    with pytest.raises(error, match=match):
        run_preflight(config, world)


def test_context_parallel_valid_layout_passes():
    config = JobConfig.parse_args(
        [
            "--job.config_file",
            "train_configs/debug_model.toml",
            "--training.seq_len",
            "64",
            "--experimental.context_parallel_degree",
            "2",
            "--training.tensor_parallel_degree",
            "2",
        ]
    )
    run_preflight(config, 8)


MOE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64", "--model.name", "llama3_moe"]


@pytest.mark.parametrize(
    "args, world, error, match",
    [
        (
            ["--model.name", "llama3", "--experimental.expert_parallel_degree", "2"],
            2,
            ConfigError,
            r"expert_parallel_degree = 2 but model.name = 'llama3' \(flavor 'debugmodel'\) has no experts",
        ),
        (
            ["--experimental.expert_parallel_degree", "3"],
            3,
            ConfigError,
            r"num_experts = 8, not divisible by experimental.expert_parallel_degree = 3",
        ),
        (
            ["--experimental.expert_parallel_degree", "2", "--training.tensor_parallel_degree", "4"],
            8,
            ConfigError,
            r"expert_parallel_degree = 2 is not a multiple of training.tensor_parallel_degree = 4",
        ),
        (
            ["--experimental.expert_parallel_degree", "4"],
            2,
            ConfigError,
            r"expert_parallel_degree = 4 = 4 does not divide data_parallel_shard_degree = 2",
        ),
        (
            ["--experimental.expert_parallel_degree", "4", "--training.tensor_parallel_degree", "2"],
            2,
            ConfigError,
            r"/ tensor_parallel_degree 2 = 2 does not divide data_parallel_shard_degree = 1",
        ),
        (
            ["--training.tensor_parallel_degree", "2"],
            2,
            NotImplementedError,
            r"tensor_parallel_degree = 2 with experimental.expert_parallel_degree = 1: the routed experts",
        ),
        (
            ["--experimental.expert_parallel_degree", "2", "--experimental.context_parallel_degree", "2"],
            4,
            NotImplementedError,
            r"expert_parallel_degree = 2 with experimental.context_parallel_degree = 2",
        ),
        (
            ["--model.flavor", "debugmodel_aux_loss", "--experimental.pipeline_parallel_degree", "2"],
            2,
            NotImplementedError,
            r"balances with an aux loss, and under experimental.pipeline_parallel_degree = 2",
        ),
    ],
    ids=[
        "ep-without-experts",
        "experts-not-divisible",
        "ep-not-multiple-of-tp",
        "ep-not-dividing-dp-shard",
        "ep-over-tp-not-dividing-dp-shard",
        "moe-tp-without-ep",
        "ep-with-cp",
        "aux-loss-with-pp",
    ],
)
def test_expert_parallel_validation(args, world, error, match):
    config = JobConfig.parse_args([*MOE, *args])
    with pytest.raises(error, match=match):
        run_preflight(config, world)


@pytest.mark.parametrize(
    "args, world, axes",
    [
        # dp_shard 4 = dp_shard_mod_ep 2 x dp_shard_in_ep 2; ep = dp_shard_in_ep
        (
            ["--experimental.expert_parallel_degree", "2"],
            4,
            {"dp": "dp", "dp_shard_cp": "dp_shard_cp", "ep": "dp_shard_in_ep", "dp_shard_mod_ep": "dp_shard_mod_ep"},
        ),
        # dp_shard 2 x tp 2 with ep 2: the EP group is the TP group; experts shard over dp_shard_mod_ep 2
        (
            ["--experimental.expert_parallel_degree", "2", "--training.tensor_parallel_degree", "2"],
            4,
            {"dp": "dp_shard_mod_ep", "ep": "tp", "dp_shard_mod_ep": "dp_shard_mod_ep"},
        ),
        # dp_shard 4 x tp 2 with ep 4 = dp_shard_in_ep 2 x tp 2
        (
            ["--experimental.expert_parallel_degree", "4", "--training.tensor_parallel_degree", "2"],
            8,
            {
                "dp": "dp",
                "dp_shard_cp": "dp_shard_cp",
                "dp_cp": "dp_cp",
                "ep": "ep",
                "dp_shard_mod_ep": "dp_shard_mod_ep",
            },
        ),
        # ep = dp_shard: the experts' FSDP axis has one rank (None: no group to address)
        (
            ["--experimental.expert_parallel_degree", "2"],
            2,
            {"dp": "dp_shard_in_ep", "ep": "dp_shard_in_ep", "dp_shard_mod_ep": None},
        ),
    ],
    ids=["fsdp4-ep2", "fsdp2-tp2-ep2", "fsdp4-tp2-ep4", "ep2"],
)
def test_expert_parallel_layouts_and_axes(args, world, axes):
    from torchtitan.distributed.parallel_dims import ParallelDims

    config = JobConfig.parse_args([*MOE, *args])
    run_preflight(config, world)
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world)
    assert {axis: dims.axis_name(axis) for axis in axes} == axes
    assert dims.size("ep") == config.experimental.expert_parallel_degree
    assert dims.size("dp_shard") == dims.dp_shard  # dense FSDP still shards over all of dp_shard


def test_torch_context_parallel_is_pinned_to_its_torch_version(monkeypatch):
    args = [
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--training.seq_len",
        "64",
        "--experimental.context_parallel_degree",
        "2",
        "--experimental.context_parallel_impl",
        "torch",
    ]
    run_preflight(JobConfig.parse_args(args), 2)
    for checked in ("2.11.0+cu130", "2.15.1"):
        monkeypatch.setattr(torch, "__version__", checked)
        run_preflight(JobConfig.parse_args(args), 2)
    for other in ("2.10.0", "2.16.0"):
        monkeypatch.setattr(torch, "__version__", other)
        with pytest.raises(NotImplementedError, match=rf"checked on torch 2.11 to 2.15, and this is torch {other};"):
            run_preflight(JobConfig.parse_args(args), 2)


def test_help_prints_each_keys_bounds_and_allowed_values():
    """Numeric ranges and allowed values are schema metadata: --help shows what the preflight enforces."""
    text = format_help()
    for line in (
        "--training.steps (int, default 10000, >= 1)",
        "--optimizer.lr (float, default 0.0008, > 0)",
        "--training.max_norm (float, default 1.0, >= 0 (0 turns clipping off))",
        "--checkpoint.interval (int, default 500, >= 1 (interval_type))",
        "--checkpoint.load_step (int, default -1, -1 (the newest complete checkpoint) or a step >= 0)",
        "--validation.batch_size (int | None, default None, >= 1 (or unset))",
        "--model.norm_type (str, default 'rmsnorm', one of rmsnorm, fused_rmsnorm, layernorm, np_layernorm)",
        "--experimental.enable_compiled_autograd (bool, default False, not built yet: only the default is accepted)",
    ):
        assert line in text, line


def test_schema_norm_types_are_the_models():
    """config/ cannot import the models (it is a leaf), so it spells the norm types out; they stay equal."""
    from torchtitan.config import schema
    from torchtitan.models.llama import model

    assert schema.NORM_TYPES == model.NORM_TYPES


def test_help_into_a_reader_that_stops_early_is_no_traceback(monkeypatch):
    """`python -m torchtitan.train --help | head -3`: the pipe closes after 3 lines; the rest is dropped quietly."""
    from torchtitan.config.manager import format_help, print_help

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone
    saved = os.dup(1)
    stdout = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    os.dup2(write_end, 1)
    try:
        print_help(format_help())  # BrokenPipeError before: a traceback after the help's first lines
    finally:
        os.dup2(saved, 1)
        os.close(saved)
