"""Fault tolerance's parts in one process (docs/fault_tolerance.md): the pre-launch check's refusals, every group's
data position (exchanged through a stand-in for torchft's all-reduce), what a heal moves, the gradient buckets, the
config fingerprint, the one-line errors, the planner's cross-group time. Through the trainer:
tests/runs/reliability/test_fault_tolerance_runs.py."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig, format_help
from torchtitan.datasets.hf_datasets import build_hf_data_loader, compute_stream_groups
from torchtitan.datasets.tokenizer import DEFAULT_TOKENIZER_PATH, build_tokenizer
from torchtitan.features.fault_tolerance import replicas as replicas_mod
from torchtitan.features.fault_tolerance.errors import INSTALL_HINT, ReplicaGroupsFailed, short_reason
from torchtitan.features.fault_tolerance.heal import HealState
from torchtitan.features.fault_tolerance.positions import DataPositions
from torchtitan.features.fault_tolerance.replicas import average_in_buckets
from torchtitan.features.fault_tolerance.setup import config_fingerprint
from torchtitan.launch.run_folder import checkpoint_root, run_folder
from torchtitan.preflight import run_preflight

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
SEQ = 16


@pytest.fixture
def lighthouse_env(monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")


def _check(*argv: str, world_size: int = 1) -> list[str]:
    return run_preflight(JobConfig.parse_args(list(argv), world_size=world_size), world_size)


# --------------------------------------------------------------------------- the pre-launch check


@pytest.mark.parametrize(
    "argv, error, match",
    [
        (["--fault_tolerance.enable"], ConfigError, "group_size = 0: group_size is the number of replica groups"),
        ([*FT, "--fault_tolerance.replica_id", "2"], ConfigError, "replica_id = 2 with group_size = 2"),
        ([*FT, "--fault_tolerance.min_replica_size", "3"], ConfigError, "min_replica_size = 3 > group_size = 2"),
        ([*FT, "--optimizer.early_step_in_backward", "--training.max_norm", "0"], NotImplementedError, "backward"),
        ([*FT, "--checkpoint.enable_checkpoint", "--checkpoint.keep_latest_k", "1"], ConfigError, "keep at least 2"),
        (
            [*FT, "--fault_tolerance.semi_sync_method", "diloco", "--training.steps", "7"],
            ConfigError,
            "make training.steps a multiple of sync_steps",
        ),
        (
            [*FT, "--fault_tolerance.semi_sync_method", "local_sgd", "--training.steps", "10"]
            + ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "3"],
            ConfigError,
            "an interval that is a multiple of sync_steps",
        ),
        (
            [*FT, "--fault_tolerance.semi_sync_method", "local_sgd", "--training.steps", "10"]
            + ["--checkpoint.enable_checkpoint", "--checkpoint.interval_type", "seconds", "--checkpoint.interval", "5"],
            ConfigError,
            "checkpoint.interval_type = 'steps'",
        ),
        (
            [*FT, "--fault_tolerance.semi_sync_method", "local_sgd", "--training.steps", "10"]
            + ["--training.on_nonfinite", "skip"],
            NotImplementedError,
            "out of step with the others'",
        ),
    ],
    ids=lambda v: v[-1] if isinstance(v, list) else None,
)
def test_refusals_are_one_line(lighthouse_env, argv, error, match):
    with pytest.raises(error, match=match) as e:
        _check(*argv)
    assert "\n" not in str(e.value)


def test_the_replicate_degree_is_the_groups(lighthouse_env):
    with pytest.raises(ConfigError, match="the replica groups are the replicate dimension") as e:
        _check(*FT, "--training.data_parallel_replicate_degree", "2", world_size=2)
    assert "\n" not in str(e.value)


def test_this_machine_needs_the_lighthouse_and_torchft(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match="needs the lighthouse's address in TORCHFT_LIGHTHOUSE"):
        _check(*FT)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "localhost:29510")
    with pytest.raises(ConfigError, match="expected the lighthouse's address as http://HOST:PORT"):
        _check(*FT)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    if not torch.cuda.is_available():  # device-choice: the refusal exists only without CUDA
        with pytest.raises(NotImplementedError, match="'nccl' needs CUDA"):
            _check(*FT, "--fault_tolerance.process_group", "nccl")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(NotImplementedError) as e:
        _check(*FT)
    assert str(e.value) == INSTALL_HINT
    # the memory estimator plans for another machine: it skips these
    config = JobConfig.parse_args(FT)
    assert run_preflight(config, 1, this_machine=False) == []


def test_a_key_without_enable_warns(lighthouse_env):
    assert _check("--fault_tolerance.replica_id", "1") == [
        "fault_tolerance.replica_id has no effect without fault_tolerance.enable = true"
    ]
    assert _check(*FT) == []


def test_help_lists_the_keys_and_folders_follow_the_mode():
    text = format_help()
    for key in ("enable", "replica_id", "group_size", "min_replica_size", "semi_sync_method", "outer_lr"):
        assert f"--fault_tolerance.{key} (" in text
    c = JobConfig.parse_args([*FT, "--fault_tolerance.replica_id", "1", "--job.dump_folder", "/d"])
    assert (run_folder(c), checkpoint_root(c)) == ("/d/replica_1", "/d/checkpoint")
    c = JobConfig.parse_args([*FT, "--fault_tolerance.semi_sync_method", "diloco", "--job.dump_folder", "/d"])
    assert (run_folder(c), checkpoint_root(c)) == ("/d/replica_0", "/d/checkpoint/replica_0")
    c = JobConfig.parse_args(["--job.dump_folder", "/d"])
    assert (run_folder(c), checkpoint_root(c)) == ("/d", "/d/checkpoint")


def test_the_fingerprint_tells_configs_apart_but_not_replica_ids():
    base = config_fingerprint(JobConfig.parse_args(FT), 2)
    same = [[*FT, "--fault_tolerance.replica_id", "1"], [*FT, "--job.dump_folder", "/elsewhere"]]
    assert all(config_fingerprint(JobConfig.parse_args(a), 2) == base for a in same)
    other = [[*FT, "--training.seed", "7"], [*FT, "--model.flavor", "debugmodel_tiny"], [*FT, "--optimizer.lr", "1"]]
    assert all(config_fingerprint(JobConfig.parse_args(a), 2) != base for a in other)
    assert config_fingerprint(JobConfig.parse_args(FT), 4) != base
    assert 0 < base < 2**60


def test_short_reason_is_one_line():
    gloo = RuntimeError(
        "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:30937. "
        "This is typically caused by a remote worker crashing.\nmore"
    )
    assert short_reason(gloo) == "Connection closed by peer [127.0.0.1]:30937"
    grpc = TimeoutError('status: Cancelled, message: "Timeout expired", details: [], metadata: MetadataMap {}')
    assert short_reason(grpc) == 'status: Cancelled, message: "Timeout expired"'
    assert short_reason(None) == "no error recorded"


# --------------------------------------------------------------------------- every group's data position


class _Pair:
    """torchft's all-reduce between two threads (two replica groups' rank 0): SUM or AVG, in place."""

    def __init__(self):
        self.barrier = threading.Barrier(2)
        self.slots: list[torch.Tensor | None] = [None, None]

    def manager(self, group: int):
        pair = self

        class Manager:
            def errored(self):
                return None

            def allreduce(self, tensor, reduce_op=None):
                pair.slots[group] = tensor.clone()
                pair.barrier.wait()
                total = pair.slots[0] + pair.slots[1]
                pair.barrier.wait()
                tensor.copy_(total)
                return type("Done", (), {"wait": lambda self: None})()

        return Manager()


@pytest.fixture
def corpus(tmp_path) -> str:
    path = tmp_path / "c.jsonl"
    path.write_text("".join(f'{{"text": "document {i} " }}\n'.replace("} ", "}") for i in range(40)))
    return str(path)


def _positions(corpus: str, group: int, batch: int = 2) -> DataPositions:
    tokenizer = build_tokenizer(os.path.join(ROOT, DEFAULT_TOKENIZER_PATH))
    groups = compute_stream_groups(group, 2, batch, 1)  # dp 1 inside a group, 2 groups
    loader = build_hf_data_loader("c4_test", corpus, tokenizer, SEQ, groups, num_streams=2 * batch)
    return DataPositions(loader, replica_id=group, group_size=2, dp_rank=0, dp_degree=1, batch_size=batch, accum=1)


def _exchange_both(positions: list[DataPositions], pair: _Pair) -> list:
    out: list = [None, None]

    def run(g):
        out[g] = positions[g].exchange(pair.manager(g))

    threads = [threading.Thread(target=run, args=(g,)) for g in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_every_group_knows_every_position_and_one_checkpoint_resumes_all(corpus):
    positions = [_positions(corpus, g) for g in (0, 1)]
    iters = [iter(p.loader) for p in positions]
    for _ in range(3):  # three steps of both groups
        for it in iters:
            next(it)
    assert _exchange_both(positions, _Pair()) == [(0, 1), (0, 1)]
    merged = positions[0].state_dict()  # what group 0 writes into the shared checkpoint
    assert sorted(merged["streams"], key=int) == ["0", "1", "2", "3"]
    assert merged == positions[1].state_dict()
    # after a full stop: group 1 restarts, loads it, reads on where it was; it keeps group 0's record too
    fresh = _positions(corpus, 1)
    fresh.load_state_dict(merged)
    assert [t.tolist() for t in next(iter(fresh.loader))] == [t.tolist() for t in next(iters[1])]
    assert fresh.known[0] == positions[1].known[0]


def test_a_heal_gives_a_group_its_own_position_and_a_discarded_step_is_retried(corpus):
    positions = [_positions(corpus, g) for g in (0, 1)]
    iters = [iter(p.loader) for p in positions]
    for it in iters:
        next(it)
    _exchange_both(positions, _Pair())
    expected = next(iters[1])  # group 1's next step, which it then loses (killed)
    restarted = _positions(corpus, 1)
    assert restarted.adopt(positions[0].records())  # the heal payload of the live group 0
    assert [t.tolist() for t in next(iter(restarted.loader))] == [t.tolist() for t in expected]
    assert not _positions(corpus, 1).adopt({0: positions[0].known[0]})  # no record of its own: stays put
    # a discarded step: rewound to its start and read again
    positions[0].snapshot(moved=True)
    again = iter(positions[0].loader)
    first = next(again)
    positions[0].rewind()
    assert [t.tolist() for t in next(iter(positions[0].loader))] == [t.tolist() for t in first]


# --------------------------------------------------------------------------- heal state, buckets


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    return model, opt, sched


class _NoData:
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _heal_state(model, opt, sched, replica: int, fingerprint: int = 7) -> HealState:
    positions = DataPositions(
        _NoData(), replica_id=replica, group_size=2, dp_rank=0, dp_degree=1, batch_size=1, accum=1
    )
    return HealState(
        view=model, optimizer=opt, lr_scheduler=sched, positions=positions, replica_id=replica, fingerprint=fingerprint
    )


def test_a_heal_moves_weights_optimizer_and_schedule_exactly():
    live = _trained(0)
    for _ in range(3):
        live[1].zero_grad()
        live[0](torch.randn(3, 4)).sum().backward()
        live[1].step()
        live[2].step()
    fresh = _trained(1)  # another seed, an optimizer that never stepped
    state = _heal_state(*live, replica=0).state_dict()
    healing = _heal_state(*fresh, replica=1)
    healing.load_state_dict(state)
    assert (healing.healed, healing.last_source) == (1, 0)
    for a, b in zip(live[0].state_dict().values(), fresh[0].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(live[0].parameters(), fresh[0].parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(live[1].state[p][key], fresh[1].state[q][key]), key
    assert fresh[2].state_dict()["last_epoch"] == 3 and fresh[2].get_last_lr() == live[2].get_last_lr()
    with pytest.raises(ReplicaGroupsFailed, match="cannot heal from group 0: they run different configs") as e:
        _heal_state(*_trained(2), replica=1, fingerprint=8).load_state_dict(state)
    assert "\n" not in str(e.value)


def test_gradients_are_averaged_in_bounded_buckets(monkeypatch):
    monkeypatch.setattr(replicas_mod, "BUCKET_BYTES", 64)  # 16 fp32 values a bucket
    params = [torch.nn.Parameter(torch.ones(n)) for n in (10, 10, 3, 30)]
    for i, p in enumerate(params[:3]):
        p.grad = torch.full_like(p, float(i + 1))
    sizes = []

    def halve(flat: torch.Tensor) -> None:  # the other group's gradients are zeros: the average is half
        sizes.append(flat.numel())
        flat.mul_(0.5)

    average_in_buckets(params, halve)
    assert sizes == [10, 13, 30]  # a bucket closes before it would pass 64 bytes; a bigger tensor goes alone
    assert [p.grad[0].item() for p in params] == [0.5, 1.0, 1.5, 0.0]  # no gradient: zeros, averaged alike


# --------------------------------------------------------------------------- the planner


def test_the_planner_counts_the_cross_group_all_reduce():
    from torchtitan.estimation.plan import Hardware, feature_terms

    hw = Hardware(inter_node_gbps=50.0)

    def _replica_seconds(config, shard, hw):  # what plan.py's step time adds for the run's features
        return feature_terms(config).comm_seconds(config, shard, hw.inter_node_gbps * 1e9)

    off = JobConfig.parse_args([])
    sync = JobConfig.parse_args([*FT, "--fault_tolerance.group_size", "4"])
    diloco = JobConfig.parse_args(
        [*FT, "--fault_tolerance.group_size", "4", "--fault_tolerance.semi_sync_method", "diloco"]
    )
    shard = 1e9  # parameters on this rank
    assert _replica_seconds(off, shard, hw) == 0.0
    ring = 2 * shard * 4 * 3 / 4 / 50e9  # a ring all-reduce of the fp32 shard over 4 groups
    assert _replica_seconds(sync, shard, hw) == pytest.approx(ring)
    assert _replica_seconds(diloco, shard, hw) == pytest.approx(ring / 5)  # every sync_steps = 5


# --------------------------------------------------------------------------- the weights fingerprint


def test_the_weights_fingerprint_sees_one_changed_bit_within_its_slices():
    from torchtitan.features.fault_tolerance.fingerprint import SLICES, weights_fingerprint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 19), torch.nn.Linear(19, 3, bias=False)).to(torch.bfloat16)
    before = [weights_fingerprint(model, s) for s in range(SLICES)]
    assert before == [weights_fingerprint(model, s) for s in range(SLICES)]  # a function of the weights
    for param, index in ((model[0].weight, 0), (model[0].weight, 700), (model[0].bias, 18), (model[1].weight, 56)):
        flat = param.data.view(-1).view(torch.int16)
        flat[index] ^= 1  # the lowest bit of one element
        after = [weights_fingerprint(model, s) for s in range(SLICES)]
        assert sum(a != b for a, b in zip(after, before)) == 1, (param.shape, index)  # exactly its slice
        flat[index] ^= 1
    assert all(0 < f < 2**40 for f in before)


def test_the_agreed_weights_are_the_majority_and_a_tie_goes_to_the_lowest_group():
    from torchtitan.features.fault_tolerance.fingerprint import agreed_value

    assert agreed_value((0, 1, 2), [7, 5, 5]) == 5
    assert agreed_value((0, 1), [7, 5]) == 7
    assert agreed_value((1, 2), [0, 5, 9]) == 5
    assert agreed_value((0, 2, 3), [4, 0, 9, 9]) == 9
