"""Per-step training history: live ``history.jsonl``, then an xarray dataset, summary and plots.

Usable by any training loop::

    hist = History("outputs/run1", write=(rank == 0))
    for step in range(n):
        ...
        hist.update(step, loss=loss, dt=dt, dtf=dtf, dtb=dtb, tokens_per_s=tps)   # floats or 0-d tensors
        # or: hist.update({"loss": loss, "dt": dt}, step=step)
    summary = hist.finalize(extra={"world_size": 4})   # history.nc, summary.json, plots/

``update`` appends one JSON line per call and flushes it, so a crash loses nothing that finished (a step's
later metrics, ``update(step, val_loss=...)``, add a line of that step). ``finalize`` writes ``history.nc``
(netCDF, the file xarray writes), ``summary.json`` (mean/std/min/max of each metric with the first ``warmup``
steps excluded, plus ``extra``) and ``plots/<metric>.txt`` (plotext) and ``plots/<metric>.png`` (matplotlib),
each file written to a temporary name and renamed into place. There are no hidden collectives: gathering
across ranks is the caller's explicit choice. Heavy packages (xarray, plotext, matplotlib) load only inside
``finalize``. ``hooks`` are called with each record as it is made (experiment trackers, :mod:`mmm.tracking`);
with none, ``update`` does no more than before.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from mmm import faults
from mmm.errors import UsageError
from mmm.files import fsync_path, write_atomic
from mmm.log import get_logger

DEFAULT_WARMUP = 2
TEXT_PLOT_POINTS = 400  # plotext draws at most this many points (evenly strided)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _scalar(v: Any) -> float | int | None:
    if v is None or isinstance(v, (int, float)):
        return v
    item = getattr(v, "item", None)  # torch/numpy 0-d
    if item is not None:
        return item()
    return float(v)


def _json_line(rec: dict) -> str:
    """``json.dumps(rec) + "\\n"`` for flat records of numbers, about 2x faster for identifier keys."""
    parts = []
    for k, v in rec.items():
        key = f'"{k}"' if k.isidentifier() else json.dumps(k)  # "train/loss", a quote: json escapes it
        if type(v) is float and math.isfinite(v) or type(v) is int:
            parts.append(f"{key}: {v!r}")
        else:  # None, bool, nan/inf: let json spell them
            parts.append(f"{key}: {json.dumps(v)}")
    return "{" + ", ".join(parts) + "}\n"


MAX_FILE_NAME = 100  # a longer name is cut and told apart by a checksum of the whole (a file name holds 255 bytes)


def file_name(metric: str) -> str:
    """A metric's name as a file or netCDF variable name: ``/`` (``train/loss``) and other characters a
    path or an HDF5 name cannot hold become ``_``, as do names of dots alone (the folder itself, HDF5's
    group); a name over :data:`MAX_FILE_NAME` characters is cut, with a checksum of the whole after it."""
    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", metric) or "_"
    if not name.strip("."):
        name = "_" * len(name)
    if len(name) > MAX_FILE_NAME:
        name = f"{name[: MAX_FILE_NAME - 9]}-{zlib.crc32(metric.encode()):08x}"
    return name


def read_rows(path: Path, step_key: str = "iter") -> tuple[list[dict], list[str]]:
    """The rows of a ``history.jsonl`` (a later line of the same step adds to its row) and the lines that are
    no step's row (cut short by a crash, edited)."""
    rows: list[dict] = []
    unread: list[str] = []
    for line in path.read_text(encoding="utf-8", errors="surrogateescape").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if isinstance(rec, dict) and type(rec.get(step_key)) is int:
            if rows and rows[-1][step_key] == rec[step_key]:
                rows[-1].update(rec)
            else:
                rows.append(rec)
        elif line.strip():
            unread.append(line)
    return rows, unread


