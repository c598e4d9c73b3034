"""How long a checkpoint save holds training up: synchronous saves against ``--checkpoint-async``.

    python benchmarks/async_checkpoint.py                  # 2 CPU ranks, dim 768 x 8 layers, 3 pairs
    python benchmarks/async_checkpoint.py --ranks 4 --dim 1024 --repeats 5

Runs the fsdp_tp trainer on the same ranks, alternately without and with ``--checkpoint-async`` (same
seed, model and batch), saving every ``--every`` steps into a fresh folder, and reads each run's
``history.jsonl`` and log. A periodic save runs after its step is recorded, so what it holds training up
lands in the next step's ``dt``. Printed per mode (medians over the repeats): the step without a save
before it, the step right after one, their difference (the stall at a save, as the loop sees it), the
save's own time from its log line (sync: the whole save; async: the copy to host memory that holds
training up, and the background write), and the whole loop (the sum of every step's ``dt``); then the
async/sync ratios, each against the sync runs measured in the same invocation.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mmm.cli import positive_int
from mmm.errors import ArgumentParser, UsageError, run_command

SAVED = re.compile(
    r"checkpoint: step (\d+) saved to \S+ in ([\d.]+)s(?: in the background \(training held up ([\d.]+)s\))?"
)


def one_run(args, root: Path, asynchronous: bool, repeat: int) -> dict[str, float]:
    name = f"{'async' if asynchronous else 'sync'}-{repeat}"
    trainer = [
        "-m", "mmm.examples.fsdp_tp", "--dim", str(args.dim), "--n-layers", str(args.n_layers),
        "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--max-iters", str(args.steps),
        "--checkpoint-dir", str(root / name / "ck"), "--checkpoint-every", str(args.every), "--keep-last", "1",
        "--outdir", str(root / name / "out"), "--warmup", "0", "--log-every", "1", "--no-plots",
    ]  # fmt: skip
    if asynchronous:
        trainer.append("--checkpoint-async")
    cmd = [sys.executable, "-m", "mmm.launch", "--launcher", "local", "-n", str(args.ranks), sys.executable, *trainer]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1800)
    if res.returncode != 0:
        sys.exit(f"{name} failed (rc {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (root / name / "out" / "history.jsonl").read_text().splitlines()]
    dt = {r["iter"]: r["dt"] for r in rows}
    saves = {s for s in dt if s % args.every == 0 and s < args.steps}
    after = [dt[s + 1] for s in saves if s + 1 in dt]
    plain = [dt[s] for s in dt if s - 1 not in saves and s > 1]  # step 1 is the warm-up
    found = [m.groups() for m in SAVED.finditer(res.stdout) if int(m.group(1)) < args.steps]
    return {
        "plain": statistics.mean(plain),
        "after": statistics.mean(after),
        "stall": statistics.mean(after) - statistics.mean(plain),
        "held": statistics.mean(float(h if h is not None else t) for _, t, h in found),
        "write": statistics.mean(float(t) for _, t, _ in found),
        "loop": sum(dt[s] for s in dt if s > 1),
    }


def main() -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=positive_int, default=2, help="ranks of each run [2]")
    p.add_argument("--dim", type=positive_int, default=768, help="the Llama's width [768]")
    p.add_argument("--n-layers", type=positive_int, default=8, help="its blocks [8]")
    p.add_argument("--seq-len", type=positive_int, default=64, help="tokens a sequence [64]")
    p.add_argument("--batch-size", type=positive_int, default=4, help="global batch (sequences) [4]")
    p.add_argument("--steps", type=positive_int, default=13, help="steps per run (step 1, a warm-up, is left out) [13]")
    p.add_argument("--every", type=positive_int, default=4, help="save every N steps [4]")
    p.add_argument("--repeats", type=positive_int, default=3, help="sync/async pairs, alternated [3]")
    p.add_argument("--root", type=Path, default=None, help="where the runs write (default: a fresh temporary folder)")
    args = p.parse_args()
    if args.steps < args.every + 2 or args.every < 2:
        raise UsageError(
            f"--steps {args.steps} --every {args.every}: a run needs a save before its last step, the step after "
            "it and a step that follows no save (--every >= 2, --steps >= --every + 2)"
        )
    root = args.root or Path(tempfile.mkdtemp(prefix="async-ckpt-"))
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for repeat in range(args.repeats):
        for asynchronous in (False, True):
            runs[asynchronous].append(one_run(args, root, asynchronous, repeat))
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    print(
        f"{args.ranks} ranks, dim {args.dim} x {args.n_layers} layers, seq {args.seq_len}, batch {args.batch_size}, "
        f"{args.steps} steps, a save every {args.every}; medians of {args.repeats} runs each (s)"
    )
    print(f"{'mode':6} {'step':>7} {'after a save':>13} {'stall':>7} {'held up':>8} {'save/write':>11} {'loop':>7}")
    for mode, name in ((False, "sync"), (True, "async")):
        m = med[mode]
        print(
            f"{name:6} {m['plain']:7.3f} {m['after']:13.3f} {m['stall']:7.3f} {m['held']:8.3f} {m['write']:11.3f} "
            f"{m['loop']:7.2f}"
        )
    for mode, name in ((False, "sync"), (True, "async")):
        each = ", ".join(f"{r['stall']:.2f}/{r['held']:.2f}/{r['loop']:.1f}" for r in runs[mode])
        print(f"{name} runs (stall/held up/loop): {each}")
    s, a = med[False], med[True]
    print(
        f"async/sync: stall at a save {a['stall'] / s['stall']:.2f}, time a save holds training up "
        f"{a['held'] / s['held']:.2f}, whole loop {a['loop'] / s['loop']:.3f}"
    )


if __name__ == "__main__":
    run_command(main, "python benchmarks/async_checkpoint.py")
