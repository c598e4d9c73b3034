"""The bad-input campaign: every flag of every command, every variable mmm reads, malformed files; each ends in
one line naming the input and the fix, a non-zero exit, fast, nothing left running, nothing written.

The table is generated from the code's own surfaces, so a new flag or variable cannot go untried:

- every valued flag of every command has a parser that declares the values it refuses (``mmm.cli.refuses``:
  ``positive_int`` refuses ``0``, ``-1``, ``x``, ...), or choices (``bogus``); each such value is tried on each
  flag in this process (argparse's own error path, one line);
- every environment variable mmm reads is declared with its kind in ``mmm.env`` (the source is scanned for
  reads that bypass it); each kind's bad values are tried on each variable;
- hand rows: checks that need the world size, files (hostfiles, hardware files, token folders, checkpoint
  folders), and launch's own; in this process where the check is a function;
- one real multi-rank run per distinct error path (parsing, the config checks after setup, a variable a rank
  reads, a token folder, a checkpoint that does not fit, launch's own refusal): every rank's exit note
  non-zero, within 10 s of the start on an idle machine, nothing left running, no output written.

Each test records its rows; conftest.py prints the table at the end of the run, beside the fault campaign's.
Bad input and bugs stay apart: tests/test_failures.py shows a real bug keeps its traceback.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import time
from contextlib import redirect_stderr

import numpy as np
import pytest

from conftest import ROOT, clean_env, group_alive, launch, run, spawn
from mmm import env as mmm_env
from mmm.errors import UsageError

TIMELY_S = 10.0  # a bad input is refused within this of the start (launch and both ranks' imports included)
LOADED_S = 30.0  # the same, asserted with the suite's three workers sharing two cores (the table shows each)


@pytest.fixture
def rows(record_property, tmp_path_factory):
    """Rows of the campaign's table (input, the line, exit, seconds): they travel with the test's report (also
    from an xdist worker) to conftest's summary at the end of the run. Temporary paths are shown as <tmp>."""
    tmp = str(tmp_path_factory.getbasetemp())

    def add(what: str, line: str, code: int, seconds: float) -> None:
        line = line.replace(tmp, "<tmp>")
        record_property("bad_input", [what, line[:300] + (" ..." if len(line) > 300 else ""), code, round(seconds, 2)])

    return add


# --------------------------------------------------------------------------- every flag of every command
def _commands() -> dict[str, tuple[argparse.ArgumentParser, list[str], list[str]]]:
    """command -> (its parser, flags it needs before the tried one, arguments after it)."""
    from mmm.__main__ import build_parser as smoke
    from mmm.data.prepare import build_parser as prepare
    from mmm.examples import fsdp, fsdp_tp, vit
    from mmm.launch.cli import build_parser as launcher
    from mmm.plan.calibrate import build_parser as calibrate
    from mmm.plan.cli import build_parser as planner
    from mmm.plan.simulate import build_parser as simulate
    from mmm.training.recipe import recipe_named
    from mmm.verify import build_parser as verify

    return {
        "launch": (launcher(), [], ["python3", "-c", "pass"]),
        "python -m mmm": (smoke(), [], []),
        "python -m mmm.data prepare": (prepare(), ["--out", "d"], ["in.txt"]),
        "python -m mmm.verify": (verify(), [], []),
        "python -m mmm.plan": (planner(), ["--world", "8"], []),
        "python -m mmm.plan.calibrate": (calibrate(), ["--out", "hw.json"], []),
        "python -m mmm.plan.simulate": (simulate(), ["--world", "8"], []),
        "python -m mmm.examples.fsdp_tp": (fsdp_tp.build_parser(), [], []),
        "python -m mmm.examples.vit": (vit.build_parser(), [], []),
        "python -m mmm.examples.fsdp": (fsdp.build_parser(), [], []),
        "python -m mmm.training.trainer --recipe hf": (recipe_named("hf").command_line().parser(), [], []),
    }


def _bad_values(action: argparse.Action) -> list[str] | None:
    """The values a flag must refuse: its parser's declared ones, or a choice it does not offer."""
    if action.choices is not None:
        return ["bogus", ""]
    return list(getattr(action.type, "bad", [])) or None


def test_every_flag_of_every_command_refuses_its_bad_values(rows):
    t0 = time.perf_counter()
    undeclared, accepted, unclear, tried = [], [], [], 0
    for name, (parser, before, after) in _commands().items():
        t_cmd, n_cmd, flags, example = time.perf_counter(), 0, 0, ""
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or isinstance(action, argparse._HelpAction):
                continue
            values = _bad_values(action)
            flag = action.option_strings[0]
            if values is None:
                undeclared.append(f"{name} {flag}")
                continue
            flags += 1
            for value in values:
                tried += 1
                n_cmd += 1
                with _Refused() as caught:
                    parser.parse_args([*before, flag, value, *after])
                if caught.error is None:
                    accepted.append(f"{name} {flag} {value!r}")
                    continue
                line = str(caught.error)
                named = any(s in line for s in action.option_strings)
                shows = not value.strip() or value in line or repr(value) in line or _number_shown(value, line)
                if "\n" in line or not named or not shows:
                    unclear.append(f"{name} {flag} {value!r}: {line}")
                example = example or f"{flag} {value!r} -> {line}"
        rows(f"{name}: {n_cmd} bad values on {flags} flags", example, 2, time.perf_counter() - t_cmd)
    assert not undeclared, f"flags with no declared bad values (give their parser mmm.cli.refuses): {undeclared}"
    assert not accepted, f"bad values accepted: {accepted}"
    assert not unclear, f"not one line naming the flag and the value: {unclear}"
    assert tried > 500, tried  # the surfaces are all there (11 commands)
    assert time.perf_counter() - t0 < 60


