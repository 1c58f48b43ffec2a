"""lm-evaluation-harness backend (issue 49; docs/evaluation.md), on a tiny fine-tuned model of the shipped
arithmetic chat data (20 steps of llama3 ``debugmodel_tiny``, its checkpoint and our HF export of it).

- Our backend vs lm-eval's own ``hf`` backend (transformers on our export), same tokenizer, fp32 (llama3, and
  transformers' Mistral class as ``model.name = "hf"``, fine-tuned the same way): on the shipped
  multiple-choice task and two tasks this test writes (rolling perplexity, greedy generation with stop strings),
  every per-request loglikelihood within 1e-4, the same is-greedy flags, accuracy and exact match identical,
  perplexities within relative 1e-5, the same generated strings.
- The same numbers under FSDP2 (2 ranks, requests split over them) and TP2 (one model over both), within 1e-5.
- In the loop: eval every 3 steps of a 9-step run logs metrics at 3, 6, 9 and the losses equal a run without
  eval bit for bit.
- Bad input, one line each: an unknown task (listing the tasks found), a task file that does not parse, a
  multimodal task (or a group holding one), a checkpoint of another flavor, lm-eval missing.
Offline: HF_DATASETS_OFFLINE / HF_HUB_OFFLINE are set; every task reads local JSON files.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

from tests.support.distributed import run_distributed  # noqa: E402
from tests.support.runs import ROOT
from torchtitan.config.manager import JobConfig  # noqa: E402
from torchtitan.train import run_job  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.pool(2)]

CONFIG = "train_configs/sft_debug.toml"
TINY = ["--model.flavor", "debugmodel_tiny", "--training.data_parallel_shard_degree", "1"]
HF_MODEL = ["--model.name", "hf", "--model.flavor", "mistral_tiny", "--training.data_parallel_shard_degree", "1"]
TASKS = ["arith_mc", "t_ppl", "t_gen"]
LIMIT = 8
ATOL_LL = (
    1e-4  # the bound for per-request loglikelihoods (fp32); measured max 3.1e-5 (a rolling sum of ~300 nats)
)
RTOL_LAYOUT = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One thread for this file's in-process runs (on a loaded 2-core machine two threads made a training step
    ~20x slower); the thread count is put back for the files after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)


def _train_argv(folder: str, steps: int, extra: list[str] = (), model: list[str] = TINY) -> list[str]:
    return [
        "--job.config_file", CONFIG, *model,
        "--training.steps", str(steps), "--training.batch_size", "2", "--training.warmup_steps", "2",
        "--optimizer.lr", "1e-2", "--validation.enabled", "false", "--metrics.log_freq", "1",
        "--training.seed", "3", "--job.dump_folder", folder, *extra,
    ]  # fmt: skip


def _write_tasks(folder: str) -> None:
    """A rolling-perplexity task and a greedy generation task over local JSON files, written here."""
    os.makedirs(folder, exist_ok=True)
    pairs = [(1, 2), (3, 14), (5, 6), (7, 8)]
    turn = "<|im_start|>user\nWhat is {a} plus {b}?<|im_end|>\n<|im_start|>assistant\n"
    with open(os.path.join(folder, "ppl.jsonl"), "w") as f:
        for a, b in pairs:
            f.write(
                json.dumps({"text": (turn + "{a} plus {b} is {c}.<|im_end|>\n").format(a=a, b=b, c=a + b) * 3}) + "\n"
            )
    with open(os.path.join(folder, "gen.jsonl"), "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"q": turn.format(a=a, b=b), "a": f"{a} plus {b} is {a + b}."}) + "\n")
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    with open(os.path.join(folder, "ppl.yaml"), "w") as f:
        f.write("task: t_ppl\n" + common.format(path=os.path.join(folder, "ppl.jsonl")))
        f.write('output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n')
        f.write("metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    with open(os.path.join(folder, "gen.yaml"), "w") as f:
        f.write("task: t_gen\n" + common.format(path=os.path.join(folder, "gen.jsonl")))
        f.write('output_type: generate_until\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\n')
        f.write('generation_kwargs:\n  until: ["<|im_end|>", "\\n"]\n  max_gen_toks: 24\n  do_sample: false\n')
        f.write("metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run folder, task folder): 20 steps of the tiny model, its step-20 checkpoint and HF export."""
    from torchtitan.checkpointing.hf.convert import export_to_hf

    os.chdir(ROOT)
    base = tmp_path_factory.mktemp("eval")
    run = str(base / "run")
    run_job(JobConfig.parse_args(_train_argv(run, 20, ["--checkpoint.enable_checkpoint"])), world_size=1, rank=0)
    export_to_hf(os.path.join(run, "checkpoint", "step-20"), os.path.join(run, "hf"))
    _write_tasks(str(base / "tasks"))
    return run, str(base / "tasks")


