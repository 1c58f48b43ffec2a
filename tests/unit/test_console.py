import io
import logging
import sys
import types

import pytest

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig
from torchtitan.observability.console import COLOURS, PLAIN, build_palette, format_duration, format_step_line
from torchtitan.observability.metrics import build_metric_logger
from torchtitan.preflight import run_preflight

RECORD = {"loss": 7.123456, "grad_norm": 0.5, "lr": 8e-4, "tps": 12345.6, "mfu": 41.25, "memory_gib": 1.5}


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_palette_only_on_a_terminal_and_when_enabled():
    assert build_palette(True, _Tty()) is COLOURS
    assert build_palette(False, _Tty()) is PLAIN
    assert build_palette(True, io.StringIO()) is PLAIN  # redirected: plain text


def test_step_line_plain_and_coloured():
    plain = format_step_line(3, 100, RECORD, eta_s=3725, c=PLAIN)
    assert "\x1b[" not in plain
    assert plain.startswith("step   3/100  loss   7.1235  grad_norm  0.5000  lr 8.00e-04  tps    12,346")
    assert plain.endswith("mfu 41.25%  memory   1.50 GiB  eta 1:02:05")
    coloured = format_step_line(3, 100, RECORD, eta_s=0, c=COLOURS)
    assert "\x1b[" in coloured
    # the same text once the escape codes are removed: colour never changes the alignment
    import re

    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured) == format_step_line(3, 100, RECORD, eta_s=0)


def test_duration():
    assert (
        format_duration(0) == "0:00:00" and format_duration(59.6) == "0:01:00" and format_duration(90061) == "25:01:01"
    )


def test_wandb_logging_goes_through_wandb(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append((step, metrics))

        def finish(self):
            calls.append("finish")

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw["project"], kw["dir"])) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "p")
    logger = build_metric_logger(
        str(tmp_path),
        enabled=True,
        enable_tensorboard=False,
        save_tb_folder="tb",
        enable_wandb=True,
        wandb_config={"a": 1},
    )
    logger.log(5, {"loss": 1.0})
    logger.close()
    assert calls == [("init", "p", str(tmp_path)), (5, {"loss": 1.0}), "finish"]


def test_wandb_missing_is_a_clear_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    config = JobConfig.parse_args(["--job.config_file", "train_configs/debug_model.toml", "--metrics.enable_wandb"])
    with pytest.raises(ConfigError, match="pip install wandb"):
        run_preflight(config, 1)


def test_validation_keys_checked():
    with pytest.raises(ConfigError, match="validation.freq must be >= 1"):
        run_preflight(
            JobConfig.parse_args(["--job.config_file", "train_configs/debug_model.toml", "--validation.freq", "0"]), 1
        )


@pytest.fixture
def _levels():
    """The root's and the import-note loggers' levels, put back after the test."""
    from torchtitan.observability.logging import IMPORT_NOTES

    loggers = [logging.getLogger(), *map(logging.getLogger, IMPORT_NOTES)]
    before = [lg.level for lg in loggers]
    yield
    for lg, level in zip(loggers, before):
        lg.setLevel(level)


@pytest.mark.parametrize("level", ["info", "debug"])
def test_third_party_output_is_the_runs_debug_detail(level, capsys, _levels):
    """Issue 56, item 7: below job.log_level 'debug' a library's notes, warnings and progress bars are held back
    (torchao's import notes too); at 'debug' they show; held output comes out when the block raises."""
    from torchtitan.observability.logging import set_log_level, third_party_detail

    set_log_level(level)
    debug = level == "debug"
    assert logging.getLogger("torchao.kernel").isEnabledFor(logging.WARNING) == debug
    with third_party_detail("some_lib"):
        sys.stderr.write("Building contexts: 100%|##########| 4/4\n")
        assert logging.getLogger("some_lib.tasks").isEnabledFor(logging.WARNING) == debug
    assert ("Building contexts" in capsys.readouterr().err) == debug
    assert logging.getLogger("some_lib.tasks").isEnabledFor(logging.WARNING)  # put back
    with pytest.raises(RuntimeError), third_party_detail("some_lib"):
        sys.stderr.write("what led to it\n")
        raise RuntimeError("task failed")
    assert "what led to it" in capsys.readouterr().err


def test_torchao_import_notes_are_dropped_only_inside_and_only_those(caplog, monkeypatch):
    """Issue 84, item 11: importing torchao (float8, QLoRA, or transformers' model classes) logs its optional kernels
    that did not load, "no triton" and torch's pytree deprecation of its enums before generate.py's answer or the
    pre-launch check's line; ``quiet_torchao_import`` (their one home) drops exactly those notes while it is open:
    not another library's enum, not torchao's other messages, not another logger's, nothing outside it."""
    import enum

    from torchtitan.observability.logging import quiet_torchao_import

    class Theirs(enum.Enum):  # torchao's enum, as torch's pytree names it
        A = 1

    class Ours(enum.Enum):
        A = 1

    Theirs.__module__ = "torchao.float8.config"
    so_note = "Failed to load /venv/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library"
    triton_note = "Warning: Detected no triton, on systems without Triton certain kernels will not work"
    deprecated = "%s is an Enum subclass ... Calling register_constant() on Enum subclasses is deprecated and ..."
    other = "torchao: something that matters"
    names = ("", "torchao", "torchao.kernel.intmm", "torch.utils._pytree", "torchtitan.train")
    # The loggers' own levels too (restored after): an earlier test in this process may have run
    # set_log_level('info'), which leaves them at ERROR.
    for name in names:
        caplog.set_level(logging.WARNING, logger=name or None)
    ao, intmm, pytree, ours = (logging.getLogger(name) for name in names[1:])
    for logger in (ao, intmm, pytree):
        monkeypatch.setattr(logger, "filters", [])
    with quiet_torchao_import():
        ao.warning(so_note)
        intmm.warning(triton_note)
        pytree.warning(deprecated, Theirs)
        pytree.warning(deprecated, Ours)  # another library's enum: not ours to hide
        ao.warning(other)
        ours.warning(so_note)  # another logger entirely
    ao.warning(so_note)  # outside: as torchao says it
    assert [r.getMessage() for r in caplog.records] == [deprecated % Ours, other, so_note, so_note]
    assert all(not logger.filters for logger in (ao, intmm, pytree))  # nothing left installed


def test_torchao_notes_quieted_for_the_process_once(monkeypatch):
    """float8's and QLoRA's runs import torchao in several places: ``quiet_torchao_notes`` installs the same
    filters as ``quiet_torchao_import`` for the process, one per note however often it is called."""
    from torchtitan.observability import logging as tlog

    loggers = {note.logger: logging.getLogger(note.logger) for note in tlog._TORCHAO_IMPORT_NOTES}
    for logger in loggers.values():
        monkeypatch.setattr(logger, "filters", [])
    tlog.quiet_torchao_notes()
    tlog.quiet_torchao_notes()
    assert {name: len(logger.filters) for name, logger in loggers.items()} == dict.fromkeys(loggers, 1)
    record = logging.LogRecord("torchao", logging.WARNING, __file__, 1, "Failed to load /x/_C.so: no", None, None)
    assert not loggers["torchao"].filter(record)
