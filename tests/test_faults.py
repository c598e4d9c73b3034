"""The fault campaign: a rank (or every rank) SIGKILLed at each stage of a checkpoint save, of a re-save,
of a prune and of an export; a full disk; the job relaunched. After each, no complete checkpoint or export
is lost or half-overwritten, the resume takes the newest complete checkpoint, and the run ends with one
process's loss and gradient norm at every step, each step once in the history.

The kills come from ``MMM_SAVE_FAULT=STAGE@STEP:RANK|all`` (mmm.faults' crash points: a
real SIGKILL at that point of the real code path). Each test records what it observed (fault, outcome,
what was lost: computed from the files, not assumed); conftest.py prints the table at the end of the run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import clean_env, jsonl, launch, run
from mmm.parallel.checkpoint import Checkpointer
from mmm.parallel.checkpoint_folder import complete_steps, recover, step_dir

TINY = "-m mmm.examples.fsdp_tp --dim 64 --n-layers 2 --seq-len 32 --batch-size 4 --no-plots".split()
STEPS = 8


@pytest.fixture
def outcome(record_property):
    """Record a row of the campaign's table: it travels with the test's report (also from an xdist
    worker) to conftest's summary at the end of the run."""

    def add(fault: str, result: str, lost: str) -> None:
        record_property("fault_outcome", [fault, result, lost])

    return add


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("reference")
    res = run([sys.executable, *TINY, "--max-iters", str(STEPS), "--outdir", str(out)], timeout=180)
    assert res.returncode == 0, res.output
    return jsonl(out / "history.jsonl", key=None)


def same_run(history: list[dict], reference: list[dict], first: int = 1) -> None:
    assert [r["iter"] for r in history] == list(range(first, STEPS + 1)), [r["iter"] for r in history]
    want = {r["iter"]: r for r in reference}
    for key in ("loss", "grad_norm"):
        worst = max(abs(r[key] - want[r["iter"]][key]) / abs(want[r["iter"]][key]) for r in history)
        assert worst <= 1e-5, (key, worst)


def resumed_steps(output: str) -> list[int]:
    return [int(ln.split("step ")[1].split(",")[0]) for ln in output.splitlines() if "checkpoint: resumed from" in ln]


def sound_steps(root) -> list[int]:
    """Complete checkpoints with nothing missing (what a resume may take)."""
    ck = Checkpointer(root)
    return [s for s in complete_steps(root) if ck.damage(s) is None]


ASYNC = ["--checkpoint-async"]  # saves written in the background while training goes on
KILLS = [
    # rank 1 dies half-way through writing its DCP shards of step 4 in the background, its training thread
    # already on step 5 (its RNG file, written as the save began, is there)
    ("shards@4:1", 2, ASYNC),
    ("shards@4:all", 2, []),  # every rank dies with its DCP shards of step 4 written, its RNG file not
    ("rng@4:1", 2, []),  # rank 1 dies after its RNG file (every rank dying at a stage: shards@4:all)
    ("meta@4", 2, []),  # rank 0 dies with mmm.json written in the temporary folder, before the rename
    ("meta@4", 2, ASYNC),  # the same, in rank 0's background commit of a written step while training goes on
    ("prune@4", 4, []),  # rank 0 dies half-way through deleting step 2 (keep-last 1): 4 is complete
    ("history@5", 4, []),  # rank 0 dies half-way through writing step 5's line of history.jsonl
]


@pytest.mark.parametrize(
    "fault, resumes_at, flags",
    [pytest.param(*row, id=f"{row[0]}-{row[1]}{'-async' if row[2] else ''}") for row in KILLS],
)
def test_a_kill_during_a_save_loses_nothing(reference, tmp_path, fault, resumes_at, flags, outcome):
    ck, out = tmp_path / "ck", tmp_path / "out"
    keep = "1" if "prune" in fault else "2"
    args = [*TINY, "--max-iters", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
            "--keep-last", keep, "--outdir", str(out), *flags]  # fmt: skip
    first = run(launch("--launcher", "local", "-n", "2", "python3", *args),
                env=clean_env(MMM_SAVE_FAULT=fault, MMM_TIMEOUT="60"), timeout=180)  # fmt: skip
    sound = sound_steps(ck)
    lost = "nothing" if resumes_at in sound else f"step {resumes_at} (sound: {sound})"
    outcome(
        f"kill {fault}{' (async)' if flags else ''}",
        f"job died (rc {first.returncode}); complete after it: {sound}",
        lost,
    )
    assert first.returncode != 0, first.output  # the fault fired
    assert sound[-1] == resumes_at, (sound, first.output)
    res = run(launch("--launcher", "local", "-n", "2", "python3", *args, "--resume"), timeout=180)
    assert res.returncode == 0, res.output
    assert resumed_steps(res.stdout) == [resumes_at], res.stdout
    same_run(jsonl(out / "history.jsonl", key=None), reference)  # each step once, one process's numbers
    assert complete_steps(ck)[-1] == STEPS


