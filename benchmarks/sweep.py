"""Sweep parallel layouts of the fsdp_tp trainer: one run per layout under `launch`, one table.

    python benchmarks/sweep.py --world 4                          # every valid layout of 4 ranks
    python benchmarks/sweep.py --world 8 --tp 2 --strategies fsdp,hsdp --dim 512 --n-layers 8
    python benchmarks/sweep.py --world 4 --combos pp1-dpr1-dps2-cp1-tp2-fsdp,pp1-dpr1-dps4-cp1-tp1-ddp

Layouts come from the planner (python -m mmm.plan; the same flags select them: --tp/--pp/--cp/
--dp-replicate/--dp-shard/--strategy hold a value, --strategies lists strategies), or from
--combos (labels as the planner prints them; an invalid one is refused with the planner's reason).
Every other flag goes to the trainer unchanged (model size, --batch-size, --dtype, ...), but for
--outdir, which is refused: each run writes to OUT/runs/<label>, and --out sets OUT.

Each run writes its own folder under OUT/runs/<label>/ (summary.json, history, log.txt). The sweep
writes to OUT (default outputs/sweep/<UTC timestamp>):
  results.nc   xarray Dataset over `combo`: tokens/s, dt, dtf, dtb, peak memory per rank, startup,
               MFU, final loss, the planner's estimates, measured communication by process group
  results.md   the ranked table (fastest first) with each layout's ratio to the best
  plots/       tokens_per_s.{png,txt}: bar per layout; step_split.{png,txt}: dtf + dtb per layout
A failed layout is recorded with its error (ok = False) and the sweep goes on; the exit status
is 1 when any layout failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from mmm.errors import run_command

LAUNCH = str(Path(sys.executable).parent / "launch")
TRAINER_DEFAULTS = ["--max-iters", "10", "--log-every", "5", "--no-plots", "--measure"]
MIB = 2**20


def build_parser() -> argparse.ArgumentParser:
    from mmm.cli import ArgumentParser, positive_int

    p = ArgumentParser(
        prog="python benchmarks/sweep.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--world", type=positive_int, required=True, help="ranks per run")
    p.add_argument(
        "--strategies", default=None, metavar="S,S", help="data-parallel strategies to sweep, comma-separated [all]"
    )
    p.add_argument(
        "--combos",
        default=None,
        metavar="LABEL,LABEL",
        help="run only these layouts (labels as python -m mmm.plan prints them) [every valid one]",
    )
    p.add_argument("--out", default=None, help="output folder [outputs/sweep/<UTC timestamp>]")
    p.add_argument("--timeout", type=positive_int, default=900, help="seconds one run may take [900]")
    p.add_argument(
        "--launch-args", default="", metavar="'ARGS'", help="extra flags for `launch` (e.g. '--launcher local') ['']"
    )
    return p


def select(args, trainer_argv: list[str]):
    """The planner's layouts for these flags, narrowed to --combos; an invalid requested one is an error."""
    from mmm.errors import UsageError
    from mmm.plan.cli import parse_request, plan_for

    strategies = ["--strategies", args.strategies] if args.strategies else []
    # the planner checks the flags the runs will get
    request = parse_request(["--world", str(args.world), *strategies, *TRAINER_DEFAULTS, *trainer_argv])
    combos = plan_for(request)
    if args.combos is None:
        return [c for c in combos if c.valid], request
    by_label = {c.label: c for c in combos}
    wanted = [s.strip() for s in args.combos.split(",") if s.strip()]
    problems = []
    for label in wanted:
        if label not in by_label:
            problems.append(
                f"{label!r} is not a layout of {args.world} ranks with these flags (python -m mmm.plan "
                f"--world {args.world} lists them)"
            )
        elif not by_label[label].valid:
            problems.append(f"{label} is invalid: {'; '.join(by_label[label].problems)}")
    if problems or not wanted:
        raise UsageError("--combos: " + ("; ".join(problems) or "empty list"))
    return [by_label[label] for label in wanted], request


def _error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "error" in ln.lower():
            return re.sub(r"^\[rank \d+\]\s*", "", ln)[:400]
    return lines[-1][:400] if lines else "no output"


