"""Checkpoint and resume with torch Distributed Checkpoint (DCP), atomically, across meshes.

A save writes everything into the step's ``.tmp`` folder, then rank 0 commits it once every rank
has finished (:mod:`mmm.parallel.checkpoint_folder`: the folder's layout, the atomic commit,
pruning), so a checkpoint is visible only when complete and a crash during a save leaves the
previous one usable. Resuming from 'latest' takes the most recently SAVED checkpoint, not the
highest step: a run resumed from an earlier step, then requeued, continues itself, not the run it
abandoned. Rank 0 alone reads the folder and broadcasts the step to load. A second SIGTERM during
a save takes effect after it.

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict`` (fully
qualified names of the plain model, DTensor shards of TP/FSDP), so a checkpoint saved on one
mesh loads on another: dp=4 -> dp=2 x tp=2, tp=2 -> one process, pp=2 -> pp=1. ``mmm.json`` holds
the step, the data position, the mesh, the strategy and the model config (a checkpoint of a
different model is refused with the fields that differ). Each rank's RNG state is restored when
the world size matches (data and weights here depend only on the seed and step, so RNG state only
matters for dropout). DeepSpeed strategies use DeepSpeed's own ``save_checkpoint`` /
``load_checkpoint`` inside the same atomic folder scheme; they resume on the same data-parallel size.

``async_save=True`` (torch strategies) stalls training only while this rank's state is copied to host
memory; DCP's ``async_save`` writes the files in a background thread, its collectives on a gloo
group of their own. Every rank's RNG file is durable before the background write starts, and DCP's
write ends with a collective that completes on rank 0 only once every rank's shards are written and
fsynced, so rank 0 commits the step (``mmm.json``, rename, prune) as soon as its write ends. One save
is in flight at a time: the next save, :meth:`Checkpointer.wait` and :meth:`Checkpointer.load` wait for
it, and every rank learns there of a failure on any rank (a full disk), in the same line as a
synchronous save. A crash while it is in flight leaves only a ``.tmp`` folder, never read.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from mmm import faults
from mmm.dist.exits import RankZeroFailed, all_ok, gather_objects, on_rank0, uninterrupted
from mmm.dist.state import current
from mmm.errors import RunError, UsageError
from mmm.files import fsync_path
from mmm.parallel.checkpoint_files import SafeLoadPlanner, SafeReader, dcp_damage, torch_file_damage
from mmm.parallel.checkpoint_folder import (
    META,
    commit,
    complete_steps,
    crash_point,
    disk_full,
    keep_from_others,
    meta_of,
    missing_step,
    no_space,
    rank_world,
    recover,
    step_dir,
    steps_by_recency,
    writable_by_others,
)

# what must match to resume: the model, what defines the data of each step (a run resumed with another
# seed, global batch, dataset or epoch length would silently train on other data) and the lr schedule
COMPAT_KEYS = ("model", "seed", "global_batch", "dataset", "steps_per_epoch", "lr_schedule")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _damaged_files(e: BaseException) -> bool:
    """A DCP load failed on reading files (cut short, unreadable, unpicklable), on every failing rank:
    damage, not a code or memory problem."""
    failures = getattr(e, "failures", {}) or {}
    kinds = (OSError, EOFError, pickle.UnpicklingError)
    return bool(failures) and all(
        isinstance(exc[0] if isinstance(exc, tuple) else exc, kinds) for exc in failures.values()
    )


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class _InFlight:
    """A save whose files are being written in the background (``async_save``)."""

    step: int
    final: Path
    future: Future
    started: float  # time.perf_counter() when the save was called
    stall_s: float = 0.0  # how long the save held up training (the copy to host memory)
    written_s: float | None = None  # from the save's call until this rank's background write ended
    written: threading.Event = field(default_factory=threading.Event)  # rank 0: written and committed, or failed
    commit_error: BaseException | None = None  # rank 0: why the commit failed


class _KilledWhileWriting(DefaultSavePlanner):
    """``MMM_SAVE_FAULT=shards`` with an asynchronous save: this rank dies half-way through writing its
    shards, in the background thread, while training goes on."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def resolve_data(self, write_item):
        crash_point("shards", self.step)
        return super().resolve_data(write_item)


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def keep_implementation(optimizer) -> None:
    """After a load: how ``optimizer`` steps is this run's choice (its ``defaults``), not the saved one's
    (torch's ``load_state_dict`` copies every param-group key, ``fused`` too: a checkpoint saved unfused
    would resume unfused, one saved fused would be fused where this run's parameters cannot be)."""
    for group in optimizer.param_groups:
        for key in IMPLEMENTATION_KEYS:
            if key in optimizer.defaults:
                group[key] = optimizer.defaults[key]


