"""What a run shows beyond its own files: experiment trackers, timings across ranks, the closing report.

- **Trackers** (``--wandb``, ``--tensorboard``): rank 0 only, fed by History, the one source of
  truth: every row :class:`mmm.history.History` records goes to each tracker with its step (a
  History hook; no tracker, no hook, no work). Weights & Biases writes its run under
  ``<outdir>/wandb`` (``WANDB_MODE=offline`` needs no network; ``wandb sync`` uploads it later);
  TensorBoard event files go to ``<outdir>/tensorboard``, one scalar per History key. The packages
  are optional extras (``pip install 'mmm[wandb]'``, ``'mmm[tensorboard]'``), imported only when a
  flag asks: every rank checks the import before training (:func:`tracker_problems`), so a missing
  one stops every rank alike (exit 2). A tracker that fails at run time is dropped with one warning;
  training and ``history.jsonl`` go on. Trackers are closed at the end of the run (with its
  summary), and on a crash (``Recorder``'s context manager, else at exit).
- **Timings across ranks** (``--rank-timings``): :func:`gather_rank_timings`, an explicit
  all-gather of two numbers per rank on logging steps; see there.
- **The closing report** (rank 0): the summary as a table (rich when ``MMM_RICH``/a terminal says
  so, plain text otherwise) and ``report.md`` beside ``summary.json``.
"""

from __future__ import annotations

import atexit
import datetime
import json
import math
import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from mmm.errors import first_line
from mmm.files import write_atomic
from mmm.log import rich_wanted
from mmm.parallel.mesh import check_degrees

EXTRAS = {"wandb": "wandb", "tensorboard": "tensorboard"}  # flag -> (package to import, extra to install)


class Tracker(Protocol):
    """Something that receives a run's History rows (on rank 0)."""

    name: str

    def log(self, values: Mapping[str, float | int], step: int) -> None:
        """One History row (numbers only, the step key removed) at ``step``."""

    def close(self, summary: Mapping[str, Any] | None = None, *, failed: bool = False) -> None:
        """Flush and close; ``summary``: the run's final scalars, when it finished."""


# --------------------------------------------------------------------------- the run's settings
def tracker_problems(names: Iterable[str]) -> list[str]:
    """Every rank imports the package of each tracker asked for (``names``, keys of :data:`EXTRAS`),
    so that a missing one stops every rank alike, before training, with the extra that installs it."""
    out = []
    for name in names:
        try:
            __import__(EXTRAS[name])
        except ImportError as e:
            out.append(f"--{name} needs the {EXTRAS[name]} package: pip install 'mmm[{name}]' ({e})")
    return out


def run_config(
    values: Mapping[str, Any], *, example: str, degrees: Mapping[str, int], world_size: int
) -> dict[str, Any]:
    """What trackers record as the run's config: the example's name, the world size, the settings
    (``values``: each field by its name, e.g. ``Config.as_dict()``) and the mesh the ``degrees`` make
    on ``world_size`` ranks."""
    config: dict[str, Any] = {"example": example, "world_size": world_size}
    for k, v in values.items():
        config[k] = v if v is None or isinstance(v, (bool, int, float, str, list)) else str(v)
    config["mesh"] = mesh_degrees(degrees, world_size)
    return config


def mesh_degrees(degrees: Mapping[str, int], world_size: int) -> dict[str, int]:
    """The degrees of the mesh (``dp_shard`` -1 resolved), as the trainer builds it."""
    resolved, problems = check_degrees(world_size, **degrees)
    return dict(degrees) if problems else resolved


