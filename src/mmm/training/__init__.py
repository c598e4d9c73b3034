"""What every mmm trainer shares: output folder, step timing, startup phases, memory, run summary."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmm import __version__, dist
from mmm.dist import gather_objects, launch_time, set_stack_dir
from mmm.errors import DivergedError, UsageError
from mmm.faults import inject
from mmm.flops import mfu_report
from mmm.history import History
from mmm.log import get_logger
from mmm.measure import CommCounter, SavedActivations
from mmm.parallel.checkpoint import Checkpointer, complete_steps, latest_step, step_dir
from mmm.parallel.strategy import theoretical_state_bytes
from mmm.tracking import finish_run, gather_rank_timings, open_trackers, run_config
from mmm.training.step import StepSync, train_step  # noqa: F401  (the trainers' one step)

if TYPE_CHECKING:  # pragma: no cover  (mmm.training.config imports the parallel library: not at import mmm.training)
    from mmm.training.config import Config


# --------------------------------------------------------------------------- timing
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
def batch_problems(batch_size: int, dp: int) -> list[str]:
    """The global batch must split evenly over the data-parallel ranks."""
    if batch_size % dp == 0:
        return []
    return [
        f"--batch-size {batch_size} is not divisible by {dp} data-parallel ranks; use a multiple of {dp} "
        f"(e.g. {dp * max(1, round(batch_size / dp))})"
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
    found = problems(config, info.world_size)
    if found:
        raise UsageError("; ".join(found))
    outdir = resolve_outdir(config.run.outdir, example)
    keep_earlier_run(config.run, outdir, info)
    return info, outdir, startup


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
    history = outdir / "history.jsonl"
    if history.is_file() and history.stat().st_size > 0:
        found["--outdir"] = f"--outdir {str(outdir)!r} holds the history of an earlier run ({history.name})"
    return found


def keep_earlier_run(run, outdir: Path, info) -> None:
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
    if found:
        raise UsageError(
            "; ".join(found.values()) + ": continue it with --resume, or begin again at step 1 with --start-over "
            "(the earlier run is moved to <folder>.old-<UTC time>; nothing is deleted)"
        )


# --------------------------------------------------------------------------- output folder
def resolve_outdir(outdir: str | os.PathLike | None, example: str) -> Path:
    """``--outdir`` or ``outputs/<example>/<UTC timestamp>``; a path that is a file is an error."""
    if outdir is None:
        stamp = os.environ.get("MMM_RUN_STAMP") or datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y%m%d-%H%M%S"
        )
        return Path("outputs") / example / stamp
    path = Path(outdir)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--outdir {str(outdir)!r} is a file; pass a directory (it is created if missing)")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"--outdir {str(outdir)!r}: {str(parent)!r} is a file, not a directory")
            if not os.access(parent, os.W_OK):
                raise UsageError(f"--outdir {str(outdir)!r}: cannot write in {str(parent)!r}")
            break
    return path


# --------------------------------------------------------------------------- memory
def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak device memory (cuda/xpu), and the process's peak resident memory."""
    out: dict[str, int] = {}
    if device.type in {"cuda", "xpu"}:
        out["peak_allocated_bytes"] = int(getattr(torch, device.type).max_memory_allocated(device))
    try:
        import resource

        out["peak_rss_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except ImportError:  # pragma: no cover
        pass
    return out


def memory_now(device: torch.device) -> dict[str, int]:
    """The peaks so far (:func:`peak_memory`) and what is held now: resident memory (Linux) and,
    on cuda/xpu, allocated device memory."""
    out = peak_memory(device)
    if device.type in {"cuda", "xpu"}:
        out["allocated_bytes"] = int(getattr(torch, device.type).memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            import os

            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        pass
    return out


def versions(extra: Iterable[str] = ()) -> dict[str, str]:
    out = {"mmm": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for name in ("numpy", "deepspeed", "mpi4py", *extra):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "__version__"):
            out[name] = mod.__version__
    return out


def torchinfo_summary(model: torch.nn.Module, depth: int = 2) -> str:
    """torchinfo's parameter table of a (single-device) model."""
    import torchinfo

    return str(torchinfo.summary(model, depth=depth, verbose=0, col_names=("num_params",)))


def compiled_graphs() -> int:
    """Graphs torch.compile has captured in this process so far (0 when nothing was compiled)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0


def format_step(values: dict[str, float]) -> str:
    """``iter=3 loss=4.1234 dt=0.123 ...``: the one-line-per-step format of every trainer."""
    parts = []
    for k, v in values.items():
        if v is None:
            continue
        if isinstance(v, int) or k in {"iter", "epoch"}:
            parts.append(f"{k}={int(v)}")
        elif k in {"tps", "tokens_per_s", "samples_per_s"}:
            parts.append(f"{k}={v:.0f}")
        else:
            parts.append(f"{k}={v:.4f}")
    return " ".join(parts)


# --------------------------------------------------------------------------- the step
def mean_over(value: torch.Tensor, group) -> float:
    """A scalar averaged over a process group (e.g. the loss over data-parallel ranks)."""
    import torch.distributed as dist

    value = value.detach()
    if hasattr(value, "full_tensor"):  # a replicated DTensor (loss parallel)
        value = value.full_tensor()
    value = value.float().reshape(1).clone()
    if group is not None:
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return value.item()


def make_checkpointer(engine, *, directory: str | None, keep_last: int = 0, meta: dict[str, Any], log=None):
    """A :class:`mmm.parallel.checkpoint.Checkpointer` saving under ``directory`` (``--checkpoint-dir``;
    None without one), keeping the ``keep_last`` newest (0: all)."""
    if not directory:
        return None

    if hasattr(engine, "ds"):
        return Checkpointer(directory, deepspeed_engine=engine.ds, meta=meta, keep_last=keep_last, log=log)
    return Checkpointer(
        directory, model=engine.module, optimizer=engine.optimizer, meta=meta, keep_last=keep_last, log=log
    )


def resume(checkpointer, which: str | None, startup: Startup | None = None) -> int:
    """The first step to run: 1, or one past the checkpoint ``which`` names ('latest' or a step
    number, ``--resume``; loading it is a startup phase of its own, ``resume``). A job relaunched by
    ``launch --retries`` (``MMM_RESTART`` >= 1) resumes from the latest checkpoint, whatever ``which`` said."""
    lineage = None
    if checkpointer is not None and restart_attempt():
        # the newest checkpoint this job saved; before its first save, where it started (a rollback to
        # an earlier step must not continue the abandoned branch that is still on disk)
        lineage = os.environ.get("MMM_RUN_STAMP") or None
        which = which or "latest"
        if dist.info().is_main:
            get_logger().info(
                "restart %d (launch --retries): resuming from this run's newest checkpoint in %s (else %s)",
                restart_attempt(),
                checkpointer.root,
                which,
            )
    if checkpointer is None or not which:
        return 1
    saved = checkpointer.load(which, lineage=lineage)
    if saved is None:
        return 1
    if startup is not None:
        startup.mark("resume")
    return int(saved["step"]) + 1


def dropped_hosts() -> list[str]:
    """Hosts ``launch --drop-lost-hosts`` left out of this relaunch: they did not answer after a failure."""
    return [h for h in os.environ.get("MMM_DROPPED_HOSTS", "").split(",") if h]


def restart_attempt() -> int:
    """Which relaunch of the job this is (``MMM_RESTART`` set by ``launch --retries``; 0: the first run)."""
    raw = os.environ.get("MMM_RESTART", "")
    return int(raw) if raw.isdigit() else 0


@contextlib.contextmanager
def _measuring(run, mesh):
    comm, saved = CommCounter(mesh.named_groups()), SavedActivations()
    with comm, saved:
        yield
    run.measured = {
        "comm_bytes": comm.result(),
        "comm_calls": dict(sorted(comm.calls.items())),
        "activation_bytes": saved.bytes,
    }


class _Pending:
    """A finished step whose values are still on their way from the device."""

    def __init__(
        self, step: int, reduced, times, dt: float, rates: dict[str, float], metrics: dict, last: bool = False
    ) -> None:
        self.step, self.reduced, self.times, self.dt, self.rates, self.metrics = (
            step,
            reduced,
            times,
            dt,
            rates,
            metrics,
        )
        self.last = last


class Run:
    """What the trainers share around their loop: History, step lines, startup, summary.

    The loop calls ``begin_step`` first and ``end_step`` last in every iteration; ``dt`` is the wall
    time from one ``end_step`` to the next (the first: from ``begin_step``), so it covers everything
    the loop does. ``end_step`` reads the step's packed all-reduce (:class:`mmm.training.step.StepSync`)
    at once on steps that log, save, stop, or are the first or last; otherwise one step later, so
    that steps that do not log never wait for the device. Each step is then recorded in order
    (``history.jsonl``; an ``iter=.. loss=..`` line every ``log_every`` steps on rank 0; the first
    record closes the startup clock). ``finish`` gathers per-rank memory, writes
    ``history.nc``/``summary.json``/plots and prints the closing line.
    """

    def __init__(
        self,
        example: str,
        *,
        info,
        outdir: Path,
        startup: Startup,
        config: Config,
        step_key: str = "iter",
        resume_step: int = 0,
        sync=None,
    ) -> None:
        self.example, self.info, self.outdir, self.startup = example, info, outdir, startup
        self.options = config.run  # warmup, log_every, checkpoints, trackers, --rank-timings
        self.log = get_logger()
        self.log_every = self.options.log_every
        self.resume_step = resume_step
        self.hist = History(
            outdir,
            write=info.is_main,
            warmup=self.options.warmup,
            step_key=step_key,
            resume=resume_step if resume_step else None,
        )
        self._recorded = 0  # records made by this process (the first one closes the startup clock)
        self.stopped_by: str | None = None
        self.memory: dict[str, int] | None = None
        # the model is built, sharded, materialised (and resumed) by now: what setup cost
        self.memory_marks: dict[str, dict[str, int]] = {"after_setup": memory_now(info.device)}
        self.measured: dict[str, Any] | None = None  # what --measure recorded on this rank
        self.sync = sync  # the per-step all-reduce (mmm.training.step.StepSync)
        self._t_last: float | None = None  # when the previous iteration ended
        self._pending: _Pending | None = None

        names = self.options.trackers if info.is_main else []
        self.trackers = open_trackers(
            names,
            config=run_config(
                config.as_dict(), example=example, degrees=config.parallel.degrees, world_size=info.world_size
            )
            if names
            else {},
            project=self.options.wandb_project,
            run_name=self.options.wandb_name,
            outdir=outdir,
            step_key=step_key,
            log=self.log,
        )
        if self.trackers:
            self.hist.hooks.append(self.trackers.log_row)
        self.rank_timings = self.options.rank_timings  # an all-gather on logging steps
        if info.world_size > 1 and not os.environ.get("MMM_STACK_DIR"):
            # where each rank was, written when a collective fails and on SIGUSR1 (mmm.dist.liveness)

            set_stack_dir(outdir / "stacks", info.rank)

    def begin_step(self, step: int) -> bool:
        """Called as a step starts: carries out ``MMM_FAULT`` fault injection (:mod:`mmm.faults`);
        True when this step's loss must be made NaN."""
        if self._t_last is None:
            self._t_last = time.perf_counter()
        return inject(step, self.info.rank)

    def check_loss(self, step: int, loss_value: float, *, skipped: bool = False, checkpointer=None) -> None:
        """A non-finite loss stops the run with one line naming the step (recorded first, so the
        history shows it; no checkpoint is written for it)."""
        if math.isfinite(loss_value) or skipped:
            return
        good = "no checkpoint was saved"
        if checkpointer is not None:
            last = latest_step(checkpointer.root)
            if last is not None:
                good = f"the last good checkpoint is {step_dir(checkpointer.root, last)} (--resume {last})"
        raise DivergedError(  # exit 65: `launch --retries` does not replay a deterministic divergence
            f"loss is {loss_value} at {self.hist.step_key} {step}; {good}. Lower --lr, use --dtype fp32, "
            "--grad-clip, or --on-nonfinite skip"
        )

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """Leaving the loop on an error (a peer died, a NaN): the step read late is still written, so
        the history on disk holds every step that finished."""
        pending, self._pending = self._pending, None
        if exc_type is not None and pending is not None and pending.reduced.ready():
            with contextlib.suppress(Exception):
                loss, _, _ = pending.reduced.values()
                self.record(pending.step, loss=loss, dt=pending.dt, **pending.times.as_dict())
        if exc_type is not None:
            self.trackers.close(failed=True)  # after the late step: the trackers have it too
        return False

    def restart_clock(self) -> None:
        """The next step's ``dt`` starts now (after work that is not a training step: an evaluation)."""
        self._t_last = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` of this iteration (an evaluation) out of its ``dt``."""
        if self._t_last is not None:
            self._t_last += seconds

    def end_step(
        self, step: int, reduced, times, *, checkpointer, last: bool, rates: dict[str, float], **metrics
    ) -> bool:
        """Close a step: its ``dt``; its values read now or one step later (see the class doc), then
        recorded, checked (a non-finite loss stops the run) and SIGTERM agreed on (every rank stops
        after the same step); a checkpoint saved when one is due. ``rates``: name -> work per step
        (e.g. ``{"tps": tokens}``), recorded as work / dt. ``metrics``: more values (0-d tensors stay
        on the device until read). True: leave the loop (every rank alike)."""
        now = time.perf_counter()
        entry = _Pending(step, reduced, times, now - (self._t_last or now), rates, metrics, last)
        self._t_last = now
        if self._pending is not None:
            pending, self._pending = self._pending, None  # taken first: a failed check must not write it twice
            self._flush(pending, checkpointer)
        every = self.options.checkpoint_every
        due = (
            last
            or self._recorded == 0
            or step % self.log_every == 0
            or reduced.read
            or self.stopped_by is not None
            or (every and step % every == 0 and checkpointer is not None)
        )
        if due:
            self._flush(entry, checkpointer)
        else:
            self._pending = entry
        stopping = self.stopped_by is not None  # a stop seen in the previous step's values made this one due
        if self.options.checkpoint_due(step, last=last, stopping=stopping):
            checkpointer.save(step, {"loss": self.hist.rows[-1].get("loss") if self.hist.rows else None})
        return stopping

    def _flush(self, entry: _Pending, checkpointer) -> None:
        loss, nonfinite, stop = entry.reduced.values()
        times = entry.times.as_dict()
        metrics = dict(entry.metrics)
        if entry.reduced.grad_norm is not None:  # from the packed reduction: no read of a device tensor
            metrics["grad_norm"] = entry.reduced.grad_norm
        metrics = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        if self.rank_timings and (entry.step % self.log_every == 0 or entry.last):  # every rank, same steps
            metrics.update(gather_rank_timings(entry.dt, device=self.info.device))
        self.record(
            entry.step,
            force_log=entry.last,
            loss=loss,
            dt=entry.dt,
            dtf=times["dtf"],
            dtb=times["dtb"],
            **{k: w / entry.dt for k, w in entry.rates.items()},
            **metrics,
            **({"skipped": times["skipped"]} if "skipped" in times else {}),
        )
        # a rank whose loss does not count (an earlier pipeline stage) can still be non-finite
        self.check_loss(
            entry.step, math.nan if nonfinite else loss, skipped=bool(times.get("skipped")), checkpointer=checkpointer
        )
        if stop and self.stopped_by is None:
            self.stopped_by = "SIGTERM"
            self.log.info("%s received: stopping after this step", self.stopped_by)

    def reduce_now(
        self, step: int, reduced, times, *, rates: dict[str, float], checkpointer=None, **metrics
    ) -> tuple[float, bool]:
        """For loops that need every step's loss at once (the CNN trainer's epoch means): record and
        check the step now; returns (loss, stopping). Saving stays with the caller."""
        now = time.perf_counter()
        self._flush(_Pending(step, reduced, times, now - (self._t_last or now), rates, metrics), checkpointer)
        self._t_last = now
        return self.hist.rows[-1]["loss"], self.stopped_by is not None

    def record(self, step: int, *, force_log: bool = False, **metrics) -> dict:
        rec = self.hist.update(step, **metrics)
        self._recorded += 1
        if self._recorded == 1:
            self.memory_marks["after_first_step"] = memory_now(self.info.device)
            self.startup.mark("first_step")
            self.log.info("%s", self.startup.line())
        if force_log or step % self.log_every == 0:
            self.log.info("%s", format_step(rec))
        return rec

    def measuring(self, mesh, enabled: bool = True):
        """Context around the one step ``--measure`` watches: payload bytes per mesh process group
        and bytes of activations saved for backward (:mod:`mmm.measure`), kept for summary.json."""
        if not enabled:
            return contextlib.nullcontext()
        return _measuring(self, mesh)

    def capture_memory(self, engine) -> None:
        """Per-rank parameter + gradient + optimizer bytes, taken while gradients exist."""
        self.memory = engine.state_bytes()

    def finish(
        self,
        engine,
        extra: dict[str, Any],
        *,
        mesh,
        num_params: int,
        plots: bool = True,
        rate_key: str = "tps",
        flops_per_unit: float | None = None,
        dtype: str = "fp32",
    ) -> dict[str, Any]:
        """Gather per-rank memory, compare it with the strategy's theoretical figure, work out MFU
        (``flops_per_unit``: training FLOPs per token, or per sample when ``rate_key`` counts
        samples), write the outputs."""
        memory = {**(self.memory or engine.state_bytes()), **peak_memory(self.info.device)}
        per_rank = gather_objects(memory)
        marks = gather_objects(self.memory_marks)  # per rank: {"after_setup": {...}, "after_first_step": {...}}
        measured = gather_objects(self.measured) if self.measured is not None else None
        stats = self.hist.stats()
        rate = stats.get(rate_key, {}).get("mean")
        mfu = mfu_report(self.info.device, dtype, rate=rate, flops_per_unit=flops_per_unit)
        summary_extra: dict[str, Any] = {
            "example": self.example,
            "world_size": self.info.world_size,
            "num_nodes": self.info.num_nodes,
            "launcher": self.info.launcher,
            "restart": restart_attempt(),
            "dropped_hosts": dropped_hosts(),
            "device": str(self.info.device),
            "backend": self.info.backend,
            **extra,
            "final_loss": self.hist.rows[-1].get("loss") if self.hist.rows else None,
            "memory_per_rank": per_rank,
            "memory": {phase: [m.get(phase) for m in marks] for phase in ("after_setup", "after_first_step")},
            "mfu": mfu["mfu"],
            "flops": mfu,
            **({"measured_per_rank": measured} if measured is not None else {}),
            "startup_s": self.startup.total_s,
            "startup_phases": self.startup.phases(),
            "stopped_by": self.stopped_by,
            "resumed_from": self.resume_step or None,
            "versions": versions(),
        }
        worst = max(m["total_bytes"] for m in per_rank)
        theory = theoretical_state_bytes(engine.strategy, num_params=num_params, mesh=mesh)
        summary_extra["state_bytes_theory"] = theory
        summary_extra["state_bytes_ratio_to_theory"] = worst / theory["total_bytes"]
        summary = self.hist.finalize(summary_extra, plots=plots)

        finish_run(self, summary, rate_key=rate_key)  # rank 0: summary table, report.md, trackers closed
        if self.info.is_main:
            st = summary["stats"]
            parts = [f"final loss {summary['final_loss']:.4f}"] if summary["final_loss"] is not None else []
            if "dt" in st:
                parts.append(" ".join(f"{k} {st[k]['mean']:.4f}s" for k in ("dt", "dtf", "dtb") if k in st))
            if rate_key in st:
                parts.append(f"{st[rate_key]['mean']:.0f} {rate_key}")
            if mfu["mfu"] is not None:
                parts.append(
                    f"MFU {100 * mfu['mfu']:.1f}% ({mfu['peak_source']} peak "
                    f"{mfu['peak_flops_per_rank'][0] / 1e12:.3g} TFLOP/s per rank)"
                )
            parts.append(
                f"state {worst / 2**20:.2f} MiB/rank ({worst / theory['total_bytes']:.3f}x of "
                f"{engine.strategy}'s theoretical {theory['total_bytes'] / 2**20:.2f})"
            )
            self.log.info("done: %s | %s", " | ".join(parts), self.outdir)
        return summary


def save_full_model(engine, path, *, is_main: bool) -> None:
    """Gather the full (unsharded) weights and save them on rank 0."""
    import torch

    if engine.strategy.startswith("zero"):
        state = (
            engine.ds._zero3_consolidated_16bit_state_dict()
            if engine.strategy == "zero3"
            else engine.ds.module.state_dict()
        )
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save({k: v.detach().cpu() for k, v in state.items()}, tmp)
        tmp.replace(path)