class _Refused:
    """Catches the UsageError a parser raises (argparse's error path) or notes that none came."""

    error: UsageError | None = None

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if isinstance(value, UsageError):
            self.error = value
            return True
        return False


def _number_shown(value: str, line: str) -> bool:
    """argparse's messages show a number as parsed (1e20 -> 1e+20)."""
    try:
        return f"{float(value):g}" in line
    except ValueError:
        return False


# --------------------------------------------------------------------------- every variable mmm reads
def test_every_variable_refuses_the_bad_values_of_its_kind(rows):
    t0, tried, problems = time.perf_counter(), 0, []
    for name, var in mmm_env.VARIABLES.items():
        for value in var.kind.bad:
            tried += 1
            try:
                mmm_env.get(name, env={name: value})
            except UsageError as e:
                line = str(e)
                if "\n" in line or f"{name}={value!r}" not in line or var.kind.what not in line:
                    problems.append(line)
            else:
                problems.append(f"{name}={value!r} accepted")
    assert not problems, problems
    assert tried > 100, tried
    example = "MMM_TIMEOUT=inf -> " + _refusal("MMM_TIMEOUT", "inf")
    rows(f"environment: {tried} bad values on {len(mmm_env.VARIABLES)} variables", example, 2, time.perf_counter() - t0)


def _refusal(name: str, value: str) -> str:
    with pytest.raises(UsageError) as e:
        mmm_env.get(name, env={name: value})
    return str(e.value)


READ = re.compile(r"""(?:environ\.get\(|environ\[|getenv\(|\benv\.get\(|\benv\[)\s*["']([A-Z][A-Z0-9_]*)["']""")


def test_every_variable_is_read_through_its_kind_and_documented():
    """No read of a declared variable (or of any MMM_ one) bypasses mmm.env.get; every MMM_ variable mmm reads
    is in docs/environment.md."""
    bypass = []
    for path in sorted((ROOT / "src" / "mmm").rglob("*.py")):
        if path.name == "env.py":
            continue
        text = path.read_text()
        module = re.search(r"^from mmm import (?:.*, )?env(?:,|$)", text, re.M) is not None  # env.get: mmm.env's
        for n, line in enumerate(text.splitlines(), 1):
            if re.search(r"\]\s*=[^=]|setdefault|\.pop\(", line):
                continue  # a write
            if module:
                line = re.sub(r"\benv\.get\(", "", line)
            for name in READ.findall(line):
                if name in mmm_env.VARIABLES or name.startswith("MMM_"):
                    bypass.append(f"{path.relative_to(ROOT)}:{n}: {name}")
    assert not bypass, f"read without mmm.env.get (its kind unchecked): {bypass}"
    documented = set(re.findall(r"`(MMM_[A-Z0-9_]+)`", (ROOT / "docs" / "environment.md").read_text()))
    missing = sorted(n for n in mmm_env.VARIABLES if n.startswith("MMM_") and n not in documented)
    assert not missing, f"not in docs/environment.md: {missing}"


# --------------------------------------------------------------------------- hand rows, in this process
def _trainer_refusal(trainer: str, flags: list[str], world: int = 2) -> str:
    from mmm.training.recipe import recipe_named

    recipe = recipe_named({"fsdp_tp": "llama", "fsdp": "cnn", "vit": "vit"}[trainer])
    config = recipe.command_line().parse(flags)
    found = recipe.problems(config, world)
    assert found, (trainer, flags)
    return "; ".join(found)