def run_one(combo, args, trainer_argv: list[str], out: Path) -> dict:
    """One layout under launch; its summary (or its error)."""
    rundir = out / "runs" / combo.label
    rundir.mkdir(parents=True, exist_ok=True)
    cmd = [
        LAUNCH,
        *args.launch_args.split(),
        "-n",
        str(args.world),
        sys.executable,
        "-m",
        "mmm.examples.fsdp_tp",
        *TRAINER_DEFAULTS,
        *trainer_argv,
        *combo.flags,
        "--outdir",
        str(rundir),
    ]
    env = {**os.environ, "MMM_RICH": "0"}
    t0 = time.time()
    # its own session, so that a timeout stops launch and every rank it started
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        stdout, stderr = p.communicate(timeout=args.timeout)
        code = p.returncode
    except subprocess.TimeoutExpired:
        _stop_group(p)
        stdout, stderr = _rest(p)
        code = 124
        stderr += f"\nerror: timed out after {args.timeout}s (--timeout)"
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM to the sweep: its session of its own never got it
        with signal_ignored(signal.SIGINT), signal_ignored(signal.SIGTERM):  # a second one must not cut it short
            _stop_group(p, first=signal.SIGINT)
            stdout, stderr = _rest(p)
        (rundir / "log.txt").write_text(f"$ {' '.join(cmd)}\n{stdout}{stderr}\ninterrupted: the sweep was stopped\n")
        (rundir / "INTERRUPTED").write_text("the sweep was stopped during this run: its outputs are incomplete\n")
        raise
    wall = time.time() - t0
    (rundir / "log.txt").write_text(f"$ {' '.join(cmd)}\n{stdout}{stderr}")
    summary_path = rundir / "summary.json"
    if code != 0 or not summary_path.exists():
        return {"ok": False, "error": _error_line(stderr or stdout) + f" (exit {code})", "wall_s": wall}
    return {"ok": True, "error": "", "wall_s": wall, "summary": json.loads(summary_path.read_text())}


@contextlib.contextmanager
def signal_ignored(signum: int):
    before = signal.signal(signum, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signum, before)


def _stop_group(p: subprocess.Popen, first: int = signal.SIGTERM) -> None:
    """Stop the run: ``first`` to its session (launch passes it on to the ranks); where anything of it is
    still there 10 s later, SIGKILL to the session and to every process launch started (an MPI launcher may
    run in a process group of its own, its ranks with it). Processes are held by pidfd where Linux has them,
    and launch is not reaped before the end: no signal reaches a process that took over an id."""
    held = _hold(_descendants(p.pid))
    try:
        os.killpg(p.pid, first)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_running(p) or any(_signal(h, 0) for h in held)):
        time.sleep(0.1)
    if _running(p) or any(_signal(h, 0) for h in held):
        held += _hold(_descendants(p.pid))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # launch's group: its id stays reserved until p.wait() below
        for h in held:
            _signal(h, signal.SIGKILL)
    for h in held:
        if isinstance(h, tuple):
            os.close(h[1])
    p.wait()


def _running(p: subprocess.Popen) -> bool:
    """Whether launch runs, without reaping it (its process and group ids stay its own until p.wait())."""
    try:
        return os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _hold(pids: list[int]) -> list:
    """Each process as a (pid, pidfd) where Linux gives one (a signal through it reaches that process only),
    else its id."""
    held: list = []
    for pid in pids:
        try:
            held.append((pid, os.pidfd_open(pid)))
        except ProcessLookupError:
            continue
        except (AttributeError, OSError):
            held.append(pid)
    return held


def _signal(h, sig: int) -> bool:
    """Send ``sig`` (0: none) to a held process; whether it is still there."""
    try:
        if isinstance(h, tuple):
            signal.pidfd_send_signal(h[1], sig)
        else:
            os.kill(h, sig)
    except ProcessLookupError:
        return False
    return True


def _rest(p: subprocess.Popen) -> tuple[str, str]:
    """What the stopped run still had to say (a process that escaped the stop keeps the pipes open: then
    what came within 30 s)."""
    try:
        return p.communicate(timeout=30)
    except subprocess.TimeoutExpired as e:
        for f in (p.stdout, p.stderr):
            f.close()
        text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        return text[0], text[1] + "\n(the run's output is cut short: a process of it outlived the stop)"


