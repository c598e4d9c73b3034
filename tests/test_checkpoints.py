"""Checkpoint folders under crashes, requeues and changed flags: what ``--resume latest`` takes, what
pruning removes, what a crash between two renames leaves, what a resume refuses."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, assert_clean_user_error, clean_env, launch, run, tiny_llama
from mmm.parallel.checkpoint import Checkpointer
from mmm.parallel.checkpoint_folder import complete_steps, latest_step, step_dir, wait_for_deletes

TINY = ["-m", "mmm.examples.fsdp_tp", *tiny_llama(batch_size=4), "--log-every", "100"]


def trainer(*args: str, timeout: float = 120):
    return run([sys.executable, *TINY, *args], timeout=timeout)


def ok(*args: str):
    res = trainer(*args)
    assert res.returncode == 0, res.output
    return res


def saver(root: Path, keep_last: int = 0) -> Checkpointer:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return Checkpointer(
        root,
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        keep_last=keep_last,
        meta={"model": {"dim": 4}},
    )


def test_a_resume_at_or_past_the_last_step_trains_nothing_and_rewrites_nothing(tmp_path):
    """A requeue of a finished run (--resume latest, the same --max-iters) says there is nothing to train and
    leaves the run's outputs as they were; a checkpoint past --max-iters is one line, exit 2; with an output of
    the run's end asked for (--export-hf), no step runs but the end does."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    ok("--max-iters", "3", "--checkpoint-dir", str(ck), "--outdir", str(out))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    res = ok("--max-iters", "3", "--checkpoint-dir", str(ck), "--resume", "latest", "--outdir", str(out))
    assert "nothing to train: the checkpoint of step 3 is this run's last step" in res.output, res.output
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    new = tmp_path / "new"  # another --outdir: no rows to summarise, so no report of files never written
    res = ok("--max-iters", "3", "--checkpoint-dir", str(ck), "--resume", "latest", "--outdir", str(new))
    assert "nothing to train: the checkpoint of step 3 is this run's last step; raise --max-iters" in res.output
    assert not new.exists() or not any(new.iterdir()), sorted(new.iterdir())
    res = trainer("--max-iters", "2", "--checkpoint-dir", str(ck), "--resume", "3", "--outdir", str(out))
    assert_clean_user_error(res, "the checkpoint of step 3 is past this run's last step 2: raise --max-iters")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    # asked for an output of the run's end (a relaunch after a kill during the export): no step, the end runs
    hf = tmp_path / "hf"
    res = ok("--max-iters", "3", "--checkpoint-dir", str(ck), "--resume", "--outdir", str(out), "--export-hf", str(hf))
    assert "no step to train: the checkpoint of step 3 is this run's last step; finishing" in res.output, res.output
    assert (hf / "model.safetensors").is_file() and (hf / "config.json").is_file()