CONFIG_CASES = [
    # (trainer, world size, flags, words the line must contain): the checks that need the world size
    ("fsdp_tp", 2, ["--tp", "3"], ["tp=3", "valid tp"]),
    ("fsdp_tp", 4, ["--tpsize", "3"], ["tp=3 does not divide world size 4; valid tp for 4 ranks: 1, 2, 4"]),
    ("fsdp_tp", 4, ["--n-heads", "6", "--tpsize", "4"], ["--n-heads 6 is not divisible by tp=4"]),
    ("fsdp_tp", 2, ["--batch-size", "7"], ["--batch-size 7", "use a multiple of 2"]),
    ("fsdp_tp", 2, ["--pp", "2", "--n-layers", "3"], ["--n-layers 3"]),
    ("fsdp_tp", 2, ["--pp", "2", "--microbatches", "3"], ["--microbatches 3"]),
    ("fsdp_tp", 2, ["--split-points", "1", "--pp-schedule", "gpipe"],
     ["--pp-schedule, --split-points only apply with --pp > 1 (got pp=1)"]),
    # without a pipeline --microbatches is gradient accumulation: its parts must split each rank's batch
    ("fsdp_tp", 2, ["--microbatches", "3"],
     ["--microbatches 3 does not divide the per-dp-rank batch 8", "use a divisor of 8, e.g. 2 or 4"]),
    ("vit", 2, ["--microbatches", "3", "--batch-size", "4"],
     ["--microbatches 3 does not divide", "use a divisor of 2, e.g. 2"]),
    ("fsdp", 2, ["--microbatches", "5"], ["--microbatches 5 does not divide"]),
    ("fsdp_tp", 2, ["--pp-schedule", "gpipe"], ["--pp-schedule only applies with --pp > 1 (got pp=1)", "drop it"]),
    ("fsdp_tp", 2, ["--cp", "2", "--seq-len", "30"], ["30"]),
    ("fsdp_tp", 2, ["--strategy", "zero1", "--on-nonfinite", "skip"], ["--on-nonfinite skip", "zero1"]),
    ("fsdp_tp", 2, ["--strategy", "zero2", "--checkpoint-dir", "ck", "--checkpoint-async"],
     ["--checkpoint-async needs a torch strategy (ddp, fsdp, hsdp), not zero2", "drop --checkpoint-async"]),
    ("fsdp_tp", 2, ["--checkpoint-async"], ["--checkpoint-async needs --checkpoint-dir"]),
    # flags that only apply with another one, given without it: refused, never a silent no-op
    ("fsdp_tp", 1, ["--checkpoint-every", "2", "--keep-last", "3"],
     ["--checkpoint-every 2, --keep-last 3 only apply with --checkpoint-dir", "add one or drop them"]),
    ("fsdp_tp", 1, ["--moe-top-k", "1"], ["--moe-top-k 1 only applies to a mixture of experts; add --moe-experts N"]),
    ("fsdp_tp", 1, ["--eval-iters", "3"], ["--eval-iters 3 only applies with --eval-every N"]),
    ("vit", 1, ["--eval-iters", "3"], ["--eval-iters 3 only applies with --eval-every N"]),
    ("fsdp_tp", 2, ["--strategy", "ddp", "--tp", "2"], ["--strategy ddp does not compose with tp"]),
    ("fsdp_tp", 2, ["--compile", "--tp", "2"], ["--compile with --tp 2 is not supported"]),
    ("fsdp_tp", 2, ["--strategy", "ddp", "--reshard-after-forward", "true"],
     ["--reshard-after-forward true is an FSDP option; --strategy ddp with dp=2, cp=1 does not shard"]),
    ("fsdp_tp", 2, ["--tp", "2", "--reshard-after-forward", "false"],
     ["--reshard-after-forward false is an FSDP option; --strategy fsdp with dp=1, cp=1 does not shard"]),
    ("fsdp_tp", 2, ["--moe-experts", "3", "--ep", "2"], ["3"]),
    # combinations that crashed in backward or in the compiled step (tracebacks of ~300 lines)
    ("fsdp_tp", 2, ["--moe-experts", "4", "--ep", "2", "--ac", "selective"],
     ["--ac selective with --ep 2 fails in backward", "use --ac full, or --ep 1"]),
    ("fsdp_tp", 2, ["--n-layers", "4", "--pp", "2", "--pp-schedule", "interleaved-zb", "--stages-per-rank", "2",
                    "--ac", "selective"], ["--ac selective with --pp-schedule interleaved-zb", "use --ac full"]),
    ("fsdp_tp", 2, ["--moe-experts", "4", "--ep", "2", "--compile"], ["--compile with --ep 2 is not supported"]),
    ("fsdp_tp", 4, ["--cp", "4", "--seq-len", "36"], ["--seq-len 36 is not divisible by 2 x cp = 8"]),
    ("fsdp_tp", 4, ["--cp", "2", "--tp", "2", "--seq-len", "36"], ["--seq-len 36 is not divisible by 2 x cp x tp = 8"]),
    ("fsdp_tp", 4, ["--cp", "4", "--n-heads", "6", "--dim", "48", "--n-kv-heads", "2", "--cp-attention", "ulysses"],
     ["--cp-attention ulysses splits the query heads over cp=4: --n-heads 6 per TP rank is not divisible by 4"]),
    ("fsdp_tp", 2, ["--pp", "2", "--batch-size", "6", "--microbatches", "4"], ["--microbatches 4 does not divide"]),
    # the learning-rate schedule and evaluation (one rank, 10 steps)
    ("fsdp_tp", 1, ["--max-iters", "10", "--lr-schedule", "constant", "--min-lr", "0.001"], ["--min-lr 0.001"]),
    ("fsdp_tp", 1, ["--max-iters", "10", "--min-lr", "0.001"], ["--min-lr 0.001"]),  # constant is the default
    ("fsdp_tp", 1, ["--max-iters", "10", "--lr-schedule", "cosine", "--warmup-steps", "3", "--lr-decay-steps", "3"],
     ["--lr-decay-steps 3"]),
    ("fsdp_tp", 1, ["--max-iters", "10", "--lr-schedule", "linear", "--warmup-steps", "3", "--lr-decay-steps", "2"],
     ["--lr-decay-steps 2"]),
    ("fsdp_tp", 1, ["--max-iters", "10", "--lr-decay-steps", "5"], ["--lr-decay-steps 5"]),  # constant: no decay
    ("fsdp_tp", 1, ["--max-iters", "10", "--lr-schedule", "cosine", "--min-lr", "0.1"], ["--min-lr 0.1"]),  # > --lr
    ("fsdp_tp", 1, ["--max-iters", "10", "--warmup-steps", "20"], ["--warmup-steps 20"]),  # longer than the run
    ("fsdp_tp", 2, ["--cp-attention", "ulysses"], ["--cp-attention"]),
    ("fsdp_tp", 1, ["--float8"], ["--float8 needs --dtype bf16", "got --dtype fp32"]),
    ("fsdp_tp", 2, ["--float8", "--dtype", "bf16", "--tp", "2"], ["--float8 with --tp 2", "use tp=1"]),
    ("vit", 2, ["--float8", "--dtype", "bf16", "--strategy", "zero2"], ["--float8 with --strategy zero2"]),
    ("fsdp", 2, ["--batch-size", "5"], ["--batch-size 5"]),
    ("fsdp", 4, ["--batch-size", "30"], ["--batch-size 30 is not divisible by 4 data-parallel ranks"]),
    ("fsdp", 2, ["--offload-optimizer"], ["--offload-optimizer needs --strategy zero1, zero2 or zero3"]),
    ("vit", 2, ["--num-heads", "3", "--tp", "2"], ["--num-heads 3 is not divisible by tp=2"]),
    ("vit", 2, ["--batch-size", "5"], ["--batch-size 5 is not divisible by 2 data-parallel ranks"]),
    ("vit", 4, ["--strategy", "zero2", "--tp", "2"], ["--strategy zero2 (DeepSpeed) runs pure data parallel here",
                                                     "--tp 2"]),
]  # fmt: skip