class Checkpointer:
    """Save and load a training state (``model``/``optimizer`` or a DeepSpeed ``engine``).

    ``meta`` (model config, mesh, strategy...) is stored with every checkpoint; on load the
    ``compat_keys`` of it must match, or the load is refused naming the differences.

    ``async_save=True`` (not with ``deepspeed_engine``): :meth:`save` returns once this rank's state is
    copied to host memory and writes in the background; :meth:`wait` (or the next save, or
    :meth:`load`) waits for it and raises a failure on every rank, :meth:`close` after the last save.
    Construct it on every rank (it makes the background writes' process group, a collective).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        model=None,
        optimizer=None,
        deepspeed_engine=None,
        meta: dict[str, Any] | None = None,
        compat_keys: tuple[str, ...] = COMPAT_KEYS,
        keep_last: int = 0,
        log=None,
        async_save: bool = False,
    ) -> None:
        if async_save and deepspeed_engine is not None:
            raise UsageError(
                "async_save=True writes torch DCP checkpoints; a DeepSpeed engine saves with its own "
                "save_checkpoint, synchronously: drop async_save"
            )
        self.root = Path(root)
        self.model, self.optimizer, self.ds = model, optimizer, deepspeed_engine
        self.meta = meta or {}
        self.compat_keys = compat_keys
        self.keep_last = keep_last
        self.log = log
        self.last_save_s: float | None = None
        self.last_load_s: float | None = None
        self.async_save = async_save
        self.previous: int | None = None  # the step this run last saved or resumed from: a save's parent
        self.last_stall_s: float | None = None  # async_save: how long the last save held up training
        self._pending: _InFlight | None = None
        self._stager: DefaultStager | None = None
        self._group = None
        if async_save and dist.is_initialized():  # a group of its own: never a collective of the training's
            info = current()
            timeout = timedelta(seconds=info.timeout_s) if info is not None else None
            self._group = dist.new_group(backend="gloo", timeout=timeout)

    # ------------------------------------------------------------------ state
    def _state(self, *, flat: bool = True) -> dict[str, Any]:
        """The model's and optimizer's state by parameter name. ``flat``: the optimizer's hyperparameters
        keyed by parameter too (``param_groups.<name>.lr``), as saved since checkpoints became resumable
        on the same pipeline split: in the nested form each rank's ``param_groups.0`` (its stage's
        parameter names among them) had one key, written by one rank only."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model_sd, "optim": optim_sd}

    # ------------------------------------------------------------------ save
    def save(self, step: int, extra: dict[str, Any] | None = None) -> Path:
        """Write the checkpoint of ``step`` (a collective: every rank calls it). With ``async_save`` it
        returns once this rank's state is in host memory; the step is complete once written (:meth:`wait`)."""
        extra = {**(extra or {}), "previous": self.previous}  # the checkpoint this one descends from
        self.previous = step
        if self.async_save:
            return self._save_async(step, extra)
        rank, world = rank_world()
        t0 = time.perf_counter()
        final = step_dir(self.root, step)
        tmp = self.root / f".{final.name}.tmp"
        with uninterrupted():  # a second SIGTERM waits until the checkpoint is complete
            try:
                self._save(step, extra, rank, world, final, tmp)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                full = self._no_space(step, e)
                if full is None:
                    raise
                raise full from None
        self.last_save_s = time.perf_counter() - t0
        if self.log is not None:
            self.log.info("checkpoint: step %d saved to %s in %.2fs", step, final, self.last_save_s)
        return final

    def _no_space(self, step: int, e: BaseException) -> RunError | None:
        """The one line for a save that failed on a full disk (None: another failure, raised as it is)."""
        failed_write = isinstance(e, Exception) or type(e).__name__ == "CheckpointException"
        if not (no_space(e) or failed_write and disk_full(self.root)):
            return None
        free = shutil.disk_usage(self.root).free if self.root.exists() else 0
        return RunError(
            f"checkpoint of step {step}: no space left in {str(self.root)!r} ({free / 2**20:.1f} MiB free); "
            "the checkpoints saved before are intact: free space (or keep fewer with keep_last) and "
            "resume from the latest"
        )

    def _prepare(self, tmp: Path) -> None:
        """Rank 0: the step's empty ``.tmp`` folder, after undoing what a crash left."""
        if not self.root.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            keep_from_others(self.root)
        recover(self.root, self.log)
        if tmp.exists():  # left by a delete that failed: out of the way, never in the way
            os.replace(tmp, self.root / f"{tmp.name}.{time.time_ns()}.del")
        tmp.mkdir()
        (tmp / "rng").mkdir()

    @staticmethod
    def _write_rng(tmp: Path, rank: int) -> None:
        with open(tmp / "rng" / f"rank{rank:05d}.pt", "wb") as f:
            torch.save(_rng_state(), f)
            f.flush()
            os.fsync(f.fileno())

    def _save(self, step: int, extra: dict[str, Any] | None, rank: int, world: int, final: Path, tmp: Path) -> None:
        on_rank0(lambda: self._prepare(tmp))
        if self.ds is not None:
            self.ds.save_checkpoint(str(tmp), tag="deepspeed", client_state={"step": step}, save_latest=False)
        else:
            import torch.distributed.checkpoint as dcp

            dcp.save(self._state(), checkpoint_id=str(tmp))  # DCP's file writer fsyncs its files
        crash_point("shards", step)
        error = None
        try:
            if self.ds is not None:  # DeepSpeed does not fsync its files: each rank makes its own durable
                for f in (tmp / "deepspeed").rglob("*"):
                    if f.is_file():
                        fsync_path(f)
            self._write_rng(tmp, rank)
        except OSError as e:  # this rank's own files: every rank learns of it (no one waits at a barrier)
            error = e
        crash_point("rng", step)
        all_ok(error)
        on_rank0(lambda: self._commit(step, extra, world, tmp))

    def _commit(self, step: int, extra: dict[str, Any] | None, world: int, tmp: Path) -> None:
        """Rank 0, once every rank's files are durable: ``mmm.json`` last, then the folder in place and the
        prune (:func:`mmm.parallel.checkpoint_folder.commit`)."""
        commit(self.root, step, tmp, self._meta(step, extra, world), keep_last=self.keep_last, log=self.log)

    def _meta(self, step: int, extra: dict[str, Any] | None, world: int) -> dict[str, Any]:
        return {
            **self.meta,
            **(extra or {}),
            "step": step,
            "world_size": world,
            "format": "deepspeed" if self.ds is not None else "dcp",
        }

    # ------------------------------------------------------------------ asynchronous save
    def _staging(self, state: dict[str, Any]) -> DefaultStager | None:
        """Where this rank's ``state`` is copied for the background write: from an accelerator, host memory
        kept for the next save (pinned where CUDA can pin it: faster copies); on CPU, torch's default (a
        plain copy, freed once written: pinning needs a device)."""
        tensors = (v for v in state["model"].values() if isinstance(v, torch.Tensor))
        device = next(tensors, torch.empty(0)).device
        if device.type == "cpu":
            return None
        if self._stager is None:
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=device.type == "cuda",
                    use_shared_memory=False,
                    use_async_staging=False,  # the copy ends before save() returns: training may then change the state
                    use_non_blocking_copy=True,
                )
            )
        return self._stager

    def _save_async(self, step: int, extra: dict[str, Any] | None) -> Path:
        import torch.distributed.checkpoint as dcp

        self.wait()  # one save in flight at a time: the previous one written and committed first
        rank, world = rank_world()
        t0 = time.perf_counter()
        final = step_dir(self.root, step)
        tmp = self.root / f".{final.name}.tmp"
        meta = self._meta(step, extra, world)
        with uninterrupted():
            try:
                on_rank0(lambda: self._prepare(tmp))
                error = None
                try:
                    self._write_rng(tmp, rank)
                except OSError as e:
                    error = e
                crash_point("rng", step)
                # every rank's RNG file durable before the shards: DCP's own last collective then tells rank 0
                # that everything of this step is written
                all_ok(error)
                dying = faults.save_fault("shards", step, rank=rank)
                state = self._state()
                future = dcp.async_save(
                    state,
                    checkpoint_id=str(tmp),
                    process_group=self._group,
                    async_stager=self._staging(state),
                    planner=_KilledWhileWriting(step) if dying else None,
                )
            except BaseException as e:
                full = self._no_space(step, e)
                if full is None:
                    raise
                raise full from None
        inflight = _InFlight(step, final, future, t0, stall_s=time.perf_counter() - t0)
        future.add_done_callback(lambda _: setattr(inflight, "written_s", time.perf_counter() - t0))
        if rank == 0:  # in the writing thread (or here, if already written): no collective in there
            future.add_done_callback(lambda done: self._commit_written(inflight, done, tmp, meta))
        self._pending = inflight
        self.last_stall_s = inflight.stall_s
        if self.log is not None:
            self.log.debug("checkpoint: step %d copied in %.2fs; writing it in the background", step, inflight.stall_s)
        return final

    def _commit_written(self, inflight: _InFlight, done: Future, tmp: Path, meta: dict[str, Any]) -> None:
        """Rank 0, when its background write ends: a write that ended well on rank 0 ended well on every
        rank (DCP's last collective gathers every rank's result first), so the step is committed now."""
        try:
            if done.exception() is None:
                commit(self.root, inflight.step, tmp, meta, keep_last=self.keep_last, log=self.log)
        except BaseException as e:  # said on every rank by wait()
            inflight.commit_error = e
        finally:
            inflight.written.set()

    def wait(self) -> Path | None:
        """Wait for the save in flight (``async_save``) to be written and committed (a collective: every
        rank calls it). A failure on any rank raises on every rank (a full disk: one line). The step's
        folder, or None when no save was in flight."""
        inflight, self._pending = self._pending, None
        if inflight is None:
            return None
        with uninterrupted():  # a second SIGTERM takes effect once the checkpoint is complete
            error: BaseException | None = None
            try:
                inflight.future.result()
            except (Exception, CheckpointException) as e:
                error = e
            if rank_world()[0] == 0:
                inflight.written.wait()
                error = error or inflight.commit_error
            failures = [f for f in gather_objects(None if error is None else f"{type(error).__name__}: {error}") if f]
            if failures:
                if error is None:
                    error = RankZeroFailed(f"{len(failures)} rank(s) failed, the first: {failures[0]}")
                full = self._no_space(inflight.step, error)
                if full is not None:
                    raise full from None
                raise error
        self.last_save_s = inflight.written_s or time.perf_counter() - inflight.started
        if self.log is not None:
            self.log.info(
                "checkpoint: step %d saved to %s in %.2fs in the background (training held up %.2fs)",
                inflight.step,
                inflight.final,
                self.last_save_s,
                inflight.stall_s,
            )
        return inflight.final

    def close(self) -> None:
        """Wait for a save in flight (:meth:`wait`), then free the staging memory (``async_save``)."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    # ------------------------------------------------------------------ load
    def resolve(self, which: str, *, skip: frozenset[int] = frozenset(), lineage: str | None = None) -> int | None:
        """The step ``which`` names ('latest' or a step number; None: 'latest' and no checkpoint yet).
        Rank 0 alone reads the folder and tells the others (a collective), so every rank loads the
        same step even where a shared file system shows ranks different listings. 'latest' passes over
        a damaged checkpoint (a file missing or empty after a node crash), and the ``skip`` ones, to the
        next most recent, saying so; a damaged step asked for by number is refused naming the damage.
        ``lineage`` (a relaunched job's ``MMM_RUN_STAMP``): the newest sound checkpoint that job saved,
        before falling back to ``which``."""
        found: list[Any] = [None]
        rank, world = rank_world()
        if rank == 0:
            recover(self.root, self.log)
            steps = complete_steps(self.root)
            mine = [s for s in steps_by_recency(self.root) if lineage and meta_of(self.root, s).get("run") == lineage]
            mine = [s for s in mine if s not in skip and self.damage(s) is None]
            if mine:
                found[0] = ("step", mine[-1])
            elif which == "latest":
                found[0] = ("step", None)
                for step in reversed(steps_by_recency(self.root)):
                    damage = "it failed to load" if step in skip else self.damage(step)
                    if damage is None:
                        found[0] = ("step", step)
                        break
                    if self.log is not None:
                        self.log.warning(
                            "checkpoint: step %d in %s is damaged (%s); trying the one saved before it",
                            step,
                            self.root,
                            damage,
                        )
            elif int(which) in steps and self.damage(int(which)) is not None:
                found[0] = (
                    "error",
                    f"checkpoint step {which} in {str(self.root)!r} is damaged: {self.damage(int(which))}",
                )
            elif int(which) in steps:
                found[0] = ("step", int(which))
            else:
                found[0] = ("error", missing_step(self.root, int(which), steps))
        if world > 1:
            dist.broadcast_object_list(found, src=0)
        kind, value = found[0]
        if kind == "error":
            raise UsageError(value)
        return value

    def damage(self, step: int) -> str | None:
        """What is missing from a checkpoint marked complete, or None (a cheap look: files present and
        not empty; DCP itself checks the shards' contents when it loads them)."""
        path = step_dir(self.root, step)
        try:
            saved = json.loads((path / META).read_text())
        except (OSError, ValueError) as e:
            return f"{META} cannot be read ({e})"
        needed = {"dcp": [".metadata"], "deepspeed": ["deepspeed"]}.get(saved.get("format"), [])
        needed += [f"rng/rank{r:05d}.pt" for r in range(int(saved.get("world_size", 0)))]
        for name in needed:
            f = path / name
            if not f.exists() or f.is_file() and f.stat().st_size == 0:
                return f"{name} is {'empty' if f.exists() else 'missing'}"
        if saved.get("format") == "dcp" and (damage := dcp_damage(path)):  # each shard as long as the metadata says
            return damage
        return torch_file_damage(path)  # DeepSpeed's files and the RNG states: each a whole torch.save archive

    def check_compatible(self, saved: dict[str, Any], path: Path) -> None:
        problems = []
        for key in self.compat_keys:
            if key not in self.meta or key not in saved:
                continue  # not recorded by this trainer (or by an older checkpoint)
            mine, theirs = self.meta.get(key), saved.get(key)
            if isinstance(mine, dict) and isinstance(theirs, dict):
                diff = [
                    f"{k}={theirs.get(k)!r} (now {mine.get(k)!r})"
                    for k in sorted(set(mine) | set(theirs))
                    if mine.get(k) != theirs.get(k)
                ]
                if diff:
                    problems.append(f"{key}: {', '.join(diff)}")
            elif mine != theirs:
                problems.append(f"{key}={theirs!r} (now {mine!r})")
        fmt = saved.get("format")
        if fmt == "deepspeed" and self.ds is None or fmt == "dcp" and self.ds is not None:
            problems.append(
                f"it was saved by {'a DeepSpeed strategy' if fmt == 'deepspeed' else 'a torch strategy'}"
                f" ({saved.get('strategy')}); resume with a strategy of the same kind"
            )
        if fmt == "deepspeed" and saved.get("mesh", {}) != self.meta.get("mesh", {}):
            problems.append(
                f"DeepSpeed checkpoints resume on the same mesh (saved {saved.get('mesh')}, "
                f"now {self.meta.get('mesh')})"
            )
        if problems:
            raise UsageError(
                f"checkpoint {str(path)!r} does not fit this run: {'; '.join(problems)}; use the "
                "settings it was saved with, or another checkpoint folder"
            )

    def load(
        self, which: str, *, lineage: str | None = None, check: Callable[[dict[str, Any]], None] | None = None
    ) -> dict[str, Any] | None:
        """Restore the checkpoint ``which`` names (a collective); its metadata, or None when
        'latest' finds nothing to resume. ``check(metadata)`` runs on every rank before anything is read
        (it raises to refuse the checkpoint: a refusal that costs no load of a large model)."""
        self.wait()  # a save in flight is written and committed first
        failed: set[int] = set()
        while True:
            step = self.resolve(which, skip=frozenset(failed), lineage=lineage)
            if step is None and complete_steps(self.root):  # never a fresh start over checkpoints that exist
                steps = ", ".join(map(str, complete_steps(self.root)))
                raise UsageError(
                    f"no checkpoint in {str(self.root)!r} can be loaded (steps {steps}: damaged or unreadable, see "
                    "the warnings above); resume a step by number, or move the folder away to start afresh"
                )
            if step is None:
                if self.log is not None:
                    self.log.info("checkpoint: none in %s yet; starting from step 1", self.root)
                return None
            t0 = time.perf_counter()
            path = step_dir(self.root, step)
            saved = json.loads((path / META).read_text())
            self.check_compatible(saved, path)
            if check is not None:
                check(saved)
            if (loose := writable_by_others(path)) is not None:
                raise UsageError(
                    f"checkpoint {str(path)!r}: {loose!r} can be written by any user (mode o+w), so what is loaded "
                    f"from it could be anyone's; remove that permission (chmod -R o-w {str(self.root)!r})"
                )
            rank, world = rank_world()
            if self.ds is not None:
                self.ds.load_checkpoint(str(path), tag="deepspeed", load_module_strict=True)
                break
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            reader = SafeReader(path)
            # checkpoints saved before the optimizer's state was flat: their nested form, as saved
            flat = "optim.param_groups.0.params" not in reader.read_metadata().state_dict_metadata
            state = self._state(flat=flat)
            try:  # a read error on any rank raises on every rank
                dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
            except CheckpointException as e:
                if which != "latest" or not _damaged_files(e):
                    raise  # not damage (a changed model, out of memory...): keep the traceback
                failed.add(step)  # damaged in a way the cheap look missed: the one saved before it
                continue
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=StateDictOptions(flatten_optimizer_state_dict=flat),
            )
            keep_implementation(self.optimizer)
            break
        rng = path / "rng" / f"rank{rank:05d}.pt"
        if saved.get("world_size") == world and rng.is_file():
            try:
                state = torch.load(rng, weights_only=True)  # tensors only: nothing in the folder runs
            except Exception as e:
                raise UsageError(
                    f"{rng} is not an RNG state as mmm writes it (tensors only; loading it as a pickle would "
                    f"run code from the checkpoint folder): {type(e).__name__}; delete that checkpoint or "
                    "resume from another"
                ) from None
            _set_rng_state(state)
        _barrier()
        self.previous = step
        self.last_load_s = time.perf_counter() - t0
        if self.log is not None:
            self.log.info(
                "checkpoint: resumed from %s (step %d, saved on %d ranks, mesh %s) in %.2fs",
                path,
                step,
                saved.get("world_size"),
                saved.get("mesh"),
                self.last_load_s,
            )
        return saved