def _aside_path(path: Path) -> Path:
    """``<name>.replaced-<UTC time>-<pid>.jsonl`` beside ``path``, one that does not exist yet."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = path.with_name(f"{path.stem}.replaced-{stamp}-{os.getpid()}.jsonl")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.stem}.replaced-{stamp}-{os.getpid()}-{n}.jsonl")
    return aside


def keep_aside(path: Path, rows: list[dict], step_key: str, unread: Iterable[str] = ()) -> Path:
    """Write ``rows`` (the steps a resume runs again) and ``unread`` (lines that are no step's row: cut short
    by a crash, or edited) to ``<name>.replaced-<UTC time>-<pid>.jsonl`` beside ``path`` before the history
    drops them, and say so: a rolled-back run's abandoned steps stay."""
    aside = _aside_path(path)
    unread = list(unread)
    write_atomic(aside, "".join(_json_line(r) for r in rows) + "".join(f"{line}\n" for line in unread))
    steps = [r[step_key] for r in rows]
    what = [f"{step_key} {min(steps)}-{max(steps)} run again" if steps else ""]
    what += [f"{len(unread)} lines that are no step's row" if unread else ""]
    get_logger().info("history: %s; the earlier run's lines are kept in %s", ", ".join(w for w in what if w), aside)
    return aside


