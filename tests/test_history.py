"""History: live jsonl, warmup-excluded stats, netCDF, summary.json and plots, with real packages."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from mmm.errors import UsageError
from mmm.history import History


def test_update_appends_a_line_per_step_immediately(tmp_path):
    h = History(tmp_path, warmup=1)
    h.update(1, loss=torch.tensor(2.5), dt=0.1)
    # visible before finalize: a crash after this step loses nothing
    assert json.loads((tmp_path / "history.jsonl").read_text()) == {"iter": 1, "loss": 2.5, "dt": 0.1}
    h.update(2, loss=2.0, dt=0.2, tps=torch.tensor(1000, dtype=torch.int64))
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    assert [json.loads(x)["iter"] for x in lines] == [1, 2] and json.loads(lines[1])["tps"] == 1000


def _record_fsyncs(monkeypatch) -> list[str]:
    """The paths os.fsync is called on from now on (through /proc/self/fd)."""
    synced, real = [], os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name the fsynced files")
def test_files_are_written_whole_and_durably(tmp_path, monkeypatch):
    """write_atomic: a failed write leaves the old file and no temporary one; a durable write fsyncs the
    data before the rename and the folder after it; the history is fsynced at a checkpoint (sync) and at
    the end, its resume rewrite and summary.json as they are written."""
    from mmm.files import write_atomic

    synced = _record_fsyncs(monkeypatch)
    path = tmp_path / "summary.json"
    path.write_text("old")

    def half_then_full_disk(f) -> None:
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomic(path, half_then_full_disk)
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["summary.json"]
    write_atomic(path, "new \udcff")  # a kept line's undecodable byte, as it was read
    assert path.read_bytes() == b"new \xff" and synced == [str(tmp_path / ".summary.json.tmp"), str(tmp_path)]
    synced.clear()
    write_atomic(path, b"remade", durable=False)
    assert path.read_bytes() == b"remade" and not synced

    h = History(tmp_path / "run")
    h.update(1, loss=1.0)
    h.sync()
    assert synced == [str(tmp_path / "run" / "history.jsonl")]
    synced.clear()
    again = History(tmp_path / "run", resume=0)  # rewritten: step 1 set aside, the history emptied
    assert str(tmp_path / "run" / "history.jsonl") in [s.replace(".history.jsonl.tmp", "history.jsonl") for s in synced]
    again.update(1, loss=2.0)
    synced.clear()
    again.finalize(plots=False)
    assert synced[0] == str(tmp_path / "run" / "history.jsonl"), synced
    assert str(tmp_path / "run" / ".summary.json.tmp") in synced


def test_a_resume_keeps_the_rows_of_the_steps_it_runs_again_beside_the_history(tmp_path):
    """A rollback (--resume 2 after 5 steps) drops steps 3-5 from history.jsonl, which will hold each step
    once; the earlier run's rows of them (the loss spike the user rolled back from) are kept beside it."""
    first = History(tmp_path)
    for step in range(1, 6):
        first.update(step, loss=10.0 * step)  # each line reaches the file as the step finishes
    again = History(tmp_path, resume=2)
    assert [r["iter"] for r in again.rows] == [1, 2]
    again.update(3, loss=1.5)
    rows = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert rows == [{"iter": 1, "loss": 10.0}, {"iter": 2, "loss": 20.0}, {"iter": 3, "loss": 1.5}]
    (kept,) = tmp_path.glob("history.replaced-*.jsonl")
    assert again.replaced == kept
    assert [json.loads(x) for x in kept.read_text().splitlines()] == [{"iter": s, "loss": 10.0 * s} for s in (3, 4, 5)]
    History(tmp_path, resume=3)  # nothing after step 3: nothing more set aside
    assert len(list(tmp_path.glob("history.replaced-*.jsonl"))) == 1