@pytest.fixture(scope="module")
def trained_hf(trained, tmp_path_factory):
    """(run folder, task folder) as ``trained``, for transformers' Mistral class (``model.name = "hf"``)."""
    from torchtitan.checkpointing.hf.convert import export_to_hf

    run = str(tmp_path_factory.mktemp("eval_hf") / "run")
    argv = _train_argv(run, 20, ["--checkpoint.enable_checkpoint"], HF_MODEL)
    run_job(JobConfig.parse_args(argv), world_size=1, rank=0)
    export_to_hf(os.path.join(run, "checkpoint", "step-20"), os.path.join(run, "hf"))
    return run, trained[1]


def _evaluate(lm, task_folder: str) -> dict:
    import lm_eval

    from torchtitan.eval.tasks import build_task_manager

    tm = build_task_manager(TASKS, task_folder)
    return lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=tm, limit=LIMIT, log_samples=True)


def _responses(out: dict) -> dict[str, list]:
    return {t: [s["resps"] for s in out["samples"][t]] for t in TASKS}


def _ours(run: str, overrides: list[str] = (), model: list[str] = TINY) -> object:
    from torchtitan.eval.lm import TorchtitanLM

    ckpt = os.path.join(run, "checkpoint", "step-20")
    return TorchtitanLM(config=CONFIG, checkpoint=ckpt, overrides=" ".join([*model, *overrides]), batch_size=4)


def _flat_lls(resps: list) -> list[float]:
    out = []
    for per_doc in resps:
        for r in per_doc:
            value = r[0]
            out.append(value[0] if isinstance(value, (tuple, list)) else value)
    return out


def test_backend_equals_lm_eval_hf_backend(trained):
    _equals_lm_eval_hf_backend(*trained, TINY)


def test_hf_family_backend_equals_lm_eval_hf_backend(trained_hf):
    """transformers' own class through our backend (its generation without our KV cache) gives lm-eval's numbers."""
    _equals_lm_eval_hf_backend(*trained_hf, HF_MODEL)


def _equals_lm_eval_hf_backend(run: str, tasks: str, model: list[str]) -> None:
    from lm_eval.models.huggingface import HFLM

    ours = _evaluate(_ours(run, model=model), tasks)
    hf = HFLM(
        pretrained=os.path.join(run, "hf"),
        tokenizer="tests/assets/sft/tokenizer",
        batch_size=4,
        max_length=128,
        dtype="float32",
        device="cpu",
    )
    theirs = _evaluate(hf, tasks)
    a, b = _responses(ours), _responses(theirs)
    worst = 0.0
    for task in ("arith_mc", "t_ppl"):
        x, y = _flat_lls(a[task]), _flat_lls(b[task])
        assert len(x) == len(y) > 0
        worst = max(worst, max(abs(p - q) for p, q in zip(x, y)))
    print(f"max |loglikelihood ours - hf| {worst:.2e}")
    assert worst <= ATOL_LL
    greedy = [[r[0][1] for r in doc] for doc in a["arith_mc"]], [[r[0][1] for r in doc] for doc in b["arith_mc"]]
    assert greedy[0] == greedy[1]
    assert a["t_gen"] == b["t_gen"]  # the same strings
    assert any(doc[0][0] for doc in a["t_gen"])  # something was generated
    r1, r2 = ours["results"], theirs["results"]
    for key in ("acc,none", "acc_norm,none"):
        assert r1["arith_mc"][key] == r2["arith_mc"][key]
    assert r1["t_gen"]["exact_match,none"] == r2["t_gen"]["exact_match,none"]
    for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isclose(r1["t_ppl"][key], r2["t_ppl"][key], rel_tol=1e-5), key


def _layout_job(rank: int, world_size: int, run: str, task_folder: str) -> dict | None:
    """On each rank: our backend under FSDP2 over both ranks, then TP2; rank 0 returns each layout's responses
    (lm-eval's simple_evaluate returns results where LOCAL_RANK is 0 only)."""
    os.chdir(ROOT)
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    out = {}
    for name, overrides in {
        "fsdp2": ["--training.data_parallel_shard_degree", "2"],
        "tp2": ["--training.tensor_parallel_degree", "2"],
    }.items():
        result = _evaluate(_ours(run, overrides), task_folder)
        assert (result is None) == (rank != 0)
        out[name] = result and _responses(result)
    return out if rank == 0 else None