def test_latest_is_the_most_recent_save_not_the_highest_step(tmp_path):
    """Resumed from step 2 with steps 4 and 6 of the first run on disk, then requeued: the requeued run
    continues the resumed one (5), and pruning removes the abandoned 6, not the new run's steps."""
    ck = tmp_path / "ck"
    ok("--max-iters", "6", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--outdir", str(tmp_path / "a"))
    assert complete_steps(ck) == [2, 4, 6]
    ok(
        "--max-iters",
        "5",
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        "1",
        "--keep-last",
        "2",
        "--resume",
        "2",
        "--outdir",
        str(tmp_path / "b"),
    )
    assert complete_steps(ck) == [4, 5]  # 6 was saved before 3, 4 and 5: it goes first
    res = ok("--max-iters", "6", "--checkpoint-dir", str(ck), "--resume", "--outdir", str(tmp_path / "c"))
    assert "resumed from" in res.output and "step-00000005" in res.output, res.output


def test_a_rollback_prunes_the_abandoned_branch_not_the_step_it_went_back_to(tmp_path, caplog):
    """Saved 4, 8, 12; resumed from 4 and saving 6 with keep_last 2: 8 and 12 (the branch left behind) go, 4
    (what this line descends from) and 6 stay; it kept 12 and 6 and removed 4. The log names what goes."""
    from mmm.parallel.checkpoint_folder import prune_order

    first = saver(tmp_path)
    for step in (4, 8, 12):
        first.save(step)
    assert prune_order(tmp_path) == [4, 8, 12]  # one line: the oldest first
    again = saver(tmp_path, keep_last=2)
    again.log = logging.getLogger("test-rollback")
    with caplog.at_level(logging.INFO, logger="test-rollback"):
        again.load("4")
        again.save(6)
    assert complete_steps(tmp_path) == [4, 6], complete_steps(tmp_path)
    assert "checkpoint: pruning step(s) 8, 12 (keep_last=2)" in caplog.text, caplog.text
    again.save(9)  # the line's own oldest goes next
    assert complete_steps(tmp_path) == [6, 9]
    # each save names its parent: saved 4, 8, 12; back to 4, saving 6 (8 goes); then forward again to 12,
    # saving 16: 12 is 16's parent and stays, 4 goes (by the order of saving alone, 12 looked abandoned)
    other = tmp_path / "other"
    ck = saver(other, keep_last=3)
    for step in (4, 8, 12):
        ck.save(step)
    ck.load("4")
    ck.save(6)
    assert complete_steps(other) == [4, 6, 12]
    ck.load("12")
    ck.save(16)
    assert complete_steps(other) == [6, 12, 16], complete_steps(other)
    assert json.loads((step_dir(other, 16) / "mmm.json").read_text())["previous"] == 12


def test_every_rank_loads_the_step_rank_0_chose(tmp_path):
    mine, stale = tmp_path / "rank0", tmp_path / "rank1"
    for root, steps in ((mine, (2, 4)), (stale, (2, 6))):
        for i, step in enumerate(steps):
            d = step_dir(root, step)
            d.mkdir(parents=True)
            (d / "mmm.json").write_text(json.dumps({"step": step, "saved_at": 1000.0 + i}))
    res = run(
        launch("--launcher", "local", "-n", "2", "python3", str(SCRIPTS / "resolve_latest.py"), str(mine), str(stale)),
        timeout=90,
    )
    assert res.returncode == 0, res.output
    assert sorted(ln for ln in res.stdout.splitlines() if "resolves" in ln) == [
        "rank 0 resolves latest to 4",
        "rank 1 resolves latest to 4",
    ], res.output


def test_a_crash_between_the_renames_of_a_resave_loses_nothing(tmp_path, monkeypatch):
    ck = saver(tmp_path)
    ck.save(3)
    calls = []
    real = os.replace

    def crash_on_second(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        ck.save(3)  # a re-save of step 3 (a resumed run reaching it again)
    monkeypatch.setattr(os, "replace", real)
    again = saver(tmp_path)
    assert again.resolve("latest") == 3  # the old step 3 is back in place
    assert again.load("latest")["step"] == 3


def test_a_prune_cut_short_never_leaves_a_folder_that_looks_complete(tmp_path, monkeypatch):
    ck = saver(tmp_path, keep_last=1)
    ck.save(1)
    real = shutil.rmtree

    def half(path, ignore_errors=False, **kw):  # removes the shards, then "crashes" before mmm.json goes
        for f in Path(path).iterdir():
            if f.name != "mmm.json":
                real(f) if f.is_dir() else f.unlink()

    monkeypatch.setattr(shutil, "rmtree", half)
    ck.save(2)
    wait_for_deletes(10)
    monkeypatch.setattr(shutil, "rmtree", real)
    assert complete_steps(tmp_path) == [2] and latest_step(tmp_path) == 2
    saver(tmp_path, keep_last=1).save(3)  # the next save clears what was left
    wait_for_deletes(10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """The checkpoints of a 2-step run with seed 0 (global batch 4, synthetic data)."""
    root = tmp_path_factory.mktemp("saved")
    ok("--max-iters", "2", "--checkpoint-dir", str(root / "ck"), "--seed", "0", "--outdir", str(root / "a"))
    return root / "ck"


@pytest.mark.parametrize(
    "flag, value, saved",
    [
        ("--seed", "2", "seed=0 (now 2)"),
        ("--batch-size", "8", "global_batch=4 (now 8)"),
        ("--dataset", "pydoc", "dataset='synthetic' (now 'pydoc')"),
    ],
)
def test_resume_refuses_other_data(saved_run, tmp_path, flag, value, saved):
    ck = tmp_path / "ck"
    shutil.copytree(saved_run, ck)  # one saved run, made once, copied for each refusal
    res = trainer(
        "--max-iters",
        "4",
        "--checkpoint-dir",
        str(ck),
        "--resume",
        "latest",
        flag,
        value,
        "--outdir",
        str(tmp_path / "b"),
    )
    assert res.returncode == 2 and "Traceback" not in res.output, res.output
    line = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert len(line) == 1 and saved in line[0] and "step-00000002" in line[0], res.stderr


def test_two_sigterms_at_once_still_finish_the_step_and_save(tmp_path):
    """srun and the scheduler both signal: a SIGTERM repeated within milliseconds is the same request. With
    saves written in the background (--checkpoint-async), the stop waits for the one in flight (step 2) and
    for its own (step 4): both complete when the run exits."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    res = run(
        launch(
            "--launcher",
            "local",
            "-n",
            "2",
            "python3",
            *TINY,
            "--max-iters",
            "20",
            "--checkpoint-dir",
            str(ck),
            "--checkpoint-every",
            "2",
            "--checkpoint-async",
            "--outdir",
            str(out),
        ),
        env=clean_env(MMM_FAULT="term2@3"),
        timeout=120,
    )
    assert res.returncode == 0, res.output
    assert complete_steps(ck) == [2, 4] and sorted(p.name for p in ck.iterdir()) == [
        "step-00000002",
        "step-00000004",
    ], res.output
    assert Checkpointer(ck).damage(4) is None
    assert json.loads((out / "summary.json").read_text())["stopped_by"] == "SIGTERM"


def test_a_later_second_sigterm_waits_for_the_checkpoint_being_written(tmp_path):
    """Inside a save, a stop-now SIGTERM takes effect only once the checkpoint is complete."""
    import signal

    from mmm.dist import Terminated, graceful_sigterm

    old = signal.getsignal(signal.SIGTERM)
    graceful_sigterm()
    try:
        ck = saver(tmp_path)
        os.kill(os.getpid(), signal.SIGTERM)  # the graceful one: a stop flag
        time.sleep(2.2)  # past the repeat window
        real = ck._state

        def state_then_signal():
            os.kill(os.getpid(), signal.SIGTERM)  # mid-save: stop now
            return real()

        ck._state = state_then_signal
        with pytest.raises(Terminated):
            ck.save(7)
        assert complete_steps(tmp_path) == [7]
    finally:
        signal.signal(signal.SIGTERM, old)
        import mmm.dist.exits as exits

        exits._STOP_SIGNAL = None


def test_a_damaged_latest_checkpoint_falls_back_to_the_one_saved_before(tmp_path, caplog):
    """A node crash can leave a checkpoint marked complete with a file missing, or a shard cut short:
    'latest' then resumes the one saved before it (saying so) instead of failing the same way on every
    retry; the damaged step asked for by number is refused naming the damage."""

    from mmm.errors import UsageError

    ck = saver(tmp_path)
    ck.log = logging.getLogger("test-ck")
    for step in (2, 4, 6):
        ck.save(step)
    (step_dir(tmp_path, 6) / "rng" / "rank00000.pt").unlink()  # lost with the node
    shard = next(step_dir(tmp_path, 4).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # cut short: only loading sees it
    with caplog.at_level(logging.WARNING, logger="test-ck"):
        saved = ck.load("latest")
    assert saved["step"] == 2, saved
    text = caplog.text
    assert "step 6" in text and "rng/rank00000.pt is missing" in text and "step 4" in text, text
    with pytest.raises(UsageError, match=r"checkpoint step 6 .* is damaged: rng/rank00000.pt is missing"):
        ck.resolve("6")
    (step_dir(tmp_path, 2) / ".metadata").unlink()  # now none is sound: never a fresh start over them
    with pytest.raises(UsageError, match=r"no checkpoint in .* can be loaded \(steps 2, 4, 6"):
        ck.load("latest")


def test_loading_a_checkpoint_runs_no_code_from_its_folder(tmp_path):
    """The per-rank RNG files are read as tensors only: a pickle planted there (a group-writable project
    folder, a downloaded checkpoint) is refused, never run."""
    import pickle

    from mmm.errors import UsageError

    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    import torch

    ck = saver(tmp_path / "ck")
    ck.save(2)
    rng = step_dir(tmp_path / "ck", 2) / "rng" / "rank00000.pt"
    torch.save({"cpu": Planted()}, rng)  # a whole torch file whose pickle would run code
    with pytest.raises(UsageError, match=r"rank00000.pt is not an RNG state as mmm writes it"):
        ck.load("latest")
    rng.write_bytes(pickle.dumps({"cpu": Planted()}))  # a bare pickle: not even a torch file
    with pytest.raises(UsageError, match=r"step 2 .* is damaged: rng/rank00000.pt is not a whole torch file"):
        ck.load("2")
    assert not marker.exists()


def test_a_prune_leaves_the_deletes_to_the_background_and_says_when_one_fails(tmp_path, caplog, monkeypatch):
    """Rank 0 renames pruned checkpoints away (fast) inside the save; the slow deletes run after it.
    A delete that fails is logged, not hidden; the leftover folder is never read."""

    from mmm.parallel import checkpoint_folder as C

    ck = saver(tmp_path, keep_last=1)
    ck.log = logging.getLogger("test-prune")
    ck.save(1)
    real = shutil.rmtree

    def refuse(path, *a, onerror=None, **k):
        onerror(os.unlink, str(path), (OSError, OSError(16, "Device or resource busy"), None))

    monkeypatch.setattr(C.shutil, "rmtree", refuse)
    with caplog.at_level(logging.WARNING, logger="test-prune"):
        ck.save(2)
        C.wait_for_deletes(10)
    monkeypatch.setattr(C.shutil, "rmtree", real)
    assert complete_steps(tmp_path) == [2]
    assert "could not delete" in caplog.text and "Device or resource busy" in caplog.text, caplog.text
    leftover = [p.name for p in tmp_path.iterdir() if p.name.endswith(".del")]
    assert len(leftover) == 1 and leftover[0].startswith(".step-00000001."), leftover
    ck.save(3)  # the next save clears what was left, in the background
    C.wait_for_deletes(10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]


def test_a_fresh_start_never_overwrites_an_earlier_run(saved_run, tmp_path):
    """A job script resubmitted without --resume into the folders of a finished run: refused in one line
    (before, it re-saved the old run's steps and pruned its newest checkpoints first). --start-over
    begins again and moves the earlier run aside, every file of it intact."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    shutil.copytree(saved_run, ck)
    before = sorted(str(p.relative_to(ck)) for p in ck.rglob("*"))
    res = trainer("--max-iters", "2", "--checkpoint-dir", str(ck), "--keep-last", "1", "--outdir", str(out))
    assert res.returncode == 2 and "Traceback" not in res.output, res.output
    (line,) = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert f"--checkpoint-dir '{ck}' holds the checkpoints of an earlier run (steps 2)" in line, line
    assert "--start-over" in line and "nothing is deleted" in line, line
    assert sorted(str(p.relative_to(ck)) for p in ck.rglob("*")) == before  # untouched
    ok("--max-iters", "2", "--outdir", str(out))
    # the same outdir again: its history is an earlier run's too
    res = trainer("--max-iters", "2", "--outdir", str(out))
    said = f"--outdir '{out}' holds the outputs of an earlier run (history.jsonl, history.nc, summary.json, report.md"
    assert res.returncode == 2 and said in res.stderr, res.output
    assert "write to another --outdir" in res.stderr and "--resume" not in res.stderr, res.stderr  # no checkpoint
    # --resume with nothing to resume from would have started afresh over that finished run's outputs
    res = trainer("--max-iters", "2", "--checkpoint-dir", str(tmp_path / "new"), "--resume", "--outdir", str(out))
    assert res.returncode == 2 and said in res.stderr, res.output
    res = ok("--max-iters", "2", "--checkpoint-dir", str(ck), "--outdir", str(out), "--start-over")
    aside = sorted(p.name for p in tmp_path.iterdir() if ".old-" in p.name)
    assert [a.split(".old-")[0] for a in aside] == ["ck", "out"], aside
    (old_ck,) = [tmp_path / a for a in aside if a.startswith("ck.")]
    assert complete_steps(old_ck) == [2] and complete_steps(ck) == [2]
    assert (
        json.loads((step_dir(old_ck, 2) / "mmm.json").read_text())["saved_at"]
        != json.loads((step_dir(ck, 2) / "mmm.json").read_text())["saved_at"]
    )


def test_an_outdir_holds_its_own_runs_outputs_only(saved_run, tmp_path):
    """A fresh start where an earlier run's summary, report or plots are (no history.jsonl) is refused, not
    written over. A requeued job (--resume latest) whose first attempt ended before its first save starts
    again, the attempt's rows set aside. A resume into the folder of another run (its rows up to the step
    are not the resumed checkpoint's run) is refused: it would have continued another run's history."""
    mine = tmp_path / "mine"
    (mine / "plots").mkdir(parents=True)
    for name in ("summary.json", "report.md", "plots/loss.txt"):
        (mine / name).write_text("my notes\n")
    res = trainer("--max-iters", "2", "--outdir", str(mine))
    assert_clean_user_error(
        res, f"--outdir '{mine}' holds the outputs of an earlier run (summary.json, report.md, plots)"
    )
    assert all((mine / n).read_text() == "my notes\n" for n in ("summary.json", "report.md", "plots/loss.txt"))
    # the attempt: killed at step 2, before its first save (every 5 steps)
    out, ck = tmp_path / "out", tmp_path / "ck"
    flags = ["--max-iters", "3", "--checkpoint-dir", str(ck), "--checkpoint-every", "5", "--resume", "latest"]
    flags += ["--seed", "1"]
    first = run(
        [sys.executable, *TINY, *flags, "--outdir", str(out), "--log-every", "1"], env=clean_env(MMM_FAULT="kill@2")
    )
    assert first.returncode != 0 and complete_steps(ck) == [] and (out / "history.jsonl").read_text(), first.output
    ok(*flags, "--outdir", str(out))
    (aside,) = out.glob("history.replaced-*.jsonl")
    assert [json.loads(x)["iter"] for x in aside.read_text().splitlines()] == [1]
    assert [json.loads(x)["iter"] for x in (out / "history.jsonl").read_text().splitlines()] == [1, 2, 3]
    # another run's folder: saved_run's checkpoint of step 2 (seed 0) resumed into out (seed 1's run)
    shutil.copytree(saved_run, tmp_path / "theirs")
    res = trainer(
        "--max-iters", "3", "--checkpoint-dir", str(tmp_path / "theirs"), "--resume", "2", "--outdir", str(out)
    )
    assert_clean_user_error(res, f"--outdir '{out}' holds another run's history: its step 2 has loss ")
    assert "checkpoint: resumed from" not in res.output  # refused before the checkpoint was read
    assert [json.loads(x)["iter"] for x in (out / "history.jsonl").read_text().splitlines()] == [1, 2, 3]
    ok(
        "--max-iters",
        "3",
        "--checkpoint-dir",
        str(tmp_path / "theirs"),
        "--resume",
        "2",
        "--outdir",
        str(tmp_path / "a2"),
    )


def test_a_relaunch_resumes_its_own_lineage_not_the_abandoned_branch(saved_run, tmp_path):
    """Rolled back to step 2 of a run that also saved 4 and 6 (still on disk), the job loses a rank at
    step 3, before its first save: the relaunch resumes step 2 again (its own starting point), not 6
    (the most recent on disk, the branch the user abandoned). Both jobs export the same MMM_RUN_STAMP (a job
    script that names its output folder with it): each launch's own MMM_RUN_ID tells them apart."""
    ck = tmp_path / "ck"
    first = run(
        launch("--launcher", "local", "-n", "2", "python3", *TINY, "--max-iters", "6", "--checkpoint-dir", str(ck),
               "--checkpoint-every", "2", "--outdir", str(tmp_path / "a")),
        env=clean_env(MMM_RUN_STAMP="project-run"),
        timeout=240,
    )  # fmt: skip
    assert first.returncode == 0, first.output
    res = run(
        launch("--launcher", "local", "--retries", "1", "-n", "2", "python3", *TINY, "--max-iters", "6",
               "--checkpoint-dir", str(ck), "--checkpoint-every", "4", "--resume", "2",
               "--outdir", str(tmp_path / "b")),
        env=clean_env(MMM_FAULT="kill@3:1", MMM_TIMEOUT="60", MMM_RUN_STAMP="project-run"),
        timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.output
    resumed = [ln for ln in res.stdout.splitlines() if "checkpoint: resumed from" in ln]
    assert len(resumed) == 2 and all("step-00000002" in ln for ln in resumed), resumed
    rows = [json.loads(x)["iter"] for x in (tmp_path / "b" / "history.jsonl").read_text().splitlines()]
    assert rows == [3, 4, 5, 6], rows


class _Reduced:
    """Pickles as ``fn(*args)``."""

    def __init__(self, fn, args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


class _Planted:
    """What someone who can write to a checkpoint folder could leave as its ``.metadata``: unpickling runs
    a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_runs_no_code_and_others_cannot_write_to_it(tmp_path):
    """A planted ``.metadata`` is never unpickled (DCP's own reader would run it): the step is damaged and
    `latest` takes the one before; a folder any user can write to is refused in one line."""
    import pickle

    from mmm.errors import UsageError

    root = tmp_path / "ck"
    ck = saver(root)
    ck.save(1)
    ck.save(2)
    marker = tmp_path / "ran"
    (step_dir(root, 2) / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    again = saver(root)
    assert "posix.system is not something DCP writes" in (again.damage(2) or ""), again.damage(2)
    # Python 3.11.0-3.11.4 pickle an enum member (DCP's memory format) as getattr(cls, name): that reads,
    # and getattr reaching anything else does not
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from mmm.parallel.checkpoint_files import _MetadataUnpickler

    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    reduced = pickle.dumps(_Reduced(getattr, (_MEM_FORMAT_ENCODING, member.name)))
    assert _MetadataUnpickler(io.BytesIO(reduced)).load() is member
    for cls, name in ((torch.Size, "__reduce__"), (_MEM_FORMAT_ENCODING, "__class__")):
        with pytest.raises(pickle.UnpicklingError, match="is not something DCP writes"):
            _MetadataUnpickler(io.BytesIO(pickle.dumps(_Reduced(getattr, (cls, name))))).load()
    assert again.load("latest")["step"] == 1 and not marker.exists()
    with pytest.raises(UsageError, match="is damaged"):
        saver(root).load("2")
    assert not marker.exists()
    os.chmod(step_dir(root, 1), 0o777)
    with pytest.raises(UsageError, match=r"can be written by any user \(mode o\+w\).*chmod -R o-w"):
        saver(root).load("1")
    os.chmod(step_dir(root, 1), 0o755)
    os.chmod(root, 0o775)  # group-writable (a project's shared folder): the group's, allowed
    assert saver(root).load("1")["step"] == 1
    mask = os.umask(0)  # what mmm writes under a umask of 0 is still its own: a resume takes it
    try:
        saver(tmp_path / "open").save(1)
    finally:
        os.umask(mask)
    assert saver(tmp_path / "open").load("1")["step"] == 1


def async_saver(root: Path, keep_last: int = 0) -> Checkpointer:
    ck = saver(root, keep_last)
    return Checkpointer(
        root, model=ck.model, optimizer=ck.optimizer, keep_last=keep_last, meta=ck.meta, async_save=True
    )


def train_a_step(ck: Checkpointer) -> None:
    ck.model(torch.ones(2, 4)).sum().backward()
    ck.optimizer.step()
    ck.optimizer.zero_grad()


@pytest.fixture
def held_write(monkeypatch):
    """Hold every background write half-way (the shards' files open, nothing written) until ``go`` is set;
    ``started`` is set once one is held."""
    import threading

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    started, go = threading.Event(), threading.Event()
    real = DefaultSavePlanner.resolve_data

    def held(self, write_item):
        started.set()
        assert go.wait(30), "the write was never let go"
        return real(self, write_item)

    monkeypatch.setattr(DefaultSavePlanner, "resolve_data", held)
    yield started, go
    go.set()


def test_an_async_save_is_complete_only_once_written_and_a_crash_before_leaves_the_one_before(tmp_path, held_write):
    """While a background write is in flight, training changes the state freely; the step is not complete,
    and a crash then (the folder as it is, copied) leaves the previous checkpoint as 'latest' and the partial
    one a .tmp folder that recover() removes. Written, it holds the state of the moment it was saved: the
    same tensors as a synchronous save of that moment."""
    from mmm.parallel.checkpoint_folder import recover

    started, go = held_write
    go.set()
    ck = async_saver(tmp_path / "a")
    train_a_step(ck)
    ck.save(1)
    assert ck.wait() == step_dir(tmp_path / "a", 1) and complete_steps(tmp_path / "a") == [1]
    train_a_step(ck)
    Checkpointer(tmp_path / "sync", model=ck.model, optimizer=ck.optimizer, meta=ck.meta).save(2)  # the same state
    go.clear()
    ck.save(2)
    assert started.wait(30)
    state_at_2 = {k: v.clone() for k, v in ck.model.state_dict().items()}
    train_a_step(ck)  # the training thread goes on while step 2 is written
    assert complete_steps(tmp_path / "a") == [1]  # in flight: not complete
    crashed = tmp_path / "crashed"
    shutil.copytree(tmp_path / "a", crashed)  # what a crash now leaves on disk
    assert (crashed / ".step-00000002.tmp").is_dir()
    assert saver(crashed).resolve("latest") == 1
    recover(crashed)
    wait_for_deletes(10)
    assert sorted(p.name for p in crashed.iterdir()) == ["step-00000001"]
    go.set()
    assert ck.wait() == step_dir(tmp_path / "a", 2)
    assert complete_steps(tmp_path / "a") == [1, 2] and ck.wait() is None
    loaded = async_saver(tmp_path / "a")
    assert loaded.load("latest")["step"] == 2
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in state_at_2.items())
    from_sync = saver(tmp_path / "sync")
    from_sync.load("2")
    for a, b in zip(loaded.optimizer.state.values(), from_sync.optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    ck.close()


def test_a_full_disk_in_the_background_write_is_one_line_at_the_next_wait(tmp_path, monkeypatch):
    """A background write that fails (a full disk) is never lost: the next wait raises the synchronous
    save's one line, and the checkpoints saved before stay complete; DeepSpeed's engine saves synchronously."""
    import errno

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from mmm.errors import RunError, UsageError

    ck = async_saver(tmp_path)
    ck.save(1)
    ck.wait()

    def full(self, write_item):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DefaultSavePlanner, "resolve_data", full)
    ck.save(2)  # the copy to host memory works: the failure is the background write's
    with pytest.raises(RunError, match=r"checkpoint of step 2: no space left in .*checkpoints saved before are intact"):
        ck.save(3)  # waits for step 2 first
    assert complete_steps(tmp_path) == [1]
    with pytest.raises(UsageError, match="async_save=True writes torch DCP checkpoints.*drop async_save"):
        Checkpointer(tmp_path, deepspeed_engine=object(), async_save=True)


def test_a_checkpoint_in_the_older_nested_optimizer_form_still_resumes(tmp_path, monkeypatch):
    """Checkpoints written before the optimizer's state was saved flat (torch's nested form: ``param_groups.0``
    holding the hyperparameters and parameter names) load into this version: the weights, AdamW's moments and
    step, and the saved learning rate, as they were saved."""
    from mmm.parallel.checkpoint_files import read_metadata

    old = saver(tmp_path)
    train_a_step(old)
    old.optimizer.param_groups[0]["lr"] = 0.0123
    nested = Checkpointer._state
    with monkeypatch.context() as m:  # the older versions' save
        m.setattr(Checkpointer, "_state", lambda self, flat=True: nested(self, flat=False))
        old.save(1)
    assert "optim.param_groups.0.params" in read_metadata(step_dir(tmp_path, 1)).state_dict_metadata
    torch.manual_seed(1)
    new = saver(tmp_path)
    with torch.no_grad():
        new.model.weight.add_(1.0)  # other weights than the saved ones
    assert new.load("latest")["step"] == 1
    assert torch.equal(new.model.weight, old.model.weight) and torch.equal(new.model.bias, old.model.bias)
    assert new.optimizer.param_groups[0]["lr"] == 0.0123
    for p_new, p_old in zip(new.model.parameters(), old.model.parameters()):
        s_new, s_old = new.optimizer.state[p_new], old.optimizer.state[p_old]
        assert float(s_new["step"]) == float(s_old["step"]) == 1.0
        assert torch.equal(s_new["exp_avg"], s_old["exp_avg"]) and torch.equal(s_new["exp_avg_sq"], s_old["exp_avg_sq"])