def test_config_checks_name_the_value_and_the_fix(rows):
    for trainer, world, flags, needles in CONFIG_CASES:
        t0 = time.perf_counter()
        line = _trainer_refusal(trainer, flags, world)
        assert "\n" not in line and all(n in line for n in needles), (flags, line)
        rows(f"{trainer} {' '.join(flags)} ({world} ranks)", line, 2, time.perf_counter() - t0)


def test_a_warmup_that_leaves_no_step_timed_is_refused(rows):
    """--warmup N >= --max-iters would leave the timing statistics to every step (the flag silently off);
    the default on a run that short is left alone (its summary says every step counts)."""
    from mmm.training.recipe import recipe_named
    from mmm.training.startup import warmup_problems

    llama = recipe_named("llama")
    t0 = time.perf_counter()
    (line,) = warmup_problems(llama.command_line().parse(["--max-iters", "3", "--warmup", "3"]))
    assert line.startswith("--warmup 3 leaves none of the run's 3 steps (--max-iters)"), line
    assert "--warmup 2 or fewer" in line, line
    rows("fsdp_tp --max-iters 3 --warmup 3", line, 2, time.perf_counter() - t0)
    assert warmup_problems(llama.command_line().parse(["--max-iters", "3", "--warmup", "2"])) == []
    assert warmup_problems(llama.command_line().parse(["--max-iters", "2"])) == []  # the default warmup, 2


def test_a_prepare_that_would_leave_no_training_tokens_writes_nothing(tmp_path, rows):
    """--val-fraction so high that train.bin would hold no window: refused, no folder left behind."""
    from mmm.data.prepare import prepare

    text = tmp_path / "tiny.txt"
    text.write_text("hello world tiny")
    t0 = time.perf_counter()
    with pytest.raises(UsageError) as e:
        prepare([text], tmp_path / "tokens", tokenizer="bytes", val_fraction=0.999999)
    assert "--val-fraction 0.999999 leaves 0 of 17 tokens to train.bin: at least 2 are needed" in str(e.value)
    assert not (tmp_path / "tokens").exists()
    rows("python -m mmm.data prepare --val-fraction 0.999999 tiny.txt", str(e.value), 2, time.perf_counter() - t0)


def test_an_export_that_would_move_the_runs_own_folders_aside_is_refused_before_training(tmp_path, monkeypatch, rows):
    """--export-hf writes after the last step and replaces its folder whole (what it held moved aside): a
    folder it cannot make, or one that is or holds the current folder, the run's --outdir or --checkpoint-dir,
    or a parent folder of others, is refused at the start, not after the training."""
    from mmm.parallel.hf_checkpoint import export_problems

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "models" / "llama-1b").mkdir(parents=True)
    cases = [
        (["--export-hf", "afile/hf"], "--export-hf 'afile/hf': 'afile' is a file, not a directory"),
        (["--export-hf", "."], "--export-hf '.' is the current folder"),
        (["--outdir", "run", "--export-hf", "run"], "--export-hf 'run' is this run's --outdir"),
        (["--outdir", "runs/1", "--export-hf", "runs"], "--export-hf 'runs' holds this run's --outdir"),
        (["--checkpoint-dir", "ck", "--export-hf", "ck"], "--export-hf 'ck' is this run's --checkpoint-dir"),
        (["--export-hf", "models"], "--export-hf 'models' holds folders ('llama-1b'), so it is not an earlier export"),
        (["--export-hf", "outputs/fsdp_tp"], "--export-hf 'outputs/fsdp_tp' holds this run's --outdir"),  # default
    ]
    for flags, needle in cases:
        t0 = time.perf_counter()
        line = _trainer_refusal("fsdp_tp", flags, 1)
        assert "\n" not in line and needle in line, (flags, line)
        rows(f"fsdp_tp {' '.join(flags)} (1 ranks)", line, 2, time.perf_counter() - t0)
    # a new folder inside the output folder, or an earlier export (files only), is taken
    (tmp_path / "run" / "hf").mkdir(parents=True)
    (tmp_path / "run" / "hf" / "config.json").write_text("{}")
    assert export_problems("--export-hf", "run/hf", keep={"--outdir": "run"}) == []
    assert export_problems("--export-hf", "run/new", keep={"--outdir": "run"}) == []
    # a Hugging Face checkpoint with folders of its own (--init-from's weights, exported over): taken
    (tmp_path / "models" / "llama-1b" / "original").mkdir()
    (tmp_path / "models" / "llama-1b" / "config.json").write_text("{}")
    assert export_problems("--export-hf", "models/llama-1b") == []