def test_fsdp2_and_tp2_give_the_single_process_numbers(trained):
    run, tasks = trained
    single = _responses(_evaluate(_ours(run), tasks))
    by_rank = run_distributed(_layout_job, 2, run, tasks, timeout_s=600)
    for layout, got in by_rank[0].items():
        for task in ("arith_mc", "t_ppl"):
            x, y = _flat_lls(got[task]), _flat_lls(single[task])
            worst = max(abs(p - q) / max(abs(q), 1.0) for p, q in zip(x, y))
            print(f"{layout} {task}: {len(x)} loglikelihoods, max rel diff vs one process {worst:.1e}")
            assert len(x) == len(y) and worst <= RTOL_LAYOUT, (layout, task)
        assert got["t_gen"] == single["t_gen"], layout


def _losses_and_evals(folder: str) -> tuple[list[float], dict[int, dict]]:
    losses, evals = [], {}
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if "loss" in record:
                losses.append(record["loss"])
            if any(k.startswith("eval/") for k in record):
                evals[record["step"]] = record
    return losses, evals


def test_in_loop_eval_every_3_steps_leaves_training_bit_identical(tmp_path, monkeypatch):
    """Also: no evaluation runs torch's environment report (lm-eval's add_env_info: subprocesses, ~1.3 s each;
    torchtitan/features/in_loop_eval/loop.py), and lm-eval's own function is back in place afterwards."""
    import lm_eval.evaluator
    import torch.utils.collect_env

    reports = []
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: reports.append(1) or "report")
    add_env_info = lm_eval.evaluator.add_env_info
    plain, with_eval = str(tmp_path / "plain"), str(tmp_path / "eval")
    det = ["--training.deterministic"]
    run_job(JobConfig.parse_args(_train_argv(plain, 9, det)), world_size=1, rank=0)
    ev = [
        "--eval.enabled",
        "--eval.tasks",
        "arith_mc",
        "--eval.freq",
        "3",
        "--eval.limit",
        "4",
        "--metrics.enable_tensorboard",
    ]
    run_job(JobConfig.parse_args(_train_argv(with_eval, 9, [*det, *ev])), world_size=1, rank=0)
    base, _ = _losses_and_evals(plain)
    losses, evals = _losses_and_evals(with_eval)
    assert len(base) == 9 and losses == base  # bit for bit
    assert sorted(evals) == [3, 6, 9]
    assert reports == [] and lm_eval.evaluator.add_env_info is add_env_info
    for record in evals.values():
        assert set(record) == {"step", "eval/arith_mc/acc", "eval/arith_mc/acc_norm"}
        assert 0.0 <= record["eval/arith_mc/acc"] <= 1.0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tb,) = [d for d, _, files in os.walk(os.path.join(with_eval, "tb")) if any("tfevents" in f for f in files)]
    events = EventAccumulator(tb)
    events.Reload()
    assert [e.step for e in events.Scalars("eval/arith_mc/acc")] == [3, 6, 9]


def _one_line_error(capsys, argv: list[str]) -> str:
    from torchtitan.eval.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_unknown_task_names_the_tasks_found(trained, capsys):
    _, tasks = trained
    err = _one_line_error(capsys, ["--model", "torchtitan", "--tasks", "arith_mcq", "--include_path", tasks])
    assert "unknown task 'arith_mcq'" in err and "arith_mc, t_gen, t_ppl" in err, err


