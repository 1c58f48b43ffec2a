"""torchtitan's 2025 config schema beside ours: its shipped TOML files and flags load, each key does what it does
upstream or is refused in one line, and its warmup-stable-decay lr schedule matches upstream's formula.

The files under tests/assets/torchtitan_2025/ are upstream's (commit 7e4ab8599), unchanged; job_config_keys.txt
there lists every leaf key of upstream's JobConfig at that commit.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import pytest
import tomllib
import torch

from torchtitan.components.optim.lr_schedule import compute_lr_factor, compute_wsd_lr_factor, wsd_phases
from torchtitan.components.optim.optimizer import build_lr_scheduler
from torchtitan.config.compat.keys_2025 import RULES, SHARED, file_is_2025
from torchtitan.config.compat.spellings import Alias
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig, _field_type, all_keys, format_help
from torchtitan.config.schema import Training
from torchtitan.preflight import run_preflight

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSETS = os.path.join(ROOT, "tests", "assets", "torchtitan_2025")
# Upstream's launch of its fault-tolerance debug file (its docs/torchft.md): 4 GPUs, one of 2 replica groups.
FT_LAUNCH = ["--parallelism.data_parallel_shard_degree=4", "--fault_tolerance.group_size=2"]
FT_LAUNCH += ["--fault_tolerance.replica_id=0"]
STREAMING = (
    "fault_tolerance.num_fragments = 2: Streaming DiLoCo (several model fragments synced at different steps) is not "
    "built; diloco syncs the whole model; set fault_tolerance.num_fragments = 1 or remove it"
)
# Every 2025 TOML of a family here (tests/assets/torchtitan_2025/README.md): (file, the world size its layout was
# written for: the NOTE at its top, its degrees (EP 8), upstream's documented launch, 2 for the debug files that
# CPU runs train, the flags that launch adds, None where the pre-launch check passes or the one line refusing it).
UPSTREAM_FILES = [
    ("llama3_debug_model.toml", 2, [], None),
    ("llama3_8b.toml", 64, [], None),  # NOTE: 64 A100s
    ("llama3_70b.toml", 64, [], None),  # NOTE: 64 A100s
    ("llama3_405b.toml", 128, [], None),  # NOTE: 128 H100s; float8, async TP, compile of the model and the loss
    ("llama3_ft_debug_model.toml", 4, FT_LAUNCH, STREAMING),
    ("qwen3_0.6b.toml", 8, [], None),
    ("qwen3_1.7b.toml", 8, [], None),
    ("qwen3_32b.toml", 8, [], None),  # NOTE: 8 H100s
    ("qwen3_moe_debug.toml", 2, [], None),
    ("deepseek_v3_debug_model.toml", 2, [], None),
    ("deepseek_v3_16b.toml", 8, [], None),  # expert_parallel_degree = 8
    ("deepseek_v3_671b.toml", 256, [], None),
    ("gpt_oss_debug_model.toml", 2, [], None),
]
LOADABLE = [(name, world, flags) for name, world, flags, refusal in UPSTREAM_FILES if refusal is None]
# The fault-tolerance file loads once Streaming DiLoCo is turned off: the rest of it is built.
LOADABLE.append(("llama3_ft_debug_model.toml", 4, [*FT_LAUNCH, "--fault_tolerance.num_fragments=1"]))


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        out |= _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return out


def _get(config: JobConfig, key: str):
    section, _, name = key.partition(".")
    return getattr(getattr(config, section), name)


def _parse(tmp_path, toml: str = "", *cli: str, world_size: int | None = None) -> JobConfig:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    return JobConfig.parse_args(["--job.config_file", str(path), *cli], world_size=world_size)


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# --------------------------------------------------------------------------- every key has a meaning


# Upstream's torchft experiment adds these to [fault_tolerance] (torchtitan/experiments/torchft/config/job_config.py)
TORCHFT_EXPERIMENT = {
    f"fault_tolerance.{k}"
    for k in (
        "sync_steps",
        "should_quantize",
        "fragment_sync_delay",
        "fragment_update_alpha",
        "module_fqns_per_model_fragment",
        "num_fragments",
    )
}


def test_every_upstream_key_is_shared_or_has_a_rule():
    with open(os.path.join(ASSETS, "job_config_keys.txt")) as f:
        upstream = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert len(upstream) == 147
    assert set(upstream) | TORCHFT_EXPERIMENT == set(RULES) | SHARED and not set(RULES) & SHARED
    ours = set(all_keys())
    assert SHARED - {"metrics.disable_color_printing"} <= ours  # spelled as here (that one: a late-2024 alias)
    for key, rule in RULES.items():
        if isinstance(rule, Alias):
            assert rule.target in ours and all(k in ours for k, _ in rule.implies), key


def _doc_2025_keys() -> set[str]:
    """The keys of the 2025 table's first column; a name without a dot shares the last dotted one's section."""
    with open(os.path.join(ROOT, "docs", "compatibility.md")) as f:
        doc = f.read().split("# Coming from torchtitan (2025)")[1].split("# Coming from torchtitan (2026)")[0]
    keys = set()
    for line in doc.splitlines():
        if line.startswith("| `"):
            prefix = ""
            for name in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
                prefix = name.rpartition(".")[0] if "." in name else prefix
                keys.add(name if "." in name else f"{prefix}.{name}")
    return keys


def test_compatibility_doc_lists_every_2025_key():
    assert _doc_2025_keys() == set(RULES) | SHARED


def test_help_names_the_2025_spellings():
    text = format_help()
    assert (
        "--parallelism.data_parallel_shard_degree (torchtitan 2025): spelling of training.data_parallel_shard_degree"
        in text
    )
    assert "--fault_tolerance.num_fragments: accepted only as 1: Streaming DiLoCo" in text


# --------------------------------------------------------------------------- upstream's files


@pytest.mark.parametrize("name, world_size, flags, refusal", UPSTREAM_FILES, ids=[f[0] for f in UPSTREAM_FILES])
def test_2025_files_pass_the_prelaunch_check_or_are_refused_in_one_line(name, world_size, flags, refusal, capsys):
    """``python -m torchtitan.preflight --target cuda --world_size N`` on upstream's file and the flags its launch
    adds, as a user checks a GPU cluster's config from any machine: a refusal is this one line; a passing file
    prints the ``ok:`` line, its device checks run for CUDA and the checks of this machine's files (upstream's
    data and tokenizer folders) are listed as not checked here."""
    from torchtitan.preflight.__main__ import main

    argv = ["--target", "cuda", "--world_size", str(world_size), "--job.config_file", os.path.join(ASSETS, name)]
    code, out = main([*argv, *flags]), capsys.readouterr()
    if refusal is not None:
        assert (code, out.err, out.out) == (2, f"error: {refusal}\n", "")
        return
    assert code == 0, out.err
    assert out.out.startswith(f"ok: {argv[-1]}, world_size {world_size}, device cuda (--target): "), out.out
    assert "not checked here (on the cuda machines): " in out.out and out.out.count("\n") == 1, out.out


@pytest.mark.parametrize("name, world_size, flags", LOADABLE, ids=[f"{n} {f[-1:]}" for n, _, f in LOADABLE])
def test_2025_files_load_each_key_as_upstream(name, world_size, flags):
    path = os.path.join(ASSETS, name)
    config = JobConfig.parse_args(["--job.config_file", path, *flags], world_size=world_size)
    with open(path, "rb") as f:
        raw = _flat(tomllib.load(f))
    assert file_is_2025(list(raw))
    compiled = raw.get("compile.components", ["model", "loss"]) if raw.get("compile.enable") else []
    moved = {"model.name", "model.flavor"} if name == "qwen3_moe_debug.toml" else set()  # checked below
    for key, value in raw.items():
        rule = RULES.get(key)
        if key in moved or f"--{key}" in " ".join(flags):
            continue
        if key in SHARED and key != "metrics.disable_color_printing":
            assert _get(config, key) == value, key
        elif isinstance(rule, Alias) and key != "compile.enable":
            want = rule.convert(value) if rule.convert else value
            assert _get(config, rule.target) == want, key
    # compile.enable with components: upstream compiles the blocks for "model", the loss for "loss"
    assert (config.training.compile, config.training.compile_loss) == ("model" in compiled, "loss" in compiled)
    assert config.training.lr_schedule == "wsd"  # [lr_scheduler]: upstream's warmup-stable-decay
    assert "parallelism" not in config.to_toml() and "[lr_scheduler]" not in config.to_toml()  # dumped in our keys
    if moved:  # upstream's qwen3 holds MoE flavors; here they are qwen3_moe's (the debug one at our debug size)
        assert (config.model.name, config.model.flavor) == ("qwen3_moe", "debugmodel")


def test_2025_compile_components(tmp_path):
    """deepseek_v3_16b.toml's ["loss"] compiles the loss only: its MoE blocks do not compile here (nor upstream)."""
    c = JobConfig.parse_args(["--job.config_file", os.path.join(ASSETS, "deepseek_v3_16b.toml")], world_size=8)
    assert (c.training.compile, c.training.compile_loss) == (False, True)
    c = _parse(tmp_path, "[compile]\nenable = true\n")  # upstream's default components: both
    assert (c.training.compile, c.training.compile_loss) == (True, True)
    c = _parse(tmp_path, '[compile]\nenable = false\ncomponents = ["loss"]\n')  # no effect with compile off
    assert (c.training.compile, c.training.compile_loss) == (False, False)
    with pytest.raises(ConfigError, match="means training.compile_loss = true, but training.compile_loss = false") as e:
        _parse(tmp_path, "[compile]\nenable = true\n", "--training.compile_loss", "false")
    _one_line(e)


