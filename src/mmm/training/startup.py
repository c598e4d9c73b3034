"""The start of every trainer: the distributed job set up, the banner, the config checked, the output
folder picked (an earlier run's folders are never overwritten), and the startup clock from launch to
the first finished step."""

from __future__ import annotations

import datetime
import math
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmm import dist, env
from mmm.cli import FLAGS
from mmm.dist import launch_time
from mmm.errors import UsageError, folder_problem
from mmm.history import read_rows
from mmm.log import get_logger
from mmm.parallel.accumulate import accumulation_problems
from mmm.parallel.checkpoint_folder import complete_steps

if TYPE_CHECKING:  # pragma: no cover
    from mmm.training.config import Config


def process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc, 10 ms resolution), else now."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class Startup:
    """Phases from launch (``MMM_LAUNCH_TIME``, else process start) to the first finished step."""

    def __init__(self) -> None:
        self.process_start = process_start_time()
        self.launch = launch_time() or self.process_start
        self.marks: list[tuple[str, float]] = [("interpreter", self.process_start)]

    def mark(self, phase: str) -> None:
        """Record that ``phase`` just finished."""
        self.marks.append((phase, time.time()))

    def mark_setup(self, info) -> None:
        """After :func:`mmm.dist.setup`: two phases, ``imports`` (flags, torch and the rest) and
        ``process_group`` (its initialisation, a rendezvous of every rank)."""
        now = time.time()
        self.marks.append(("imports", now - info.timings.get("init_process_group_s", 0.0)))
        self.marks.append(("process_group", now))

    def phases(self) -> dict[str, float]:
        out, prev = {}, self.launch
        for name, t in self.marks:
            out[f"{name}_s"] = max(0.0, t - prev)
            prev = t
        return out

    @property
    def total_s(self) -> float:
        return self.marks[-1][1] - self.launch

    def line(self) -> str:
        parts = " ".join(f"{k[:-2]}={v:.2f}s" for k, v in self.phases().items())
        return f"startup {self.total_s:.2f}s from launch to first finished step: {parts}"


