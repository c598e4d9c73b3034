"""mmm's trainer against ezpz's on the same work: launch to first finished step, and the steady step.

    python benchmarks/vs_ezpz.py --ezpz-python /path/to/ezpz-env/bin/python
    python benchmarks/vs_ezpz.py --ezpz-python ... --ranks 4 --tp 2 --dim 256 --n-layers 4 --repeats 3

Both sides train the same Llama shape (width, blocks, heads, key/value heads, feed-forward width,
vocabulary, sequence), on the same layout (FSDP over dp x TP over tp), with the same global batch, in
fp32, with AdamW at the same learning rate, on generated tokens: `mmm.examples.fsdp_tp` and
`ezpz.examples.fsdp_tp --dataset random --fp32`. Both start under the same launcher (torchrun,
standalone) from the Python of their own environment, alternately, `--repeats` times.

Each is timed from outside, the same way for both, from the launcher's start: the first finished step
is the moment its `iter=1` line reaches this process; the steady step is the time between the
`iter=3` and the last `iter=N` lines, over N - 3 steps (everything each trainer does per step:
logging, metrics, its collectives). The table shows the medians and mmm's ratio to ezpz's (goal:
first step < 1, steady step <= 1). The parameter counts both print are compared, so a shape that
differs is said.

ezpz (github.com/saforem2/ezpz) is not a dependency of mmm: install it into an environment of its own
(``pip install "git+https://github.com/saforem2/ezpz"``, with the torch you use for mmm) and give that
environment's Python. On a machine with Slurm's commands installed but outside a job, ezpz takes the
scheduler to be Slurm and stops; EZPZ_SCHEDULER=unknown is set for its runs unless already set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import selectors
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mmm.cli import positive_int
from mmm.errors import UsageError, folder_problem, run_command
from mmm.models.llama import LlamaConfig

ITER = re.compile(r"\biter=(\d+)\b")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MMM_PARAMS = re.compile(r"the model \(([\d,]+) parameters")
EZPZ_PARAMS = re.compile(r"Total params: ([\d,]+)")
FIRST_STEADY = 3  # the steady step is timed from this step's line to the last one's


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/vs_ezpz.py",
        description="mmm's fsdp_tp trainer against ezpz's on the same model, layout and batch: first step and "
        "steady step, timed from outside the same way for both.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--ezpz-python", metavar="PATH", help="the Python of an environment with ezpz installed "
                   "[this Python, if it can import ezpz]")  # fmt: skip
    p.add_argument("--ranks", type=positive_int, default=4, help="ranks (torchrun --nproc-per-node)")
    p.add_argument("--tp", type=positive_int, default=2, help="tensor parallel degree; dp = ranks / tp")
    p.add_argument("--dim", type=positive_int, default=256)
    p.add_argument("--n-layers", type=positive_int, default=4)
    p.add_argument("--n-heads", type=positive_int, default=8)
    p.add_argument("--n-kv-heads", type=positive_int, default=4)
    p.add_argument("--vocab-size", type=positive_int, default=8192)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--batch-size", type=positive_int, default=16, help="GLOBAL batch in sequences")
    p.add_argument("--steps", type=positive_int, default=20, help=f"steps per run (> {FIRST_STEADY})")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs of each, alternately")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds a run may take")
    p.add_argument("--out", metavar="DIR", help="the runs' output folders and vs_ezpz.json [outputs/vs_ezpz/<time>]")
    return p


def _problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.ranks % args.tp:
        problems.append(f"--tp {args.tp} does not divide --ranks {args.ranks}")
    dp = args.ranks // args.tp
    if args.batch_size % dp:
        problems.append(f"--batch-size {args.batch_size} is not divisible by dp={dp} (ranks / tp)")
    if args.dim % args.n_heads:
        problems.append(f"--dim {args.dim} is not divisible by --n-heads {args.n_heads}")
    if args.n_heads % args.n_kv_heads:
        problems.append(f"--n-heads {args.n_heads} is not divisible by --n-kv-heads {args.n_kv_heads}")
    if args.n_heads % args.tp or args.n_kv_heads % args.tp:
        problems.append(f"--n-heads {args.n_heads} and --n-kv-heads {args.n_kv_heads} must divide by --tp {args.tp}")
    if args.steps <= FIRST_STEADY:
        problems.append(f"--steps {args.steps}: give more than {FIRST_STEADY} (the steady step starts after step 3)")
    return problems


def _ezpz_python(given: str | None) -> str:
    python = given or sys.executable
    if given and not (Path(given).is_file() and os.access(given, os.X_OK)):
        raise UsageError(
            f"--ezpz-python {given!r} is not an executable file; give the bin/python of ezpz's environment"
        )
    # PyPI's "ezpz" is another project (image cropping): ask for the trainer itself
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('ezpz.examples.fsdp_tp') is None)"
    res = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if res.returncode != 0:
        raise UsageError(
            f"{'--ezpz-python ' + repr(given) if given else 'this Python'} has no ezpz.examples.fsdp_tp; install "
            "ezpz in an environment of its own (pip install 'git+https://github.com/saforem2/ezpz') and give "
            "--ezpz-python"
        )
    return python


def commands(args: argparse.Namespace, ezpz_python: str, out: Path, i: int) -> dict[str, list[str]]:
    config = LlamaConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads)
    ffn = config.ffn_hidden  # ezpz rounds even a given width up to its --multiple-of: mmm's is passed too
    shape = ["--dim", args.dim, "--n-layers", args.n_layers, "--n-heads", args.n_heads]
    shape += ["--n-kv-heads", args.n_kv_heads, "--vocab-size", args.vocab_size, "--seq-len", args.seq_len]
    shape += ["--tp", args.tp, "--lr", "3e-3"]
    dp = args.ranks // args.tp

    def torchrun(python: str, *rest) -> list[str]:
        head = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
        return [str(x) for x in (*head, *rest)]

    return {
        "mmm": torchrun(sys.executable, "-m", "mmm.examples.fsdp_tp", *shape, "--batch-size", args.batch_size,
                        "--max-iters", args.steps, "--dataset", "synthetic", "--outdir", out / f"mmm-{i}"),
        "ezpz": torchrun(ezpz_python, "-m", "ezpz.examples.fsdp_tp", *shape, "--hidden-dim", ffn,
                         "--multiple-of", config.multiple_of,
                         "--batch-size", args.batch_size // dp, "--train-iters", args.steps, "--dataset", "random",
                         "--fp32", "--outdir", out / f"ezpz-{i}"),
    }  # fmt: skip


def timed_run(cmd: list[str], env: dict[str, str], timeout: float, log: Path) -> dict:
    """Runs cmd, reading its merged output as it comes; the time each step's `iter=N` line arrived."""
    t0 = time.monotonic()
    # a session of its own: a timed-out run's ranks end with the launcher, not after it
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, bufsize=0, start_new_session=True
    )
    seen: dict[int, float] = {}
    lines: list[str] = []
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    pending = b""
    try:
        while True:
            left = timeout - (time.monotonic() - t0)
            if left <= 0:
                raise TimeoutError
            if not sel.select(timeout=min(left, 1.0)):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            now = time.monotonic() - t0
            if not chunk:
                break
            pending += chunk
            *done, pending = pending.split(b"\n")
            for raw in done:
                line = ANSI.sub("", raw.decode(errors="replace"))
                lines.append(line)
                m = ITER.search(line)
                if m and "loss=" in line:
                    seen.setdefault(int(m.group(1)), now)
        rc = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except (TimeoutError, subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
                break
        if isinstance(e, KeyboardInterrupt):
            raise
        rc = None
    wall = time.monotonic() - t0
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("\n".join(lines) + "\n")
    text = "\n".join(lines)
    params = MMM_PARAMS.search(text) or EZPZ_PARAMS.search(text)
    return {
        "rc": rc,
        "wall_s": wall,
        "iter_s": seen,
        "params": int(params.group(1).replace(",", "")) if params else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problems = _problems(args)
    if problems:
        raise UsageError("; ".join(problems))
    out = Path(args.out or Path("outputs") / "vs_ezpz" / time.strftime("%Y%m%d-%H%M%S"))
    if problem := folder_problem(f"--out {str(out)!r}", out):
        raise UsageError(problem)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} is not empty: give a new folder (nothing there is overwritten)")
    ezpz_python = _ezpz_python(args.ezpz_python)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.setdefault("WANDB_MODE", "disabled")
    ezpz_env = {**env, "EZPZ_SCHEDULER": os.environ.get("EZPZ_SCHEDULER", "unknown")}
    results: dict[str, list[dict]] = {"mmm": [], "ezpz": []}
    print(f"vs_ezpz: {args.ranks} ranks, tp {args.tp} x dp {args.ranks // args.tp}, {args.steps} steps, "
          f"{args.repeats} runs each -> {out}", flush=True)  # fmt: skip
    for i in range(args.repeats):
        cmds = commands(args, ezpz_python, out, i)
        for name in ("mmm", "ezpz") if i % 2 == 0 else ("ezpz", "mmm"):
            r = timed_run(cmds[name], ezpz_env if name == "ezpz" else env, args.timeout, out / f"{name}-{i}.log")
            steps = sorted(r["iter_s"])
            if r["rc"] != 0 or steps != list(range(1, args.steps + 1)):
                tail = (out / f"{name}-{i}.log").read_text().splitlines()[-15:]
                print("\n".join(tail), file=sys.stderr)
                why = "timed out" if r["rc"] is None else f"exit {r['rc']}, steps seen {steps[:3]}...{steps[-2:]}"
                print(
                    f"vs_ezpz: {name}'s run {i} failed ({why}); its output: {out / f'{name}-{i}.log'}", file=sys.stderr
                )
                return 1
            t = r["iter_s"]
            r["first_step_s"] = t[1]
            r["steady_step_s"] = (t[args.steps] - t[FIRST_STEADY]) / (args.steps - FIRST_STEADY)
            results[name].append(r)
            print(f"  {name:<4} run {i}: first step {r['first_step_s']:6.2f} s, steady step "
                  f"{r['steady_step_s'] * 1e3:7.1f} ms, exit after {r['wall_s']:6.2f} s", flush=True)  # fmt: skip
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("first_step_s", "steady_step_s", "wall_s")}
        for name, rs in results.items()
    }
    params = {name: rs[0]["params"] for name, rs in results.items()}
    rows = [("first finished step (s)", "first_step_s", 1), ("steady step (ms)", "steady_step_s", 1e3),
            ("launch to exit (s)", "wall_s", 1)]  # fmt: skip
    print(f"\n| median of {args.repeats} | mmm | ezpz | mmm / ezpz |\n|---|---|---|---|")
    for label, key, scale in rows:
        a, b = med["mmm"][key], med["ezpz"][key]
        print(f"| {label} | {a * scale:.2f} | {b * scale:.2f} | {a / b:.2f} |")
    print(f"\nparameters: mmm {params['mmm']}, ezpz {params['ezpz']} (as each printed them)")
    if params["mmm"] != params["ezpz"]:
        print("note: the parameter counts differ (or one was not printed): the work is not the same", file=sys.stderr)
    (out / "vs_ezpz.json").write_text(
        json.dumps(
            {
                "args": {k: v for k, v in vars(args).items()},
                "median": med,
                "params": params,
                "runs": {n: [{k: v for k, v in r.items() if k != "iter_s"} for r in rs] for n, rs in results.items()},
            },
            indent=1,
        )  # fmt: skip
    )
    return 0


if __name__ == "__main__":
    run_command(main, "python benchmarks/vs_ezpz.py")