def test_stats_exclude_warmup():
    h = History(None, warmup=2)
    for i, dt in enumerate([10.0, 5.0, 1.0, 2.0, 3.0], start=1):
        h.update(i, dt=dt)
    s = h.stats()["dt"]
    assert (s["mean"], s["min"], s["max"], s["n"], s["last"]) == (2.0, 1.0, 3.0, 3, 3.0)
    assert math.isclose(s["std"], math.sqrt(2 / 3))
    short = History(None, warmup=5)
    short.update(1, dt=4.0)
    assert short.stats()["dt"]["mean"] == 4.0  # too few steps: nothing excluded
    assert short.finalize(summary_file=None, plots=False)["warmup_excluded"] == 0  # and the summary says so
    assert h.finalize(summary_file=None, plots=False)["warmup_excluded"] == 2


def test_a_resumed_history_leaves_out_its_own_warmup_and_keeps_the_last_recorded_value(tmp_path):
    """Resumed at step 3, the restarted process's first steps (compiling, filling caches again) are left out
    of the means as the history's first ones are (it left out steps 1-2 only: a slow step 4 counted); "last"
    is the last value recorded (NaN when the last row did not carry the metric)."""
    h = History(tmp_path, warmup=2)
    for i, dt in enumerate([9.0, 8.0, 1.0, 1.0, 1.0], start=1):
        h.update(i, dt=dt)
    h.finalize(plots=False)
    again = History(tmp_path, warmup=2, resume=3)
    for i, dt in enumerate([7.0, 6.0, 2.0, 2.0], start=4):
        again.update(i, dt=dt, val=float(i) if i == 6 else None)
    again.update(8, loss=0.5)  # a last row without dt or val
    s = again.finalize(plots=False)
    assert s["warmup_excluded"] == 4 and s["stats"]["dt"]["n"] == 3, s  # steps 1-2 and 4-5 out
    assert s["stats"]["dt"]["mean"] == pytest.approx(5 / 3) and s["stats"]["dt"]["last"] == 2.0, s
    assert s["stats"]["val"]["last"] == 6.0, s
    short = History(tmp_path / "short", warmup=2)  # the two warm-ups would leave nothing: the first alone
    for i in (1, 2):
        short.update(i, dt=9.0)
    short.finalize(plots=False)
    short = History(tmp_path / "short", warmup=2, resume=2)
    for i in (3, 4):
        short.update(i, dt=1.0)
    assert short.finalize(plots=False)["stats"]["dt"] == pytest.approx({"mean": 1.0, "std": 0.0, "min": 1.0,
                                                                        "max": 1.0, "last": 1.0, "n": 2})  # fmt: skip


def test_a_bad_update_is_refused_before_it_leaves_a_trace(tmp_path):
    """update(step=N, ...) records step N (step was positional only: it became a metric and the row took the
    next index); a step given twice, a step that is no whole number, a metric name that is no string are
    refused, and leave nothing behind: finalize writes every output as if they were never tried."""
    h = History(tmp_path, warmup=0)
    assert h.update(step=5, loss=1.0) == {"iter": 5, "loss": 1.0}
    assert h.update(iter=6, loss=2.0) == {"iter": 6, "loss": 2.0}
    for call, needle in [
        (lambda: h.update(7, iter=9, loss=1.0), "the step given twice (7 and iter=9)"),
        (lambda: h.update(24.7, loss=1.0), "step 24.7 is not a whole number"),
        (lambda: h.update(8, {1: 2.0}), "metric name 1 is not a string"),
        (lambda: h.update({"step": 7, "iter": 7}), "the step given twice (7 and iter=7)"),
        (lambda: h.update("7", loss=1.0), "step '7' is not a whole number"),
        (lambda: h.update(float("nan"), loss=1.0), "step nan is not a whole number"),
    ]:
        with pytest.raises(UsageError, match=re.escape(needle)):
            call()
    assert h.steps() == [5, 6]
    mine = {"step": 7.0, "loss": 3.0}
    assert h.update(mine) == {"iter": 7, "loss": 3.0} and mine == {"step": 7.0, "loss": 3.0}  # a whole float; as given
    h.finalize(print_plots=False)
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3


