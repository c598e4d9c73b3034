"""Fault injection for testing a job's resilience: ``MMM_FAULT`` makes a rank fail at a step.

    MMM_FAULT=kill@5:1      rank 1 sends itself SIGKILL when step 5 starts
    MMM_FAULT=stop@5:1      rank 1 stops itself (SIGSTOP): a stalled rank; the others time out
    MMM_FAULT=term@5        every rank gets SIGTERM at step 5 (a preemption): finish, save, exit 0
    MMM_FAULT=term2@5       two SIGTERMs a few milliseconds apart (srun and the scheduler both signal)
    MMM_FAULT=nan@5         step 5's loss is NaN on every rank (``:R`` for one rank)
    MMM_FAULT=nangrad@5:1   step 5's loss is finite, but a gradient of rank 1 is NaN (no ``:R``: every rank's)
    MMM_FAULT=exit@5:2      rank 2 exits with code 3 at once, skipping teardown

``MMM_SAVE_FAULT`` kills a rank (SIGKILL) at a point of writing what a run keeps, to prove nothing
complete is lost (tests/test_faults.py):

    MMM_SAVE_FAULT=rng@4:1      rank 1 once its RNG file of step 4's checkpoint is written
    MMM_SAVE_FAULT=prune:all    every rank half-way through deleting a pruned checkpoint

``STAGE[@STEP][:RANK|:all]`` (rank 0 by default), STAGE one of :data:`SAVE_STAGES`: shards (a rank's
DCP files written; with an asynchronous save, half-way through writing them in the background), rng (its
RNG file written; an asynchronous save writes it first), meta (rank 0: mmm.json written, not yet renamed;
with an asynchronous save, in its background commit), rename (rank 0: between the two renames of a
re-save), prune (rank 0: half-way through deleting a pruned folder), export (rank 0: the export written
beside DIR, not yet in place), history (rank 0: half-way through writing step STEP's line of
history.jsonl), prepare (``python -m mmm.data prepare``: its token files renamed into place, its
meta.json not yet).

Several faults of MMM_FAULT are separated by commas. Faults fire in a job's first attempt only (not after a
relaunch by ``launch --retries``, ``MMM_RESTART`` >= 1), so a recovered job can finish. The trainers
call :func:`inject` at the start of every step, and the writers :func:`crash_point`; a real signal is
sent, so launchers and the other ranks see exactly what a real failure looks like. Unset (the
default), each costs one dict lookup.
"""

from __future__ import annotations

import os
import re
import signal
import time

from mmm import env
from mmm.errors import UsageError

KINDS = ("kill", "stop", "term", "term2", "nan", "nangrad", "exit")
SAVE_STAGES = ("shards", "rng", "meta", "rename", "prune", "export", "history", "prepare")
_SAVE_SPEC = re.compile(r"(?P<stage>[a-z]+)(?:@(?P<step>\d+))?(?::(?P<rank>\d+|all))?")
_SPEC = re.compile(r"^(?P<kind>[a-z0-9]+)@(?P<step>\d+)(?::(?P<rank>\d+))?$")
_PARSED: dict[int, list[tuple[str, int | None]]] | None = None