# --------------------------------------------------------------------------- trackers
class WandbTracker:
    """Weights & Biases: one run, its files under ``<outdir>/wandb``, or under ``$WANDB_DIR/wandb`` when
    the user set ``WANDB_DIR`` (clusters point it at scratch: home is small); ``WANDB_MODE`` etc. apply.

    The run's id is kept in ``<outdir>/wandb-run.json`` (:data:`ID_FILE`). A resumed run that continues its
    line (``continue_run``: ``--resume latest``, a relaunch, or the newest checkpoint by number) goes on in
    the same W&B run (``resume="allow"``), and the steps that run already holds (a crash's steps after its
    last checkpoint, run again) are not sent twice; any other start (a rollback to an earlier step, a fresh
    start) begins a new run."""

    name = "wandb"
    ID_FILE = "wandb-run.json"

    def __init__(
        self,
        *,
        outdir: Path,
        project: str | None,
        run_name: str | None,
        config: Mapping[str, Any],
        resume_step: int = 0,
        continue_run: bool = False,
        log=None,
    ) -> None:
        import wandb

        project = project or os.environ.get("WANDB_PROJECT") or "mmm"
        self._id_file = outdir / self.ID_FILE
        kept = self._read_id() if resume_step else {}
        same = continue_run and kept.get("project") == project and isinstance(kept.get("id"), str)
        self.run = wandb.init(
            project=project,
            name=run_name,
            dir=None if os.environ.get("WANDB_DIR") else str(outdir),  # None: W&B reads WANDB_DIR itself
            config=dict(config),
            **({"id": kept["id"], "resume": "allow"} if same else {}),
        )
        self.dir = Path(self.run.dir).parent  # <outdir>/wandb/<offline-run-...|run-...>
        held = kept.get("last_step") if same else None
        self.held = held if isinstance(held, int) and held > resume_step else resume_step
        """Steps up to this one are in the W&B run already (not sent again)."""
        self.last_step: int | None = None
        if same and log is not None:
            span = f"step {self.held}" if self.held == resume_step + 1 else f"steps {resume_step + 1}-{self.held}"
            again = f" ({span}, which it holds, not sent again)" if self.held > resume_step else ""
            log.info("wandb: run %s continued from step %d%s", self.run.id, resume_step + 1, again)
        elif kept and log is not None:
            why = (
                f"run {kept.get('id')} is in project {kept.get('project')}"
                if continue_run
                else f"run {kept.get('id')} keeps the steps of the line this run left"
            )
            log.info("wandb: a new run %s from step %d (%s)", self.run.id, resume_step + 1, why)
        self._write_id()

    def _read_id(self) -> dict[str, Any]:
        try:
            kept = json.loads(self._id_file.read_text())
        except (OSError, ValueError):
            return {}
        return kept if isinstance(kept, dict) else {}

    def _write_id(self) -> None:
        last = max(self.held, self.last_step or 0) or None
        record = {"id": self.run.id, "project": self.run.project, "last_step": last}
        try:
            write_atomic(self._id_file, json.dumps(record) + "\n")
        except OSError:  # a full disk: the next resume starts a new W&B run, nothing else is lost
            pass

    def log(self, values: Mapping[str, float | int], step: int) -> None:
        if step > self.held:
            self.run.log(dict(values), step=step)
            self.last_step = step

    def close(self, summary: Mapping[str, Any] | None = None, *, failed: bool = False) -> None:
        if summary:
            self.run.summary.update(dict(summary))
        self._write_id()
        self.run.finish(exit_code=1 if failed else 0)


class TensorBoardTracker:
    """TensorBoard event files under ``<outdir>/tensorboard``: each History row is one event holding
    a scalar per key; the flags (and at the end the summary) as text."""

    name = "tensorboard"
    FLUSH_SECS = 10  # a crash that skips close() loses at most this much (history.jsonl has it all)

    def __init__(self, logdir: Path, *, config: Mapping[str, Any], resume_step: int = 0) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._Event, self._Summary = Event, Summary
        self.dir = logdir
        self._writer = EventFileWriter(str(logdir), flush_secs=self.FLUSH_SECS)
        if resume_step or any(logdir.glob("events.out.tfevents.*")):  # steps run again (a resume, or a requeued
            # first attempt's): TensorBoard drops their earlier events
            start = SessionLog(status=SessionLog.START)
            self._writer.add_event(Event(wall_time=time.time(), step=resume_step + 1, session_log=start))
        self._text("config", markdown_table(sorted(_flatten(config).items()), ("flag", "value")), step=0)

    def _text(self, tag: str, text: str, *, step: int) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb

        self._writer.add_event(self._Event(wall_time=time.time(), step=step, summary=text_pb(tag, text)))

    def log(self, values: Mapping[str, float | int], step: int) -> None:
        value = self._Summary.Value
        summary = self._Summary(value=[value(tag=k, simple_value=v) for k, v in values.items()])
        self._writer.add_event(self._Event(wall_time=time.time(), step=step, summary=summary))

    def close(self, summary: Mapping[str, Any] | None = None, *, failed: bool = False) -> None:
        if summary:
            self._text(
                "summary", markdown_table([(k, _fmt(v)) for k, v in summary.items()], ("metric", "value")), step=0
            )
        self._writer.close()