def _descendants(pid: int) -> list[int]:
    """Every process ``pid`` started, their children too (Linux's /proc; none elsewhere)."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in (task / "children").read_text().split()]
                found += kids
                todo += kids
    return found


def _stat(summary: dict, key: str) -> float:
    st = summary.get("stats", {}).get(key)
    return float(st["mean"]) if st else math.nan


def _peak_memory(summary: dict) -> float:
    ranks = summary.get("memory_per_rank") or []
    values = [m.get("peak_allocated_bytes", m.get("peak_rss_bytes", math.nan)) for m in ranks]
    return float(max(values)) if values else math.nan


def to_dataset(combos, results, request):
    """Every layout's figures as one xarray Dataset over ``combo`` (and ``group`` for communication)."""
    import numpy as np
    import xarray as xr

    labels = [c.label for c in combos]
    groups = sorted(
        {g for c in combos for g in (c.comm or {})}
        | {g for r in results if r["ok"] for m in r["summary"].get("measured_per_rank", []) for g in m["comm_bytes"]}
    )
    data: dict = {}
    for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        data[axis] = ("combo", np.array([c.degrees[axis] for c in combos], dtype=np.int64))
    data["strategy"] = ("combo", np.array([c.strategy for c in combos], dtype=object))
    data["ok"] = ("combo", np.array([r["ok"] for r in results]))
    data["error"] = ("combo", np.array([r["error"] for r in results], dtype=object))
    data["wall_s"] = ("combo", np.array([r["wall_s"] for r in results]))

    def per(fn):
        return ("combo", np.array([fn(r["summary"]) if r["ok"] else math.nan for r in results], dtype=float))

    data["tokens_per_s"] = per(lambda s: _stat(s, "tps"))
    for key in ("dt", "dtf", "dtb"):
        data[key] = per(lambda s, key=key: _stat(s, key))
    data["peak_memory_bytes"] = per(_peak_memory)
    data["state_bytes"] = per(lambda s: max(m["total_bytes"] for m in s["memory_per_rank"]))
    data["startup_s"] = per(lambda s: s.get("startup_s", math.nan))
    data["mfu"] = per(lambda s: s["mfu"] if s.get("mfu") is not None else math.nan)
    data["final_loss"] = per(lambda s: s.get("final_loss") if s.get("final_loss") is not None else math.nan)
    for key in ("state_bytes", "activation_bytes", "total_bytes"):  # NaN: the planner has no estimate (MoE, ViT, HF)
        data[f"est_{key}"] = ("combo", np.array([c.memory[key] if c.memory else math.nan for c in combos], dtype=float))
    if groups:
        est = np.array([[c.comm.get(g, 0.0) if c.comm is not None else math.nan for g in groups] for c in combos])
        meas = np.full((len(combos), len(groups)), math.nan)
        for i, r in enumerate(results):
            ranks = r["summary"].get("measured_per_rank") if r["ok"] else None
            if ranks:
                for j, g in enumerate(groups):
                    meas[i, j] = max(m["comm_bytes"].get(g, 0) for m in ranks)
        data["est_comm_bytes"] = (("combo", "group"), est)
        data["comm_bytes"] = (("combo", "group"), meas)
    ds = xr.Dataset(data, coords={"combo": labels, **({"group": groups} if groups else {})})
    ds.attrs.update(
        {
            "world_size": request.world,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "trainer_flags": " ".join(sys.argv[1:]),
            "units": "bytes, seconds, tokens/s",
        }
    )
    ds["tokens_per_s"].attrs["long_name"] = "warmup-excluded mean tokens per second"
    ds["peak_memory_bytes"].attrs["long_name"] = "max over ranks of peak device memory (peak RSS on CPU)"
    return ds


