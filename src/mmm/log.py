"""Rank-aware logging: rank 0 only by default, every rank on request.

Every rank logs when ``all_ranks=True`` or ``LOG_FROM_ALL_RANKS=1`` (also ``MMM_LOG_ALL_RANKS=1``);
lines then carry a ``[r3]`` prefix. ``MMM_LOG_LEVEL`` sets the level (default INFO). Python warnings
follow the same rule (rank 0 says each once). Rich renders the lines on a terminal; a batch job's
output file (and any MPI-launched rank) gets plain, unwrapped lines; ``MMM_RICH=0/1`` forces it.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from mmm import env as mmm_env

LOGGER_NAME = "mmm"
_TRUE = {"1", "true", "yes", "on"}


def env_flag(name: str, env=os.environ) -> bool:
    return bool(mmm_env.get(name, False, env=env))


def all_ranks_requested(env=os.environ) -> bool:
    return env_flag("LOG_FROM_ALL_RANKS", env) or env_flag("MMM_LOG_ALL_RANKS", env)


def get_logger(name: str | None = None) -> logging.Logger:
    """The ``mmm`` logger, or a child of it (``get_logger("mesh")`` -> ``mmm.mesh``)."""
    return logging.getLogger(LOGGER_NAME if not name else f"{LOGGER_NAME}.{name}")


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        width = len(str(max(world_size - 1, 0)))
        self.prefix = f"[r{rank:>{width}}] " if world_size > 1 else ""

    def filter(self, record: logging.LogRecord) -> bool:
        if self.prefix and not getattr(record, "_mmm_prefixed", False):
            record.msg = f"{self.prefix}{record.msg}"
            record._mmm_prefixed = True
        return True


def configure(
    *, rank: int = 0, world_size: int = 1, all_ranks: bool | None = None, level: str | int | None = None
) -> logging.Logger:
    """Set up the ``mmm`` logger for this rank. Idempotent: a second call replaces the handler."""
    logger = get_logger()
    if all_ranks is None:
        all_ranks = all_ranks_requested()
    level = level or mmm_env.get("MMM_LOG_LEVEL", "INFO")
    for h in list(logger.handlers):
        if getattr(h, "_mmm", False):
            logger.removeHandler(h)
    logger.propagate = False
    if rank != 0 and not all_ranks:
        logger.setLevel(logging.ERROR)  # errors still surface from the rank that has them
        # Python warnings too: every rank runs the same code, so N ranks would print N copies of the
        # same warning (FSDP2's "returned a view tensor", deprecations); rank 0 says it once
        warnings.filterwarnings("ignore")
    else:
        logger.setLevel(level if isinstance(level, int) else str(level).upper())
    handler = _make_handler()
    handler._mmm = True  # type: ignore[attr-defined]
    if all_ranks:
        handler.addFilter(_RankFilter(rank, world_size))
    logger.addHandler(handler)
    quiet_torchao()  # a user's script may import transformers (and it torchao) later: two filters, no import
    return logger


_QUIETED = False


def quiet_torchao() -> None:
    """transformers imports torchao when it is installed (for its quantizers), and torchao's import says, on
    every rank of a run that uses neither, that its CUDA kernels do not load into a torch built without CUDA,
    and (torch) that it registers an Enum the deprecated way. Those two messages are dropped, nothing else
    (call before transformers is imported; once is enough; :func:`configure` calls it)."""
    global _QUIETED
    if _QUIETED:
        return
    _QUIETED = True

    def cuda_kernels_on_a_cpu_build(record: logging.LogRecord) -> bool:
        torch = sys.modules.get("torch")
        cpu_build = torch is not None and getattr(torch.version, "cuda", None) is None
        return not (cpu_build and record.getMessage().startswith("Failed to load "))

    logging.getLogger("torchao").addFilter(cuda_kernels_on_a_cpu_build)
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda r: "register_constant() on Enum subclasses is deprecated" not in r.getMessage()
    )


def rich_wanted(env=os.environ) -> bool:
    """Whether output is rich-rendered: ``MMM_RICH=0/1`` when set, else on a terminal outside MPI."""
    # MPI launchers hand ranks a pseudo-terminal even when the job writes to a file.
    forced = mmm_env.get("MMM_RICH", env=env)
    if forced is not None:
        return forced
    under_mpi = any(v in env for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PALS_RANKID", "PMIX_RANK"))
    return sys.stdout.isatty() and not under_mpi


def _make_handler() -> logging.Handler:
    """Rich on a terminal; plain ``HH:MM:SS LEVEL message`` lines in a job's output file."""
    if rich_wanted():
        try:
            from rich.console import Console
            from rich.logging import RichHandler

            h = RichHandler(
                console=Console(file=sys.stdout),
                show_path=False,
                markup=False,
                rich_tracebacks=False,
                log_time_format="%H:%M:%S",
            )
            h.setFormatter(logging.Formatter("%(message)s"))
            return h
        except ImportError:  # rich is a dependency, but never let logging be the thing that fails
            pass
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)-5s %(message)s", "%H:%M:%S"))
    return h