class Trackers:
    """A run's trackers (empty, and falsy, on every rank but 0 and when none was asked for).

    :meth:`log_row` is the History hook; :meth:`close` is idempotent and also runs at exit, so a
    crash still closes them (marked failed)."""

    def __init__(self, trackers: Iterable[Tracker] = (), *, step_key: str = "iter", log=None) -> None:
        self.trackers = list(trackers)
        self.step_key = step_key
        self._log = log
        self._closed = False
        if self.trackers:
            atexit.register(self._at_exit)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def __iter__(self):
        return iter(self.trackers)

    def log_row(self, row: Mapping[str, Any]) -> None:
        """Send one History row to every tracker (``None`` values left out)."""
        step = row[self.step_key]
        values = {k: v for k, v in row.items() if v is not None and k != self.step_key}
        for t in tuple(self.trackers):
            try:
                t.log(values, step)
            except Exception as e:  # a tracker must never stop training: drop it, say so once
                self._drop(t, e)

    def _drop(self, tracker: Tracker, e: BaseException) -> None:
        self.trackers.remove(tracker)
        try:
            tracker.close(failed=True)
        except Exception:
            pass
        if self._log is not None:
            self._log.warning(
                "--%s failed, going on without it (history.jsonl has every step): %s", tracker.name, first_line(e)
            )

    def close(self, summary: Mapping[str, Any] | None = None, *, failed: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        for t in self.trackers:
            try:
                t.close(summary, failed=failed)
            except Exception as e:
                if self._log is not None:
                    self._log.warning("--%s: closing failed: %s", t.name, first_line(e))

    def _at_exit(self) -> None:
        self.close(failed=True)


def open_trackers(
    names: Iterable[str],
    *,
    config: Mapping[str, Any],
    outdir: Path,
    project: str | None = None,
    run_name: str | None = None,
    step_key: str = "iter",
    resume_step: int = 0,
    continue_run: bool = False,
    log=None,
) -> Trackers:
    """The trackers ``names`` asks for (keys of :data:`EXTRAS`; pass none on ranks other than 0), each
    recording ``config`` (:func:`run_config`); ``project``/``run_name``: W&B's. One that cannot start
    (say, W&B without a login and without ``WANDB_MODE=offline``) is left out with a warning: the run
    goes on. ``resume_step``: the step a resumed run starts after (TensorBoard's earlier events of the steps
    it runs again are dropped, as ``SummaryWriter(purge_step=...)`` does); ``continue_run``: the resumed
    checkpoint continues the run's line, so W&B goes on in the run it began (:class:`WandbTracker`)."""
    names = list(names)
    opened: list[Tracker] = []
    if names:
        for name in names:
            try:
                if name == "wandb":
                    opened.append(
                        WandbTracker(
                            outdir=outdir,
                            project=project,
                            run_name=run_name,
                            config=config,
                            resume_step=resume_step,
                            continue_run=continue_run,
                            log=log,
                        )
                    )
                else:
                    opened.append(TensorBoardTracker(outdir / "tensorboard", config=config, resume_step=resume_step))
            except Exception as e:
                if log is not None:
                    hint = " (WANDB_MODE=offline needs no login)" if name == "wandb" else ""
                    log.warning("--%s could not start, going on without it: %s%s", name, first_line(e), hint)
        if log is not None and opened:
            log.info("tracking: %s", ", ".join(f"{t.name} -> {t.dir}" for t in opened))
    return Trackers(opened, step_key=step_key, log=log)


def tracker_summary(summary: Mapping[str, Any]) -> dict[str, float | int | str]:
    """The run's final scalars for the trackers: means of the step metrics and the headline numbers."""
    out: dict[str, Any] = {f"mean/{k}": s["mean"] for k, s in summary.get("stats", {}).items()}
    for key in ("final_loss", "mfu", "startup_s", "test_acc", "test_loss", "world_size", "stopped_by"):
        if summary.get(key) is not None:
            out[key] = summary[key]
    return out


# --------------------------------------------------------------------------- timings across ranks
def gather_rank_timings(dt: float, *, device=None) -> dict[str, float | int]:
    """Every rank's ``dt`` for this step, and when it got here: an explicit all-gather of two numbers
    per rank over the whole job, so EVERY rank must call it, at the same step (``--rank-timings``
    does, on logging steps, from :class:`mmm.training.recorder.Recorder`).

    Returns ``dt_min``, ``dt_max``, ``dt_mean`` over ranks, ``slowest_rank`` (the rank that finished
    the step last: the straggler) and ``dt_lag`` (how many seconds after the first one it did so).
    The collectives inside a step make every rank wait for the slowest, so the ranks' ``dt`` are
    alike and a slow rank shows as lag: the others finish when it lets them, it finishes last.
    Arrival is wall-clock time (``time.time()``), so across nodes lag below their clock skew is noise.
    """
    import torch
    import torch.distributed as dist

    if device is None or device.type not in ("cuda", "xpu"):
        device = torch.device("cpu")
    mine = torch.tensor([dt, time.time()], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        out = torch.empty(2 * dist.get_world_size(), dtype=torch.float64, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # its 2.13 name
        gather(out, mine)
    else:
        out = mine
    values = out.tolist()
    dts, arrived = values[0::2], values[1::2]
    last = max(range(len(arrived)), key=arrived.__getitem__)
    return {
        "dt_min": min(dts),
        "dt_max": max(dts),
        "dt_mean": sum(dts) / len(dts),
        "slowest_rank": last,
        "dt_lag": arrived[last] - min(arrived),
    }


# --------------------------------------------------------------------------- the closing report
def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


RATE_NAMES = {"tps": "tokens/s", "tokens_per_s": "tokens/s", "samples_per_s": "samples/s"}


def summary_rows(
    summary: Mapping[str, Any], *, rate_key: str = "tps", slowest_ranks: Iterable[int] = ()
) -> list[tuple[str, str]]:
    """The summary as (metric, value) rows: the table printed at the end and the one in report.md.
    ``slowest_ranks``: the ``slowest_rank`` of each logged step (``--rank-timings``)."""
    st = summary.get("stats", {})
    warm = summary.get("warmup_excluded", 0)
    rows = [("steps", f"{summary.get('steps', 0)} (means exclude {warm} warm-up step{'s' if warm != 1 else ''})")]
    if summary.get("final_loss") is not None:
        rows.append(("final loss", f"{summary['final_loss']:.4f}"))
    if summary.get("test_acc") is not None:
        rows.append(("test accuracy", f"{summary['test_acc']:.2f}%"))
    for key, what in (("dt", "step"), ("dtf", "forward + loss"), ("dtb", "backward")):
        if key in st:
            rows.append((f"{key} ({what})", f"{st[key]['mean']:.4f} s ± {st[key]['std']:.4f}"))
    if rate_key in st:
        rows.append((RATE_NAMES.get(rate_key, rate_key), f"{st[rate_key]['mean']:,.0f}"))
    if "mfu" in summary:
        flops = summary.get("flops") or {}
        if summary["mfu"] is None:
            rows.append(("MFU", "n/a (no FLOP count or peak for this device)"))
        else:
            peak = (flops.get("peak_flops_per_rank") or [None])[0]
            where = f" of {flops.get('peak_source')} peak {peak / 1e12:.3g} TFLOP/s per rank" if peak else ""
            rows.append(("MFU", f"{100 * summary['mfu']:.2f}%{where}"))
    per_rank = summary.get("memory_per_rank") or []
    if per_rank:
        state = [m.get("total_bytes") for m in per_rank if m.get("total_bytes") is not None]
        if state:
            rows.append(("model state (max rank)", f"{_mib(max(state))} (params + grads + optimizer)"))
        for key, label in (
            ("peak_allocated_bytes", "peak device memory (max rank)"),
            ("peak_rss_bytes", "peak host memory (max rank)"),
        ):
            vals = [m[key] for m in per_rank if m.get(key) is not None]
            if vals:
                rows.append((label, _mib(max(vals))))
    if summary.get("startup_s") is not None:
        rows.append(("startup", f"{summary['startup_s']:.2f} s (launch to first finished step)"))
    if "dt_max" in st:
        text = (
            f"dt {st['dt_min']['mean']:.4f}-{st['dt_max']['mean']:.4f} s over ranks, lag {st['dt_lag']['mean']:.4f} s"
            if "dt_lag" in st
            else ""
        )
        counts = Counter(int(r) for r in slowest_ranks if r is not None and not math.isnan(r))
        if counts:
            rank, n = counts.most_common(1)[0]
            text += f"; slowest rank {rank} ({n} of {sum(counts.values())} logged steps)"
        rows.append(("across ranks", text))
    if summary.get("stopped_by"):
        rows.append(("stopped by", str(summary["stopped_by"])))
    return rows


def summary_table(rows: list[tuple[str, str]], *, title: str, rich: bool | None = None) -> str | Any:
    """A rich ``Table`` of the rows when rich is on (``MMM_RICH``, else a terminal), else aligned text."""
    if rich is None:
        rich = rich_wanted()
    if rich:
        try:
            from rich.table import Table

            table = Table(title=title, title_justify="left")
            table.add_column("metric", style="bold")
            table.add_column("value")
            for k, v in rows:
                table.add_row(k, v)
            return table
        except ImportError:
            pass
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join([title, *(f"  {k:<{width}}  {v}" for k, v in rows)])


def print_summary(rows: list[tuple[str, str]], *, title: str, log) -> None:
    table = summary_table(rows, title=title)
    if isinstance(table, str):
        log.info("%s", table)
        return
    from rich.console import Console

    Console(file=sys.stdout).print(table)
    sys.stdout.flush()


def markdown_table(rows: Iterable[tuple[Any, Any]], header: tuple[str, str]) -> str:
    def cell(x: Any) -> str:
        return _fmt(x).replace("|", "\\|").replace("\n", " ")

    lines = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    lines += [f"| {cell(k)} | {cell(v)} |" for k, v in rows]
    return "\n".join(lines)


def command_line(argv: list[str] | None = None) -> str:
    """This process's command, as typed: ``python -m mmm.examples.fsdp_tp --tp 2 ...``."""
    argv = list(sys.argv if argv is None else argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if name:
        head = ["python", "-m", name.removesuffix(".__main__")]
    else:
        head = ["python", argv[0] if argv else "?"]
    return shlex.join(head + argv[1:])


def write_report(
    outdir: Path, summary: Mapping[str, Any], rows: list[tuple[str, str]], *, example: str, metrics: Iterable[str] = ()
) -> Path:
    """``report.md`` beside summary.json: command line, launch, mesh, the summary table, versions,
    links to the PNG plots."""
    mesh = summary.get("mesh") or {}
    world = summary.get("world_size")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [f"# {example}: run report", "", f"Written {when}.", "", "```bash", command_line(), "```", ""]
    launch = [
        f"{world} rank{'s' if world != 1 else ''}" if world is not None else None,
        f"{summary['num_nodes']} node{'s' if summary['num_nodes'] != 1 else ''}"
        if summary.get("num_nodes") is not None
        else None,
        f"launcher {summary['launcher']}" if summary.get("launcher") else None,
        f"device {summary['device']}" if summary.get("device") else None,
        f"backend {summary['backend']}" if summary.get("backend") else None,
    ]
    lines.append("- **run**: " + ", ".join(x for x in launch if x))
    if mesh:
        lines.append("- **mesh**: " + " x ".join(f"{a}={d}" for a, d in mesh.items()))
    setup = [f"{k} {summary[k]}" for k in ("strategy", "dtype", "dataset") if summary.get(k) is not None]
    if summary.get("model", {}).get("num_params") is not None:
        setup.append(f"{summary['model']['num_params']:,} parameters")
    if setup:
        lines.append("- **setup**: " + ", ".join(setup))
    files = [
        n for n in ("history.jsonl", "history.nc", "summary.json", "tensorboard/", "wandb/") if (outdir / n).exists()
    ]
    lines.append("- **files**: " + (", ".join(f"`{n}`" for n in files) or "none"))
    lines += ["", "## Summary", "", markdown_table(rows, ("metric", "value")), ""]
    if summary.get("versions"):
        lines += ["## Versions", "", markdown_table(summary["versions"].items(), ("package", "version")), ""]
    plots = _plot_files(outdir, metrics)
    lines += ["## Plots", ""]
    if plots:
        for p in plots:
            lines += [f"### {p.stem}", "", f"![{p.stem}](plots/{p.name})", ""]
    else:
        lines += ["No plots (`--no-plots`).", ""]
    path = outdir / "report.md"
    write_atomic(path, "\n".join(lines))
    return path


def _plot_files(outdir: Path, metrics: Iterable[str]) -> list[Path]:
    pdir = outdir / "plots"
    if not pdir.is_dir():
        return []
    pngs = {p.stem: p for p in pdir.glob("*.png")}
    first = [pngs.pop(m) for m in metrics if m in pngs]  # the step metrics in History's order, then the rest
    return first + [pngs[k] for k in sorted(pngs)]


def finish_run(run, summary: Mapping[str, Any], *, rate_key: str = "tps") -> None:
    """The end of :func:`mmm.training.summary.write_summary` on rank 0: the summary table, ``report.md``, and
    the trackers closed with the summary (other ranks: nothing)."""
    if not run.info.is_main:
        return
    rows = summary_rows(
        summary,
        rate_key=rate_key,
        slowest_ranks=[r.get("slowest_rank") for r in run.hist.rows if r.get("slowest_rank") is not None],
    )
    print_summary(rows, title=f"{run.example} summary", log=run.log)
    if run.hist.write:
        write_report(run.outdir, summary, rows, example=run.example, metrics=run.hist.metrics)
    run.trackers.close(tracker_summary(summary))