def test_2025_memory_budget_mode(tmp_path):
    """Upstream's memory-budget AC is ours under the same keys; without compile it is refused in one line, as here."""
    toml = '[activation_checkpoint]\nmode = "memory_budget"\nmemory_budget = 0.3\n[compile]\nenable = true\n'
    c = _parse(tmp_path, toml)
    assert (c.activation_checkpoint.mode, c.activation_checkpoint.memory_budget, c.training.compile) == (
        "memory_budget",
        0.3,
        True,
    )
    run_preflight(c, 1, this_machine=False)
    with pytest.raises(ConfigError, match="needs training.compile = true") as e:
        run_preflight(_parse(tmp_path, toml, "--compile.no_enable"), 1, this_machine=False)
    _one_line(e)


def test_inert_quantize_sections_load_with_no_effect(tmp_path, caplog):
    """A section upstream reads only when model.converters names its converter (refused here) loads at any value."""
    toml = '[quantize.grouped_mm.float8]\nfqns = ["experts"]\n[quantize.linear.mx]\nrecipe_name = "mxfp8_cutlass"\n'
    with caplog.at_level("WARNING", logger="torchtitan.config.compat.resolve_2025"):
        c = _parse(tmp_path, toml)
    assert not c.float8.enable_float8_linear
    assert "quantize.grouped_mm.float8.fqns = [\"experts\"] has no effect without 'quantize.grouped_mm.float8'" in (
        caplog.text
    )
    with pytest.raises(NotImplementedError, match="'quantize.grouped_mm.float8' \\(float8 grouped GEMMs") as e:
        _parse(tmp_path, toml + '[model]\nconverters = ["quantize.grouped_mm.float8"]\n')  # named: the converter
    _one_line(e)