# --------------------------------------------------------------------------- start of a trainer
def batch_problems(batch_size: int, dp: int, *, microbatches: int | None = None) -> list[str]:
    """The global batch must split evenly over the data-parallel ranks, and each rank's share into the
    ``microbatches`` of gradient accumulation (given without a pipeline, whose own are checked with it)."""
    if batch_size % dp:
        return [
            f"--batch-size {batch_size} is not divisible by {dp} data-parallel ranks; use a multiple of {dp} "
            f"(e.g. {dp * max(1, round(batch_size / dp))})"
        ]
    return accumulation_problems(microbatches, batch_size // dp, spell=FLAGS)


def warmup_problems(config: Config) -> list[str]:
    """``--warmup N`` given that leaves no step of the run timed (the statistics would then take every step,
    the flag silently off). The default (2) on a run that short is left alone: its summary says so."""
    warmup, steps = config.run.warmup, getattr(config.train, "max_iters", None)
    default = next(f.default for f in fields(type(config.run)) if f.name == "warmup")
    if steps is None or warmup == default or warmup < steps:
        return []
    return [
        f"--warmup {warmup} leaves none of the run's {steps} steps (--max-iters) in the timing statistics; use "
        f"--warmup {steps - 1} or fewer, or more --max-iters"
    ]


def start(example: str, config: Config, problems: Callable[[Config, int], list[str]]) -> tuple[Any, Path, Startup]:
    """Set up the distributed job for a parsed ``config``, log the banner, check the config, pick the
    output folder; returns (dist info, output folder, startup clock).

    ``problems(config, world_size)``: every problem at once, raised as one UsageError.
    """
    startup = Startup()
    info = dist.setup(seed=config.run.seed, timeout=config.run.timeout)
    startup.mark_setup(info)
    if info.is_main:
        get_logger().info("%s", dist.banner(info))
        if dropped_hosts():
            get_logger().info(
                "relaunched without host(s) %s: they did not answer after the failure (launch --drop-lost-hosts)",
                ", ".join(dropped_hosts()),
            )
    found = problems(config, info.world_size) + warmup_problems(config)
    if found:
        raise UsageError("; ".join(found))
    if config.run.checkpoint_dir:
        root = Path(config.run.checkpoint_dir)
        if root.is_dir() and root.stat().st_mode & stat.S_IWOTH:  # refused now, not at the first resume
            raise UsageError(
                f"--checkpoint-dir {str(root)!r} can be written by any user (mode o+w), so a resume would refuse "
                f"what is saved there; give a folder of your own inside it, or remove it (chmod o-w {str(root)!r})"
            )
        if info.num_nodes > 1:
            check_shared(config.run.checkpoint_dir, "--checkpoint-dir")
    outdir = resolve_outdir(config.run.outdir, example)
    keep_earlier_run(config.run, outdir)
    return info, outdir, startup


def check_shared(folder: str | os.PathLike, flag: str) -> None:
    """Every rank sees ``folder`` where rank 0 does (a collective): refused at startup when some hosts
    do not, instead of failing at the first save after ``--checkpoint-every`` steps of work. Rank 0 writes
    a marker in ``folder``, or in its nearest existing parent when it does not exist yet (nothing is made),
    every rank looks for it, and rank 0 removes it."""
    token = secrets.token_hex(8)

    def place() -> str | None:
        where = Path(folder).absolute()
        while not where.exists() and where != where.parent:
            where = where.parent
        marker = where / f".mmm-shared-{token}"
        try:
            marker.write_text(socket.gethostname())
        except OSError:
            return None  # not writable here: the save will say so
        return str(marker)

    marker = dist.on_rank0(place)
    seen = dist.gather_objects((socket.gethostname(), marker is None or os.path.exists(marker)))
    dist.on_rank0(lambda: marker is not None and Path(marker).unlink(missing_ok=True))
    blind = sorted({host for host, ok in seen if not ok})
    if blind:
        raise UsageError(
            f"{flag} {str(folder)!r} is not shared by every host: {', '.join(blind)} do not see what rank 0 "
            f"({seen[0][0]}) writes there (a node-local disk?); give a folder on a file system every host mounts"
        )


def earlier_run(run, outdir: Path) -> dict[str, str]:
    """What an earlier run left where this one would write (flag -> what it holds), unless this run
    continues it (``--resume``, or a relaunch by ``launch --retries``)."""
    if restart_attempt():  # the same job, relaunched: it continues itself
        return {}
    found = {}
    steps = complete_steps(Path(run.checkpoint_dir)) if run.checkpoint_dir else []
    if run.resume is not None and steps:
        return {}  # it continues that run (its history is kept up to the step it resumes)
    if steps:
        shown = ", ".join(map(str, steps[:5])) + (f", ... ({len(steps)} in all)" if len(steps) > 5 else "")
        found["--checkpoint-dir"] = (
            f"--checkpoint-dir {run.checkpoint_dir!r} holds the checkpoints of an earlier run (steps {shown})"
        )
    outputs = [name for name in RUN_OUTPUTS if _holds(outdir / name)]
    # a requeued job with --resume latest whose first attempt ended before its first save: it starts again,
    # the attempt's history set aside (History does, nothing is deleted); a finished run's outputs stay refused
    requeued = run.resume == "latest" and not steps and run.checkpoint_dir and outputs == ["history.jsonl"]
    if outputs and not requeued:
        found["--outdir"] = f"--outdir {str(outdir)!r} holds the outputs of an earlier run ({', '.join(outputs)})"
    return found


# what a run writes in its --outdir: a fresh start there would overwrite them
RUN_OUTPUTS = ("history.jsonl", "history.nc", "summary.json", "report.md", "plots")


def _holds(path: Path) -> bool:
    """A non-empty file, or a folder with anything in it."""
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def keep_earlier_run(run, outdir: Path) -> None:
    """Never overwrite an earlier run by starting afresh in its folders (a resubmitted job script without
    --resume would re-save its steps and prune its newest checkpoints first): refuse in one line, or with
    ``--start-over`` move those folders aside (rank 0, before anyone writes; nothing is deleted)."""

    def decide_and_move() -> dict[str, str]:  # rank 0 alone looks and moves; every rank learns the outcome
        found = earlier_run(run, outdir)
        if not found or not run.start_over:
            return found
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        folders = [Path(run.checkpoint_dir)] if "--checkpoint-dir" in found else []
        if "--outdir" in found and not any(outdir.resolve().is_relative_to(f.resolve()) for f in folders):
            folders.append(outdir)
        for folder in folders:
            aside = folder.with_name(f"{folder.name}.old-{stamp}")
            try:
                os.replace(folder, aside)
            except OSError as e:
                raise UsageError(f"--start-over: cannot move {str(folder)!r} aside to {aside.name!r}: {e.strerror}")
            get_logger().info("--start-over: the earlier run in %s is now %s", folder, aside)
        return {}

    found = dist.on_rank0(decide_and_move)
    if found:  # --resume continues from a checkpoint: only offered where there is one
        go_on = "continue it with --resume" if "--checkpoint-dir" in found else "write to another --outdir"
        raise UsageError(
            "; ".join(found.values()) + f": {go_on}, or begin again at step 1 with --start-over "
            "(the earlier run is moved to <folder>.old-<UTC time>; nothing is deleted)"
        )


def check_history_is_this_runs(outdir: Path, saved: dict[str, Any], step_key: str = "iter") -> None:
    """Before a resume from the checkpoint whose metadata is ``saved`` (nothing read yet): the history already
    in ``outdir`` must be that run's, or the rows kept up to its step would be another run's, continued by this
    one (a silent splice). The checkpoint keeps its step's loss; the history's row of that step must hold the
    same (rank 0 reads, every rank learns). A history without that step's row is not judged."""

    def judge() -> str | None:
        path = outdir / "history.jsonl"
        if not path.is_file():
            return None
        step, kept = int(saved["step"]), saved.get("loss")
        logged = next((r.get("loss") for r in reversed(read_rows(path, step_key)[0]) if r[step_key] == step), None)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (kept, logged)):
            return None
        if math.isnan(kept) and math.isnan(logged) or math.isclose(kept, logged, rel_tol=1e-6, abs_tol=1e-12):
            return None
        return (
            f"--outdir {str(outdir)!r} holds another run's history: its step {step} has loss {logged:.6g}, and the "
            f"checkpoint resumed (step {step}) was saved at loss {kept:.6g}; resume into that run's own --outdir, "
            "give a new one, or resume another step of this run (--resume N)"
        )

    problem = dist.on_rank0(judge)
    if problem:
        raise UsageError(problem)


# --------------------------------------------------------------------------- output folder
def resolve_outdir(outdir: str | os.PathLike | None, example: str) -> Path:
    """``--outdir`` or ``outputs/<example>/<UTC timestamp>``; a path that is a file is an error."""
    if outdir is None:
        stamp = env.get("MMM_RUN_STAMP") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        return Path("outputs") / example / stamp
    problem = folder_problem(f"--outdir {str(outdir)!r}", outdir)
    if problem:
        raise UsageError(problem)
    return Path(outdir)


def dropped_hosts() -> list[str]:
    """Hosts ``launch --drop-lost-hosts`` left out of this relaunch: they did not answer after a failure."""
    return env.get("MMM_DROPPED_HOSTS", [])


def restart_attempt() -> int:
    """Which relaunch of the job this is (``MMM_RESTART`` set by ``launch --retries``; 0: the first run)."""
    return env.get("MMM_RESTART", 0)
