"""Checkpoint and resume with torch Distributed Checkpoint (DCP), atomically, across meshes.

Layout of a checkpoint folder (``Checkpointer(root)``)::

    step-00000040/        one complete checkpoint (DCP shards + .metadata, mmm.json, rng/)
    step-00000050/
    .step-00000060.tmp/   a save in progress (or one a crash interrupted): never read

A save writes everything into the ``.tmp`` folder, then rank 0 renames it once every rank has
finished, so a checkpoint is visible only when complete and a crash during a save leaves the
previous one usable (a re-save of a step sets the old folder aside until the new one is in place).
Resuming from 'latest' takes the most recently SAVED checkpoint, not the highest step: a run resumed
from an earlier step, then requeued, continues itself, not the run it abandoned. ``keep_last``
prunes the least recently saved ones (each renamed away before it is deleted). Rank 0 alone reads
the folder and broadcasts the step to load. A second SIGTERM during a save takes effect after it.

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict`` (fully
qualified names of the plain model, DTensor shards of TP/FSDP), so a checkpoint saved on one
mesh loads on another: dp=4 -> dp=2 x tp=2, tp=2 -> one process, pp=2 -> pp=1. ``mmm.json`` holds
the step, the data position, the mesh, the strategy and the model config (a checkpoint of a
different model is refused with the fields that differ). Each rank's RNG state is restored when
the world size matches (data and weights here depend only on the seed and step, so RNG state only
matters for dropout). DeepSpeed strategies use DeepSpeed's own ``save_checkpoint`` /
``load_checkpoint`` inside the same atomic folder scheme; they resume on the same data-parallel size.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import pickle
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mmm.dist.exits import all_ok, on_rank0, uninterrupted
from mmm.errors import API, RunError, Spelling, UsageError

STEP_DIR = re.compile(r"^step-(\d{8})$")
META = "mmm.json"
# what must match to resume: the model, what defines the data of each step (a run resumed with another
# seed, global batch, dataset or epoch length would silently train on other data) and the lr schedule
COMPAT_KEYS = ("model", "seed", "global_batch", "dataset", "steps_per_epoch", "lr_schedule")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, in step order."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / META).is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def _saved_at(root: Path, step: int) -> tuple[int, float]:
    """When a checkpoint was saved: its place in the sequence of saves (``save_seq``), then its time."""
    path = step_dir(root, step) / META
    try:
        meta = json.loads(path.read_text())
        return int(meta.get("save_seq", 0)), float(meta.get("saved_at"))
    except (OSError, ValueError, TypeError):
        return 0, path.stat().st_mtime if path.exists() else 0.0


def _meta_of(root: Path, step: int) -> dict[str, Any]:
    try:
        return json.loads((step_dir(root, step) / META).read_text())
    except (OSError, ValueError):
        return {}


def steps_by_recency(root: Path) -> list[int]:
    """Complete checkpoints, the most recently saved last. Not the same as step order: after
    resuming from 4000 with 5000 and 6000 on disk from an abandoned run, the new run's 4100 is newer."""
    return sorted(complete_steps(root), key=lambda step: (_saved_at(root, step), step))


def latest_step(root: Path) -> int | None:
    """The most recently saved complete checkpoint (what 'latest' takes), or None."""
    steps = steps_by_recency(root)
    return steps[-1] if steps else None