def test_a_kill_between_the_renames_of_a_resave_loses_nothing(reference, tmp_path, outcome):
    """A run rolled back to step 2 saves step 4 again while the old step 4 is on disk; rank 0 dies
    between setting the old one aside and renaming the new one in. The old step 4 comes back, intact."""
    ck = tmp_path / "ck"
    res = run([sys.executable, *TINY, "--max-iters", "4", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
               "--outdir", str(tmp_path / "first")], timeout=180)  # fmt: skip
    assert res.returncode == 0, res.output
    old4 = (step_dir(ck, 4) / "mmm.json").read_text()
    out = tmp_path / "out"
    args = [*TINY, "--max-iters", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
            "--resume", "2", "--outdir", str(out)]  # fmt: skip
    crashed = run(launch("--launcher", "local", "-n", "2", "python3", *args),
                  env=clean_env(MMM_SAVE_FAULT="rename@4", MMM_TIMEOUT="60"), timeout=180)  # fmt: skip
    assert crashed.returncode != 0 and not step_dir(ck, 4).exists(), crashed.output  # died between the renames
    recover(ck)  # what the next save or resume does first
    restored = (step_dir(ck, 4) / "mmm.json").read_text() if step_dir(ck, 4).exists() else None
    lost = "nothing" if restored == old4 and 4 in sound_steps(ck) else "the old step 4"
    outcome("kill rename@4 (re-save)", "the old step 4 back in place after recover()", lost)
    assert restored == old4
    res = run(launch("--launcher", "local", "-n", "2", "python3", *args), timeout=180)
    assert res.returncode == 0 and resumed_steps(res.stdout) == [2], res.output
    same_run(jsonl(out / "history.jsonl", key=None), reference, first=3)


def test_a_kill_during_an_export_leaves_the_earlier_export(tmp_path, outcome):
    hf = tmp_path / "hf"
    base = [sys.executable, *TINY, "--max-iters", "2", "--export-hf", str(hf)]
    res = run([*base, "--outdir", str(tmp_path / "a")], timeout=180)
    assert res.returncode == 0, res.output
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    res = run([*base, "--seed", "7", "--outdir", str(tmp_path / "b")], env=clean_env(MMM_SAVE_FAULT="export"))
    after = {p.name: p.read_bytes() for p in hf.iterdir()}
    outcome("kill during --export-hf", f"job died (rc {res.returncode})", "nothing" if after == before else "DIR")
    assert res.returncode != 0, res.output
    assert after == before  # untouched: the new one never took its place


def test_a_full_disk_stops_the_save_and_keeps_the_checkpoints_before(reference, tmp_path, outcome):
    """The checkpoint folder is a 3 MiB tmpfs (as root): step 2 (1.9 MiB) fits, step 4 does not. One line names the
    full disk; step 2 stays complete and loadable; with room again, the run resumes and finishes."""
    if shutil.which("mount") is None or subprocess.run(["id", "-u"], capture_output=True, text=True).stdout != "0\n":
        pytest.skip("a size-limited tmpfs needs root and mount")
    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0755", "tmpfs", str(ck)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        args = [*TINY, "--max-iters", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every", "2"]
        res = run(launch("--launcher", "local", "-n", "2", "python3", *args, "--outdir", str(out)), timeout=180)
        assert res.returncode != 0, res.output
        errors = [ln for ln in res.stderr.splitlines() if "error:" in ln and "launch:" not in ln]
        assert errors and all(
            "no space left in" in ln and "checkpoints saved before are intact" in ln for ln in errors
        ), res.output[-3000:]
        assert "Traceback" not in res.output, res.output
        sound = sound_steps(ck)
        outcome(
            "full disk at step 4", "one line; complete after it: " + str(sound), "nothing" if sound == [2] else "step 2"
        )
        assert sound == [2], sound
        subprocess.run(["mount", "-o", "remount,size=64m", str(ck)], check=True)
        res = run(launch("--launcher", "local", "-n", "2", "python3", *args, "--resume", "--outdir", str(out)),
                  timeout=180)  # fmt: skip
        assert res.returncode == 0, res.output
        assert resumed_steps(res.stdout) == [2], res.stdout
        same_run(jsonl(out / "history.jsonl", key=None), reference)
    finally:
        subprocess.run(["umount", "-l", str(ck)], capture_output=True)