def test_task_file_that_does_not_parse(trained, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    err = _one_line_error(capsys, ["--model", "torchtitan", "--tasks", "arith_mc", "--include_path", str(bad)])
    assert "broken.yaml does not parse" in err, err


def test_multimodal_task_is_refused_before_the_model_is_built(tmp_path, capsys):
    """A task reading images (doc_to_image), named itself or through a group: one line naming it and the way out."""
    folder = tmp_path / "mm"
    folder.mkdir()
    (folder / "pic_qa.yaml").write_text(
        "task: pic_qa\ndataset_path: json\noutput_type: generate_until\ntest_split: test\n"
        "doc_to_text: q\ndoc_to_target: a\ndoc_to_image: [image]\nmetric_list:\n  - metric: exact_match\n"
    )
    (folder / "pics.yaml").write_text("group: pics\ntask:\n  - pic_qa\n")
    for tasks in ("pic_qa", "arith_mc,pics"):
        err = _one_line_error(capsys, ["--model", "torchtitan", "--tasks", tasks, "--include_path", str(folder)])
        assert "task 'pic_qa' reads images or audio" in err and "hf-multimodal" in err, err


def test_checkpoint_of_another_flavor(trained):
    from torchtitan.eval.lm import TorchtitanLM

    run, _ = trained
    with pytest.raises(
        ValueError, match="holds llama3 'debugmodel_tiny' .* but the config builds llama3 'debugmodel'"
    ) as e:
        TorchtitanLM(
            config=CONFIG, checkpoint=os.path.join(run, "checkpoint", "step-20"), overrides="--model.flavor debugmodel"
        )
    assert "\n" not in str(e.value)


def test_missing_lm_eval_is_one_line_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    err = _one_line_error(capsys, ["--model", "torchtitan", "--tasks", "arith_mc"])
    assert "pip install -e '.[eval]'" in err, err
    from torchtitan.preflight.__main__ import main as preflight

    assert preflight(["--job.config_file", CONFIG, "--eval.enabled", "--eval.tasks", "arith_mc"]) == 2
    assert "pip install -e '.[eval]'" in capsys.readouterr().err


def test_cli_runs_lm_eval_with_our_model(trained, tmp_path, capsys):
    """`python -m torchtitan.eval ...` as documented: lm-eval runs our model at the documented batch size (8, not
    lm-eval's 1) and writes into a folder named after the checkpoint and the tasks, which its last line names
    (issue 56, item 5)."""
    from torchtitan.eval.__main__ import main

    run, _ = trained
    out = tmp_path / "out"
    args = f"config={CONFIG},checkpoint={run}/checkpoint/step-20,overrides=--model.flavor debugmodel_tiny"
    argv = [
        "--model",
        "torchtitan",
        "--model_args",
        args,
        "--tasks",
        "arith_mc",
        "--limit",
        "4",
        "--output_path",
        str(out),
    ]
    assert main(argv) == 0
    (result,) = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if f.startswith("results")]
    with open(result) as f:
        assert "acc,none" in json.load(f)["results"]["arith_mc"]
    printed = capsys.readouterr().out.strip().splitlines()
    assert any(line.endswith("batch_size: 8") for line in printed), printed
    assert os.path.dirname(result) == str(out / "run-step-20_arith_mc")  # the run folder's name, the step, the tasks
    assert printed[-1] == f"results: {result}"


def test_sampled_generation_is_seeded(trained):
    from lm_eval.api.instance import Instance

    run, _ = trained
    prompt = "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    sample = {"until": ["<|im_end|>"], "max_gen_toks": 12, "do_sample": True, "temperature": 1.0}
    reqs = [Instance("generate_until", {}, (prompt, dict(sample)), i) for i in range(4)]
    first, again = _ours(run).generate_until(reqs), _ours(run).generate_until(reqs)
    assert first == again and len(set(first)) > 1  # the seed decides; rows differ


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_in_loop_eval_under_a_layout_leaves_training_bit_identical(tmp_path, layout):
    """The live FSDP2 / TP2 model evaluated in place (pool jobs): the losses of the run without eval, bit for bit,
    and rank 0 logs the metrics at 3, 6, 9."""
    from tests.support.pool import run_train_job

    degree = {"fsdp2": "--training.data_parallel_shard_degree", "tp2": "--training.tensor_parallel_degree"}[layout]
    ev = ["--eval.enabled", "--eval.tasks", "arith_mc", "--eval.freq", "3", "--eval.limit", "4"]
    folders = {}
    for name, extra in {"plain": [], "eval": ev}.items():
        folders[name] = str(tmp_path / name)
        argv = _train_argv(folders[name], 9, ["--training.deterministic", degree, "2", *extra])
        # lm-eval (and the datasets/pyarrow/tokenizers it loads) leaves threads and native state in the process:
        # a later job's rank in the same pool segfaulted once in CI (6d15e64), so the pool restarts after it
        status = run_train_job(2, argv, restart_after=bool(extra))
        assert status["ok"], status["error"]
    base, _ = _losses_and_evals(folders["plain"])
    losses, evals = _losses_and_evals(folders["eval"])
    assert len(base) == 9 and losses == base
    assert sorted(evals) == [3, 6, 9]


def test_estimator_refuses_in_loop_eval(capsys):
    from torchtitan.estimation.cli import main

    argv = [
        "--job.config_file",
        CONFIG,
        *TINY,
        "--validation.enabled",
        "false",
        "--eval.enabled",
        "--eval.tasks",
        "arith_mc",
    ]
    assert main(argv) == 2
    assert "eval.enabled = True is not modeled: the in-loop evaluation runs outside" in capsys.readouterr().err