def test_2025_debug_model_values():
    c = JobConfig.parse_args(["--job.config_file", os.path.join(ASSETS, "llama3_debug_model.toml")], world_size=2)
    assert (c.training.batch_size, c.training.warmup_steps, c.training.lr_decay_ratio) == (8, 2, 0.8)
    assert (c.training.data_parallel_shard_degree, c.training.compile, c.float8.filter_fqns) == (-1, False, ["output"])
    assert (c.model.tokenizer_path, c.checkpoint.model_weights_only, c.validation.dataset) == (
        "./tests/assets/tokenizer",
        False,
        "c4_validation",
    )
    assert c.experimental.pipeline_parallel_schedule == "Interleaved1F1B"


def test_a_2025_file_gets_upstreams_defaults_and_flags_do_not(tmp_path):
    c = _parse(tmp_path, "[checkpoint]\nenable = true\n")
    assert (c.checkpoint.model_weights_only, c.checkpoint.keep_latest_k, c.training.lr_schedule) == (True, 10, "wsd")
    assert (c.training.dataset, c.model.tokenizer_path) == ("c4_test", "./tests/assets/tokenizer")
    c = _parse(tmp_path, "[checkpoint]\nenable = true\nlast_save_model_only = false\n", "--checkpoint.keep_latest_k=2")
    assert (c.checkpoint.model_weights_only, c.checkpoint.keep_latest_k) == (False, 2)  # given keys win
    c = _parse(tmp_path, "", "--checkpoint.enable")  # our file (empty), 2025 flags: our defaults
    assert (c.checkpoint.model_weights_only, c.checkpoint.keep_latest_k, c.training.lr_schedule) == (False, 0, "linear")
    c = _parse(tmp_path, "[checkpoint]\nenable = true\n[training]\nbatch_size = 2\n")  # mixed file: our defaults
    assert (c.checkpoint.model_weights_only, c.training.lr_schedule) == (False, "linear")


