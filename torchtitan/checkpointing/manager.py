"""CheckpointManager: when to save, what to save, how to resume; seed checkpoints; plain weight loading.

Layout: ``<job.dump_folder>/<checkpoint.folder>/step-N/`` (or ``<URL>/step-N/``, storage.py) holds DCP files
(``.metadata``, ``__<rank>_0.distcp``) and, once complete, the ``.complete`` marker (folders.py). Top-level DCP keys:
``model``, ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state`` (state.py).

Trust (integrity.py): every file's CRC32 is taken as DCP writes it and recorded in the marker; a
load first checks every file's size and (checkpoint.verify_checksums) CRC32. ``.metadata`` is
unpickled admitting only DCP's metadata types, and non-tensor entries only if torch's weights-only
unpickler accepts them, so a crafted folder is refused instead of running code. Sizes and CRCs
catch accidents (bit flips, truncation), not an author who rewrites data and marker alike.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

import torchtitan.checkpointing.files.integrity as integrity
from torchtitan.checkpointing.common import agree, one_process_quiet, read_metadata, short_error
from torchtitan.checkpointing.compat import check_model_matches, warn_if_data_changed
from torchtitan.checkpointing.files.folders import (
    CheckpointInfo,
    SaveSchedule,
    find_resume_checkpoint,
    later_branch,
    list_files,
    purge_stale,
    resume_point,
    set_aside,
)
from torchtitan.checkpointing.files.format import check_readable, describe
from torchtitan.checkpointing.files.jsonl import read_json_lines
from torchtitan.checkpointing.files.marker import EXPORT, FULL, read_marker, step_folder, write_marker
from torchtitan.checkpointing.files.storage import isdir, makedirs, rmtree, under
from torchtitan.checkpointing.scope import WHOLE_MODEL, ModelScope
from torchtitan.checkpointing.staging import NO_STAGING, BackgroundStaging, InFlightSave, log_blocked
from torchtitan.checkpointing.state import (
    DataLoaderState,
    ModelState,
    OptimizerState,
    SavedKeysOnly,
    TrainState,
    build_model_view,
    check_model_keys,
)
from torchtitan.dtypes import to_dtype

if TYPE_CHECKING:
    from torch import nn

    from torchtitan.config.schema import Checkpoint as CheckpointConfig

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves and resumes the trainer's state. Built by the trainer after the optimizer and scheduler.

    Every rank calls every public method (they run collectives) with the same arguments.

    ``clock``: the seconds clock of ``checkpoint.interval_type = "seconds"``. ``before_marker``: called
    on rank 0 with the step once its data is written, just before its ``.complete`` marker (tests hold
    the marker back there to kill a job mid-save); None: nothing. ``run_folder``: where this run's
    metrics.jsonl is (a fault-tolerant replica group's own folder); default ``dump_folder``. ``root``: the
    checkpoint folder, default ``<dump_folder>/<checkpoint.folder>``. ``extra``: more top-level parts of a full
    checkpoint (fault tolerance's DiLoCo outer optimizer); a checkpoint without one loads, that part fresh.
    ``sets_aside_later``: a resume moves the checkpoints newer than its step aside (False in a folder other
    replica groups write into, where a newer one may be a live group's save that just completed).
    ``scope`` (checkpointing/scope.py): the part of the model a checkpoint holds. A partial one (a feature that
    trains part of the model) saves its trained keys; its frozen base comes from ``checkpoint.initial_load_path``
    (or the seed) on every start, resume included, a seed or initial load fills the base only, and a fresh start
    loads what the scope's ``fresh_start`` loads.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        dump_folder: str,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        data_loader: Any,
        dp_rank: int,
        rank: int,
        device: torch.device,
        model_info: dict[str, Any],
        data_info: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        before_marker: Callable[[int], None] | None = None,
        run_folder: str | None = None,
        root: str | None = None,
        extra: dict[str, Stateful] | None = None,
        sets_aside_later: bool = True,
        scope: ModelScope = WHOLE_MODEL,
    ):
        self.config = config
        self.run_folder = run_folder or dump_folder
        self.enabled = config.enable_checkpoint
        self.dump_folder, self.root = dump_folder, root or under(dump_folder, config.folder)
        self.extra = extra or {}
        self.sets_aside_later = sets_aside_later
        self.scope = scope
        self.hf_root = os.path.join(dump_folder, "hf")  # checkpoint.last_save_in_hf writes step-N here
        self.view = build_model_view(model_parts)
        self.optimizer, self.lr_scheduler, self.data_loader = optimizer, lr_scheduler, data_loader
        self.dp_rank, self.rank, self.device = dp_rank, rank, device
        self.model_info, self.data_info = model_info, data_info or {}
        self.last_save_step: int | None = None  # on every rank (``_finished`` is rank 0's)
        self.train_state = TrainState(rank, device)
        self.schedule = SaveSchedule(config.interval_type, config.interval, clock)
        self.async_save = self.enabled and config.async_mode != "disabled"
        # DCP's own collectives get a separate gloo group: an async save runs them from a background
        # thread while training runs its own on the default group, and one group must not be used
        # by two threads at once.
        self.pg = dist.new_group(backend="gloo") if self.async_save and dist.is_initialized() else None
        self._pending: InFlightSave | None = None
        self.blocked_seconds: dict[int, float] = {}  # step -> seconds its save blocked training (``wait_staging``)
        pinned = self.enabled and config.async_mode == "async_with_pinned_mem"
        self.staging = BackgroundStaging(device, optimizer, self.wait_staging, log=rank == 0) if pinned else NO_STAGING
        self._finished: set[int] = set()
        self._lock = threading.Lock()
        self.loaded: str | None = None
        self.last_saved: tuple[int, float] | None = None  # (step, seconds)
        self.before_marker = before_marker

    # ---- loading -------------------------------------------------------------------------------

    def load(self) -> int:
        """Load the checkpoint to resume from, if any; return the step training continues after.

        With nothing to resume, ``checkpoint.initial_load_path`` (if set) gives the starting weights.
        """
        info = None
        if self.enabled:
            info = agree(lambda: find_resume_checkpoint(self.root, self.config.load_step, self.config.verify_checksums))
        base_first = info is not None and self.scope.partial  # its checkpoints do not hold the base
        if info is None or base_first:
            if self.config.initial_load_path:
                from torchtitan.checkpointing.hf.run import initial_load

                self.loaded = initial_load(
                    self.config, self.view, self.model_info, self._load_targets, self.rank, self.pg, self.scope.base
                )
            if not base_first:
                if self.scope.fresh_start is not None:
                    self.loaded = self.scope.fresh_start(self.view, self.model_info) or self.loaded
                return 0
        if self.config.initial_load_path and self.rank == 0 and not base_first:
            logger.info("checkpoint.initial_load_path is not read: resuming from %s", info.path)
        marker = info.marker or {}
        check_readable(marker, info.path)
        check_model_matches(marker.get("model"), self.model_info, info.path)
        if info.kind == FULL and self.rank == 0:
            warn_if_data_changed(marker.get("data"), self.data_info, info.path)
        start = time.perf_counter()
        metadata = read_metadata(info.path)
        state = self._load_targets(info, metadata)
        try:
            with one_process_quiet():
                integrity.load(state, info.path, process_group=self.pg, no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as e:
            raise ValueError(
                f"checkpoint {info.path} ({describe(marker)}) could not be loaded: {short_error(e)}"
            ) from e
        seconds = time.perf_counter() - start
        step = self.train_state.step if info.kind == FULL else 0
        self.loaded = f"resumed from step-{info.step}"
        if self.rank == 0:  # before anything new is saved; every rank's next save starts with a barrier
            if self.sets_aside_later:
                set_aside(
                    self.root, later_branch(self.root, info.step), f"abandoned-after-resume-from-step-{info.step}"
                )
            trim_metrics(self.run_folder, step)  # the run continues after ``step``: it logs the later ones again
        if self.rank == 0:
            what = "resumed from step" if info.kind == FULL else "loaded seed weights (model only) from step"
            logger.info("%s %d (%s) in %.2f s", what, info.step, info.path, seconds)
        if info.kind == FULL and f"train_state.rng_cpu.rank_{self.rank}" not in metadata.state_dict_metadata:
            logger.warning(
                "rank %d: the checkpoint has no RNG state for this rank (saved on another world "
                "size); keeping the seeded RNG",
                self.rank,
            )
        return step

    def _model_keys(self, full: bool) -> Callable[[str], bool] | None:
        """A partial scope: a full checkpoint's model part is its trained keys, a seed's or an initial load's the
        base."""
        return self.scope.keys(full)

    def _load_targets(self, info: CheckpointInfo, metadata: Any) -> dict[str, Any]:
        model = ModelState(self.view, keys=self._model_keys(info.kind == FULL))
        model_sd = model.state_dict()
        all_keys = set(model_sd)
        if dist.is_initialized():  # under PP each rank holds some stages: the union is the whole model
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, sorted(model_sd))
            all_keys = set().union(*gathered)
        check_model_keys(model_sd, metadata, f"{info.path} ({describe(info.marker)})", all_keys)
        state: dict[str, Any] = {"model": model}
        if info.kind == FULL:
            saved = set(metadata.state_dict_metadata)
            loader_keys = sorted(k.split(".", 1)[1] for k in saved if k.startswith("dataloader."))
            state.update(
                optimizer=OptimizerState(self.view, self.optimizer),
                lr_scheduler=self.lr_scheduler,
                dataloader=DataLoaderState(self.data_loader, self.dp_rank, load_keys=loader_keys),
                train_state=SavedKeysOnly(self.train_state, "train_state", saved),
            )
            for part in self.config.exclude_from_loading:  # these start fresh (checked before launch)
                del state[part]
            for key, part in self.extra.items():
                if any(k.startswith(f"{key}.") for k in saved):
                    state[key] = part
                elif self.rank == 0:
                    logger.warning(
                        "checkpoint %s has no %s (saved by another kind of run): it starts fresh", info.path, key
                    )
        return state

    # ---- saving --------------------------------------------------------------------------------

    def maybe_save(self, step: int, *, last: bool) -> None:
        """Save if the interval is due; always at the last step."""
        if not self.enabled:
            return
        due = last or self.schedule.due(step)
        if self.schedule.interval_type == "seconds" and not last:
            due = agree(lambda: due)  # rank 0's clock decides, so all ranks join the same save
        if due:
            self.save(step, final=last)

    def save(self, step: int, *, final: bool = False) -> None:
        """Write ``step-N``; async (if configured) except for the final save, which also may be an export."""
        self.wait()
        entered = time.perf_counter()  # the wait above counts for the previous save
        kind = EXPORT if final and self.config.model_weights_only else FULL
        path = step_folder(self.root, step)
        if self.rank == 0:
            if isdir(path):  # a complete one is kept (set aside) until its replacement exists
                existing = read_marker(path)
                if existing is None:
                    rmtree(path)
                else:
                    set_aside(self.root, [CheckpointInfo(step, path, existing)], f"replaced-step-{step}")
            makedirs(path)
        if dist.is_initialized():
            dist.barrier()  # nobody writes into the folder before rank 0 has cleared it
        state = self._save_state(step, kind)
        start = time.perf_counter()
        if self.async_save and not final:
            copier = self.staging.copier_for_save()  # async_with_pinned_mem's; None: DCP's writer copies
            with one_process_quiet():
                copied, written = integrity.async_save(
                    state, path, process_group=self.pg, no_dist=not dist.is_initialized(), copier=copier
                )
            self._pending = InFlightSave(written, step, kind, start, copied)
            self.blocked_seconds[step] = time.perf_counter() - entered
            if self.rank == 0:
                written.add_done_callback(lambda f: f.exception() is None and self._mark_complete(step, kind, start))
            if copied is None and self.rank == 0:  # "async": the writer copied the state before async_save returned
                log_blocked(step, self.blocked_seconds[step])
        else:
            with one_process_quiet():
                integrity.save(state, path, process_group=self.pg, no_dist=not dist.is_initialized())
            self._saved(step, kind, start)
            self.blocked_seconds[step] = time.perf_counter() - entered
        self.schedule.saved()
        self.last_save_step = step
        if final and self.config.last_save_in_hf:
            from torchtitan.checkpointing.hf.run import export_last_in_hf

            export_last_in_hf(self.config, path, step_folder(self.hf_root, step), self.scope.export_hf)

    def save_now(self, step: int) -> bool:
        """Save ``step`` unless it was just saved, and wait until it is complete; False if checkpointing is off."""
        if not self.enabled:
            return False
        if self.last_save_step != step:
            self.save(step)
        self.wait()
        return True

    def _save_state(self, step: int, kind: str) -> dict[str, Any]:
        if kind == EXPORT:
            return {"model": ModelState(self.view, to_dtype(self.config.export_dtype), keys=self._model_keys(True))}
        self.train_state.step = step
        return {
            "model": ModelState(self.view, keys=self._model_keys(True)),
            "optimizer": OptimizerState(self.view, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "dataloader": DataLoaderState(self.data_loader, self.dp_rank),
            "train_state": self.train_state,
            **self.extra,
        }

    def _saved(self, step: int, kind: str, start: float) -> None:
        """After this rank's save returned: rank 0 marks it complete and purges old checkpoints."""
        if self.rank == 0:
            self._mark_complete(step, kind, start)
            purge_stale(self.root, self.config.keep_latest_k)

    def _mark_complete(self, step: int, kind: str, start: float) -> None:
        """Rank 0, once DCP returned: the coordinator has then gathered every rank's write results."""
        with self._lock:
            if step in self._finished:
                return
            if self.before_marker is not None:
                self.before_marker(step)
            extra = {"dtype": self.config.export_dtype} if kind == EXPORT else {}
            path = step_folder(self.root, step)
            write_marker(
                path,
                step,
                kind,
                model=self.model_info,
                data=self.data_info,
                files=list_files(path),
                world_size=dist.get_world_size() if dist.is_initialized() else 1,
                **extra,
            )
            self._finished.add(step)
            self.last_saved = (step, time.perf_counter() - start)
            logger.info("checkpoint step-%d complete (%s) in %.2f s", step, kind, self.last_saved[1])

    def wait_staging(self) -> None:
        """Block until the in-flight save's background staging copy is done, before anything changes the tensors it
        reads (the optimizer's step pre-hook calls it). ``blocked_seconds[step]`` counts the save call, this wait,
        and ``wait``'s for the write when the next save (or the end) comes before it is done."""
        pending = self._pending
        waited = pending.wait_copy() if pending is not None else None
        if waited is not None:
            self.blocked_seconds[pending.step] += waited
            if self.rank == 0:
                log_blocked(pending.step, self.blocked_seconds[pending.step])

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is written and marked complete."""
        if self._pending is None:
            return
        self.wait_staging()
        pending, self._pending = self._pending, None
        start = time.perf_counter()
        try:
            pending.written.result()
        except (Exception, CheckpointException) as e:
            raise RuntimeError(f"async save of checkpoint step-{pending.step} failed: {short_error(e)}") from e
        self._saved(pending.step, pending.kind, pending.start)
        self.blocked_seconds[pending.step] += time.perf_counter() - start  # its write was not done yet

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.staging.close()
        if self.pg is not None:
            dist.destroy_process_group(self.pg)
            self.pg = None

    def summary(self) -> str:
        """For the end-of-run line."""
        if not self.enabled:
            return "not enabled (checkpoint.enable_checkpoint)"
        parts = [self.loaded or "started fresh"]
        if self.last_saved is not None:
            parts.append(f"last saved step-{self.last_saved[0]} in {self.root}")
        return ", ".join(parts)


def resumes_from(config: CheckpointConfig, root: str) -> int | None:
    """The step of the checkpoint a run with this ``[checkpoint]`` section and checkpoint folder ``root`` resumes
    from, or None (it starts fresh): from the markers alone, before any process group exists (``load`` verifies
    and loads it)."""
    found = resume_point(root, enabled=config.enable_checkpoint, load_step=config.load_step)
    return None if found is None else found.step


def trim_metrics(dump_folder: str, last_step: int) -> None:
    """Drop metrics.jsonl records after ``last_step``: a resumed run logs those steps again."""
    path = os.path.join(dump_folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return
    records = read_json_lines(path)  # a last line cut short by a kill is dropped, with a warning
    kept = [line for line, record in records if record.get("step", 0) <= last_step]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
