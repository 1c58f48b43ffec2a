"""Configurations as code (issue 88, item 1): ``--module M --config F``, a function returning the JobConfig, read as
a TOML file's values are; its mistakes one line each naming the module and the function; the launcher's
MODULE/CONFIG; the run's records. In process (the launcher's 2-rank run: tests/runs/launch/test_launch_runs.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from torchtitan.config import JobConfig
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import format_help
from torchtitan.preflight.__main__ import main as preflight

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(ROOT, "train_configs", "recipes.py")
DEBUG_TOML = os.path.join(ROOT, "train_configs", "debug_model.toml")


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.fixture
def module_file(tmp_path):
    """Write ``tmp_path/<name>.py``; the modules it imported are forgotten afterwards."""
    names = []

    def write(name: str, text: str) -> str:
        names.append(name)
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(text))
        return str(path)

    yield write
    for name in names:
        sys.modules.pop(name, None)


def _without_config_file(config: JobConfig) -> dict:
    data = config.to_dict()
    data["job"].pop("config_file")
    return data


@pytest.mark.parametrize("module", ["train_configs.recipes", "train_configs/recipes.py"])
def test_the_shipped_recipe_is_the_debug_toml_and_flags_win(module):
    """debug_model() of train_configs/recipes.py is train_configs/debug_model.toml as code (every value but the file's
    name); the flags apply on top and win, the last one last, as over a TOML."""
    flags = ["--training.steps", "7", "--optimizer.lr", "1e-3", "--training.steps", "3"]
    as_code = JobConfig.parse_args(["--module", module, "--config", "debug_model", *flags])
    as_toml = JobConfig.parse_args(["--job.config_file", DEBUG_TOML, *flags])
    assert _without_config_file(as_code) == _without_config_file(as_toml)
    assert as_code.training.steps == 3 and as_code.optimizer.lr == 1e-3 and as_code.job.config_file is None
    with open(RECIPES, "rb") as f:
        sha256 = hashlib.sha256(f.read()).hexdigest()
    assert (as_code.built_by.module, as_code.built_by.function) == (module, "debug_model")
    assert (as_code.built_by.file, as_code.built_by.sha256) == (RECIPES, sha256)
    assert as_toml.built_by is None
    assert JobConfig.parse_args(["--module", module, "--config", "debug_model_long"]).training.steps == 200


def test_a_function_that_starts_from_a_toml_resolves_as_that_toml(module_file):
    """A function that returns JobConfig.parse_args of a TOML, changed: the flags on top resolve as over the TOML,
    the optimizer's moments following a --training.dtype flag included (they follow the parameters unless set)."""
    path = module_file(
        "from_toml",
        f"""
        from torchtitan.config import JobConfig

        def longer():
            config = JobConfig.parse_args(["--job.config_file", {DEBUG_TOML!r}])
            config.training.steps = 4
            return config
        """,
    )
    flags = ["--training.dtype", "bfloat16"]
    as_code = JobConfig.parse_args(["--module", path, "--config", "longer", *flags])
    as_toml = JobConfig.parse_args(["--job.config_file", DEBUG_TOML, "--training.steps", "4", *flags])
    assert as_code.to_dict() == as_toml.to_dict()
    assert as_code.optimizer.state_dtype == "bfloat16"


BAD_RECIPES = """
from torchtitan.config import JobConfig

def raises():
    raise RuntimeError("no such cluster")

def as_dict():
    return {"training": {"steps": 5}}

def forgets_to_return():
    config = JobConfig()

def misspelt_field():
    config = JobConfig()
    config.training.stepz = 5
    return config

def wrong_type():
    config = JobConfig()
    config.training.steps = "10"
    return config

def section_as_dict():
    config = JobConfig()
    config.training = {"steps": 3}
    return config

def misspelt_section():
    config = JobConfig()
    config.trainig = {"steps": 3}
    return config

SIZE = 3
"""


def _one_error_line(argv: list[str], capsys) -> str:
    """The preflight's (the launcher's check's) exit code 2 and its one line."""
    code = preflight(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.splitlines()) == 1, (code, out, err)
    return err.removeprefix("error: ").rstrip("\n")


