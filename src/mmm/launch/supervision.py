"""How ``launch`` runs a launcher (an ``mpiexec``, ``srun``) as its child: the habits of each that it works
around, as data. ``Flavor.supervision`` holds an ``mpiexec``'s; ``SRUN`` is srun's."""

from __future__ import annotations

from dataclasses import dataclass


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
    # the variable naming the folder it keeps its session files in on launch's host: launch gives each run a
    # new one (a folder left by a killed run whose process id comes round again breaks the next)
    session_folder_var: str = ""

    @property
    def stays_parent(self) -> bool:
        """Whether launch must stay the launcher's parent to do any of this (else it hands its process over)."""
        return self.watch_ranks or bool(self.exit_box or self.stops_ranks_at_once)


# srun passes SIGUSR1, SIGUSR2 and SIGHUP on to its tasks, but answers SIGINT by printing the tasks' states
# (a second within a second ends the step) and SIGTERM by forcing the step's end (the tasks are SIGKILLed
# after KillWait, whatever they were doing): launch delivers those two to the ranks itself
SRUN = Supervision(stops_ranks_at_once=("SIGINT", "SIGTERM"))
