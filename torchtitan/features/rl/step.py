"""The RL step (``rl.enable``): the run's ``StepRunner`` (components/seams.py) when RL is on, not a copy of the trainer.

Each step: sample ``rl.prompts_per_step`` prompts, generate ``rl.group_size`` completions of each with the current
policy (or read them from an outside engine's file), score them with ``rl.reward``, compute each group's advantages,
then ``rl.updates_per_step`` optimizer updates, each over its slice of the step's completions (a dp rank's share
of it, in ``training.gradient_accumulation_steps`` micro-batches of ``training.batch_size``). The model, its layout,
the optimizer, the checkpoints (with the frozen reference when ``rl.kl_coef`` > 0: the ``step_modules`` slot),
metrics, stop signals and the loop are the trainer's own; the registry's slots give it the prompts as the run's data
(``data_loader``), the reference (``step_modules``) and this step (``step_runner``). docs/rl.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.components.generation import Sampling
from torchtitan.components.seams import StepResult
from torchtitan.features.rl.environments.episodes import episode_spec
from torchtitan.features.rl.generator import FOLDER as GENERATOR_FOLDER
from torchtitan.features.rl.generator import ROWS as GENERATOR_ROWS
from torchtitan.features.rl.generator import start_generator
from torchtitan.features.rl.losses import Clip, count_nonfinite_logprobs, group_advantages, policy_loss, token_weights
from torchtitan.features.rl.prompts import PromptSource
from torchtitan.features.rl.publish import publish_policy, run_identity
from torchtitan.features.rl.records import format_rl_line, step_records
from torchtitan.features.rl.rewards import load_reward
from torchtitan.features.rl.rollouts import (
    Rollout,
    RolloutFile,
    UpdateBatch,
    agree_all_done,
    group_seed,
    rollout_group,
    update_batch,
)
from torchtitan.models.common.documents import IGNORE_INDEX

if TYPE_CHECKING:
    from torchtitan.components.group_seams import GradientSync, StepAgreement
    from torchtitan.components.parts import CoreParts
    from torchtitan.components.run_control import Guard

logger = logging.getLogger(__name__)

GENERATOR_WAIT_S = 1800.0  # rl.max_staleness with rl.rollouts_wait_seconds 0: how long a step waits for its rows


class RLStep:
    """One RL step: the step's rollouts (generated, or read from an engine's file) as its data, then the updates."""

    def __init__(
        self,
        core: CoreParts,
        *,
        reference: nn.Module | None,
        agreement: StepAgreement,
        gradients: GradientSync,
        guard: Guard,
        start_step: int,
    ):
        self.core, self.config, self.rl = core, core.config, core.config.rl
        self.reference, self.agreement, self.gradients, self.guard = reference, agreement, gradients, guard
        self.start_step, self.device, self.rank = start_step, core.device, core.rank
        self.model_parts, self.parallel_dims = core.model_parts, core.parallel_dims
        self.world_size = core.parallel_dims.world_size
        self.prompts: PromptSource = core.data_loader
        self.stop_ids = tuple(self.rl.stop_ids) or self.prompts.stop_ids
        self.sampling = Sampling(temperature=self.rl.temperature, top_k=self.rl.top_k, top_p=self.rl.top_p)
        self.stats: dict[str, float] = {}
        self.publish_root = self.rl.publish_folder or os.path.join(self.config.job.dump_folder, "policy")
        self._dropped, self._generation_s = 0, 0.0

    def open_outside(self) -> None:
        """What the step reads and writes outside the process: the reward function, an engine's rollouts file, the
        published policy (the memory estimator's step has none of them), and the run's id they carry (rank 0's)."""
        rl = self.rl
        self.run = self._agreed(run_identity(self.publish_root, resumed=self.start_step > 0))
        in_process = rl.generates_in_process()
        self.reward_fn = load_reward(rl.reward) if in_process and not rl.environment else None
        self.episodes = episode_spec(rl, self.prompts, self.stop_ids) if in_process else None
        # an engine (or the asynchronous generator) generates from the policy this run publishes: only its rows
        live = rl.publish_every > 0 or rl.max_staleness > 0
        self.rollout_file, self.generator = None, None
        if rl.rollouts_path:
            self.rollout_file = RolloutFile(rl.rollouts_path, run=self.run if live else None)
        if live:
            self._publish(self.start_step)
        if rl.max_staleness > 0:
            path = os.path.join(self.core.run_folder, GENERATOR_FOLDER, GENERATOR_ROWS)
            if self.rank == 0:
                self.generator = start_generator(
                    self.config, self.core.run_folder, run=self.run, first_step=self.start_step + 1
                )
            self.rollout_file = RolloutFile(path, run=self.run, producer=self.generator and self.generator.error)

    def close(self) -> None:
        """Ends the asynchronous generator (rank 0's), if any."""
        if self.generator is not None:
            self.generator.close()

    def _agreed(self, value: str) -> str:
        """Rank 0's ``value`` on every rank."""
        if not dist.is_initialized():
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def summary_lines(self) -> dict[str, str]:
        """The start summary's batch and data lines, saying what an RL step does, and its own line."""
        rl = self.rl
        source = f"rollouts from {rl.rollouts_path}" if rl.rollouts_path else f"prompts from {rl.prompts_path}"
        if rl.max_staleness > 0:
            source += (
                f", generated by the run's generator process from the policy of up to {rl.max_staleness} step(s) "
                "before (rl.max_staleness)"
            )
        reward = f"reward {rl.reward}" if not rl.rollouts_path else "rewards from the rollouts"
        if rl.environment and not rl.rollouts_path:
            reward = f"episodes of up to {rl.max_turns} turns with {rl.environment}, its rewards"
        kl = f", KL to the start's policy x {rl.kl_coef:g}" if rl.kl_coef > 0 else ""
        return {
            "batch": f"{rl.prompts_per_step} prompts x {rl.group_size} completions (<= {rl.max_new_tokens} tokens, "
            f"temperature {rl.temperature:g}) per step, {rl.updates_per_step} update(s) per step",
            "data": f"{source}; {reward}",
            "rl": f"{rl.algorithm.upper()}{kl}" + ("" if rl.std_normalize else " (advantages not std-normalized)"),
        }

    # -- one step ------------------------------------------------------------------------------------------
    def data(self, step: int, data_iter: Iterator) -> list[Rollout]:
        start = time.perf_counter()
        rollouts, self._dropped = self._step_rollouts(step)
        self._generation_s = time.perf_counter() - start
        return rollouts

    def train(
        self, step: int, rollouts: list[Rollout], *, phase_done: Callable[[str], None] | None = None
    ) -> StepResult:
        update_start = time.perf_counter()
        result = self._update(step, rollouts)
        update_s = time.perf_counter() - update_start
        self.agreement.commit(step)  # one group: RL refuses fault tolerance's replica groups (preflight)
        self._record(step, rollouts, self._dropped, self._generation_s, update_s)
        return result

    def after_commit(self, step: int, *, logged: bool) -> None:
        if self.rank == 0 and logged:
            logger.info(format_rl_line(step, self.stats))
        every = 1 if self.rl.max_staleness > 0 else self.rl.publish_every  # the generator reloads every step's policy
        if every > 0 and step % every == 0:
            self._publish(step)

    def step_tokens(self) -> float:
        """This rank's tokens of the update (every completion is trained once per step, padded to seq_len)."""
        rl, t, dims = self.rl, self.config.training, self.parallel_dims
        return rl.prompts_per_step * rl.group_size * t.seq_len / (dims.dp_degree * dims.tp)

    def metrics(self) -> tuple[dict[str, float], dict[str, float]]:
        fields = dict(self.stats)
        return fields, {f"rl/{k}": v for k, v in fields.items()}

    # -- rollouts ------------------------------------------------------------------------------------------
    def _step_rollouts(self, step: int) -> tuple[list[Rollout], int]:
        """The step's ``prompts_per_step`` groups (every rank holds all of them) and how many groups were dropped.

        DAPO drops the groups whose rewards are all equal (their advantages are 0: they teach nothing) and generates
        fresh prompts' groups, up to ``rl.max_sampling_rounds`` rounds; a step still short of groups is topped up
        with dropped ones. GRPO keeps every group."""
        rl = self.rl
        kept: list[list[Rollout]] = []
        dropped: list[list[Rollout]] = []
        from_file = self.rollout_file is not None
        rounds = 1 if from_file or rl.algorithm != "dapo" else rl.max_sampling_rounds
        for round in range(rounds):
            for group in self._file_groups(step) if from_file else self._generate(step, round):
                equal = rl.algorithm == "dapo" and len({r.reward for r in group}) == 1
                (dropped if equal else kept).append(group)
            if len(kept) >= rl.prompts_per_step:
                break
        groups = (kept + dropped)[: rl.prompts_per_step]
        groups = [[dataclasses.replace(r, group=i) for r in g] for i, g in enumerate(groups)]
        self._write_rollouts(groups)
        return [r for group in groups for r in group], len(dropped)

    def _file_groups(self, step: int) -> list[list[Rollout]]:
        rl = self.rl
        wait = rl.rollouts_wait_seconds or (GENERATOR_WAIT_S if rl.max_staleness > 0 else 0.0)
        rows = self.rollout_file.take(step, rl.prompts_per_step * rl.group_size, wait)
        return [rows[i : i + rl.group_size] for i in range(0, len(rows), rl.group_size)]

    def _generate(self, step: int, round: int) -> list[list[Rollout]]:
        """This dp rank's share of the round's prompts, generated and scored; then every rank's, gathered."""
        rl, dims = self.rl, self.parallel_dims
        prompts = self.prompts.sample(step, round)
        share = len(prompts) // dims.dp_degree
        dp_rank = self.core.world.local_rank("dp")
        model, all_done = self.model_parts[0], agree_all_done(self.world_size)
        mine, error = [], None
        with self.core.step_fn.autocast():
            for position in range(dp_rank * share, (dp_rank + 1) * share):
                group, failed = rollout_group(
                    model,
                    prompts[position],
                    step=step,
                    position=position,
                    rl=rl,
                    prompts=self.prompts,
                    reward_fn=self.reward_fn,
                    episodes=self.episodes,
                    stop_ids=self.stop_ids,
                    sampling=self.sampling,
                    seed=group_seed(self.config.training.seed, step, round, position),
                    device=self.device,
                    all_done=all_done,
                    pad_multiple=dims.tp,
                )
                error = error or failed  # raised on every rank after the gather: no rank waits alone
                mine.append(group)
        groups, errors = self._gather(mine, error)
        if errors:
            raise ValueError(errors[0])
        return groups

    def _gather(self, mine: list, error: str | None) -> tuple[list, list[str]]:
        group = self.core.world.group("dp")
        if group is None:
            return mine, [error] if error else []
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (mine, error), group=group)
        return [g for groups, _ in everyone for g in groups], [e for _, e in everyone if e]

    def _write_rollouts(self, groups: list[list[Rollout]]) -> None:
        if self.rank != 0:
            return
        with open(os.path.join(self.core.run_folder, "rollouts.jsonl"), "a", encoding="utf-8") as f:
            for group in groups:
                for r in group:
                    f.write(json.dumps(r.record(self.run)) + "\n")

    # -- the update ----------------------------------------------------------------------------------------
    def _update(self, step: int, rollouts: list[Rollout]) -> StepResult:
        batch, rl = self.update_batch(rollouts), self.rl
        nonfinite = count_nonfinite_logprobs(
            batch, step, max_share=rl.max_nonfinite_logprob_share, rollouts_path=rl.rollouts_path
        )
        result, sums = self.train_update(step, batch)
        self.stats.update(self._reduce_stats(sums), nonfinite_logprob_tokens=float(nonfinite))
        return result

    def update_batch(self, rollouts: list[Rollout]) -> UpdateBatch:
        """The step's sequences with their group advantages (on the host)."""
        rl = self.rl
        rewards = torch.tensor([r.reward for r in rollouts]).view(-1, rl.group_size)
        advantages = group_advantages(rewards, std_normalize=rl.std_normalize).flatten().tolist()
        return update_batch(rollouts, advantages, self.config.training.seq_len, pad_id=self.core.tokenizer.eos_id)

    def train_update(self, step: int, batch: UpdateBatch) -> tuple[StepResult, dict[str, torch.Tensor]]:
        """``rl.updates_per_step`` optimizer updates over the step's sequences; the result and the stats' weighted
        sums (on the device, read by ``_reduce_stats``)."""
        rl, t, core = self.rl, self.config.training, self.core
        per_update = batch.inputs.shape[0] // rl.updates_per_step
        dp, dp_rank = self.parallel_dims.dp_degree, core.world.local_rank("dp")
        per_rank = per_update // dp
        sums: dict[str, torch.Tensor] = {}  # the stats' weighted sums, on the device: read once, in _reduce_stats
        loss_sum = torch.zeros((), device=self.device)
        grad_norm = torch.zeros((), device=self.device)
        stop = False
        proximal = self._proximal_logprobs(batch, per_update, per_rank) if rl.importance_cap > 0 else None
        for u in range(rl.updates_per_step):
            update = batch.rows(u * per_update, (u + 1) * per_update)
            weights = token_weights(update.mask, algorithm=rl.algorithm, finite=update.finite)
            mine = update.rows(dp_rank * per_rank, (dp_rank + 1) * per_rank)
            my_weights = weights[dp_rank * per_rank : (dp_rank + 1) * per_rank]
            update_loss = torch.zeros((), device=self.device)
            for m in range(t.gradient_accumulation_steps):
                rows = slice(m * t.batch_size, (m + 1) * t.batch_size)
                micro = mine.rows(rows.start, rows.stop)
                near = None if proximal is None else proximal[u][rows]
                loss, stats = self._micro_batch(micro, my_weights[rows].to(self.device), near)
                # FSDP and DDP average gradients over the dp ranks; the weights already divide by the update's size
                (loss * dp).backward()
                update_loss += loss.detach()
                for k, v in stats.items():
                    sums[k] = sums[k] + v if k in sums else v
            grad_norm, stops = self._optimizer_update(step, update_loss)
            stop = stop or stops
            loss_sum += update_loss * dp / rl.updates_per_step
        core.lr_scheduler.step()
        return StepResult(loss_sum, grad_norm, True, stop=stop), sums

    @torch.no_grad()
    def _proximal_logprobs(self, batch: UpdateBatch, per_update: int, per_rank: int) -> list[torch.Tensor]:
        """rl.importance_cap: this rank's rows' log-probs under the policy as the step starts, per update."""
        dp_rank, size = self.core.world.local_rank("dp"), self.config.training.batch_size
        out = []
        for u in range(self.rl.updates_per_step):
            start = u * per_update + dp_rank * per_rank
            mine = batch.rows(start, start + per_rank)
            parts = [
                self._logprobs(
                    self.model_parts[0],
                    mine.inputs[m : m + size].to(self.device),
                    mine.labels[m : m + size].to(self.device),
                )
                for m in range(0, per_rank, size)
            ]
            out.append(torch.cat(parts))
        return out

    def _micro_batch(
        self, micro: UpdateBatch, weights: torch.Tensor, proximal: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict]:
        rl = self.rl
        inputs, labels = micro.inputs.to(self.device), micro.labels.to(self.device)
        logprobs = self._logprobs(self.model_parts[0], inputs, labels)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self._logprobs(self.reference, inputs, labels)
        return policy_loss(
            logprobs,
            micro.old_logprobs.to(self.device),
            micro.advantages.to(self.device),
            weights,
            Clip(rl.clip_low, rl.clip_high),
            ref_logprobs=ref,
            kl_coef=rl.kl_coef,
            proximal_logprobs=proximal,
            importance_cap=rl.importance_cap,
        )

    def _logprobs(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(b, seq_len) log-probs of ``labels`` at the sampling temperature (0 where a label is ignored)."""
        step_fn = self.core.step_fn
        with step_fn.autocast():
            logits = model(inputs)  # (b, seq_len, vocab); vocab-sharded DTensor under loss parallel
        temperature = self.rl.temperature if self.rl.temperature > 0 else 1.0
        with step_fn.loss_context():
            if isinstance(logits, DTensor) and not self.parallel_dims.loss_parallel_enabled:
                logits = logits.full_tensor()
            scaled = logits.float() / temperature
            targets = labels.flatten()
            if isinstance(scaled, DTensor):  # loss parallel: the per-token loss's backward wants the targets as one too
                targets = DTensor.from_local(targets, scaled.device_mesh, [Replicate()] * scaled.device_mesh.ndim)
            nll = F.cross_entropy(scaled.flatten(0, 1), targets, reduction="none", ignore_index=IGNORE_INDEX)
            if isinstance(nll, DTensor):
                nll = nll.full_tensor()
        return -nll.view(labels.shape)

    def _optimizer_update(self, step: int, loss: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Reduce, clip and apply one update's gradients; (the grad norm, whether the guard asks to stop)."""
        core = self.core
        step_fn = core.step_fn
        _, params = self.gradients.reduce_gradients(step_fn.finish_gradients, loss)
        max_norm = self.config.training.max_norm
        grad_norm = core.optimizer_step.grad_norm(lambda ps: step_fn.clip_grad_norm_(max_norm, ps), params)
        verdict = self.guard.check(step, loss, grad_norm)
        if not verdict.skip:
            core.optimizer_step.apply(core.optimizer, self.gradients)
        core.optimizer.zero_grad(set_to_none=True)
        return grad_norm, verdict.stop

    def _reduce_stats(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """The updates' weighted sums (``kl`` only with a reference), added over the dp ranks, averaged over the
        updates."""
        keys = sorted(sums)
        values = torch.stack([sums[k] for k in keys]).double()
        group = self.core.world.group("dp")
        if group is not None:
            dist.all_reduce(values, group=group)
        n = self.rl.updates_per_step
        return {k: v / n for k, v in zip(keys, values.tolist())}

    # -- records and publishing ----------------------------------------------------------------------------
    def _record(self, step: int, rollouts: list[Rollout], dropped: int, generation_s: float, update_s: float) -> None:
        """The step's records; ``generation_s``: the seconds its rollouts took to come (generated here, or waited for)."""
        update_tps = self.step_tokens() / max(update_s, 1e-9)
        self.stats.update(step_records(self.rl, step, rollouts, dropped, generation_s, update_s, update_tps))

    def _publish(self, step: int) -> None:
        publish_policy(self.model_parts[0], self.core, self.publish_root, step, self.run)
