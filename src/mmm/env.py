"""The environment variables mmm reads, each with its type: a bad value is refused in one line that names
the variable, its value and what it takes, wherever it is read (no ``int(os.environ[...])`` traceback).

Every read goes through :func:`get` (``tests/test_bad_input.py`` checks the source for others), so
:data:`VARIABLES` is the whole surface: the bad-input campaign tries each kind's :attr:`Kind.bad` values
on each variable. An empty value counts as unset (``MMM_DEVICE= launch ...``), as shells use it.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mmm.errors import UsageError


@dataclass(frozen=True)
class Kind:
    """A type of value: ``what`` says what it takes (in the error), ``parse`` turns the text into the value
    or raises ValueError, ``bad`` are values it refuses (the campaign's rows)."""

    what: str
    parse: Callable[[str], Any]
    bad: tuple[str, ...]


def _integer(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text.strip())
        if value < low or (high is not None and value > high):
            raise ValueError(text)
        return value

    return parse


def _seconds(text: str) -> float:
    value = float(text)
    # finite and within what a timedelta and a C int of milliseconds hold (24 days)
    if not (0 < value <= MAX_SECONDS):
        raise ValueError(text)
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(text)
    return value


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _switch(text: str) -> bool:
    word = text.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(text)
    return word in _TRUE


def choice(*names: str, case: bool = False) -> Kind:
    """One of ``names`` (any case unless ``case``); the value returned as written in ``names``."""

    def parse(text: str) -> str:
        word = text.strip()
        for name in names:
            if word == name or (not case and word.lower() == name.lower()):
                return name
        raise ValueError(text)

    return Kind(f"one of {', '.join(names)}", parse, ("bogus",))


def _tasks_per_node(text: str) -> list[int]:
    """Slurm's ``SLURM_TASKS_PER_NODE`` form: ``"4(x2),3"`` -> ``[4, 4, 3]``."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None or int(m[1]) < 1 or (m[2] is not None and int(m[2]) < 1):
            raise ValueError(text)
        out += [int(m[1])] * int(m[2] or 1)
    if not out:
        raise ValueError(text)
    return out


def _backend(text: str) -> str:
    """A backend name, or torch's per-device form (``cpu:gloo,cuda:nccl``)."""
    names = [part.rpartition(":")[2].strip().lower() for part in text.split(",")]
    if not all(n in BACKENDS for n in names):
        raise ValueError(text)
    return text.strip()


def _watch(text: str) -> tuple[str, int, str]:
    host, port, token = text.rsplit(":", 2)
    if not host or not token:
        raise ValueError(text)
    return host, PORT.parse(port), token


def _stamp(text: str) -> str:
    if "/" in text or text in (".", "..") or "\0" in text:
        raise ValueError(text)
    return text


def _hosts(text: str) -> list[str]:
    return [h for h in (x.strip() for x in text.split(",")) if h]


BACKENDS = ("gloo", "nccl", "xccl", "ccl", "mpi", "ucc")
MAX_SECONDS = 2_000_000.0  # 23 days: a C int of milliseconds (gloo, NCCL) holds up to 24.8
POSITIVE_INT = Kind("a positive integer", _integer(1), ("x", "1.5", "0", "-1"))
NONNEGATIVE_INT = Kind("an integer >= 0", _integer(0), ("x", "1.5", "-1"))
PORT = Kind("a port number (1-65535)", _integer(1, 65535), ("x", "0", "70000"))
SECONDS = Kind(
    f"a positive number of seconds (at most {MAX_SECONDS:.0f})", _seconds, ("x", "0", "-5", "inf", "nan", "1e20")
)
TFLOPS = Kind("a positive number", _positive_float, ("x", "0", "-1", "inf", "nan"))
UNIX_TIME = Kind("a Unix time in seconds (as launch sets it)", _positive_float, ("x", "inf", "nan", "-1"))
SWITCH = Kind("1 or 0 (true/false, yes/no, on/off)", _switch, ("maybe",))
TEXT = Kind("any text", str, ())
STAMP = Kind("a name without '/' (a folder's name)", _stamp, ("a/b", ".."))
HOSTS = Kind("host names, comma-separated", _hosts, ())
TASKS_PER_NODE = Kind("counts like 4(x2),3", _tasks_per_node, ("x", "4(x", "0", "4(x0)"))
WATCH = Kind("host:port:token (as launch sets it)", _watch, ("x", "h:70000:t", "h:1:"))
LOG_LEVEL = choice("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL", "NOTSET")


@dataclass(frozen=True)
class Variable:
    name: str
    kind: Kind
    what: str  # what it does (docs/environment.md says more)
    per_rank: bool = False  # each rank has its own value (a rank id): each says what it found


VARIABLES: dict[str, Variable] = {}


def _var(name: str, kind: Kind, what: str, *, per_rank: bool = False) -> None:
    VARIABLES[name] = Variable(name, kind, what, per_rank)


# set by the user (docs/environment.md)
_var("MMM_DEVICE", choice("auto", "cpu", "cuda", "xpu", "mps"), "the device")
_var(
    "MMM_BACKEND",
    Kind(f"a backend: {', '.join(BACKENDS)} (or cpu:gloo,cuda:nccl)", _backend, ("bogus",)),
    "the process-group backend",
)
_var("MMM_TIMEOUT", SECONDS, "the collective timeout")
_var("MMM_TOKEN_CACHE", TEXT, "the folder of memory-mapped token caches")
_var("MMM_STACK_DIR", TEXT, "the folder of each rank's stacks")
_var("MMM_LOG_ALL_RANKS", SWITCH, "log from every rank")
_var("LOG_FROM_ALL_RANKS", SWITCH, "log from every rank")
_var("MMM_LOG_LEVEL", LOG_LEVEL, "the log level")
_var("MMM_RICH", SWITCH, "rich rendering")
_var("MMM_HOST_MALLOC", choice("auto", "return", "default"), "host allocations of 1 MiB and more by mmap")
_var("MMM_PEAK_TFLOPS", TFLOPS, "this rank's peak TFLOP/s")
_var("MMM_FAULT", TEXT, "fault injection")
_var("MMM_SAVE_FAULT", TEXT, "save-fault injection")
_var("MMM_GPUS_PER_NODE", NONNEGATIVE_INT, "ranks per host (0: count no accelerators)")
_var("MMM_MPI_FLAVOR", choice("openmpi", "hydra", "pals", case=True), "the mpiexec flavour")
_var("MMM_NO_MPI4PY", SWITCH, "no mpi4py")
_var("MMM_DS_SHM", SWITCH, "DeepSpeed's CPU shared-memory kernel")
_var("MMM_LEAN_FSDP_SETUP", SWITCH, "FSDP's lean setup")
# set by launch, read by the ranks
_var("MMM_LAUNCH_TIME", UNIX_TIME, "the launch's wall-clock time")
_var("MMM_LAUNCHER", TEXT, "the launcher's name")
_var("MMM_RUN_STAMP", STAMP, "the job's stamp")
_var("MMM_RUN_ID", STAMP, "the launch's own id")
_var("MMM_RESTART", NONNEGATIVE_INT, "the attempt number")
_var("MMM_DROPPED_HOSTS", HOSTS, "hosts left out of a relaunch")
_var("MMM_CHECK_WORLD", POSITIVE_INT, "a world size a trainer only checks its flags against")
_var("MMM_PID_DIR", TEXT, "the folder of rank process ids")
_var("MMM_WATCH", WATCH, "launch's rank watch")
# launchers' (rendezvous, ranks, Slurm)
_var("MASTER_ADDR", TEXT, "rank 0's host")
_var("MASTER_PORT", PORT, "the rendezvous port")
for _name in ("RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "PALS_RANKID",
              "PALS_LOCAL_RANKID", "PMI_RANK", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_LOCALID",
              "SLURM_NODEID"):  # fmt: skip
    _var(_name, NONNEGATIVE_INT, "a rank or node id launchers set", per_rank=True)
for _name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_SIZE",
              "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
              "SLURM_CPUS_PER_TASK"):  # fmt: skip
    _var(_name, POSITIVE_INT, "a count launchers set")