def recover(root: Path, log=None) -> None:
    """Undo what a crash in the middle of a re-save or a prune leaves (rank 0 only): a step set aside
    as ``.step-N.old`` while its replacement was renamed in goes back; ``.del`` and ``.tmp`` folders
    (never read) are removed."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.name.startswith(".step-") and p.name.endswith(".old"):
            final = root / p.name[1 : -len(".old")]
            if final.exists():
                doomed = root / f"{p.name[: -len('.old')]}.{time.time_ns()}.del"
                os.replace(p, doomed)
                _delete_in_background(doomed, log)
            else:
                os.replace(p, final)
        elif p.name.startswith(".step-") and p.name.endswith((".del", ".tmp")) and str(p) not in _being_deleted:
            if p.name.endswith(".tmp"):  # a unique name first: a new save may make a folder of this name
                doomed = root / f"{p.name}.{time.time_ns()}.del"
                os.replace(p, doomed)
                p = doomed
            _delete_in_background(p, log)  # never read; slow on a big checkpoint, so not in the ranks' way


def missing_step(root: Path, step: int, steps: list[int]) -> str:
    """The message for a step to resume from that has no complete checkpoint."""
    return (
        f"no complete checkpoint of step {step} in {str(root)!r} "
        f"(steps there: {', '.join(map(str, steps)) or 'none'}); use one of those or 'latest'"
    )


def checkpoint_problems(
    checkpoint_dir: str | None, resume: str | None, checkpoint_every: int, keep_last: int, *, spell: Spelling = API
) -> list[str]:
    """Problems with a run's checkpoint settings, each naming the value and a fix (nothing is created
    here): the folder, the step to resume from ('latest' or a step number), how often to save and
    how many to keep."""
    out = []
    if resume is not None and checkpoint_dir is None:
        out.append(
            f"{spell('resume', resume)} needs {spell.name('checkpoint_dir')} (the folder holding "
            "step-NNNNNNNN checkpoints)"
        )
    if resume is not None and resume != "latest" and not (resume.isdigit() and int(resume) > 0):
        out.append(f"{spell('resume', resume)}: use 'latest' or a step number (e.g. {spell('resume', '40')})")
    if checkpoint_every < 0:
        out.append(f"{spell('checkpoint_every', checkpoint_every)} must be >= 0 (0: only at the end and on SIGTERM)")
    if keep_last < 0:
        out.append(f"{spell('keep_last', keep_last)} must be >= 0 (0 keeps every checkpoint)")
    if checkpoint_dir is not None:
        path = Path(checkpoint_dir)
        where = spell("checkpoint_dir", checkpoint_dir)
        if path.exists() and not path.is_dir():
            out.append(f"{where} is a file; pass a directory")
        else:
            parent = next((p for p in [path, *path.parents] if p.exists()), None)
            if parent is not None and not parent.is_dir():
                out.append(f"{where}: {str(parent)!r} is a file, not a directory")
            elif parent is not None and not os.access(parent, os.W_OK):
                out.append(f"{where}: cannot write in {str(parent)!r}")
        if resume is not None and resume != "latest" and resume.isdigit() and path.is_dir():
            steps = complete_steps(path)
            if int(resume) not in steps:
                out.append(f"{spell('resume', resume)}: {missing_step(path, int(resume), steps)}")
    return out


# ---------------------------------------------------------------------- crash points (tests)
# MMM_SAVE_FAULT=STAGE[@STEP][:RANK|:all] SIGKILLs a rank at that point of a checkpoint save (or an
# export): shards (its DCP files written), rng (its RNG file written), meta (rank 0: mmm.json written,
# not yet renamed), rename (rank 0: between the two renames of a re-save), prune (rank 0: half-way
# through deleting a pruned folder), export (rank 0: the export written beside DIR, not yet in place).
# First attempt only (not after a relaunch by launch --retries), like MMM_FAULT. Unset: one dict lookup.
CRASH_STAGES = ("shards", "rng", "meta", "rename", "prune", "export", "history")


def crash_armed(stage: str, step: int | None = None) -> bool:
    spec = os.environ.get("MMM_SAVE_FAULT")
    if not spec or os.environ.get("MMM_RESTART", "0") not in ("", "0"):
        return False
    m = re.fullmatch(r"(?P<stage>[a-z]+)(?:@(?P<step>\d+))?(?::(?P<rank>\d+|all))?", spec)
    if m is None or m["stage"] not in CRASH_STAGES:
        raise UsageError(
            f"MMM_SAVE_FAULT={spec!r} is not STAGE[@STEP][:RANK|:all] with STAGE one of {', '.join(CRASH_STAGES)} "
            "(e.g. rng@4:1)"
        )
    rank, _ = _rank_world()
    who = m["rank"] or "0"
    return (
        m["stage"] == stage
        and (m["step"] is None or step is None or int(m["step"]) == step)
        and (who == "all" or int(who) == rank)
    )


def crash_point(stage: str, step: int | None = None) -> None:
    if crash_armed(stage, step):
        os.kill(os.getpid(), signal.SIGKILL)


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


def _full(root: Path) -> bool:
    """The checkpoint folder's filesystem has (almost) no room left: torch.save's zip writer reports a
    full disk as 'unexpected pos', not as ENOSPC."""
    try:
        return shutil.disk_usage(root).free < 1 << 20
    except OSError:
        return False


def _no_space(e: BaseException) -> bool:
    """A full disk or quota, however DCP or rank 0's broadcast wrapped it."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return "No space left on device" in text or "Disk quota exceeded" in text