def parse(text: str) -> dict[int, list[tuple[str, int | None]]]:
    out: dict[int, list[tuple[str, int | None]]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _SPEC.match(part)
        if not m or m["kind"] not in KINDS:
            raise UsageError(
                f"MMM_FAULT={text!r}: {part!r} is not KIND@STEP[:RANK] with KIND one of "
                f"{', '.join(KINDS)} (e.g. kill@5:1)"
            )
        if int(m["step"]) < 1:
            raise UsageError(f"MMM_FAULT={text!r}: {part!r} names step 0; the steps start at 1 (e.g. kill@5:1)")
        out.setdefault(int(m["step"]), []).append((m["kind"], int(m["rank"]) if m["rank"] else None))
    return out


def unreachable(world_size: int) -> list[str]:
    """The problem with ``MMM_FAULT`` faults that name a rank this job does not have (they would never fire).
    None after a relaunch (faults do not fire then; a relaunch on fewer hosts has fewer ranks)."""
    if not _first_attempt():
        return []
    text = env.get("MMM_FAULT", "")
    far = [f"{k}@{step}:{rank}" for step, fs in parse(text).items() for k, rank in fs if (rank or 0) >= world_size]
    if not far:
        return []
    return [f"MMM_FAULT={text!r}: {', '.join(far)} names a rank this job of {world_size} does not have"]


def _save_spec(text: str) -> str:
    m = _SAVE_SPEC.fullmatch(text.strip())
    if m is None or m["stage"] not in SAVE_STAGES or m["stage"] == "history" and (m["rank"] or "0") != "0":
        raise ValueError(text)
    return text.strip()


def _fault_spec(text: str) -> str:
    try:
        parse(text)
    except UsageError:
        raise ValueError(text) from None
    return text


env.declare("MMM_FAULT", env.Kind(f"KIND@STEP[:RANK], comma-separated, STEP from 1, KIND one of {', '.join(KINDS)}",
                                  _fault_spec, ("boom@3", "kill@x", "kill", "nan@0")))  # fmt: skip
env.declare("MMM_SAVE_FAULT", env.Kind(f"STAGE[@STEP][:RANK|:all], STAGE one of {', '.join(SAVE_STAGES)}",
                                       _save_spec, ("boom", "rng@x", "history@2:1")))  # fmt: skip


def inject(step: int, rank: int) -> str | None:
    """Carry out the faults set for ``step`` on ``rank``; ``"nan"`` when this step's loss must be NaN,
    ``"nangrad"`` when a gradient must be (after backward), else None."""
    global _PARSED
    if _PARSED is None:  # a job relaunched by `launch --retries` runs without faults: it can finish
        _PARSED = {} if not _first_attempt() else parse(env.get("MMM_FAULT", ""))
    poison = None
    for kind, who in _PARSED.get(step, ()):
        if who is not None and who != rank:
            continue
        if kind in ("nan", "nangrad"):
            poison = kind
        elif kind == "exit":
            os._exit(3)
        elif kind == "term2":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.005)  # the handler runs in between: two deliveries, not one coalesced
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[kind]
            os.kill(os.getpid(), sig)
    return poison


def _first_attempt() -> bool:
    return env.get("MMM_RESTART", 0) == 0


def save_fault(stage: str, step: int | None = None, *, rank: int = 0) -> bool:
    """Whether ``MMM_SAVE_FAULT`` kills ``rank`` at ``stage`` of saving ``step`` (first attempt only).
    Unset: one dict lookup."""
    spec = env.get("MMM_SAVE_FAULT")
    if not spec or not _first_attempt():
        return False
    m = _SAVE_SPEC.fullmatch(spec)
    if m is None or m["stage"] not in SAVE_STAGES:
        raise UsageError(
            f"MMM_SAVE_FAULT={spec!r} is not STAGE[@STEP][:RANK|:all] with STAGE one of {', '.join(SAVE_STAGES)} "
            "(e.g. rng@4:1)"
        )
    who = m["rank"] or "0"
    if m["stage"] == "history" and who != "0":
        raise UsageError(f"MMM_SAVE_FAULT={spec!r}: the history fault is history@STEP (rank 0 writes the history)")
    return (
        m["stage"] == stage
        and (m["step"] is None or step is None or int(m["step"]) == step)
        and (who == "all" or int(who) == rank)
    )


def crash_point(stage: str, step: int | None = None, *, rank: int = 0) -> None:
    """SIGKILL this process here when ``MMM_SAVE_FAULT`` asks for ``stage`` (of ``step``, on ``rank``)."""
    if save_fault(stage, step, rank=rank):
        os.kill(os.getpid(), signal.SIGKILL)