def test_a_backend_is_named_in_any_case_and_refused_where_torch_has_none(monkeypatch, rows):
    import torch

    from mmm.dist.device import pick_backend

    cpu = torch.device("cpu")
    for given, want in (("Gloo", "gloo"), (" gloo ", "gloo"), ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl")):
        monkeypatch.setenv("MMM_BACKEND", given)
        assert pick_backend(cpu) == want, given
    if torch.distributed.is_nccl_available():
        pytest.skip("this torch has NCCL: the refusal of a backend it lacks cannot be seen here")
    monkeypatch.setenv("MMM_BACKEND", "NCCL")
    t0 = time.perf_counter()
    with pytest.raises(UsageError) as e:
        pick_backend(cpu)
    assert "MMM_BACKEND=nccl: this torch" in str(e.value) and "unset it (mmm picks gloo for cpu)" in str(e.value)
    rows("MMM_BACKEND=NCCL (a CPU build)", str(e.value), 2, time.perf_counter() - t0)


VERIFY_CASES = [
    (["--model", "llama", "--tp-plan", "mine:PLAN"], ["--tp-plan mine:PLAN: --model llama has its own TP plan"]),
    (["--model", "vit", "--seq-len", "64"], ["--seq-len 64: --model vit", "16 x 16 images", "drop it"]),
    # module:NAME must be a function of no arguments that returns a model: checked before any step
    (["--model", "nosuch_module:build"], ["--model 'nosuch_module:build': No module named 'nosuch_module'"]),
    (["--model", "mmm.models.llama:Llama"], ["--model 'mmm.models.llama:Llama' needs arguments (cfg)"]),
    (["--model", "os:getcwd"], ["--model 'os:getcwd' returned a str, not a torch.nn.Module"]),
    (["--model", "os:sep"], ["--model 'os:sep' is a str, not a function that returns your model"]),
]


def test_verify_refuses_what_its_models_cannot_take(rows, monkeypatch):
    from mmm.verify import COMMAND_LINE, target

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    # a recipe's own checks of the layout (its model runs on no pipeline: a stage's traceback before)
    recipe = (["--model", "own_recipe:RECIPE", "--pp", "2"], ["this model runs on a dp x tp mesh: leave --pp"])
    for flags, needles in [*VERIFY_CASES, recipe]:
        t0 = time.perf_counter()
        parsed = COMMAND_LINE.parse(flags)
        with pytest.raises(UsageError) as e:
            target(parsed["check"], parsed["parallel"], 4)
        line = str(e.value)
        assert "\n" not in line and all(n in line for n in needles), (flags, line)
        rows(f"python -m mmm.verify {' '.join(flags)}", line, 2, time.perf_counter() - t0)


def _launch_main(argv: list[str], monkeypatch, **environ: str) -> tuple[int, str, float]:
    from mmm.launch.cli import main

    for name in ("SLURM_JOB_ID", "PBS_NODEFILE", "MMM_GPUS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    err = io.StringIO()
    t0 = time.perf_counter()
    with redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue(), time.perf_counter() - t0


def test_launch_refuses_bad_files_and_variables_in_one_line(tmp_path, monkeypatch, rows):
    """launch's own checks (files, variables, launcher variables), through its main in this process."""
    files = {
        "not UTF-8": b"\xff\xfe node1\n",
        "an IPv6 host": b"fe80::1 slots=2\n",
        "host:x": b"node1:x\n",
        "slots=0": b"node1 slots=0\n",
        "a field that is not key=value": b"node1 fast\n",
        "no host": b"# only a comment\n",
    }
    cases = []
    for what, data in files.items():
        path = tmp_path / f"hosts-{len(cases)}"
        path.write_bytes(data)
        cases.append((f"hostfile: {what}", ["--hostfile", str(path), "-n", "2", "--dry-run", "python3"], {}, str(path)))
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    remote = tmp_path / "remote-hosts"
    remote.write_text("node7 slots=2\n")
    cases += [
        # flags the local launcher cannot honour: refused, never a silent no-op
        ("--mpi-args with --launcher local",
         ["--launcher", "local", "--mpi-args", "--bind-to core", "-n", "2", "python3"], {},
         "--mpi-args '--bind-to core' are flags for mpiexec or srun"),
        ("--hostfile of another host with --launcher local", ["--launcher", "local", "--hostfile", str(remote), "-n",
         "2", "python3"], {}, "names node7; use --launcher mpiexec"),
        ("--ppn 2 -n 4 on this machine", ["--launcher", "local", "--ppn", "2", "-n", "4", "python3"], {},
         "--ppn 2 with -n 4: this machine is one host"),
        ("hostfile: a folder", ["--hostfile", str(unreadable), "-n", "2", "python3"], {}, str(unreadable)),
        ("MMM_GPUS_PER_NODE=-1", ["--launcher", "local", "python3", "-c", "pass"], {"MMM_GPUS_PER_NODE": "-1"},
         "MMM_GPUS_PER_NODE='-1'"),
        ("MMM_TIMEOUT=inf", ["-n", "2", "python3"], {"MMM_TIMEOUT": "inf"}, "MMM_TIMEOUT='inf'"),
        ("MMM_LOG_LEVEL=bogus", ["-n", "2", "python3"], {"MMM_LOG_LEVEL": "bogus"}, "MMM_LOG_LEVEL='bogus'"),
        ("MASTER_PORT=70000", ["-n", "2", "python3"], {"MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
        ("SLURM_TASKS_PER_NODE=x", ["-n", "2", "--dry-run", "python3"],
         {"SLURM_JOB_ID": "1", "SLURM_TASKS_PER_NODE": "x"}, "SLURM_TASKS_PER_NODE='x'"),
        ("SLURM_CPUS_PER_TASK=0", ["--launcher", "srun", "-n", "2", "--dry-run", "python3"],
         {"SLURM_JOB_ID": "1", "SLURM_CPUS_PER_TASK": "0"}, "SLURM_CPUS_PER_TASK='0'"),
        ("--mpi-args '\"x'", ["--mpi-args", '"x', "-n", "2", "python3"], {}, "--mpi-args"),
        ("no command", ["-n", "2"], {}, "command"),
        ("--launcher pbs", ["--launcher", "pbs", "python3"], {}, "pbs"),
        ("--drop-lost-hosts without --retries", ["--drop-lost-hosts", "python3"], {}, "--retries"),
    ]  # fmt: skip
    for what, argv, environ, needle in cases:
        with monkeypatch.context() as m:
            code, err, seconds = _launch_main(argv, m, **environ)
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        assert code == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, (what, code, err)
        rows(f"launch: {what}", lines[0].split("error: ", 1)[1], code, seconds)


def test_hardware_files_and_token_folders_refused_in_one_line(tmp_path, rows):
    from mmm.data.tokens import bin_tokens
    from mmm.plan.hardware import load_hardware

    good = {"devices_per_node": 4, "memory_gb": 80, "peak_tflops": {"bf16": 900}, "intra_node_gbps": 300,
            "inter_node_gbps": 25}  # fmt: skip
    hardware = {
        '"cores_per_node": "x"': {**good, "cores_per_node": "x"},
        '"devices_per_node": 1.5': {**good, "devices_per_node": 1.5},
        '"memory_gb": -1': {**good, "memory_gb": -1},
        "a list": [1, 2],
        '"peak_tflops": 5': {**good, "peak_tflops": 5},
    }
    for what, data in hardware.items():
        path = tmp_path / "hw.json"
        path.write_text(json.dumps(data))
        t0 = time.perf_counter()
        with pytest.raises(UsageError) as e:
            load_hardware(str(path))
        assert "\n" not in str(e.value) and "--hardware" in str(e.value), str(e.value)
        rows(f"hardware file: {what}", str(e.value), 2, time.perf_counter() - t0)
    path.write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_hardware(str(path))

    folder = tmp_path / "tokens"
    folder.mkdir()
    np.arange(4096, dtype=np.uint16).__mod__(200).astype(np.uint16).tofile(folder / "train.bin")
    meta = {"dtype": "uint16", "vocab_size": 256, "tokens": {"train": 4096}, "max_token": {"train": 199}}
    metas = {
        '"max_token": 5': {**meta, "max_token": 5},
        '"tokens": "x"': {**meta, "tokens": "x"},
        '"tokens": {"train": -1}': {**meta, "tokens": {"train": -1}},
        "a count the file does not hold": {**meta, "tokens": {"train": 5000}},
        '"dtype": "int8"': {**meta, "dtype": "int8"},
        '"vocab_size": 0': {**meta, "vocab_size": 0},
    }
    for what, data in metas.items():
        (folder / "meta.json").write_text(json.dumps(data))
        t0 = time.perf_counter()
        with pytest.raises(UsageError) as e:
            bin_tokens(folder, seq_len=16, vocab_size=256)
        assert "\n" not in str(e.value) and "meta.json" in str(e.value), str(e.value)
        rows(f"token folder: meta.json {what}", str(e.value), 2, time.perf_counter() - t0)
    (folder / "meta.json").write_text(json.dumps(meta))
    assert len(bin_tokens(folder, seq_len=16, vocab_size=256)) > 0  # the same folder, whole, trains


# --------------------------------------------------------------------------- one real run per error path
FILE = "<file>"  # replaced by a path that is a file
CKPT = "<ckpt>"  # replaced by a folder holding a checkpoint of a (different) fsdp_tp model
EMPTY = "<empty>"  # replaced by an empty folder
TOKENS = "<tokens>"  # replaced by a token folder whose train.bin lost its last 2 KiB

BASE = {
    "fsdp_tp": ["--dim", "64", "--n-layers", "2", "--seq-len", "32", "--max-iters", "4"],
    "fsdp": ["--epochs", "1", "--steps-per-epoch", "2"],
    "vit": ["--depth", "2", "--max-iters", "4"],
}
REAL_CASES = [
    # (path, trainer, flags, env, words the error line must contain): one per distinct error path
    ("parsing", "fsdp_tp", ["--dim", "0"], {}, ["--dim", "0"]),
    ("config checks after setup", "fsdp_tp", ["--tp", "3"], {}, ["tp=3", "valid tp"]),
    ("a variable every rank reads", "fsdp_tp", [], {"LOG_FROM_ALL_RANKS": "maybe"}, ["LOG_FROM_ALL_RANKS='maybe'"]),
    ("an output folder that is a file", "fsdp_tp", ["--outdir", FILE], {}, [FILE]),
    ("a checkpoint that does not fit", "vit", ["--checkpoint-dir", CKPT, "--resume", "latest"], {},
     ["does not fit this run"]),
    ("a token file cut short", "fsdp_tp", ["--dataset", "bin", "--data-dir", TOKENS], {}, ["train.bin", "records"]),
    ("a data folder without MNIST", "fsdp", ["--data-dir", EMPTY], {},
     ["holds no MNIST: missing train-images-idx3-ubyte"]),
    ("a flag this device cannot honour", "fsdp_tp", ["--float8", "--dtype", "bf16"], {},
     ["--float8 needs a CUDA device with float8 matmuls", "this run's device is cpu"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    f = root / "a_file"
    f.write_text("x")
    empty = root / "empty"
    empty.mkdir()
    ckpt = root / "ckpt"
    args = ["--dim", "64", "--n-layers", "2", "--seq-len", "32", "--max-iters", "1", "--no-plots"]
    res = run([sys.executable, "-m", "mmm.examples.fsdp_tp", *args, "--checkpoint-dir", str(ckpt), "--outdir",
               str(root / "o")])  # fmt: skip
    assert res.returncode == 0, res.output
    text = root / "text.txt"
    text.write_text(" ".join(["alpha", "beta", "gamma"] * 4000))
    tokens = root / "tokens"
    res = run([sys.executable, "-m", "mmm.data", "prepare", "--out", str(tokens), str(text)])
    assert res.returncode == 0, res.output
    with open(tokens / "train.bin", "r+b") as fh:  # an interrupted copy
        fh.truncate((tokens / "train.bin").stat().st_size - 2048)
    return {FILE: str(f), CKPT: str(ckpt), EMPTY: str(empty), TOKENS: str(tokens)}


def _fill(items, paths):
    out = []
    for x in items:
        for key, value in paths.items():
            x = x.replace(key, value)
        out.append(x)
    return out


@pytest.mark.parametrize("path, trainer, flags, env, needles", REAL_CASES, ids=[c[0] for c in REAL_CASES])
def test_one_real_run_per_error_path(paths, tmp_path, path, trainer, flags, env, needles, rows):
    """2 ranks under launch's local spawner, each wrapped to note its exit code: every rank exits non-zero,
    rank 0 says it once, within seconds (the table's), nothing left running, nothing written."""
    notes, out, ck = tmp_path / "exits", tmp_path / "out", tmp_path / "ck"
    notes.mkdir()
    given = _fill(flags, paths)
    own = [] if "--outdir" in given else ["--outdir", str(out)]
    own += [] if "--checkpoint-dir" in given else ["--checkpoint-dir", str(ck)]
    note = [str(ROOT / "tests" / "scripts" / "exit_note.py"), str(notes)]
    cmd = launch("--launcher", "local", "-n", "2", "python3", *note, sys.executable, "-m", f"mmm.examples.{trainer}",
                 "--no-plots", *BASE[trainer], *own, *given)  # fmt: skip
    with spawn(cmd, env=clean_env(**env), stdout=-1, stderr=-1) as p:
        t0 = time.monotonic()
        try:
            stdout, stderr = p.communicate(timeout=60)
        except Exception:
            pytest.fail(f"no exit within 60 s: {cmd}")
        seconds = time.monotonic() - t0
        time.sleep(0.3)
        left = group_alive(p.pid)
    output = stdout + stderr
    lines = [ln for ln in stderr.splitlines() if "error:" in ln]
    assert p.returncode != 0 and "Traceback" not in output, output
    assert len(lines) == 1, output  # reported once, by rank 0
    for needle in _fill(needles, paths):
        assert needle in lines[0], (needle, lines[0])
    codes = {f.name: int(f.read_text()) for f in notes.iterdir()}
    assert len(codes) == 2 and all(codes.values()), codes  # every rank's exit note: non-zero
    assert not left, f"left running: {left}"
    assert not ck.exists() and not (out / "history.jsonl").exists(), "written although refused"
    assert seconds < LOADED_S, seconds
    rows(f"{trainer} {' '.join(flags) or ' '.join(f'{k}={v}' for k, v in env.items())} (2 ranks)",
         lines[0].split("error: ", 1)[1], p.returncode, seconds)  # fmt: skip


def test_launch_of_a_missing_script_fails_fast_without_traceback(rows):
    res = run(launch("--launcher", "local", "-n", "2", "python3", "/no/such/script.py"), timeout=60)
    assert res.returncode != 0 and res.seconds < LOADED_S, res.output
    assert "Traceback" not in res.output and "/no/such/script.py" in res.stderr, res.output
    rows("launch -n 2 python3 /no/such/script.py", "python3: can't open file '/no/such/script.py'", res.returncode,
         res.seconds)  # fmt: skip


@pytest.mark.parametrize(
    "script, needle",
    [
        ("one_gpu.py", "measures one CUDA device's step (a 0.9 B-parameter model by default) and found none"),
        ("float8_curve.py", "--float8 trains on an H100-class CUDA device and there is none here"),
    ],
)
def test_a_gpu_benchmark_on_a_machine_without_one_is_refused_before_it_starts(rows, script, needle):
    """It started the 0.9 B-parameter yardstick on the CPU, silently, for as long as it took."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the benchmark would run")
    res = run([sys.executable, str(ROOT / "benchmarks" / script)], timeout=60)
    assert res.returncode == 2 and needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.output
    rows(f"python benchmarks/{script} (no GPU)", res.stderr.split("error: ", 1)[1].strip(), 2, res.seconds)


def test_launch_refuses_before_any_rank_starts(tmp_path, rows):
    """A variable every rank would refuse is refused by launch itself, in one line, before any rank starts."""
    marker = tmp_path / "started"
    res = run(launch("--launcher", "local", "-n", "2", "python3", "-c", f"open({str(marker)!r}, 'w')"),
              env=clean_env(MMM_TIMEOUT="1e20"), timeout=60)  # fmt: skip
    lines = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert res.returncode == 2 and len(lines) == 1 and "MMM_TIMEOUT='1e20'" in lines[0], res.output
    assert not marker.exists()
    rows("MMM_TIMEOUT=1e20 launch -n 2 ...", lines[0].split("error: ", 1)[1], res.returncode, res.seconds)


@pytest.mark.parametrize(
    "program, needle",
    [
        ("pythn3", "cannot start 'pythn3': not found on PATH"),
        ("./train.py", "cannot start './train.py': not executable"),
    ],
    ids=["misspelled", "not-executable"],
)
def test_a_command_no_rank_could_start_is_refused_by_launch_and_not_retried(rows, tmp_path, program, needle):
    """A misspelled program, or a script here without its execute bit: mpiexec would print its own 8-12-line
    box, exit 66 or 183, and --retries would relaunch it."""
    (tmp_path / "train.py").write_text("print('trained')\n")  # mode 644
    res = run(launch("--retries", "2", "-n", "2", program), timeout=60, cwd=tmp_path)
    lines = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert res.returncode == 2 and len(lines) == 1, res.output
    assert needle in lines[0], res.output
    assert "relaunching" not in res.output and "mpiexec" not in res.stderr, res.output
    rows(f"launch --retries 2 -n 2 {program}", lines[0].split("error: ", 1)[1], res.returncode, res.seconds)


def test_flag_checks_in_process():
    """The library names its arguments; the trainers pass FLAGS to name their flags."""
    from mmm.cli import FLAGS
    from mmm.faults import parse
    from mmm.parallel.checkpoint_folder import checkpoint_problems

    assert checkpoint_problems(None, "latest", 0, 0) == [
        "resume='latest' needs checkpoint_dir (the folder holding step-NNNNNNNN checkpoints)"
    ]
    assert checkpoint_problems(None, "latest", 0, 0, spell=FLAGS) == [
        "--resume latest needs --checkpoint-dir (the folder holding step-NNNNNNNN checkpoints)"
    ]
    assert any("'soon'" in p for p in checkpoint_problems("ck", "soon", 0, 0))
    assert any("--keep-last -1" in p for p in checkpoint_problems("ck", None, 0, -1, spell=FLAGS))
    assert parse("kill@5:1, nan@7") == {5: [("kill", 1)], 7: [("nan", None)]}
    with pytest.raises(UsageError, match="'kill@x'"):
        parse("kill@x")
    assert mmm_env.get("SLURM_TASKS_PER_NODE", env={"SLURM_TASKS_PER_NODE": "4(x2),3"}) == [4, 4, 3]
    assert mmm_env.get("MMM_BACKEND", env={"MMM_BACKEND": "cpu:gloo,cuda:nccl"}) == "cpu:gloo,cuda:nccl"
    assert mmm_env.get("MMM_TIMEOUT", 600.0, env={"MMM_TIMEOUT": " "}) == 600.0  # blank: unset
    assert os.environ.get("MMM_NOT_A_VARIABLE") is None


@pytest.mark.parametrize(
    "command, argv, needle",
    [
        # a flag another trainer takes: why this one does not, not a typo
        ("python -m mmm.training.trainer --recipe hf", ["--cp", "2"], "--cp: no context parallel for transformers"),
        ("python -m mmm.examples.vit", ["--pp", "2"], "--pp: the ViT trainer runs a dp x tp mesh"),
        ("python -m mmm.examples.fsdp", ["--tp", "2"], "--tp: the CNN trainer is data parallel only"),
        ("python -m mmm.examples.fsdp", ["--dp-shard", "2"], "--dp-shard: the CNN trainer infers dp_shard"),
        # a misspelt flag: the nearest one this command takes
        ("python -m mmm.examples.fsdp_tp", ["--moe_experts", "8"], "--moe_experts: did you mean --moe-experts?"),
        ("python -m mmm.examples.fsdp_tp", ["--moe-expert", "8"], "--moe-expert: did you mean --moe-experts?"),
        ("python -m mmm.plan.simulate", ["--world", "8", "--hard", "h100"], "--hard: did you mean --hardware?"),
        ("launch", ["-n", "2", "--retry", "1", "python3", "-c", "pass"], "--retry: did you mean --retries?"),
    ],
)
def test_an_unknown_flag_is_named_with_its_reason_or_the_nearest(command, argv, needle, rows):
    parser = _commands()[command][0]
    t0 = time.perf_counter()
    with pytest.raises(UsageError) as caught:
        parser.parse_args(argv)
    line = str(caught.value)
    assert line.startswith("unrecognized arguments: ") and needle in line and "\n" not in line, line
    rows(f"{command} {' '.join(argv)}", line, 2, time.perf_counter() - t0)


def test_a_value_that_begins_with_a_dash_is_shown_how_to_give(rows):
    """argparse takes ``--mpi-args --oversubscribe``'s value for a flag: the error says to write it after '='."""
    parser = _commands()["launch"][0]
    argv = ["--mpi-args", "--oversubscribe", "-n", "2", "python3", "-c", "pass"]
    t0 = time.perf_counter()
    with pytest.raises(UsageError) as caught:
        parser.parse_args(argv)
    line = str(caught.value)
    assert "expected one argument; a value that begins with '-' goes after '=': --mpi-args=--oversubscribe" in line
    rows(f"launch {' '.join(argv)}", line, 2, time.perf_counter() - t0)
    assert parser.parse_args(["--mpi-args=--oversubscribe", "python3"]).mpi_args == ["--oversubscribe"]
    with pytest.raises(UsageError) as caught:  # a value left out before another flag: no such hint
        parser.parse_args(["--hostfile", "-n", "4", "python3"])
    assert "goes after '='" not in str(caught.value), caught.value


def test_help_reads_as_plain_text():
    """--help shows a module's docstring without its markup (``x``, :func:`x`)."""
    for name, (parser, _, _) in _commands().items():
        text = parser.format_help()
        assert "``" not in text and ":func:`" not in text and ":class:`" not in text, (name, text)