def markdown(ds, *, cores: int | None = None) -> str:
    """The ranked table: fastest layout first, failed layouts last with their error."""
    import numpy as np

    tps = ds["tokens_per_s"].values
    order = sorted(range(len(tps)), key=lambda i: (not ds["ok"].values[i], -(tps[i] if tps[i] == tps[i] else 0)))
    best = np.nanmax(tps) if np.isfinite(tps).any() else math.nan
    head = (
        "| # | layout | tokens/s | dt (s) | dtf (s) | dtb (s) | peak mem/rank (MiB) | state/rank (MiB) "
        "| startup (s) | MFU | ratio to best |"
    )
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for n, i in enumerate(order, 1):
        v = {
            k: ds[k].values[i]
            for k in ("tokens_per_s", "dt", "dtf", "dtb", "peak_memory_bytes", "state_bytes", "startup_s", "mfu")
        }
        label = str(ds["combo"].values[i])
        if not ds["ok"].values[i]:
            lines.append(f"| {n} | {label} | failed: {ds['error'].values[i]} |" + " |" * 8)  # 11 cells, as the head
            continue
        mfu = f"{100 * v['mfu']:.1f}%" if v["mfu"] == v["mfu"] else "-"
        dtf, dtb = (f"{v[k]:.4f}" if v[k] == v[k] else "-" for k in ("dtf", "dtb"))  # no split under PP
        lines.append(
            f"| {n} | {label} | {v['tokens_per_s']:.0f} | {v['dt']:.4f} | {dtf} | {dtb} | "
            f"{v['peak_memory_bytes'] / MIB:.0f} | {v['state_bytes'] / MIB:.1f} | {v['startup_s']:.2f} | "
            f"{mfu} | {v['tokens_per_s'] / best:.2f} |"
        )
    note = (
        f"\n{int(ds.attrs['world_size'])} ranks per run; ratio = tokens/s / best tokens/s; dt/dtf/dtb: "
        "warmup-excluded means of step / forward / backward time; peak mem: max over ranks of peak device "
        "memory (peak RSS on CPU); state: parameters + gradients + optimizer state, busiest rank; startup: "
        "launch to first finished step"
    )
    if cores:
        note += f"; this machine has {cores} cores"
    return "\n".join(lines) + "\n" + note + "\n"


def plots(ds, outdir: Path) -> None:
    """tokens/s per layout and the dtf/dtb split, as png (matplotlib) and text (plotext)."""
    import numpy as np

    from mmm.files import write_atomic
    from mmm.history import _ANSI

    ok = [i for i in range(ds.sizes["combo"]) if ds["ok"].values[i]]
    labels = [str(ds["combo"].values[i]) for i in ok]
    tps = [float(ds["tokens_per_s"].values[i]) for i in ok]
    dtf = [float(np.nan_to_num(ds["dtf"].values[i])) for i in ok]
    dtb = [float(np.nan_to_num(ds["dtb"].values[i])) for i in ok]
    if not ok:
        return
    outdir.mkdir(parents=True, exist_ok=True)
    import plotext as plt

    plt.clf()
    plt.theme("clear")
    plt.plotsize(110, 3 * len(labels) + 4)
    plt.bar(labels, tps, orientation="horizontal", marker="#", width=0.6)
    plt.title("tokens/s per layout")
    write_atomic(outdir / "tokens_per_s.txt", _ANSI.sub("", plt.build()) + "\n")
    plt.clf()
    plt.theme("clear")
    plt.plotsize(110, 3 * len(labels) + 4)
    plt.stacked_bar(
        labels, [dtf, dtb], labels=["dtf (#)", "dtb (=)"], orientation="horizontal", marker=["#", "="], width=0.6
    )
    plt.title("forward (dtf) + backward (dtb) seconds per step")
    write_atomic(outdir / "step_split.txt", _ANSI.sub("", plt.build()) + "\n")

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as mpl

    height = max(2.5, 0.35 * len(labels) + 1)
    for name, draw in (
        ("tokens_per_s", lambda ax: ax.barh(labels, tps, color="tab:blue")),
        (
            "step_split",
            lambda ax: (
                ax.barh(labels, dtf, label="dtf (forward)"),
                ax.barh(labels, dtb, left=dtf, label="dtb (backward)"),
                ax.legend(),
            ),
        ),
    ):
        fig, ax = mpl.subplots(figsize=(8, height), dpi=100)
        draw(ax)
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s" if name == "tokens_per_s" else "seconds per step")
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        tmp = outdir / f".{name}.png.tmp"
        fig.savefig(tmp, format="png")
        mpl.close(fig)
        os.replace(tmp, outdir / f"{name}.png")