class History:
    """Collects per-step scalars; see the module docstring."""

    def __init__(
        self,
        outdir: str | os.PathLike | None = None,
        *,
        write: bool = True,
        warmup: int = DEFAULT_WARMUP,
        name: str = "history",
        step_key: str = "iter",
        resume: int | None = None,
        hooks: Iterable[Callable[[dict], Any]] = (),
    ) -> None:
        """``name`` names the files (``<name>.jsonl``, ``<name>.nc``; plots ``<name>_<metric>`` unless
        it is "history"), so one run can keep per-step and per-epoch histories side by side.

        A new History starts ``<name>.jsonl`` afresh (an earlier one there is moved to
        ``<name>.replaced-<UTC time>-<pid>.jsonl`` beside it, never emptied); ``resume=N`` keeps its records
        up to step N (those a checkpoint of step N covers), moves later ones (they will be run again) and
        lines that are no step's row to ``<name>.replaced-<UTC time>-<pid>.jsonl``, and appends after them.
        Metric names may hold any character: files and netCDF variables take :func:`file_name`. ``hooks`` (also
        ``self.hooks``, a list): called with every new record."""
        self.outdir = Path(outdir) if outdir is not None else None
        self.write = write and self.outdir is not None
        self.warmup = warmup
        self.name = name
        self.step_key = step_key
        self.rows: list[dict[str, float | int | None]] = []
        self.hooks: list[Callable[[dict], Any]] = list(hooks)
        self._file = None
        self.finalized = False  # finalize() closed the files: a later update would be lost, so it is refused
        self.replaced: Path | None = None  # where a resume kept the rows of the steps it runs again
        path = self.outdir / f"{name}.jsonl" if self.outdir is not None else None
        later: list[dict] = []  # rows of steps after ``resume``: they will run again
        unread: list[str] = []  # lines that are no step's row (cut short by a crash, edited): kept aside too
        if path is not None and path.is_dir():
            raise UsageError(f"{path} is a folder; History writes {path.name} there: give another outdir")
        if resume is not None and path is not None and path.is_file():
            rows, unread = read_rows(path, step_key)
            self.rows = [r for r in rows if r[step_key] <= resume]
            later = [r for r in rows if r[step_key] > resume]
        self._resumed_rows = len(self.rows)  # this process's first row: its first steps warm up again
        if self.write:
            self.outdir.mkdir(parents=True, exist_ok=True)
            if resume is not None:
                if later or unread:  # kept, not dropped: a rolled-back branch's steps (its loss spike, say)
                    self.replaced = keep_aside(path, later, step_key, unread)
                write_atomic(path, "".join(_json_line(r) for r in self.rows))
            elif path.is_file() and path.stat().st_size:  # an earlier history here: set aside, never emptied
                self.replaced = _aside_path(path)
                os.replace(path, self.replaced)
                get_logger().info("history: %s held an earlier history: moved to %s", path, self.replaced)
            # line-buffered: every step reaches the OS as it finishes (survives a crash or SIGKILL)
            self._file = open(path, "a" if resume is not None else "w", buffering=1, encoding="utf-8")

    def update(
        self, step: int | Mapping[str, Any] | None = None, values: Mapping[str, Any] | None = None, /, **metrics: Any
    ) -> dict:
        """Record one step's metrics (floats, ints or 0-d tensors); returns the record.

        ``update(3, loss=1.0)``, ``update(3, {"loss": 1.0})`` and ``update({"loss": 1.0}, step=3)``
        record the same; a mapping may carry the step under the step key (``{"iter": 3, ...}``, a
        record of another History). Without a step the record gets the next index (one past the last step).

        The step of the last record again adds to its row (``update(3, val_loss=...)`` after the training
        metrics of step 3; a metric given twice keeps the later value): ``history.jsonl`` gets a line of the
        step and the new metrics, read back as one row. A step before the last is refused (UsageError)."""
        if self.finalized:
            raise UsageError(
                f"History.update after finalize(): {self.name}.jsonl is closed and {self.name}.nc written, so this "
                f"record would be lost; record every step before finalize(), or go on in History(..., resume=N)"
            )
        if step is not None and type(step) is not int and isinstance(step, Mapping):
            if values is not None:
                raise TypeError("update(metrics, step=N): pass the step by keyword after a mapping")
            values, step = step, None
        values = dict(values) if values is not None else None  # the caller's mapping is left as it was
        for given in (values or {}, metrics):  # the step by name: update(step=3, ...), update({"iter": 3, ...})
            for key in dict.fromkeys(("step", self.step_key)):
                if key in given:
                    if step is not None:
                        raise UsageError(f"History.update: the step given twice ({step} and {key}={given[key]})")
                    step = given.pop(key)
        if values is not None:
            metrics = values | metrics
        if step is None:  # the next index: one past the last step (0 first)
            step = self.rows[-1][self.step_key] + 1 if self.rows else 0
        whole = step if type(step) is int else _scalar(step) if hasattr(step, "item") else step
        if type(whole) not in (int, float) or not math.isfinite(whole) or whole != int(whole):
            raise UsageError(f"History.update: step {step!r} is not a whole number")
        rec = {self.step_key: int(whole)}
        for k, v in metrics.items():
            if type(k) is not str:  # checked before the row is kept: a failed update leaves no trace
                raise UsageError(f"History.update: metric name {k!r} is not a string")
            t = type(v)
            rec[k] = v if t is float or t is int or v is None else _scalar(v)
        row = rec
        if self.rows and (last := self.rows[-1][self.step_key]) >= rec[self.step_key]:
            if last > rec[self.step_key]:
                raise UsageError(
                    f"History.update: {self.step_key} {rec[self.step_key]} comes after {self.step_key} {last}; "
                    f"steps may not go back (a run that runs steps again: History(..., resume=N))"
                )
            row = self.rows[-1]
            row.update(rec)
        else:
            self.rows.append(rec)
        if self._file is not None:
            line = _json_line(rec)
            if self.name == "history" and faults.save_fault("history", rec[self.step_key]):  # a kill mid-line
                self._file.write(line[: len(line) // 2])
                self._file.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            self._file.write(line)
        if self.hooks:
            for hook in self.hooks:
                hook(rec)
        return row

    def sync(self) -> None:
        """Make the rows written so far durable (``history.jsonl`` is appended a line at a time: a killed
        process loses none, a node crash could lose the last ones): at every checkpoint and at the end."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def __len__(self) -> int:
        return len(self.rows)

    def file_names(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """Each metric's :func:`file_name`, unique (``train/loss`` and ``train_loss`` both recorded: the second
        in order of first appearance gets ``_2``), the same on every call."""
        out: dict[str, str] = {}
        taken: set[str] = set()
        for m in self.metrics if names is None else names:
            base = name = file_name(m)
            n = 1
            while name in taken or name == self.step_key:
                n += 1
                name = f"{base}_{n}"
            taken.add(name)
            out[m] = name
        return out

    @property
    def metrics(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.rows:
            for k in r:
                if k != self.step_key:
                    seen.setdefault(k, None)
        return list(seen)

    def series(self, name: str) -> list[float]:
        return [math.nan if r.get(name) is None else float(r[name]) for r in self.rows]

    def steps(self) -> list[int]:
        return [int(r[self.step_key]) for r in self.rows]

    # ------------------------------------------------------------------ summaries
    def warm_rows(self, warmup: int | None = None) -> set[int]:
        """The rows (indices) a warm-up leaves out of :meth:`stats`: the first ``warmup`` of the history, and
        of this process after a resume (its first steps compile and fill caches again); when that would leave
        no row, the history's first ones alone; when even that would, none."""
        warmup = self.warmup if warmup is None else warmup
        n = len(self.rows)
        for starts in ({0, self._resumed_rows} if self._resumed_rows < n else {0}, {0}):  # both, else the first
            out = {i for s in starts for i in range(s, min(s + warmup, n))}
            if len(out) < n:
                return out
        return set()

    def stats(self, warmup: int | None = None) -> dict[str, dict[str, float]]:
        """mean/std/min/max of every metric with the warm-up's rows (:meth:`warm_rows`) left out, and its
        last recorded value."""
        warm = self.warm_rows(warmup)
        out = {}
        for name in self.metrics:
            values = self.series(name)
            kept = [v for i, v in enumerate(values) if i not in warm and not math.isnan(v)]
            if not kept:
                continue
            mean = sum(kept) / len(kept)
            var = sum((v - mean) ** 2 for v in kept) / len(kept)
            out[name] = {
                "mean": mean,
                "std": math.sqrt(var),
                "min": min(kept),
                "max": max(kept),
                "last": next(float(r[name]) for r in reversed(self.rows) if r.get(name) is not None),
                "n": len(kept),
            }
        return out

    def to_dataset(self, attrs: Mapping[str, Any] | None = None):
        """The history as an ``xarray.Dataset`` with one variable per metric along ``iter``."""
        import numpy as np
        import xarray as xr

        coords = {self.step_key: np.asarray(self.steps(), dtype=np.int64)}
        names = self.file_names()
        data = {names[m]: ((self.step_key,), np.asarray(self.series(m), dtype=np.float64)) for m in self.metrics}
        ds = xr.Dataset(data, coords=coords)
        for m, name in names.items():  # a metric renamed for the file (``train/loss``) keeps its name beside it
            if name != m:
                ds[name].attrs["long_name"] = m
        ds.attrs.update(_netcdf_attrs(attrs))
        return ds

    def _write_netcdf(self, path: Path, attrs: Mapping[str, Any]) -> None:
        """``to_dataset(attrs).to_netcdf(path)``, the same file; with h5netcdf it is written directly, without
        importing xarray (about 0.3 s at the end of every run)."""
        try:
            import h5netcdf
        except ImportError:
            self.to_dataset(attrs).to_netcdf(path, engine=_netcdf_engine())
            return
        import numpy as np

        with h5netcdf.File(path, "w") as f:
            f.dimensions = {self.step_key: len(self.rows)}
            f.create_variable(self.step_key, (self.step_key,), data=np.asarray(self.steps(), dtype=np.int64))
            for m, name in self.file_names().items():  # xarray's encoding of a float: NaN marks a missing value
                v = f.create_variable(name, (self.step_key,), dtype=np.float64, fillvalue=np.nan)
                v[:] = np.asarray(self.series(m), dtype=np.float64)
                if name != m:
                    v.attrs["long_name"] = m
            for k, v in _netcdf_attrs(attrs).items():
                f.attrs[k] = v

    # ------------------------------------------------------------------ finalize
    def finalize(
        self,
        extra: Mapping[str, Any] | None = None,
        *,
        plots: bool = True,
        print_plots: bool = True,
        metrics_to_plot: Iterable[str] | None = None,
        summary_file: str | None = "summary.json",
    ) -> dict[str, Any]:
        """Write ``<name>.nc``, ``summary.json`` (unless ``summary_file=None``) and plots; returns the
        summary (also on non-writing ranks)."""
        summary: dict[str, Any] = {
            "steps": len(self.rows),
            "warmup_excluded": len(self.warm_rows()),  # too few: every step counts
            "stats": self.stats(),
            **(extra or {}),
        }
        if self._file is not None:
            self.sync()
            self._file.close()
            self._file = None
        self.finalized = True
        if not self.write or not self.rows:
            return summary
        tmp = self.outdir / f".{self.name}.nc.tmp"
        self._write_netcdf(tmp, {k: v for k, v in summary.items() if k != "stats"})
        fsync_path(tmp)
        os.replace(tmp, self.outdir / f"{self.name}.nc")
        fsync_path(self.outdir)
        if summary_file:
            write_atomic(self.outdir / summary_file, json.dumps(summary, indent=2, default=str) + "\n")
        if plots:
            names = list(metrics_to_plot) if metrics_to_plot is not None else self.metrics
            self._plots(names, print_plots)
        return summary

    def _plots(self, names: list[str], print_plots: bool) -> None:
        pdir = self.outdir / "plots"
        pdir.mkdir(exist_ok=True)
        steps = self.steps()
        texts = []
        prefix = "" if self.name == "history" else f"{self.name}_"
        files = self.file_names()
        for name in names:
            text = text_plot(steps, self.series(name), title=f"{prefix}{name}", xlabel=self.step_key)
            write_atomic(pdir / f"{prefix}{files.get(name, file_name(name))}.txt", text + "\n", durable=False)  # remade
            texts.append(text)
        if print_plots and texts:
            sys.stdout.write("\n".join(texts) + "\n")
            sys.stdout.flush()
        image_plots(
            steps,
            {f"{prefix}{files.get(n, file_name(n))}": self.series(n) for n in names},
            pdir,
            xlabel=self.step_key,
            titles={f"{prefix}{files.get(n, file_name(n))}": f"{prefix}{n}" for n in names},
        )


def _netcdf_attrs(attrs: Mapping[str, Any] | None) -> dict[str, Any]:
    """netCDF attributes: numbers and strings as they are; anything else (bool, None, nesting) as JSON."""
    out = {}
    for k, v in (attrs or {}).items():
        plain = isinstance(v, (int, float, str)) and not isinstance(v, bool)
        out[k] = v if plain else json.dumps(v, default=str)
    return out


def _netcdf_engine() -> str | None:
    for module, engine in (("h5netcdf", "h5netcdf"), ("netCDF4", "netcdf4"), ("scipy", "scipy")):
        try:
            __import__(module)
            return engine
        except ImportError:
            continue
    raise ImportError("writing history.nc needs h5netcdf (pip install 'mmm[history]'), netCDF4 or scipy")


def text_plot(
    x: list[int], y: list[float], *, title: str, xlabel: str = "iter", width: int = 100, height: int = 18
) -> str:
    """A plotext line plot as plain text (no colour codes), at most TEXT_PLOT_POINTS points."""
    import plotext as plt

    stride = max(1, -(-len(x) // TEXT_PLOT_POINTS))
    pts = [(a, b) for a, b in zip(x[::stride], y[::stride]) if math.isfinite(b)]  # inf: no point to draw
    plt.clf()
    plt.theme("clear")
    plt.plotsize(width, height)
    if pts:
        plt.plot([p[0] for p in pts], [p[1] for p in pts], marker="braille")
    plt.title(title)
    plt.xlabel(xlabel)
    return _ANSI.sub("", plt.build())


def image_plots(
    x: list[int],
    series: Mapping[str, list[float]],
    outdir: Path,
    *,
    xlabel: str = "iter",
    titles: Mapping[str, str] | None = None,
) -> None:
    """One PNG per metric (matplotlib, Agg backend), ``<key>.png`` (``titles``: a key's title, else the key)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    for name, y in series.items():
        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
        finite = [math.isfinite(v) for v in y]
        alone = any(
            f and not (i and finite[i - 1]) and not (i + 1 < len(y) and finite[i + 1]) for i, f in enumerate(finite)
        )
        if alone:  # a point between gaps (an evaluation every few steps) draws no line: its points joined, marked
            points = [(a, v) for a, v, f in zip(x, y, finite) if f]
            ax.plot([a for a, _ in points], [v for _, v in points], lw=1, marker="o", ms=3)
        else:
            ax.plot(x, [v if math.isfinite(v) else math.nan for v in y], lw=1)  # inf: a gap, as NaN
        ax.set_xlabel(xlabel)
        ax.set_title((titles or {}).get(name, name))
        ax.grid(alpha=0.3)
        fig.tight_layout()
        tmp = outdir / f".{file_name(name)}.png.tmp"
        fig.savefig(tmp, format="png")
        plt.close(fig)
        os.replace(tmp, outdir / f"{file_name(name)}.png")