def test_bad_functions_are_one_line_each_naming_the_module_and_function(module_file, capsys):
    path = module_file("bad_recipes", BAD_RECIPES)
    fn = f"of {path}"

    def error(function: str) -> str:
        return _one_error_line(["--module", path, "--config", function], capsys)

    assert error("raises") == f"raises() {fn} raised RuntimeError: no such cluster ({path}, line 5)"
    expected = "expected a JobConfig: start from `config = JobConfig()` (from torchtitan.config import JobConfig)"
    assert error("as_dict") == (
        f"as_dict() {fn} returned a dict ({{'training': {{'steps': 5}}}}), {expected}, set its fields and return it"
    )
    assert error("forgets_to_return").startswith(f"forgets_to_return() {fn} returned None (a missing `return config`?)")
    assert error("misspelt_field") == (
        f"misspelt_field() {fn}: unknown config key 'training.stepz' (did you mean 'training.steps'?)"
    )
    assert error("wrong_type") == f"wrong_type() {fn}: config key 'training.steps': got '10' (str), expected int"
    assert error("section_as_dict") == (
        f"section_as_dict() {fn}: config.training is a dict ({{'steps': 3}}), expected a Training (set its fields: "
        "config.training.KEY = VALUE)"
    )
    assert error("misspelt_section") == (
        f"misspelt_section() {fn}: unknown config key 'trainig.steps' (did you mean 'training.steps'?)"
    )
    shown = f"{path} ({os.path.relpath(path)})"
    assert error("raisez") == (
        f"--config raisez: {shown} has no function 'raisez' (did you mean 'raises'?); its functions: as_dict, "
        "forgets_to_return, misspelt_field, misspelt_section, raises, section_as_dict, wrong_type"
    )
    assert error("SIZE") == f"--config SIZE: 'SIZE' of {shown} is an int (3), not a function"


def test_bad_modules_and_flags_are_one_line_each(module_file, tmp_path, monkeypatch, capsys):
    module_file("needs_a_package", "import no_such_package_xyz\n")
    module_file("raises_on_import", "\n\nvalue = 1 / 0\n")
    module_file("not_python", "def f(:\n")
    monkeypatch.chdir(tmp_path)  # dotted names are imported from the current directory

    def error(*argv: str) -> str:
        return _one_error_line(list(argv), capsys)

    assert error("--module", "no_such_recipes", "--config", "f") == (
        f"--module no_such_recipes: no such module in the current directory ({tmp_path}) or the installed packages; "
        "give a dotted module name importable from here, or a file: --module path/to/recipes.py"
    )
    assert error("--module", "needs_a_package", "--config", "f") == (
        "--module needs_a_package: importing it raised ModuleNotFoundError: No module named 'no_such_package_xyz' "
        f"({tmp_path}/needs_a_package.py, line 1)"
    )
    assert error("--module", "raises_on_import", "--config", "f") == (
        f"--module raises_on_import: importing it raised ZeroDivisionError: division by zero "
        f"({tmp_path}/raises_on_import.py, line 3)"
    )
    assert error("--module", "not_python", "--config", "f") == (
        f"--module not_python: importing it raised SyntaxError: invalid syntax ({tmp_path}/not_python.py, line 1)"
    )
    assert error("--module", "gone/recipes.py", "--config", "f") == (
        "--module gone/recipes.py: no such file (a module is a dotted name, or a .py file that exists)"
    )
    assert error("--module", "my-recipes", "--config", "f").startswith("--module 'my-recipes': not a module")
    usage = "--module M --config F (F a function of module M returning a JobConfig;"
    assert error("--config", "debug_model").startswith(f"--config debug_model needs --module too: {usage}")
    assert error("--module", "train_configs.recipes").startswith("--module train_configs.recipes needs --config too")
    assert error("--module", "a", "--config", "f", "--job.config_file", "x.toml") == (
        "--module a --config f and --job.config_file x.toml both given: pick one (run_llama_train.sh: MODULE=M "
        "CONFIG=F, or CONFIG_FILE=FILE)"
    )
    assert (
        error("--module", "a", "--module", "b", "--config", "f")
        == "--module given 2 different values: 'a', 'b'; pass one"
    )