def _progress():
    """A rich progress bar on a terminal, plain lines otherwise (CI logs, pipes)."""
    if sys.stderr.isatty() and os.environ.get("MMM_RICH", "1") != "0":
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(
            TextColumn("[bold]sweep"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            transient=False,
        )
        return progress
    return None


def main(argv=None) -> int:
    parser = build_parser()
    args, trainer_argv = parser.parse_known_args(argv)
    # each run's --outdir is OUT/runs/<label>: one passed through would be overridden without a word
    if any(a.split("=", 1)[0] == "--outdir" for a in trainer_argv):
        parser.error("--outdir is set per run (OUT/runs/<label>); use --out DIR for the sweep's folder")
    combos, request = select(args, trainer_argv)
    out = Path(
        args.out or Path("outputs") / "sweep" / datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    )
    from mmm.errors import UsageError, folder_problem

    if problem := folder_problem(f"--out {str(out)!r}", out):
        raise UsageError(problem)
    earlier = [p for p in (out / "results.nc", *(out / "runs" / c.label for c in combos)) if p.exists()]
    if earlier:  # its runs would refuse their folders one by one, and its table replace the earlier one
        raise UsageError(
            f"--out {out} holds an earlier sweep ({earlier[0].relative_to(out)}): give another --out "
            "(nothing there is overwritten)"
        )
    out.mkdir(parents=True, exist_ok=True)
    print(f"sweep: {len(combos)} layouts of {args.world} ranks -> {out}", flush=True)
    results = []
    progress = _progress()
    task = None
    if progress is not None:
        progress.start()
        task = progress.add_task("", total=len(combos))
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the sweep as Ctrl-C does
    # Ctrl-C is the sweep's to handle (it stops the run in progress), also where it inherited SIGINT ignored (a
    # shell's background job, `nohup ... &`): ignored, it would never reach the runs' own sessions
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for i, combo in enumerate(combos, 1):
            if progress is not None:
                progress.update(task, description=combo.label)
            try:
                r = run_one(combo, args, trainer_argv, out)
            except KeyboardInterrupt:
                if progress is not None:
                    progress.stop()
                    progress = None
                print(
                    f"sweep: interrupted during {combo.label} ({i - 1} of {len(combos)} layouts done, their runs in "
                    f"{out / 'runs'}; no results.nc written); its ranks are stopped: run again with another --out",
                    file=sys.stderr,
                    flush=True,
                )
                return 130
            results.append(r)
            line = (
                f"[{i}/{len(combos)}] {combo.label}: "
                + (
                    f"{_stat(r['summary'], 'tps'):.0f} tokens/s, dt {_stat(r['summary'], 'dt'):.4f}s, "
                    f"startup {r['summary'].get('startup_s', math.nan):.2f}s"
                    if r["ok"]
                    else f"FAILED: {r['error']}"
                )
                + f" ({r['wall_s']:.1f}s)"
            )
            if progress is not None:
                progress.console.print(line)
                progress.advance(task)
            else:
                print(line, flush=True)
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, interrupt)
        if progress is not None:
            progress.stop()
    ds = to_dataset(combos, results, request)
    from mmm.history import _netcdf_engine

    tmp = out / ".results.nc.tmp"
    ds.to_netcdf(tmp, engine=_netcdf_engine())
    os.replace(tmp, out / "results.nc")
    table = markdown(ds, cores=os.cpu_count())
    from mmm.files import write_atomic

    write_atomic(out / "results.md", table)
    plots(ds, out / "plots")
    print(table, flush=True)
    plotted = f", {out / 'plots'}/" if (out / "plots").is_dir() else " (no layout ran: no plots)"
    print(f"wrote {out / 'results.nc'}, {out / 'results.md'}{plotted}", flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    run_command(main, "python benchmarks/sweep.py")