# --------------------------------------------------------------------------- refusals and contradictions


@pytest.mark.parametrize(
    "cli, error, match",
    [
        (["--fault_tolerance.num_fragments", "2"], NotImplementedError, "num_fragments = 2: Streaming DiLoCo"),
        (["--experimental.custom_import", "my.mod"], NotImplementedError, 'experimental.custom_import = "my.mod"'),
        (["--job.custom_config_module", "m"], NotImplementedError, 'job.custom_config_module = "m": the config is one'),
        (["--parallelism.expert_tensor_parallel_degree", "2"], NotImplementedError, "etp = tp is not built"),
        (["--parallelism.pipeline_parallel_layers_per_stage", "2"], NotImplementedError, "layers_per_stage = 2"),
        (["--model.converters", "quantize.linear.mx"], NotImplementedError, "'quantize.linear.mx' \\(MX-format"),
        (["--model.converters", "fp4"], ConfigError, "unknown converter 'fp4'"),
        (["--model.converters", "quantize.grouped_mm.float8"], NotImplementedError, "float8 grouped GEMMs of MoE"),
        (["--compile.enable", "--compile.components", "graph"], ConfigError, "unknown \\['graph'\\]"),
        (["--optimizer.implementation", "for-loop"], NotImplementedError, "'for-loop' is not built"),
        (["--comm.mode", "local_tensor"], NotImplementedError, 'comm.mode = "local_tensor"'),
        (["--comm.save_traces_folder", "t"], NotImplementedError, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
        (["--memory_estimation.enable"], NotImplementedError, "estimation.py"),
        (["--training.dataloader.num_workers", "2"], NotImplementedError, "num_workers = 0"),
        (["--checkpoint.no_initial_load_model_only"], NotImplementedError, "initial_load_model_only = false"),
        (["--debug.deterministic_warn_only"], NotImplementedError, "deterministic_warn_only"),
        (["--validation.enable", "--validation.seq_len", "512"], NotImplementedError, "validation.seq_len = 512"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_refusals_are_one_line(tmp_path, cli, error, match):
    with pytest.raises(error, match=match) as e:
        _parse(tmp_path, "", *cli)
    _one_line(e)


def test_a_flag_overrides_a_refused_file_value(tmp_path):
    """A refusal waits until every source is in: upstream's precedence (the flag wins) holds for it too."""
    _parse(tmp_path, "[fault_tolerance]\nnum_fragments = 2\ngroup_size = 4\n", "--fault_tolerance.num_fragments", "1")
    c = _parse(tmp_path, '[model]\nconverters = ["quantize.linear.mx"]\n', "--model.converters", "float8")
    assert c.float8.enable_float8_linear
    with pytest.raises(NotImplementedError, match="fault_tolerance.num_fragments = 2"):
        _parse(tmp_path, "[fault_tolerance]\nnum_fragments = 2\n")


@pytest.mark.parametrize(
    "toml, cli, match",
    [
        (
            "[training]\nbatch_size = 8\nlocal_batch_size = 4\n",
            [],
            "training.batch_size = 8 and training.local_batch_size = 4",
        ),
        (
            "",
            ["--training.data_parallel_shard_degree", "2", "--parallelism.data_parallel_shard_degree", "4"],
            "is torchtitan 2025's spelling of training.data_parallel_shard_degree = 4",
        ),
        (
            "",
            ["--training.enable_loss_parallel", "--parallelism.disable_loss_parallel"],
            "enable_loss_parallel = false",
        ),
        (
            "",
            ["--training.lr_schedule", "linear", "--lr_scheduler.decay_type", "cosine"],
            'training.lr_schedule = "wsd"',
        ),
        (
            '[model]\ntokenizer_path = "a"\nhf_assets_path = "b"\n',
            [],
            'model.tokenizer_path = "a" and model.hf_assets_path',
        ),
        ("[compile]\nenable = true\n[training]\ncompile = false\n", [], "training.compile = false and compile.enable"),
    ],
)
def test_contradicting_spellings_are_one_line_errors(tmp_path, toml, cli, match):
    with pytest.raises(ConfigError, match=match) as e:
        _parse(tmp_path, toml, *cli)
    assert "contradict each other" in _one_line(e)


def test_agreeing_spellings_and_later_sources(tmp_path):
    c = _parse(tmp_path, "[training]\nbatch_size = 4\nlocal_batch_size = 4\n", "--parallelism.tensor_parallel_degree=2")
    assert (c.training.batch_size, c.training.tensor_parallel_degree) == (4, 2)
    c = _parse(tmp_path, "[training]\nbatch_size = 4\n", "--training.local_batch_size", "2")  # a later source wins
    assert c.training.batch_size == 2


def test_cli_spellings_of_tyro(tmp_path):
    c = _parse(tmp_path, "", "--job.print-config", "--metrics.no_enable_tensorboard", "--compile.no-enable")
    assert (c.job.print_args, c.metrics.enable_tensorboard, c.training.compile) == (True, False, False)
    c = _parse(tmp_path, "", "--parallelism.no_disable_loss_parallel", "--metrics.save_for_all_ranks")
    assert (c.training.enable_loss_parallel, c.metrics.rank_0_only) == (True, False)


# --------------------------------------------------------------------------- keys that need other keys


def test_global_batch_size_derives_gradient_accumulation(tmp_path):
    flags = ["--training.local_batch_size", "4", "--training.global_batch_size"]
    assert _parse(tmp_path, "", *flags, "16", world_size=2).training.gradient_accumulation_steps == 2
    assert _parse(tmp_path, "", *flags, "16", world_size=4).training.gradient_accumulation_steps == 1
    tp2 = ["--parallelism.tensor_parallel_degree", "2"]  # dp = 4 / tp 2 = 2
    assert _parse(tmp_path, "", *flags, "32", *tp2, world_size=4).training.gradient_accumulation_steps == 4
    shard = ["--parallelism.data_parallel_shard_degree", "2"]  # no world size needed
    assert _parse(tmp_path, "", *flags, "24", *shard).training.gradient_accumulation_steps == 3
    assert _parse(tmp_path, "", *flags, "-1", world_size=2).training.gradient_accumulation_steps == 1
    with pytest.raises(
        ConfigError, match=r"global_batch_size = 12 is not a multiple of .* = 8; set a multiple of 8"
    ) as e:
        _parse(tmp_path, "", *flags, "12", world_size=2)
    _one_line(e)
    with pytest.raises(ConfigError, match="needs the world size"):
        _parse(tmp_path, "", *flags, "16")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps = 2 here, but .* = 4 is also given"):
        _parse(tmp_path, "", *flags, "16", "--training.gradient_accumulation_steps", "4", world_size=2)
    with pytest.raises(ConfigError, match="must be -1 .* or >= 1, got 0"):
        _parse(tmp_path, "", *flags, "0", world_size=2)


def test_hf_assets_path_is_the_tokenizer_and_the_hf_weights(tmp_path):
    c = _parse(tmp_path, '[model]\nhf_assets_path = "assets/hf/x"\n[checkpoint]\ninitial_load_in_hf = true\n')
    assert (c.model.tokenizer_path, c.checkpoint.initial_load_path) == ("assets/hf/x", "assets/hf/x")
    c = _parse(tmp_path, "", "--model.hf_assets_path", "t", "--checkpoint.initial_load_path", "w")
    assert (c.model.tokenizer_path, c.checkpoint.initial_load_path) == ("t", "w")


def test_converters_and_quantize_tables(tmp_path):
    c = _parse(tmp_path, '[model]\nconverters = ["float8"]\n[quantize.linear.float8]\nrecipe_name = "rowwise"\n')
    assert (c.float8.enable_float8_linear, c.float8.recipe_name) == (True, "rowwise")
    assert not _parse(tmp_path, "[model]\nconverters = []\n").float8.enable_float8_linear
    c = _parse(tmp_path, "", "--model.converters", "quantize.linear.float8", "--optimizer.implementation", "fused")
    assert c.float8.enable_float8_linear and c.optimizer.fused
    c = _parse(tmp_path, '[quantize.linear.mx]\nrecipe_name = "mxfp8_cublas"\nfilter_fqns = ["output"]\n')  # defaults
    assert not c.float8.enable_float8_linear


def test_pipeline_keys(tmp_path):
    parts = '[["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "norm", "output"]]'
    toml = f"[parallelism]\npipeline_parallel_degree = 2\nmodule_fqns_per_model_part = {parts}\n"
    c = _parse(tmp_path, toml + "[training]\nlocal_batch_size = 8\n")
    assert c.experimental.pipeline_parallel_split_points == ["layers.1", "layers.3"]
    assert c.experimental.pipeline_parallel_microbatches == 8  # upstream: local batch / microbatch size 1
    c = _parse(tmp_path, toml + "pipeline_parallel_microbatch_size = 2\n[training]\nlocal_batch_size = 8\n")
    assert c.experimental.pipeline_parallel_microbatches == 4
    even = "[parallelism]\npipeline_parallel_degree = 2\n"
    with pytest.raises(NotImplementedError, match=r"first_stage_less_layers = 1 \(torchtitan 2025's default\)") as e:
        _parse(tmp_path, even)
    _one_line(e)
    zero = "pipeline_parallel_first_stage_less_layers = 0\npipeline_parallel_last_stage_less_layers = 0\n"
    assert _parse(tmp_path, even + zero).experimental.pipeline_parallel_split_points == []
    with pytest.raises(ConfigError, match="part 1 = \\['layers.2'"):
        _parse(tmp_path, '[parallelism]\nmodule_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.2"]]\n')


def test_validation_keys(tmp_path):
    c = _parse(tmp_path, "[validation]\nenable = true\nsteps = 3\nlocal_batch_size = 2\n[training]\nseq_len = 2048\n")
    assert (c.validation.enabled, c.validation.steps, c.validation.batch_size) == (True, 3, 2)
    with pytest.raises(NotImplementedError, match="validation.steps = -1 \\(torchtitan 2025's default") as e:
        _parse(tmp_path, "[validation]\nenable = true\n[training]\nseq_len = 2048\n")
    _one_line(e)
    with pytest.raises(NotImplementedError, match="validation.seq_len = 2048 \\(torchtitan 2025's default\\) differs"):
        _parse(tmp_path, "[validation]\nenable = true\nsteps = 2\n[training]\nseq_len = 256\n")


def test_late_2024_disable_fake_mode_is_accepted_again(tmp_path):
    c = _parse(tmp_path, "[memory_estimation]\nenabled = false\ndisable_fake_mode = false\n")
    assert c.training.lr_schedule == "linear"  # a late-2024 file: our defaults
    with pytest.raises(NotImplementedError, match="disable_fake_mode = true: .*estimation.py") as e:
        _parse(tmp_path, "[memory_estimation]\ndisable_fake_mode = true\n")
    _one_line(e)


def test_dumped_2025_config_reloads_identically(tmp_path):
    c = JobConfig.parse_args(["--job.config_file", os.path.join(ASSETS, "llama3_debug_model.toml")], world_size=2)
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(c.to_toml())
    again = JobConfig.parse_args(["--job.config_file", str(dumped)]).to_dict()
    expected = c.to_dict()
    again["job"].pop("config_file"), expected["job"].pop("config_file")
    assert again == expected


# --------------------------------------------------------------------------- the lr schedule


def _wsd(decay_type: str, *, steps=10, warmup=2, ratio=0.8, min_factor=0.1) -> list[float]:
    t = dataclasses.replace(
        Training(), steps=steps, warmup_steps=warmup, lr_schedule="wsd", lr_decay_ratio=ratio,
        lr_decay_type=decay_type, lr_min_factor=min_factor,
    )  # fmt: skip
    phases = wsd_phases(t)
    return [compute_wsd_lr_factor(s, phases, decay_type, min_factor) for s in range(steps)]


# Upstream's linear_warmup_stable_decay at steps = 10, warmup_steps = 2, decay_ratio = 0.8, min_lr_factor = 0.1:
# decay = round(10 x 0.8) = 8 steps, stable = 10 + 1 - 2 - 8 = 1 (the virtual last step). Step s (0-based):
# s < 2: (s+1)/2 -> 0.5, 1.0; s = 2 (< warmup + stable = 3): 1.0; s >= 3: progress p = (s+1-3)/8, so
# p(3) = 0.125 and p(9) = 0.875, and the factor is 0.1 + 0.9 x curve(p), with curve = 1 - p (linear),
# 1 - sqrt(p) (sqrt), 0.5 (1 + cos(pi p)) (cosine).
EXPECTED = {
    "linear": (0.1 + 0.9 * (1 - 0.125), 0.1 + 0.9 * (1 - 0.875)),  # 0.8875, 0.2125
    "sqrt": (0.1 + 0.9 * (1 - math.sqrt(0.125)), 0.1 + 0.9 * (1 - math.sqrt(0.875))),  # 0.681802, 0.158127
    "cosine": (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.125)),  # 0.965746
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.875)),  # 0.134254
    ),
}


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_wsd_schedule_is_upstreams_formula(decay_type):
    factors = _wsd(decay_type)
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert (factors[3], factors[9]) == pytest.approx(EXPECTED[decay_type], rel=1e-12)
    assert all(a >= b for a, b in zip(factors[2:], factors[3:]))  # decays monotonically, never below 0.1
    assert min(factors) > 0.1