for _name in ("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
    _var(_name, TASKS_PER_NODE, "Slurm's tasks per node")


def declare(name: str, kind: Kind) -> None:
    """Give variable ``name`` the kind its own module parses it as (e.g. :mod:`mmm.faults`' specs)."""
    old = VARIABLES[name]
    VARIABLES[name] = Variable(name, kind, old.what, old.per_rank)


def get(name: str, default: Any = None, env: Mapping[str, str] | None = None) -> Any:
    """Variable ``name`` of ``env`` (this process's) parsed as its kind, or ``default`` when unset or
    empty; a value its kind refuses is a :class:`~mmm.errors.UsageError` naming it and what it takes."""
    var = VARIABLES[name]  # a KeyError here is a bug: every variable mmm reads is declared above
    raw = (os.environ if env is None else env).get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return var.kind.parse(raw)
    except (ValueError, OverflowError):
        raise UsageError(
            f"{name}={raw!r}: {var.what} takes {var.kind.what}; fix or unset it", same_on_all_ranks=not var.per_rank
        ) from None


def problems(env: Mapping[str, str] | None = None, *, prefixes: tuple[str, ...] = ("MMM_", "MASTER_")) -> list[str]:
    """Every set variable whose name starts with one of ``prefixes`` (mmm's own and the rendezvous') that its
    kind refuses, each as :func:`get` says it: checked at the start of ``launch`` and of every rank, so a
    value read late (``MMM_PEAK_TFLOPS`` at the end of a run) fails before any work."""
    out = []
    for name in VARIABLES:
        if name.startswith(prefixes):
            try:
                get(name, env=env)
            except UsageError as e:
                out.append(str(e))
    return out


def check(env: Mapping[str, str] | None = None) -> None:
    """:func:`problems` as one :class:`~mmm.errors.UsageError` (all of them at once)."""
    found = problems(env)
    if found:
        raise UsageError("; ".join(found))


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    """``name`` is set to something other than blanks."""
    VARIABLES[name]
    return bool((os.environ if env is None else env).get(name, "").strip())