def test_finalize_writes_dataset_summary_and_plots(tmp_path, capsys):
    import xarray as xr

    h = History(tmp_path, warmup=1)
    for i in range(1, 21):
        h.update(i, loss=1.0 / i, dt=0.01 * i, dtf=0.004 * i, dtb=0.006 * i)
    h.update(21, loss=0.04)  # a metric may be missing on a step
    summary = h.finalize({"world_size": 4, "strategy": "fsdp", "compile": False, "mfu": None})
    ds = xr.open_dataset(tmp_path / "history.nc")
    assert list(ds["iter"].values) == list(range(1, 22))
    assert ds["loss"].values[0] == 1.0 and math.isnan(float(ds["dt"].values[-1]))
    assert ds.attrs["world_size"] == 4 and ds.attrs["strategy"] == "fsdp"
    ds.close()
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["stats"]["dt"]["n"] == 19 and on_disk["world_size"] == 4
    for metric in ("loss", "dt", "dtf", "dtb"):
        text = (tmp_path / "plots" / f"{metric}.txt").read_text()
        assert metric in text and "\x1b[" not in text  # plain text, no colour codes
        png = (tmp_path / "plots" / f"{metric}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "loss" in capsys.readouterr().out  # the text plots are printed too
    assert not list(tmp_path.glob(".*tmp"))  # atomic writes leave no temporaries


def test_a_metric_of_some_steps_is_drawn_in_its_image(tmp_path):
    """An evaluation every 4th step (NaN between) is drawn as its points joined and marked: as a line with
    gaps at every NaN it left the image with axes alone."""
    mpimg = pytest.importorskip("matplotlib.image")
    h = History(tmp_path)
    for i in range(1, 41):
        h.update(i, loss=1.0 / i, **({"val_loss": 2.0 / i} if i % 4 == 0 else {}), **({"acc": i} if i % 2 else {}))
    h.finalize(print_plots=False)
    for metric in ("loss", "val_loss", "acc"):  # acc: every other step, half of them
        rgb = mpimg.imread(tmp_path / "plots" / f"{metric}.png")[..., :3]
        line = (abs(rgb[..., 0] - 0x1F / 255) < 0.05) & (abs(rgb[..., 2] - 0xB4 / 255) < 0.05)  # matplotlib's C0
        assert line.sum() > 100, (metric, int(line.sum()))


def test_non_writing_rank_writes_nothing_but_returns_summary(tmp_path):
    h = History(tmp_path / "r1", write=False)
    h.update(1, loss=1.0)
    assert h.finalize({"x": 1})["stats"]["loss"]["mean"] == 1.0
    assert not (tmp_path / "r1").exists()


def test_import_history_is_light():
    code = (
        "import sys, mmm.history\nprint([m for m in ('xarray', 'matplotlib', 'plotext', 'torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_update_takes_keywords_or_a_dict(tmp_path):
    h = History(tmp_path)
    h.update(1, loss=1.0, dt=0.5)
    h.update({"loss": 0.9, "dt": 0.4}, step=2)
    h.update(3, {"loss": 0.8}, dt=0.3)
    h.update({"iter": 4, "loss": 0.7})  # a record of another History: its step comes along
    h.update({"loss": torch.tensor(0.6)})  # no step: the next index
    rows = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert rows == [
        {"iter": 1, "loss": 1.0, "dt": 0.5},
        {"iter": 2, "loss": 0.9, "dt": 0.4},
        {"iter": 3, "loss": 0.8, "dt": 0.3},
        {"iter": 4, "loss": 0.7},
        {"iter": 5, "loss": pytest.approx(0.6)},  # one past the last step (it was the count of rows: 4 again)
    ]
    assert h.update(step=9) == {"iter": 9}  # the step by keyword, as after a mapping
    with pytest.raises(TypeError):
        h.update({"loss": 1.0}, {"dt": 1.0})


def test_a_step_recorded_again_adds_to_its_row_and_a_step_back_is_refused(tmp_path):
    """Evaluation logged after the training metrics of the same step: one row in memory, in history.nc and
    in a resume's read of history.jsonl (two lines there, the second with the new metrics); a step before
    the last is refused, not a second row out of order."""
    seen = []
    h = History(tmp_path, hooks=[seen.append])
    h.update(1, loss=2.0, dt=0.5)
    h.update(2, loss=1.5, dt=0.4)
    row = h.update(2, val_loss=1.7, dt=0.45)
    assert row == {"iter": 2, "loss": 1.5, "dt": 0.45, "val_loss": 1.7}  # the step's whole row
    assert seen[-1] == {"iter": 2, "val_loss": 1.7, "dt": 0.45}  # trackers get what is new
    assert h.steps() == [1, 2] and h.series("val_loss") == [pytest.approx(float("nan"), nan_ok=True), 1.7]
    lines = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [x["iter"] for x in lines] == [1, 2, 2] and lines[2] == {"iter": 2, "val_loss": 1.7, "dt": 0.45}
    with pytest.raises(UsageError, match="iter 1 comes after iter 2; steps may not go back"):
        h.update(1, loss=9.0)
    assert h.steps() == [1, 2] and len((tmp_path / "history.jsonl").read_text().splitlines()) == 3
    h.update(3, loss=1.2)
    h.finalize(plots=False)
    with pytest.raises(UsageError, match="History.update after finalize"):  # it would reach no file
        h.update(4, loss=1.0)
    xr = pytest.importorskip("xarray")
    with xr.open_dataset(tmp_path / "history.nc") as ds:
        assert list(ds["iter"].values) == [1, 2, 3] and float(ds["val_loss"].sel(iter=2)) == 1.7
    again = History(tmp_path, resume=2)  # read back: one row a step
    assert again.rows == [{"iter": 1, "loss": 2.0, "dt": 0.5}, {"iter": 2, "loss": 1.5, "dt": 0.45, "val_loss": 1.7}]


def test_hooks_see_every_record_as_it_is_made():
    seen = []
    h = History(None, hooks=[seen.append])
    h.update(1, loss=2.0)
    h.hooks.append(lambda rec: seen.append(("second", rec["iter"])))
    h.update({"loss": 1.0}, step=2)
    assert seen == [{"iter": 1, "loss": 2.0}, {"iter": 2, "loss": 1.0}, ("second", 2)]


def test_history_nc_is_the_file_xarray_writes_written_without_xarray(tmp_path):
    """finalize writes history.nc with h5netcdf directly: the same dataset as xarray's own to_netcdf
    (values, a missing value, the coordinate, attributes of every kind), and xarray is not imported."""
    code = f"""
import sys, math
from mmm.errors import UsageError
from mmm.history import History
h = History({str(tmp_path)!r}, warmup=1)
for i in range(1, 6):
    h.update(i, loss=1.0 / i, dt=0.01 * i)
h.update(6, loss=0.1)  # dt missing on the last step
h.finalize({{"world_size": 4, "strategy": "fsdp", "compile": False, "mfu": None, "mesh": {{"tp": 2}}}}, plots=False)
assert "xarray" not in sys.modules, "finalize imported xarray"
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
    import xarray as xr

    h = History(None)
    for row in (json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()):
        h.update(row.pop("iter"), **row)
    attrs = json.loads((tmp_path / "summary.json").read_text())
    attrs.pop("stats")
    h.to_dataset(attrs).to_netcdf(tmp_path / "by_xarray.nc", engine="h5netcdf")
    with xr.open_dataset(tmp_path / "history.nc") as ours, xr.open_dataset(tmp_path / "by_xarray.nc") as theirs:
        assert ours.identical(theirs), (ours, theirs)
        assert math.isnan(float(ours["dt"].values[-1])) and ours.attrs["mesh"] == '{"tp": 2}'
        assert ours["iter"].dtype == theirs["iter"].dtype and list(ours.data_vars) == list(theirs.data_vars)


def test_an_earlier_history_is_moved_aside_never_emptied(tmp_path):
    """History(outdir) over an outdir that holds a history.jsonl: the earlier one is kept beside it (it was
    opened with "w": emptied); a resume keeps a line that is no step's row (cut short, edited) aside too."""
    first = History(tmp_path)
    first.update(1, loss=1.0)
    first.update(2, loss=2.0)
    again = History(tmp_path)
    assert not (tmp_path / "history.jsonl").read_text()
    assert [json.loads(x)["loss"] for x in again.replaced.read_text().splitlines()] == [1.0, 2.0]
    again.update(1, loss=3.0)
    with open(tmp_path / "history.jsonl", "ab") as f:  # a float step, a line cut short mid-character
        f.write(b'{"iter": 2.0, "loss": 4.0}\n{"iter": 3, "lo\xc3')
    resumed = History(tmp_path, resume=1)
    assert [r["loss"] for r in resumed.rows] == [3.0]
    kept = resumed.replaced.read_bytes().splitlines()
    assert kept == [b'{"iter": 2.0, "loss": 4.0}', b'{"iter": 3, "lo\xc3'], kept  # byte for byte
    assert len(list(tmp_path.glob("history.replaced-*.jsonl"))) == 2
    (tmp_path / "d" / "history.jsonl").mkdir(parents=True)
    with pytest.raises(UsageError, match="history.jsonl is a folder; History writes history.jsonl there"):
        History(tmp_path / "d")


def test_any_metric_name_and_infinite_values_reach_every_output(tmp_path):
    """A name with '/' (train/loss) or a quote, and an infinite value (a perplexity of a NaN loss), in the jsonl,
    the netCDF, the text and image plots (an inf crashed the text plots at the end of a run)."""
    import xarray as xr

    h = History(tmp_path, warmup=0)
    for step, loss in enumerate([1.0, math.inf, 2.0], start=1):
        h.update(step, **{"train/loss": loss, 'say "hi"': 1.0})
    rows = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in rows] == [1.0, math.inf, 2.0] and rows[0]['say "hi"'] == 1.0
    h.finalize(print_plots=False)
    ds = xr.open_dataset(tmp_path / "history.nc")
    assert list(ds["train_loss"].values[[0, 2]]) == [1.0, 2.0] and math.isinf(ds["train_loss"].values[1])
    assert sorted(p.name for p in (tmp_path / "plots").glob("*.txt")) == ["say__hi_.txt", "train_loss.txt"]
    assert (tmp_path / "plots" / "train_loss.png").stat().st_size > 1000
    odd = History(tmp_path / "odd", warmup=0)  # "." names the folder (and HDF5's group); 300 characters a file
    odd.update(1, **{".": 1.0, "x" * 300: 2.0, "x" * 299 + "y": 3.0})
    odd.finalize(print_plots=False)
    ds = xr.open_dataset(tmp_path / "odd" / "history.nc")
    names = {ds[v].attrs.get("long_name", v): v for v in ds.data_vars}
    assert names["."] == "_" and len(names["x" * 300]) == 100 and names["x" * 300] != names["x" * 299 + "y"]
    assert float(ds[names["x" * 299 + "y"]][0]) == 3.0 and (tmp_path / "odd" / "summary.json").is_file()
    assert len(list((tmp_path / "odd" / "plots").glob("*.png"))) == 3
    both = History(tmp_path / "both", warmup=0)  # two names of one file name: the second gets _2, both kept
    both.update(1, **{"train/loss": 1.0, "train_loss": 2.0})
    both.finalize(print_plots=False)
    ds = xr.open_dataset(tmp_path / "both" / "history.nc")
    assert (float(ds["train_loss"][0]), float(ds["train_loss_2"][0])) == (1.0, 2.0)
    assert (ds["train_loss"].attrs["long_name"], ds["train_loss_2"].attrs["long_name"]) == ("train/loss", "train_loss")
    assert sorted(p.name for p in (tmp_path / "both" / "plots").glob("*.png")) == ["train_loss.png", "train_loss_2.png"]