def test_wsd_without_decay_ratio_and_with_too_long_warmup():
    # decay_ratio unset: decay = 6 - 2 = 4, stable = 1; s = 3: p = 1/4; s = 5 (the last): p = 3/4, never 0
    assert _wsd("linear", steps=6, ratio=None, min_factor=0.0) == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    t = dataclasses.replace(Training(), steps=4, warmup_steps=10, lr_schedule="wsd")
    assert wsd_phases(t).warmup == 4 and "exceeds training.steps" in wsd_phases(t).notes[0]
    assert _wsd("linear", steps=4, warmup=10, ratio=None) == [0.25, 0.5, 0.75, 1.0]


def test_lr_scheduler_runs_the_configured_schedule_and_ours_is_unchanged():
    def lrs(training: Training) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        sched = build_lr_scheduler(opt, training)
        out = []
        for _ in range(training.steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    ours = dataclasses.replace(Training(), steps=10, warmup_steps=2)
    # bit for bit the late-2024 formula (the loss-parity goldens depend on it)
    assert lrs(ours) == [0.5 * compute_lr_factor(s, 2, 10) for s in range(10)]
    assert lrs(ours) == [0.5 * f for f in (1 / 3, 2 / 3, 1.0, 1 - 1 / 9, 1 - 2 / 9, 1 - 3 / 9, 1 - 4 / 9, 1 - 5 / 9,
                                           1 - 6 / 9, 1 - 7 / 9)]  # fmt: skip
    wsd = dataclasses.replace(ours, lr_schedule="wsd", lr_decay_ratio=0.8, lr_decay_type="cosine", lr_min_factor=0.1)
    assert lrs(wsd) == [0.5 * f for f in _wsd("cosine")]


def test_wsd_keys_need_the_wsd_schedule(tmp_path):
    c = _parse(tmp_path, "", "--training.lr_decay_type", "cosine")
    with pytest.raises(ConfigError, match="training.lr_decay_type = 'cosine' shapes the 'wsd' schedule") as e:
        run_preflight(c, 1, this_machine=False)
    _one_line(e)
    c = _parse(tmp_path, "[lr_scheduler]\nwarmup_steps = 20\n[training]\nsteps = 10\n")
    assert run_preflight(c, 1, this_machine=False) == [
        "training.warmup_steps (20) exceeds training.steps (10): warmup lasts 10 steps"
    ]
    assert _field_type("training.lr_schedule") is not None