def _fsync_path(path: Path) -> None:
    """Make a file's data, or a folder's entries (renames, new files), durable (a node crash after a
    checkpoint is marked complete must not lose any of it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_deleting: list[Any] = []  # threads removing pruned checkpoints (rank 0)
EXIT_WAIT_S = 300.0  # how long a finished process waits for them (after teardown: no rank waits on it)
_being_deleted: set[str] = set()


def _delete_in_background(folder: Path, log=None) -> None:
    """Remove a folder already renamed out of sight (``.step-N.del``) without holding up the ranks: a
    multi-TB checkpoint on a parallel file system takes minutes. A delete that fails is said, not hidden
    (the folder stays, is never read, and the next start tries again)."""

    def remove() -> None:
        failed: list[str] = []
        shutil.rmtree(folder, onerror=lambda fn, path, exc: failed.append(f"{path}: {exc[1]}"))
        _being_deleted.discard(str(folder))
        if failed and log is not None:
            log.warning(
                "checkpoint: could not delete %s (%s%s); it is never read, remove it by hand",
                folder,
                failed[0],
                f" and {len(failed) - 1} more" if len(failed) > 1 else "",
            )

    if not _deleting and not _being_deleted:  # once: a run that ends lets its deletes finish (bounded)
        atexit.register(wait_for_deletes, EXIT_WAIT_S)
    _being_deleted.add(str(folder))
    t = threading.Thread(target=remove, name="mmm-prune", daemon=True)
    t.start()
    _deleting.append(t)


def wait_for_deletes(timeout_s: float | None = None) -> None:
    """Wait for background deletes of pruned checkpoints (tests, and a clean exit); what is left after
    ``timeout_s`` stays as a ``.del`` folder, removed by the next run's first save or resume."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for t in list(_deleting):
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not t.is_alive():
            _deleting.remove(t)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Save and load a training state (``model``/``optimizer`` or a DeepSpeed ``engine``).

    ``meta`` (model config, mesh, strategy...) is stored with every checkpoint; on load the
    ``compat_keys`` of it must match, or the load is refused naming the differences.
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
    ) -> None:
        self.root = Path(root)
        self.model, self.optimizer, self.ds = model, optimizer, deepspeed_engine
        self.meta = meta or {}
        self.compat_keys = compat_keys
        self.keep_last = keep_last
        self.log = log
        self.last_save_s: float | None = None
        self.last_load_s: float | None = None

    # ------------------------------------------------------------------ state
    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    # ------------------------------------------------------------------ save
    def save(self, step: int, extra: dict[str, Any] | None = None) -> Path:
        """Write the checkpoint of ``step`` (a collective: every rank calls it)."""
        rank, world = _rank_world()
        t0 = time.perf_counter()
        final = step_dir(self.root, step)
        tmp = self.root / f".{final.name}.tmp"
        with uninterrupted():  # a second SIGTERM waits until the checkpoint is complete
            try:
                self._save(step, extra, rank, world, final, tmp)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                failed_write = isinstance(e, Exception) or type(e).__name__ == "CheckpointException"
                if not (_no_space(e) or failed_write and _full(self.root)):
                    raise
                free = shutil.disk_usage(self.root).free if self.root.exists() else 0
                raise RunError(
                    f"checkpoint of step {step}: no space left in {str(self.root)!r} ({free / 2**20:.1f} MiB free); "
                    "the checkpoints saved before are intact: free space (or keep fewer with keep_last) and "
                    "resume from the latest"
                ) from None
        self.last_save_s = time.perf_counter() - t0
        if self.log is not None:
            self.log.info("checkpoint: step %d saved to %s in %.2fs", step, final, self.last_save_s)
        return final

    def _save(self, step: int, extra: dict[str, Any] | None, rank: int, world: int, final: Path, tmp: Path) -> None:
        def prepare() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            recover(self.root, self.log)
            if tmp.exists():  # left by a delete that failed: out of the way, never in the way
                os.replace(tmp, self.root / f"{tmp.name}.{time.time_ns()}.del")
            tmp.mkdir()
            (tmp / "rng").mkdir()

        on_rank0(prepare)
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
                        _fsync_path(f)
            with open(tmp / "rng" / f"rank{rank:05d}.pt", "wb") as f:
                torch.save(_rng_state(), f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # this rank's own files: every rank learns of it (no one waits at a barrier)
            error = e
        crash_point("rng", step)
        all_ok(error)
        on_rank0(lambda: self._commit(step, extra, world, final, tmp))

    def _commit(self, step: int, extra: dict[str, Any] | None, world: int, final: Path, tmp: Path) -> None:
        """Rank 0, once every rank's files are durable: the metadata last, then the renames, each made
        durable before the next; then the prune (renames only; the deletes go on in the background)."""
        for folder in (p for p in tmp.rglob("*") if p.is_dir()):
            _fsync_path(folder)
        meta = {
            **self.meta,
            **(extra or {}),
            "step": step,
            "world_size": world,
            "format": "deepspeed" if self.ds is not None else "dcp",
            "saved_at": time.time(),
            # the order of saves, whatever the clocks of the hosts rank 0 ran on say
            "save_seq": 1
            + max((_meta_of(self.root, s).get("save_seq", 0) for s in complete_steps(self.root)), default=0),
            "run": os.environ.get("MMM_RUN_STAMP"),  # the job (all its relaunches) that saved it
        }
        with open(tmp / META, "w") as f:
            json.dump(meta, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        crash_point("meta", step)
        if final.exists():  # a re-save of the same step (after a resume): set the old one aside first,
            aside = self.root / f".{final.name}.old"  # so a crash between the renames loses nothing
            os.replace(final, aside)
            _fsync_path(self.root)
            crash_point("rename", step)
            os.replace(tmp, final)
            _fsync_path(self.root)
            doomed = self.root / f".{final.name}.{time.time_ns()}.del"
            os.replace(aside, doomed)
            _delete_in_background(doomed, self.log)
        else:
            os.replace(tmp, final)
        _fsync_path(self.root)
        self._prune(keep=step)

    def _prune(self, *, keep: int) -> None:
        """Remove all but the ``keep_last`` most recently saved checkpoints (never ``keep``, the one
        just written). Each goes by a rename first: a half-deleted folder never looks complete."""
        if self.keep_last <= 0:
            return
        for old in steps_by_recency(self.root)[: -self.keep_last]:
            if old == keep:
                continue
            doomed = self.root / f".{step_dir(self.root, old).name}.{time.time_ns()}.del"
            try:
                os.replace(step_dir(self.root, old), doomed)
            except OSError as e:  # the new checkpoint is committed: keep training, keep this one, say so
                if self.log is not None:
                    self.log.warning("checkpoint: could not prune %s (%s); it stays", step_dir(self.root, old), e)
                continue
            _fsync_path(self.root)
            if crash_armed("prune", keep):  # die half-way through deleting it
                next(p for p in doomed.rglob("*") if p.is_file()).unlink()
                crash_point("prune", keep)
            _delete_in_background(doomed, self.log)

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
        rank, world = _rank_world()
        if rank == 0:
            recover(self.root, self.log)
            steps = complete_steps(self.root)
            mine = [s for s in steps_by_recency(self.root) if lineage and _meta_of(self.root, s).get("run") == lineage]
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
        return None

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

    def load(self, which: str, *, lineage: str | None = None) -> dict[str, Any] | None:
        """Restore the checkpoint ``which`` names (a collective); its metadata, or None when
        'latest' finds nothing to resume."""
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
            rank, world = _rank_world()
            if self.ds is not None:
                self.ds.load_checkpoint(str(path), tag="deepspeed", load_module_strict=True)
                break
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.api import CheckpointException
            from torch.distributed.checkpoint.state_dict import set_state_dict

            state = self._state()
            try:
                dcp.load(state, checkpoint_id=str(path))  # a read error on any rank raises on every rank
            except CheckpointException as e:
                if which != "latest" or not _damaged_files(e):
                    raise  # not damage (a changed model, out of memory...): keep the traceback
                failed.add(step)  # damaged in a way the cheap look missed: the one saved before it
                continue
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
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
