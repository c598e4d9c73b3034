"""MPI's ``mpiexec``: where it is, which flavour it is, and how that flavour spells launch's flags.

``FLAVORS`` is the table: one row per flavour (Open MPI, MPICH/Intel MPI's Hydra, Cray/HPE PALS).
Adding a flavour is adding a row.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mmm import env as mmm_env
from mmm.errors import UsageError
from mmm.launch.supervision import Supervision


@dataclass(frozen=True)
class Flavor:
    """How one flavour's ``mpiexec`` is recognised and how it spells each setting. ``{n}``, ``{ppn}``,
    ``{file}``, ``{hosts}``, ``{host}``, ``{name}`` and ``{value}`` are filled in; an empty spelling is a
    setting this flavour does without."""

    version_says: tuple[str, ...]  # words in its `mpiexec --version` (lower case)
    nproc: tuple[str, ...]  # total ranks
    ppn: tuple[str, ...]  # ranks per host
    ppn_on_one_host: bool  # ranks per host also for a job on this machine alone
    hostfile: tuple[str, ...]
    hosts: tuple[str, ...]  # the host list, when there is no hostfile and more than this machine
    host: str  # one entry of {hosts}
    export: tuple[str, ...]  # one environment variable for every rank
    as_root: tuple[str, ...]  # when launch runs as root
    oversubscribe: tuple[str, ...]  # more ranks than cores on this machine
    hostfile_line: str = "{host} slots={slots}"  # a line of a hostfile launch writes (after a host is lost)
    supervision: Supervision = Supervision()  # what launch does for it, running it as its child


FLAVORS: dict[str, Flavor] = {  # in the order `mpiexec --version` is matched
    "openmpi": Flavor(
        version_says=("open mpi", "openrte", "prte"),
        nproc=("-n", "{n}"),
        ppn=("--map-by", "ppr:{ppn}:node"),
        ppn_on_one_host=False,
        hostfile=("--hostfile", "{file}"),
        hosts=("--host", "{hosts}"),
        host="{host}:{ppn}",
        export=("-x", "{name}"),
        as_root=("--allow-run-as-root",),
        oversubscribe=("--oversubscribe",),
        supervision=Supervision(
            exit_box="detected that one or more processes exited with non-zero status",
            instead=(("SIGQUIT", "SIGTERM"),),  # its prterun dies of SIGQUIT and leaves the ranks running
            # prterun passes SIGINT/SIGTERM on, then SIGKILLs the ranks within a second (Open MPI 5.0)
            stops_ranks_at_once=("SIGINT", "SIGTERM"),
            says_1_when_stopped=True,
            own_group=True,  # so timeout's SIGTERM to launch's group does not reach it too
            # prterun keeps <tmp>/ompi.<its pid>; one left by a killed prterun fails the next prterun of that
            # pid ("The PMIx server's listener thread failed to start")
            session_folder_var="PRTE_MCA_prte_local_tmpdir_base",
            # (prterun refuses prte_tmpdir_base together with prte_local_tmpdir_base)
            session_folder_params=("prte_tmpdir_base", "prte_local_tmpdir_base"),
            param_files=("{prefix}/etc/prte-mca-params.conf", "{home}/.prte/mca-params.conf"),
        ),
    ),
    "hydra": Flavor(  # MPICH, Intel MPI
        version_says=("hydra", "intel(r) mpi", "mpich"),
        nproc=("-n", "{n}"),
        ppn=("-ppn", "{ppn}"),
        ppn_on_one_host=True,
        hostfile=("-hostfile", "{file}"),
        hosts=("-hosts", "{hosts}"),
        host="{host}",
        export=("-genv", "{name}", "{value}"),
        as_root=(),
        oversubscribe=(),
        supervision=Supervision(
            watch_ranks=True,
            passes_on=("SIGUSR1",),  # its mpiexec dies of SIGUSR2, taking the job with it
        ),
        hostfile_line="{host}:{slots}",  # Hydra refuses Open MPI's "slots="
    ),
    "pals": Flavor(  # Cray/HPE
        version_says=("pals", "cray", "hpe"),
        nproc=("-n", "{n}"),
        ppn=("--ppn", "{ppn}"),
        ppn_on_one_host=True,
        hostfile=("--hostfile", "{file}"),
        hosts=(),
        host="{host}",
        export=("--env", "{name}={value}"),
        as_root=(),
        oversubscribe=(),
        hostfile_line="{host}",  # one host a line; ranks per host come from --ppn
    ),
}
MPI_FLAVORS = tuple(FLAVORS)
UNRECOGNISED = "hydra"  # an mpiexec whose --version names none of the above


def venv_mpiexec() -> str | None:
    cand = Path(sys.executable).parent / "mpiexec"
    return str(cand) if cand.is_file() and os.access(cand, os.X_OK) else None


def find_mpiexec() -> str | None:
    """The ``mpiexec`` first on PATH (a site's MPI, a module loaded, another environment put first), else this
    environment's own (``pip install 'mmm[mpi]'``: Open MPI), which an unactivated environment's PATH lacks.
    With ``MMM_MPI_FLAVOR`` set to another flavour than Open MPI, an Open MPI ``mpiexec`` (pip's, in an
    activated environment) is passed over for the next one; none left is one line naming what was found."""
    found = list(dict.fromkeys(p for p in (*_all_on_path("mpiexec"), venv_mpiexec()) if p))
    forced = mmm_env.get("MMM_MPI_FLAVOR")
    if not forced or forced == "openmpi" or not found:
        return found[0] if found else None
    fits = [p for p in found if _detected_flavor(p) != "openmpi"]  # only Open MPI says so for sure
    if not fits:
        raise UsageError(
            f"MMM_MPI_FLAVOR={forced}, but every mpiexec here is Open MPI's ({', '.join(found)}), which takes other "
            f"flags: put your {forced} mpiexec's folder first on PATH (e.g. module load), or unset MMM_MPI_FLAVOR"
        )
    return fits[0]


def _all_on_path(name: str) -> list[str]:
    """Every executable ``name`` on PATH, in PATH's order."""
    out = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        cand = os.path.join(folder or ".", name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            out.append(cand)
    return out


def mpi_flavor(mpiexec: str) -> str:
    """openmpi, hydra (MPICH, Intel MPI) or pals (Cray/HPE), from ``mpiexec --version``;
    ``MMM_MPI_FLAVOR`` overrides."""
    return mmm_env.get("MMM_MPI_FLAVOR") or _detected_flavor(mpiexec)


def _detected_flavor(mpiexec: str) -> str:
    """The flavour ``mpiexec --version`` names (:data:`UNRECOGNISED` when it names none)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20)
        text = (out.stdout + out.stderr).lower()
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    for name, row in FLAVORS.items():
        if any(word in text for word in row.version_says):
            return name
    return UNRECOGNISED


def mpiexec_flags(
    flavor: str,
    *,
    nproc: int,
    ppn: int,
    hosts: Sequence[str],
    hostfile: str | None,
    one_host: bool,
    env: Mapping[str, str],
    cpus: int,
) -> list[str]:
    """``mpiexec``'s flags for ``nproc`` ranks, ``ppn`` per host, on ``hosts`` (or those of ``hostfile``),
    every rank getting ``env``. ``one_host``: this machine alone (no scheduler, no hostfile)."""
    if flavor not in FLAVORS:
        raise UsageError(f"MPI flavour {flavor!r}; choose one of: {', '.join(MPI_FLAVORS)}")
    row = FLAVORS[flavor]
    flags = _fill(row.nproc, n=nproc)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        flags += row.as_root
    if one_host and nproc > cpus:
        flags += row.oversubscribe
    if row.ppn_on_one_host or not one_host:
        flags += _fill(row.ppn, ppn=ppn)
    if hostfile:
        flags += _fill(row.hostfile, file=hostfile)
    elif not one_host and row.hosts:
        flags += _fill(row.hosts, hosts=",".join(row.host.format(host=h, ppn=ppn) for h in hosts))
    return flags + export_flags(flavor, env)


def export_flags(flavor: str, env: Mapping[str, str]) -> list[str]:
    """``mpiexec``'s flags that give every rank, on every host, the variables of ``env``."""
    return [flag for name, value in env.items() for flag in _fill(FLAVORS[flavor].export, name=name, value=value)]


def _fill(spelling: Sequence[str], **values: object) -> list[str]:
    return [part.format(**values) for part in spelling]
