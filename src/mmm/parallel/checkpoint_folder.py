"""A checkpoint folder: complete steps only, an atomic commit, pruning, recovery after a crash.

Layout of a checkpoint folder::

    step-00000040/        one complete checkpoint (DCP shards + .metadata, mmm.json, rng/)
    step-00000050/
    .step-00000060.tmp/   a save in progress (or one a crash interrupted): never read

What is written into a step's ``.tmp`` folder (DCP or DeepSpeed files, RNG states) is
:mod:`mmm.parallel.checkpoint`'s; this module makes the folder complete at once or not at all
(:func:`commit`: ``mmm.json`` last, each rename made durable before the next, a re-save setting the
old folder aside until the new one is in place), prunes the least recently saved (each renamed
away before it is deleted, in the background), and undoes what a crash in between leaves
(:func:`recover`). A step is complete when its folder has ``mmm.json``.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import re
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mmm import env, faults
from mmm.errors import API, Spelling, folder_problem, only_with
from mmm.files import fsync_path

STEP_DIR = re.compile(r"^step-(\d{8})$")
META = "mmm.json"


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


def meta_of(root: Path, step: int) -> dict[str, Any]:
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
                delete_in_background(doomed, log)
            else:
                os.replace(p, final)
        elif p.name.startswith(".step-") and p.name.endswith((".del", ".tmp")) and str(p) not in being_deleted:
            if p.name.endswith(".tmp"):  # a unique name first: a new save may make a folder of this name
                doomed = root / f"{p.name}.{time.time_ns()}.del"
                os.replace(p, doomed)
                p = doomed
            delete_in_background(p, log)  # never read; slow on a big checkpoint, so not in the ranks' way


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
    given = [spell(k, v) for k, v in (("checkpoint_every", checkpoint_every), ("keep_last", keep_last)) if v > 0]
    if given and checkpoint_dir is None:
        out.append(only_with(given, f"with {spell.name('checkpoint_dir')} (the folder to save in)", "add one"))
    if checkpoint_dir is not None:
        path = Path(checkpoint_dir)
        problem = folder_problem(spell("checkpoint_dir", checkpoint_dir), path)
        if problem:
            out.append(problem)
        if resume is not None and resume != "latest" and resume.isdigit() and int(resume) > 0 and path.is_dir():
            steps = complete_steps(path)
            if int(resume) not in steps:
                out.append(f"{spell('resume', resume)}: {missing_step(path, int(resume), steps)}")
    return out


def disk_full(root: Path) -> bool:
    """The checkpoint folder's filesystem has (almost) no room left: torch.save's zip writer reports a
    full disk as 'unexpected pos', not as ENOSPC."""
    try:
        return shutil.disk_usage(root).free < 1 << 20
    except OSError:
        return False


def no_space(e: BaseException) -> bool:
    """A full disk or quota, however DCP or rank 0's broadcast wrapped it."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return "No space left on device" in text or "Disk quota exceeded" in text


def writable_by_others(folder: Path) -> str | None:
    """The first of a checkpoint folder, its parent (the checkpoint root) and the files and folders in it
    that any user may write to (mode o+w): anyone could then put their own ``.metadata`` or shards there.
    A group-writable folder (a project's shared space) is the group's: allowed."""
    folder = Path(folder)
    for path in [folder.parent, folder, *folder.rglob("*")]:
        try:
            mode = path.lstat().st_mode
        except OSError:
            continue
        if mode & stat.S_IWOTH and not stat.S_ISLNK(mode):
            return str(path)
    return None


def keep_from_others(path: Path) -> None:
    """Take away any user's write permission (o+w) from a file or folder mmm wrote into a checkpoint (a
    umask of 0 gives it), since :func:`writable_by_others` refuses to load from such a checkpoint."""
    try:
        mode = path.lstat().st_mode
        if mode & stat.S_IWOTH and not stat.S_ISLNK(mode):
            os.chmod(path, stat.S_IMODE(mode) & ~stat.S_IWOTH)
    except OSError:  # not ours to change: the load names it, with the chmod
        pass


_deleting: list[Any] = []  # threads removing pruned checkpoints (rank 0)
EXIT_WAIT_S = 300.0  # how long a finished process waits for them (after teardown: no rank waits on it)
being_deleted: set[str] = set()


def delete_in_background(folder: Path, log=None) -> None:
    """Remove a folder already renamed out of sight (``.step-N.del``) without holding up the ranks: a
    multi-TB checkpoint on a parallel file system takes minutes. A delete that fails is said, not hidden
    (the folder stays, is never read, and the next start tries again)."""

    def remove() -> None:
        failed: list[str] = []
        shutil.rmtree(folder, onerror=lambda fn, path, exc: failed.append(f"{path}: {exc[1]}"))
        being_deleted.discard(str(folder))
        if failed and log is not None:
            log.warning(
                "checkpoint: could not delete %s (%s%s); it is never read, remove it by hand",
                folder,
                failed[0],
                f" and {len(failed) - 1} more" if len(failed) > 1 else "",
            )

    if not _deleting and not being_deleted:  # once: a run that ends lets its deletes finish (bounded)
        atexit.register(wait_for_deletes, EXIT_WAIT_S)
    being_deleted.add(str(folder))
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


def rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def crash_point(stage: str, step: int | None = None) -> None:
    """``MMM_SAVE_FAULT`` (:mod:`mmm.faults`): SIGKILL this rank at ``stage`` of a save, when asked."""
    faults.crash_point(stage, step, rank=rank_world()[0])


def commit(root: Path, step: int, tmp: Path, meta: dict[str, Any], *, keep_last: int = 0, log=None) -> Path:
    """Rank 0, once every rank's files in ``tmp`` are durable: ``meta`` (with the time and order of the
    save and the job that made it) written as ``mmm.json``, then ``tmp`` renamed to the step's folder,
    each made durable before the next; then the prune (renames only; the deletes go on in the
    background). Returns the step's folder."""
    final = step_dir(root, step)
    for path in [tmp, *tmp.rglob("*")]:
        keep_from_others(path)  # under a umask of 0 the files came out world-writable: a resume refuses those
        if path.is_dir():
            fsync_path(path)
    meta = {
        **meta,
        "saved_at": time.time(),
        # the order of saves, whatever the clocks of the hosts rank 0 ran on say
        "save_seq": 1 + max((meta_of(root, s).get("save_seq", 0) for s in complete_steps(root)), default=0),
        "run": env.get("MMM_RUN_ID") or env.get("MMM_RUN_STAMP"),  # the job (all its relaunches) that saved it
    }
    with open(tmp / META, "w") as f:
        json.dump(meta, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    keep_from_others(tmp / META)
    fsync_path(tmp)
    crash_point("meta", step)
    if final.exists():  # a re-save of the same step (after a resume): set the old one aside first,
        aside = root / f".{final.name}.old"  # so a crash between the renames loses nothing
        os.replace(final, aside)
        fsync_path(root)
        crash_point("rename", step)
        os.replace(tmp, final)
        fsync_path(root)
        doomed = root / f".{final.name}.{time.time_ns()}.del"
        os.replace(aside, doomed)
        delete_in_background(doomed, log)
    else:
        os.replace(tmp, final)
    fsync_path(root)
    prune(root, keep_last=keep_last, keep=step, log=log)
    return final


def prune_order(root: Path) -> list[int]:
    """The complete checkpoints in the order pruning removes them: first those of an abandoned branch (after
    ``--resume 4`` with 8 and 12 on disk and 6 saved since: 8 and 12), oldest saved first; then the line the
    newest save descends from, oldest first (4, then 6). Each checkpoint names its parent (``previous``: the
    step its run saved or resumed from before it); for checkpoints without one, the line is guessed from the
    order of saving: going back from the newest, each step below the last."""
    by_recency = steps_by_recency(root)
    line: set[int] = set()
    step: int | None = by_recency[-1] if by_recency else None
    while step is not None and step in by_recency and step not in line:
        line.add(step)
        parent = meta_of(root, step).get("previous", ...)
        if parent is ...:  # saved before checkpoints named their parent: the guess, from here back
            below = step
            for older in reversed(by_recency[: by_recency.index(step)]):
                if older < below:
                    line.add(older)
                    below = older
            break
        step = parent
    return [s for s in by_recency if s not in line] + [s for s in by_recency if s in line]


def prune(root: Path, *, keep_last: int, keep: int, log=None) -> None:
    """Remove all but ``keep_last`` checkpoints (never ``keep``, the one just written; 0 keeps all), an
    abandoned branch's first (:func:`prune_order`). Each goes by a rename first: a half-deleted folder
    never looks complete."""
    if keep_last <= 0:
        return
    order = prune_order(root)
    doomed_steps = [s for s in order[: max(len(order) - keep_last, 0)] if s != keep]
    if doomed_steps and log is not None:
        log.info("checkpoint: pruning step(s) %s (keep_last=%d)", ", ".join(map(str, doomed_steps)), keep_last)
    for old in doomed_steps:
        doomed = root / f".{step_dir(root, old).name}.{time.time_ns()}.del"
        try:
            os.replace(step_dir(root, old), doomed)
        except OSError as e:  # the new checkpoint is committed: keep training, keep this one, say so
            if log is not None:
                log.warning("checkpoint: could not prune %s (%s); it stays", step_dir(root, old), e)
            continue
        fsync_path(root)
        if faults.save_fault("prune", keep, rank=rank_world()[0]):  # die half-way through deleting it
            next(p for p in doomed.rglob("*") if p.is_file()).unlink()
            crash_point("prune", keep)
        delete_in_background(doomed, log)
