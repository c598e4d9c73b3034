"""What a run records of its steps (:class:`Recorder`): History, trackers, the step lines and the
late reads that keep the host from waiting on the device."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed

from mmm import env
from mmm.dist import set_stack_dir
from mmm.errors import DivergedError
from mmm.history import History
from mmm.log import get_logger
from mmm.measure import CommCounter, SavedActivations
from mmm.tracking import gather_rank_timings, open_trackers, run_config
from mmm.training.memory import memory_now
from mmm.training.startup import Startup

if TYPE_CHECKING:  # pragma: no cover
    from mmm.training.config import Config


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


def mean_over(value: torch.Tensor, group) -> float:
    """A scalar averaged over a process group (e.g. the loss over data-parallel ranks)."""
    value = value.detach()
    if hasattr(value, "full_tensor"):  # a replicated DTensor (loss parallel)
        value = value.full_tensor()
    value = value.float().reshape(1).clone()
    if group is not None:
        torch.distributed.all_reduce(value, group=group)
        value /= torch.distributed.get_world_size(group)
    return value.item()


@contextlib.contextmanager
def _measuring(run, mesh):
    comm, saved = CommCounter(mesh.named_groups()), SavedActivations()
    with comm, saved:
        yield
    run.measured = {
        "comm_bytes": comm.result(),
        "comm_calls": dict(sorted(comm.calls.items())),
        "activation_bytes": saved.bytes,
        "activation_peak_bytes": saved.peak_bytes,
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


class Recorder:
    """What a run records of its steps: History (``history.jsonl``), the trackers, the step lines,
    the startup clock's end, memory marks and what ``--measure`` saw.

    The loop calls ``begin_step`` first and ``end_step`` last in every iteration; ``dt`` is the wall
    time from one ``end_step`` to the next (the first: from ``begin_step``), so it covers everything
    the loop does. ``end_step`` reads the step's packed all-reduce (:class:`mmm.training.step.StepSync`)
    at once on steps that save, stop, or are the first or last, and on CPU steps that log; otherwise
    one step later, once the next step is queued, so that the host never waits for the device with
    nothing queued. On an accelerator a step that logs is read late too: its line comes when the step
    ends, as before, while the next one runs (reading every step at once cost 5% of a 97 ms step on
    an H200: the device idled while the host queued the next step's first kernels). Each step is then recorded in order
    (``history.jsonl``; an ``iter=.. loss=..`` line every ``log_every`` steps on rank 0; the first
    record closes the startup clock). A non-finite loss stops the run with one line naming the step
    and ``last_good()`` (where to go back to). :func:`mmm.training.summary.write_summary` writes
    ``history.nc``/``summary.json``/plots from it after the loop.
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
        continues: bool = False,
        sync=None,
        last_good: Callable[[], str] | None = None,
    ) -> None:
        self.example, self.info, self.outdir, self.startup = example, info, outdir, startup
        self.options = config.run  # warmup, log_every, trackers, --rank-timings
        self.last_good = last_good or (lambda: "no checkpoint was saved")
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
            resume_step=resume_step,
            continue_run=continues,
            log=self.log,
        )
        if self.trackers:
            self.hist.hooks.append(self.trackers.log_row)
        self.rank_timings = self.options.rank_timings  # an all-gather on logging steps
        if info.world_size > 1 and not env.is_set("MMM_STACK_DIR"):
            # where each rank was, written when a collective fails and on SIGUSR1 (mmm.dist.liveness)
            set_stack_dir(outdir / "stacks", info.rank)

    def begin_step(self, step: int) -> None:
        """Called as a step starts (the first step's ``dt`` counts from here)."""
        if self._t_last is None:
            self._t_last = time.perf_counter()

    def check_loss(
        self, step: int, loss_value: float, *, skipped: bool = False, grad_norm: float | None = None
    ) -> None:
        """A non-finite loss or gradient norm stops the run with one line naming the step (recorded first,
        so the history shows it; no checkpoint is written for it)."""
        bad_grad = grad_norm is not None and not math.isfinite(grad_norm)
        if (math.isfinite(loss_value) and not bad_grad) or skipped:
            return
        good = self.last_good()
        what = (
            f"loss is {loss_value}"
            if not math.isfinite(loss_value)
            else f"the gradient norm is {grad_norm} (loss {loss_value:.4f})"
        )
        raise DivergedError(  # exit 65: `launch --retries` does not replay a deterministic divergence
            f"{what} at {self.hist.step_key} {step}; {good}. Lower --lr, use --dtype fp32, or --on-nonfinite skip"
        )

    def __enter__(self) -> Recorder:
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

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` of this iteration (an evaluation) out of its ``dt``."""
        if self._t_last is not None:
            self._t_last += seconds

    def end_step(
        self, step: int, reduced, times, *, last: bool, rates: dict[str, float], force: bool = False, **metrics
    ) -> bool:
        """Close a step: its ``dt``; its values read now or one step later (see the class doc), then
        recorded, checked (a non-finite loss stops the run) and SIGTERM agreed on (every rank stops
        after the same step). ``force``: read this step's values now (a checkpoint or an evaluation
        needs them). ``rates``: name -> work per step (e.g. ``{"tps": tokens}``), recorded as
        work / dt. ``metrics``: more values (0-d tensors stay on the device until read). True: leave
        the loop (every rank alike); the caller saves a checkpoint first when one is due."""
        now = time.perf_counter()
        entry = _Pending(step, reduced, times, now - (self._t_last or now), rates, metrics, last)
        self._t_last = now
        if self._pending is not None:
            pending, self._pending = self._pending, None  # taken first: a failed check must not write it twice
            self._flush(pending)
        due = (
            last
            or force
            or self._recorded == 0
            or (step % self.log_every == 0 and self.info.device.type == "cpu")
            or reduced.read
            or self.stopped_by is not None
        )
        if due:
            self._flush(entry)
        else:
            self._pending = entry
        return self.stopped_by is not None  # a stop seen in the previous step's values made this one due

    @property
    def last_loss(self) -> float | None:
        """The loss of the newest recorded step."""
        return self.hist.rows[-1].get("loss") if self.hist.rows else None

    def _flush(self, entry: _Pending) -> None:
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
        # a rank whose loss does not count (an earlier pipeline stage) can still be non-finite; a finite loss
        # can come with non-finite gradients (in the packed reduction, or the norm DeepSpeed measured)
        grad_norm = metrics.get("grad_norm")
        bad_loss = not math.isfinite(loss) or (nonfinite and (grad_norm is None or math.isfinite(grad_norm)))
        self.check_loss(
            entry.step, math.nan if bad_loss else loss, skipped=bool(times.get("skipped")), grad_norm=grad_norm
        )
        if stop and self.stopped_by is None:
            self.stopped_by = "SIGTERM"
            self.log.info("%s received: stopping after this step", self.stopped_by)

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
