"""How ``launch`` runs a launcher (an ``mpiexec``, ``srun``) as its child: the habits of each that it works
around, as data. ``Flavor.supervision`` holds an ``mpiexec``'s; ``SRUN`` is srun's."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mmm.launch import tempdirs


@dataclass(frozen=True)
class Supervision:
    """What launch does for a launcher it runs as its child; the defaults are a launcher without quirks."""

    exit_box: str = ""  # in the box it prints after a rank's non-zero exit (dropped after a usage error)
    watch_ranks: bool = False  # it kills every rank at once and names none: launch names the first to die
    # the signals of launch's SIGUSR1/SIGUSR2 promise it passes on to the ranks; launch delivers the others
    # itself (through a rank watch)
    passes_on: tuple[str, ...] = ("SIGUSR1", "SIGUSR2")
    # a stopping signal it does not survive with its ranks, and the one launch sends it instead
    instead: tuple[tuple[str, str], ...] = ()
    # stopping signals it answers by ending the ranks at once (no step finished, no checkpoint saved): launch
    # sends these to the ranks itself (through a rank watch) and lets the launcher end when they have; before
    # any rank has noted itself the launcher gets them (nothing to save yet)
    stops_ranks_at_once: tuple[str, ...] = ()
    # it exits 1 when it stopped the ranks on such a signal itself: launch says 128 + the signal, as theirs
    says_1_when_stopped: bool = False
    # it runs in a process group of its own (unless launch is a terminal's foreground job), so that a signal to
    # launch's whole group (``timeout``'s, a shell's ``kill %1``) reaches the ranks through launch alone, not also
    # through it (which would end them at once), and it is sent SIGTERM when launch dies (Linux's parent-death
    # signal): it never outlives launch
    own_group: bool = False
    # the variable naming the folder it keeps its session files in on launch's host: launch gives each run a
    # new one (a folder left by a killed run whose process id comes round again breaks the next) ...
    session_folder_var: str = ""
    # ... unless the user placed them: one of these parameters set in the environment (as the variable's
    # prefix + name), on the command line, or in one of these files ({prefix}: the launcher's installation)
    session_folder_params: tuple[str, ...] = ()
    param_files: tuple[str, ...] = ()

    @property
    def stays_parent(self) -> bool:
        """Whether launch must stay the launcher's parent to do any of this (else it hands its process over)."""
        return self.watch_ranks or bool(self.exit_box or self.stops_ranks_at_once)


# srun passes SIGUSR1, SIGUSR2 and SIGHUP on to its tasks, but answers SIGINT by printing the tasks' states
# (a second within a second ends the step) and SIGTERM by forcing the step's end (the tasks are SIGKILLed
# after KillWait, whatever they were doing): launch delivers those two to the ranks itself
SRUN = Supervision(stops_ranks_at_once=("SIGINT", "SIGTERM"))


def session_folder(
    sup: Supervision | None, argv: Sequence[str], env: Mapping[str, str], parent: str | None = None
) -> dict[str, str]:
    """A new folder (in ``parent``, else the temporary folder) for the session files of the launcher that
    ``argv`` runs, as the variable that names it; nothing when it keeps none or the user placed them."""
    if sup is None or not sup.session_folder_var or placed_by_user(sup, argv, env):
        return {}
    return {sup.session_folder_var: tempdirs.make("mpi", parent)}


def placed_by_user(sup: Supervision, argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether the user placed the launcher's session files (in ``env``, on the command line ``argv``, or in
    one of its parameter files): then launch leaves them where they are."""
    names = sup.session_folder_params
    prefix = sup.session_folder_var.partition("_MCA_")[0] + "_MCA_"
    if any(prefix + name in env for name in names) or any(arg in names for arg in argv):
        return True
    exe = shutil.which(argv[0], path=env.get("PATH")) if argv else None
    prefixes = {str(Path(os.path.realpath(exe)).parent.parent)} if exe else set()
    prefixes |= {env[k] for k in ("OPAL_PREFIX", "PRTE_PREFIX") if env.get(k)}
    home = env.get("HOME") or os.path.expanduser("~")
    files = {f.format(prefix=p, home=home) for f in sup.param_files for p in prefixes or {""}}
    return any(_sets(Path(f), names) for f in files)


def _sets(file: Path, names: Sequence[str]) -> bool:
    """Whether an MCA parameter file (``name = value`` lines, ``#`` comments) sets any of ``names``."""
    try:
        text = file.read_text(errors="replace")
    except OSError:
        return False
    return any(line.split("#", 1)[0].partition("=")[0].strip() in names for line in text.splitlines())