def _config_args(env: dict[str, str], *args: str) -> tuple[int, list[str], str]:
    """scripts/config_args.sh (what run_llama_train.sh and the slurm script run): its exit code, the arguments it
    puts before the user's, what it printed."""
    script = 'source scripts/config_args.sh && config_args DEFAULT "$@" && printf "%s\\n" "${CONFIG_ARGS[@]}"'
    clean = {k: v for k, v in os.environ.items() if k not in ("MODULE", "CONFIG", "CONFIG_FILE")}
    result = subprocess.run(
        ["bash", "-c", script, "bash", *args], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True
    )
    return result.returncode, [a for a in result.stdout.split("\n") if a], result.stderr.strip()


def test_the_launcher_reads_module_and_config_as_upstreams_does():
    m, f = "train_configs.recipes", "debug_model"
    assert _config_args({}) == (0, ["--job.config_file", "DEFAULT"], "")
    assert _config_args({"MODULE": m, "CONFIG": f}) == (0, ["--module", m, "--config", f], "")
    assert _config_args({}, "--module", m, "--config", f) == (0, [], "")
    assert _config_args({"MODULE": m}, f"--config={f}") == (0, ["--module", m], "")
    assert _config_args({"MODULE": "other", "CONFIG": f}, "--module", m) == (
        0,
        ["--config", f],
        f"note: --module {m} overrides MODULE=other",
    )
    assert _config_args({"CONFIG_FILE": "x.toml"}, "--module", m, "--config", f) == (
        0,
        [],
        "note: training the function of --module/--config (it overrides CONFIG_FILE=x.toml)",
    )
    assert _config_args({"MODULE": m, "CONFIG": f}, "--job.config_file", "t.toml") == (
        0,
        [],
        "note: training with --job.config_file t.toml (it overrides MODULE/CONFIG)",
    )
    assert _config_args({"MODULE": m, "CONFIG": f, "CONFIG_FILE": "x.toml"}) == (
        2,
        [],
        "error: MODULE/CONFIG (a function's config) and CONFIG_FILE=x.toml (a TOML file) are both set: pick one "
        "(unset CONFIG_FILE, or MODULE and CONFIG)",
    )


def test_the_run_records_name_the_function(tmp_path, monkeypatch):
    from torchtitan.observability.run_records import write_run_records

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    folder = tmp_path / "run"
    argv = ["--module", "train_configs.recipes", "--config", "debug_model", "--job.dump_folder", str(folder)]
    write_run_records(JobConfig.parse_args(argv), 2)
    lines = (folder / "command.txt").read_text().splitlines()
    assert lines[1] == (
        f"# config built by debug_model() of train_configs.recipes ({RECIPES}); config.toml holds its values"
    )
    assert lines[2].startswith("# reproduce (2 processes;") and f"CONFIG_FILE={folder}/config.toml " in lines[3]
    record = json.loads((folder / "run_info.json").read_text())["config_function"]
    assert record == {
        "module": "train_configs.recipes",
        "function": "debug_model",
        "file": RECIPES,
        "sha256": hashlib.sha256(open(RECIPES, "rb").read()).hexdigest(),
    }
    write_run_records(JobConfig.parse_args(["--job.config_file", DEBUG_TOML, "--job.dump_folder", str(folder)]), 2)
    assert json.loads((folder / "run_info.json").read_text())["config_function"] is None
    assert not any("config built by" in line for line in (folder / "command.txt").read_text().splitlines())


def test_the_other_entry_points_take_the_pair(capsys):
    """estimation.py and python -m torchtitan.eval's config go through the same parse; --help names the pair."""
    from torchtitan.estimation.cli import main as estimate
    from torchtitan.eval.model import load_config

    assert estimate(["--module", "train_configs.recipes", "--config", "nope", "--world_size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --config nope: train_configs.recipes (train_configs/recipes.py) has no function")
    config = load_config("debug_model", ["--training.steps", "3"], module="train_configs.recipes")
    assert config.training.steps == 3 and config.built_by.function == "debug_model"
    with pytest.raises(ConfigError, match="train_configs.recipes .* has no function 'debug_modle'"):
        load_config("debug_modle", module="train_configs.recipes")
    assert "[--job.config_file FILE | --module M --config F]" in format_help()