def test_a_shard_cut_short_is_passed_over(reference, tmp_path, outcome):
    """Step 4's complete checkpoint has a DCP shard cut short (a copy interrupted, a node lost while its file
    server wrote): `--resume latest` names the damage and resumes step 2, and the run ends with one process's
    numbers; a relaunch does not fail the same way again and again."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    args = [*TINY, "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--outdir", str(out)]
    res = run(launch("--launcher", "local", "-n", "2", "python3", *args, "--max-iters", "4"), timeout=180)
    assert res.returncode == 0, res.output
    shard = sorted(step_dir(ck, 4).glob("*.distcp"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    assert "cut short" in (Checkpointer(ck).damage(4) or ""), Checkpointer(ck).damage(4)
    res = run(launch("--launcher", "local", "-n", "2", "python3", *args, "--max-iters", str(STEPS), "--resume"),
              timeout=180)  # fmt: skip
    damaged = [ln for ln in res.stdout.splitlines() if "is damaged" in ln]
    outcome("a DCP shard cut short (step 4)", f"resumed {resumed_steps(res.stdout)}, said: {len(damaged)} line",
            "nothing" if res.returncode == 0 and resumed_steps(res.stdout) == [2] else "the run")  # fmt: skip
    assert res.returncode == 0 and resumed_steps(res.stdout) == [2], res.output
    assert len(damaged) == 1 and shard.name in damaged[0], res.stdout
    same_run(jsonl(out / "history.jsonl", key=None), reference)


def test_token_files_cut_short_or_left_by_a_killed_prepare_are_refused(tmp_path, outcome):
    """A train.bin that lost its last 2 KiB (an interrupted copy), and a folder where `prepare` was killed
    between renaming its new token files in and writing their meta.json (MMM_SAVE_FAULT=prepare): each run
    is refused in one line before any step (never trained on the wrong tokens or with the wrong meta); a
    prepare run again makes the folder whole."""
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(["alpha", "beta", "gamma", "delta"] * 5000))
    data = tmp_path / "tokens"
    prepare = [sys.executable, "-m", "mmm.data", "prepare", "--out", str(data), str(text)]
    assert run(prepare).returncode == 0
    train = [sys.executable, *TINY, "--max-iters", "2", "--dataset", "bin", "--data-dir", str(data)]
    meta_before = (data / "meta.json").read_text()
    with open(data / "train.bin", "r+b") as f:
        f.truncate((data / "train.bin").stat().st_size - 2048)
    cut = run([*train, "--outdir", str(tmp_path / "a")])
    killed = run([*prepare, "--val-fraction", "0.3"], env=clean_env(MMM_SAVE_FAULT="prepare"))
    assert killed.returncode != 0 and (data / "meta.json").read_text() == meta_before, killed.output
    mixed = run([*train, "--outdir", str(tmp_path / "b")])
    assert run(prepare).returncode == 0
    whole = run([*train, "--outdir", str(tmp_path / "c")])
    for what, res in (("a train.bin cut short", cut), ("a kill between prepare's renames and its meta.json", mixed)):
        lines = [ln for ln in res.stderr.splitlines() if "error:" in ln]
        outcome(what, f"refused (rc {res.returncode}): {len(lines)} line", "nothing (no step ran)")
        assert res.returncode == 2 and len(lines) == 1 and "train.bin" in lines[0], res.output
        assert "Traceback" not in res.output and "step 1" not in res.stdout, res.output
    assert whole.returncode == 0, whole.output


def test_a_full_disk_while_saving_the_model_keeps_the_earlier_one(tmp_path, outcome):
    """`--save-model`'s model.pt on a full disk: one line naming the path and the fix, the earlier model.pt
    whole (written under a temporary name, fsynced, renamed over it), no temporary file left."""
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("a size-limited tmpfs needs root and mount")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    code = (
        "import sys, types, torch\n"
        "from pathlib import Path\n"
        "from mmm.errors import RunError\n"
        "from mmm.training.checkpoints import save_full_model\n"
        "torch.manual_seed(0)\n"
        "size = int(sys.argv[2])\n"
        "engine = types.SimpleNamespace(strategy='ddp', module=torch.nn.Linear(size, size))\n"
        "try:\n"
        "    save_full_model(engine, Path(sys.argv[1]))\n"
        "except RunError as e:\n"
        "    print('error:', e); sys.exit(1)\n"
    )
    try:
        path = disk / "model.pt"
        small = run([sys.executable, "-c", code, str(path), "64"], timeout=60)
        assert small.returncode == 0 and path.exists(), small.output
        before = path.read_bytes()
        big = run([sys.executable, "-c", code, str(path), "1024"], timeout=60)  # 4 MiB: does not fit
        lines = [ln for ln in big.stdout.splitlines() if ln.startswith("error:")]
        intact = path.read_bytes() == before and sorted(p.name for p in disk.iterdir()) == ["model.pt"]
        outcome("full disk saving --save-model's model.pt", f"{len(lines)} line (rc {big.returncode})",
                "nothing" if intact else "model.pt")  # fmt: skip
        assert big.returncode == 1 and "Traceback" not in big.output, big.output
        assert len(lines) == 1 and "no space left" in lines[0] and str(path) in lines[0], big.output
        assert intact
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
