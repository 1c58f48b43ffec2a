"""Checkpointing on one process: folders and markers, purge, load_step, save schedule, errors, HF export."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading

import pytest
import torch
import torch.nn.functional as F

from tests.support.checkpoint import ARGS, tiny_llama, tiny_manager, tiny_train_step
from torchtitan.checkpointing.common import load_model_weights, save_model_weights
from torchtitan.checkpointing.files.folders import SaveSchedule, find_resume_checkpoint, list_checkpoints, purge_stale
from torchtitan.checkpointing.files.marker import EXPORT, FULL, SEED, step_folder, write_marker
from torchtitan.checkpointing.hf.convert import export_to_hf, import_from_hf
from torchtitan.checkpointing.manager import trim_metrics
from torchtitan.checkpointing.state import ModelPartsView
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama.hf_adapter import ADAPTER
from torchtitan.preflight import run_preflight


def make(root, step: int, kind: str | None = FULL) -> str:
    path = step_folder(str(root), step)
    os.makedirs(path)
    if kind is not None:
        write_marker(path, step, kind)
    return path


# ---- folders ----------------------------------------------------------------------------------


def test_discovery_picks_newest_complete_and_warns_on_incomplete(tmp_path, caplog):
    make(tmp_path, 2)
    make(tmp_path, 4)
    make(tmp_path, 6, kind=None)  # an interrupted save
    os.makedirs(tmp_path / "not-a-step")
    assert [(c.step, c.complete) for c in list_checkpoints(str(tmp_path))] == [(2, True), (4, True), (6, False)]
    with caplog.at_level(logging.WARNING):
        assert find_resume_checkpoint(str(tmp_path), -1).step == 4
    assert "ignoring incomplete checkpoint" in caplog.text and "step-6" in caplog.text
    assert find_resume_checkpoint(str(tmp_path / "missing"), -1) is None


def test_discovery_skips_exports_but_takes_a_seed(tmp_path):
    make(tmp_path, 0, kind=SEED)
    make(tmp_path, 5, kind=EXPORT)
    assert find_resume_checkpoint(str(tmp_path), -1).step == 0


def test_load_step(tmp_path):
    make(tmp_path, 2)
    make(tmp_path, 4)
    make(tmp_path, 6, kind=None)
    make(tmp_path, 8, kind=EXPORT)
    assert find_resume_checkpoint(str(tmp_path), 2).step == 2
    with pytest.raises(ValueError, match=r"step-3 does not exist; complete checkpoints: \[2, 4, 8\]"):
        find_resume_checkpoint(str(tmp_path), 3)
    with pytest.raises(ValueError, match="step-6 is incomplete"):
        find_resume_checkpoint(str(tmp_path), 6)
    with pytest.raises(ValueError, match="weights-only export"):
        find_resume_checkpoint(str(tmp_path), 8)


def test_purge_keeps_newest_k_complete_and_the_seed(tmp_path):
    make(tmp_path, 0, kind=SEED)
    for step in (2, 4, 6):
        make(tmp_path, step)
    make(tmp_path, 3, kind=None)  # interrupted before a newer save completed: stale
    make(tmp_path, 8, kind=None)  # newer than every complete one: a save in flight, never touched
    deleted = purge_stale(str(tmp_path), keep_latest_k=2)
    assert sorted(os.path.basename(p) for p in deleted) == ["step-2", "step-3"]
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [0, 4, 6, 8]
    assert purge_stale(str(tmp_path), keep_latest_k=0) == []


def test_a_final_export_does_not_purge_the_last_full_checkpoint(tmp_path):
    make(tmp_path, 3)
    make(tmp_path, 6, kind=EXPORT)  # model_weights_only at the last step
    assert purge_stale(str(tmp_path), keep_latest_k=1) == []
    assert find_resume_checkpoint(str(tmp_path), -1).step == 3
    make(tmp_path, 9)
    assert [os.path.basename(p) for p in purge_stale(str(tmp_path), keep_latest_k=1)] == ["step-3"]
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [6, 9]


def test_marker_is_json_with_step_and_kind(tmp_path):
    path = make(tmp_path, 3)
    with open(os.path.join(path, ".complete")) as f:
        marker = json.load(f)
    assert marker["step"] == 3 and marker["kind"] == FULL and "time" in marker
    assert not os.path.exists(os.path.join(path, ".complete.tmp"))


def test_save_schedule_steps_and_seconds():
    steps = SaveSchedule("steps", 3)
    assert [s for s in range(1, 10) if steps.due(s)] == [3, 6, 9]
    now = [100.0]
    secs = SaveSchedule("seconds", 10, clock=lambda: now[0])
    now[0] = 109.9
    assert not secs.due(1)
    now[0] = 110.0
    assert secs.due(2)
    secs.saved()
    now[0] = 115.0
    assert not secs.due(3)
    with pytest.raises(ValueError, match="interval_type"):
        SaveSchedule("minutes", 1)


def test_trim_metrics_drops_records_after_the_resume_step(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    trim_metrics(str(tmp_path), 2)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


# ---- the manager on one process ---------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path):
    model = tiny_llama(0)
    saver = tiny_manager(tmp_path, model)
    tiny_train_step(model, saver)
    saver.data_loader.state["streams"]["0"]["windows"] = 7
    saver.maybe_save(1, last=False)  # not due (interval 2)
    saver.maybe_save(2, last=False)
    saver.close()
    other = tiny_llama(1)
    loader = tiny_manager(tmp_path, other)
    assert loader.load() == 2
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    assert loader.lr_scheduler.last_epoch == 1
    assert loader.data_loader.state["streams"]["0"]["windows"] == 7
    exp_avg = saver.optimizer.state[next(model.parameters())]["exp_avg"]
    assert torch.equal(loader.optimizer.state[next(other.parameters())]["exp_avg"], exp_avg)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_final_save_as_export(tmp_path, dtype):
    model = tiny_llama(0)
    manager = tiny_manager(tmp_path, model, model_weights_only=True, export_dtype=dtype)
    manager.maybe_save(3, last=True)
    weights, marker = load_model_weights(step_folder(str(tmp_path / "ckpt"), 3))
    assert marker["kind"] == EXPORT and marker["dtype"] == dtype and set(weights) == set(model.state_dict())
    for name, want in model.state_dict().items():
        assert weights[name].dtype == getattr(torch, dtype) and torch.equal(weights[name], want.to(weights[name].dtype))
    with pytest.raises(ValueError, match="weights-only export"):
        tiny_manager(tmp_path, tiny_llama(0), load_step=3).load()


def test_seed_checkpoint_loads_weights_and_keeps_step_0(tmp_path):
    seed = tiny_llama(7)
    save_model_weights(seed.state_dict(), step_folder(str(tmp_path / "ckpt"), 0), {})
    model = tiny_llama(0)
    assert tiny_manager(tmp_path, model).load() == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), seed.parameters()))


def test_other_flavor_fails_with_named_keys_and_shapes(tmp_path):
    save_model_weights(tiny_llama(0).state_dict(), step_folder(str(tmp_path / "ckpt"), 0), {})
    wider = dataclasses.replace(ARGS, dim=64)
    with pytest.raises(ValueError, match=r"shape mismatches, e.g. \['tok_embeddings.weight: checkpoint \(64, 32\)"):
        tiny_manager(tmp_path, tiny_llama(0, wider)).load()
    deeper = dataclasses.replace(ARGS, n_layers=3)
    with pytest.raises(ValueError, match=r"model keys missing from the checkpoint, e.g. \['layers.2"):
        tiny_manager(tmp_path, tiny_llama(0, deeper)).load()
    shallower = dataclasses.replace(ARGS, n_layers=1)
    with pytest.raises(ValueError, match=r"checkpoint keys this model does not have, e.g. \['layers.1"):
        tiny_manager(tmp_path, tiny_llama(0, shallower)).load()


def test_corrupted_checkpoint_is_a_value_error(tmp_path):
    model = tiny_llama(0)
    manager = tiny_manager(tmp_path, model)
    manager.save(2)
    path = step_folder(str(tmp_path / "ckpt"), 2)
    data, metadata = os.path.join(path, "__0_0.distcp"), os.path.join(path, ".metadata")
    original = open(metadata, "rb").read()
    # altered metadata of the same size: caught by the marker's CRC32 before DCP unpickles it
    with open(metadata, "r+b") as f:
        f.seek(len(original) // 2)
        f.write(bytes([original[len(original) // 2] ^ 0xFF]))
    with pytest.raises(ValueError, match=r"step-2 is corrupted: .metadata does not match its CRC32"):
        tiny_manager(tmp_path, tiny_llama(1)).load()
    with open(metadata, "wb") as f:
        f.write(original)
    with open(data, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=r"step-2 is corrupted: __0_0.distcp has 100 bytes, the save wrote \d+"):
        tiny_manager(tmp_path, tiny_llama(1)).load()
    with pytest.raises(ValueError, match="is corrupted"):
        load_model_weights(path)
    os.remove(data)
    with pytest.raises(ValueError, match=r"__0_0.distcp is missing; resume from another step"):
        tiny_manager(tmp_path, tiny_llama(1)).load()
    # a marker without the file list (written before the check existed): DCP's own errors, one line
    marker = json.load(open(os.path.join(path, ".complete")))
    del marker["files"]
    json.dump(marker, open(os.path.join(path, ".complete"), "w"))
    with pytest.raises(
        ValueError, match=r"checkpoint .*step-2 \(format 1, written by torchtitan .*\) could not be loaded"
    ):
        tiny_manager(tmp_path, tiny_llama(1)).load()
    with open(metadata, "wb") as f:
        f.write(b"garbage")
    with pytest.raises(ValueError, match="cannot read its DCP metadata"):
        tiny_manager(tmp_path, tiny_llama(1)).load()


def test_manager_saves_by_seconds_and_at_the_last_step(tmp_path):
    now = [0.0]
    model = tiny_llama(0)
    manager = tiny_manager(tmp_path, model, interval_type="seconds", interval=10, clock=lambda: now[0])
    for step, seconds in [(1, 4.0), (2, 11.0), (3, 15.0), (4, 22.0), (5, 23.0)]:
        now[0] = seconds
        tiny_train_step(model, manager)
        manager.maybe_save(step, last=step == 5)
    manager.close()
    assert [c.step for c in list_checkpoints(str(tmp_path / "ckpt")) if c.complete] == [2, 4, 5]


def test_async_save_copies_the_state_before_training_continues(tmp_path):
    model = tiny_llama(0)
    manager = tiny_manager(tmp_path, model, async_mode="async")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manager.save(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    manager.close()
    assert os.path.isfile(os.path.join(step_folder(str(tmp_path / "ckpt"), 2), ".complete"))
    weights, _ = load_model_weights(step_folder(str(tmp_path / "ckpt"), 2))
    assert all(torch.equal(weights[k], before[k]) for k in before)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.bf16)])
def test_background_staging_holds_the_next_update_until_its_copy_is_done(tmp_path, dtype):
    """async_with_pinned_mem: the step goes on while the state is copied, and the next optimizer step waits for the
    copy, so the checkpoint holds the saved step's weights and moments. bf16: pure bf16's optimizer
    (training.dtype = "bfloat16")."""
    from torchtitan.components.optim.optim_lowp import LowPrecisionAdamW

    model = tiny_llama(0).to(dtype)
    optimizer = torch.optim.AdamW if dtype == torch.float32 else LowPrecisionAdamW
    manager = tiny_manager(tmp_path, model, optimizer=optimizer, async_mode="async_with_pinned_mem")
    tiny_train_step(model, manager)
    gate = threading.Event()
    manager.staging.copier._staging_executor.submit(gate.wait)  # its one staging thread: busy until the gate opens
    manager.save(1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = manager.optimizer.state[next(model.parameters())]["exp_avg"].clone()
    tokens = torch.arange(16).view(2, 8) % ARGS.vocab_size
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()  # while the copy waits at the gate
    opened_before_update = []  # a pre-hook registered after the manager's runs after its wait
    manager.optimizer.register_step_pre_hook(lambda *_: opened_before_update.append(gate.is_set()))
    threading.Timer(0.1, gate.set).start()
    manager.optimizer.step()  # waits for the gate and the copy, then updates
    assert opened_before_update == [True]
    assert not torch.equal(model.output.weight, weights["output.weight"])
    manager.close()
    saved, _ = load_model_weights(step_folder(str(tmp_path / "ckpt"), 1))
    assert all(torch.equal(saved[k], weights[k]) for k in weights)
    assert manager.blocked_seconds[1] > 0  # the wait is counted as blocked time
    other = tiny_llama(1).to(dtype)
    loader = tiny_manager(tmp_path, other, optimizer=optimizer, async_mode="async_with_pinned_mem")
    assert loader.load() == 1
    assert torch.equal(loader.optimizer.state[next(other.parameters())]["exp_avg"], moments)
    loader.close()


def test_before_marker_runs_once_the_data_is_written_and_before_the_marker(tmp_path):
    """The injected hook (tests hold a marker back there to kill a job mid-save) sees the data, no marker."""
    seen = []

    def before_marker(step: int) -> None:
        path = step_folder(str(tmp_path / "ckpt"), step)
        data, marker = os.path.join(path, ".metadata"), os.path.join(path, ".complete")
        seen.append((step, os.path.isfile(data), os.path.exists(marker)))

    manager = tiny_manager(tmp_path, tiny_llama(0), before_marker=before_marker)
    for step in (1, 2, 3):
        manager.maybe_save(step, last=step == 3)
    manager.close()
    assert seen == [(2, True, False), (3, True, False)]
    assert [c.step for c in list_checkpoints(str(tmp_path / "ckpt")) if c.complete] == [2, 3]


def test_parts_view_names_parameters_with_whole_model_fqns():
    whole = tiny_llama(0)
    first, last = tiny_llama(0), tiny_llama(0)
    del last.layers["0"]
    del first.layers["1"]
    first.norm = first.output = None
    last.tok_embeddings = None
    view = ModelPartsView([first, last])
    assert [n for n, _ in view.named_parameters()] == [n for n, _ in whole.named_parameters()]


# ---- Hugging Face conversion ------------------------------------------------------------------


def _hf_rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _hf_rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_llama_forward(sd: dict[str, torch.Tensor], cfg: dict, tokens: torch.Tensor) -> torch.Tensor:
    """A reference LlamaForCausalLM forward written from HF's conventions (rotate-half RoPE)."""
    n_heads, n_kv, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    bs, seqlen = tokens.shape
    inv_freq = 1.0 / (
        cfg["rope_parameters"]["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    )
    freqs = torch.outer(torch.arange(seqlen, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]  # (1, 1, seqlen, head_dim)
    h = sd["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _hf_rms(h, sd[p + "input_layernorm.weight"], cfg["rms_norm_eps"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(bs, seqlen, n_heads, head_dim).transpose(1, 2)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(bs, seqlen, n_kv, head_dim).transpose(1, 2)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(bs, seqlen, n_kv, head_dim).transpose(1, 2)
        q, k = q * cos + _hf_rotate_half(q) * sin, k * cos + _hf_rotate_half(k) * sin
        k, v = (t.repeat_interleave(n_heads // n_kv, dim=1) for t in (k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bs, seqlen, -1)
        h = h + attn @ sd[p + "self_attn.o_proj.weight"].T
        x = _hf_rms(h, sd[p + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
        gate, up = x @ sd[p + "mlp.gate_proj.weight"].T, x @ sd[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return _hf_rms(h, sd["model.norm.weight"], cfg["rms_norm_eps"]) @ sd["lm_head.weight"].T


def test_hf_round_trip_is_identical():
    sd = tiny_llama(0).state_dict()
    args = dataclasses.asdict(ARGS)
    hf = ADAPTER.to_hf_state_dict(sd, args)
    assert "model.layers.1.self_attn.q_proj.weight" in hf and "lm_head.weight" in hf
    back = ADAPTER.from_hf_state_dict(hf, args)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_hf_export_gives_our_logits(tmp_path):
    from safetensors.torch import load_file

    model = tiny_llama(0)
    ckpt = step_folder(str(tmp_path / "ckpt"), 0)
    save_model_weights(model.state_dict(), ckpt, {"args": dataclasses.asdict(ARGS)})
    cfg = export_to_hf(ckpt, str(tmp_path / "hf"))
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f) == cfg
    assert cfg["intermediate_size"] == model.layers["0"].feed_forward.w1.weight.shape[0]
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    tokens = torch.randint(0, ARGS.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_llama_forward(hf, cfg, tokens), model(tokens), rtol=1e-5, atol=1e-5)
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    weights, _ = load_model_weights(str(tmp_path / "back"))
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


# ---- config validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,world_size,match",
    [
        (["--checkpoint.keep_latest_k", "-1"], 1, "keep_latest_k must be >= 0"),
        (["--checkpoint.interval", "0"], 1, "checkpoint.interval must be >= 1"),
        (["--checkpoint.load_step", "-2"], 1, "load_step must be -1"),
        (["--checkpoint.create_seed_checkpoint"], 2, "needs one process"),
    ],
)
def test_config_errors(args, world_size, match):
    from torchtitan.config.manager import JobConfig

    config = JobConfig.parse_args(["--checkpoint.enable_checkpoint", *args])
    with pytest.raises(ValueError, match=match):
        run_preflight(config, world_size)


def test_background_staging_refuses_weight_changes_outside_the_optimizer_step():
    from torchtitan.config.manager import JobConfig
    from torchtitan.features.fault_tolerance.checks import check_fault_tolerance

    pinned = ["--checkpoint.enable_checkpoint", "--checkpoint.async_mode", "async_with_pinned_mem"]
    assert run_preflight(JobConfig.parse_args(pinned), 1) == []  # on CPU too: plain host buffers
    in_backward = JobConfig.parse_args([*pinned, "--optimizer.early_step_in_backward", "--training.max_norm", "0"])
    with pytest.raises(NotImplementedError, match="early_step_in_backward = true with checkpoint.async_mode"):
        run_preflight(in_backward, 1)
    ft = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--checkpoint.keep_latest_k", "2"]
    config = JobConfig.parse_args([*pinned, *ft])
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=1)
    with pytest.raises(NotImplementedError, match=r"fault_tolerance.enable \(synchronous\) with checkpoint.async_mode"):
        check_fault_tolerance(config, dims)
    diloco = ["--fault_tolerance.semi_sync_method", "diloco", "--training.steps", "10", "--checkpoint.interval", "5"]
    config = JobConfig.parse_args([*pinned, *ft, *diloco])  # its weight changes run in hooks after the update
    assert check_fault_tolerance(config, dims) == []


def test_checkpoint_knobs_without_checkpointing_warn():
    from torchtitan.config.manager import JobConfig

    warnings = run_preflight(JobConfig.parse_args(["--checkpoint.keep_latest_k", "2"]), 1)
    assert any("no effect without checkpoint.enable_checkpoint" in w for w in warnings)


def test_exclude_from_loading_keeps_those_parts_fresh(tmp_path):
    """torchtitan's checkpoint.exclude_from_loading: the excluded parts are not restored, the rest is."""
    model = tiny_llama(0)
    saver = tiny_manager(tmp_path, model)
    tiny_train_step(model, saver)
    saver.data_loader.state["streams"]["0"]["windows"] = 7
    saver.maybe_save(2, last=False)
    saver.close()
    other = tiny_llama(1)
    loader = tiny_manager(tmp_path, other, exclude_from_loading=["optimizer", "dataloader"])
    assert loader.load() == 2
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    assert loader.lr_scheduler.last_epoch == 1  # restored
    assert loader.optimizer.state == {}  # fresh
    assert loader.data_loader.state["streams"]["0"]["windows"] == 2  # fresh


def test_exclude_from_loading_refuses_the_model():
    from torchtitan.config.manager import JobConfig

    config = JobConfig.parse_args(["--checkpoint.enable_checkpoint", "--checkpoint.exclude_from_loading", "model"])
    with pytest.raises(ValueError, match=r"'model' cannot be excluded; allowed are \['optimizer', 'lr_scheduler'"):
        run_preflight(config, 1)
