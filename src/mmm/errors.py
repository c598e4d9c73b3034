"""Errors a user can fix, and how a command-line program reports them."""

from __future__ import annotations

import argparse
import sys


class UsageError(Exception):
    """Bad input the user can fix: reported as one line, no traceback, non-zero exit.

    ``same_on_all_ranks`` marks errors every rank reaches identically (validation of
    flags and degrees): only rank 0 prints them, every rank still exits non-zero.
    """

    exit_code = 2

    def __init__(self, message: str, *, same_on_all_ranks: bool = True) -> None:
        super().__init__(message)
        self.same_on_all_ranks = same_on_all_ranks


class RunError(UsageError):
    """A run that cannot go on for a reason the user can act on (a non-finite loss, ...): one line,
    no traceback, exit 1."""

    exit_code = 1


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as a single line (usage is one `--help` away)."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


def print_error(message: str, *, prog: str | None = None, rank: int | None = None) -> None:
    prefix = f"[rank {rank}] " if rank is not None else ""
    name = f"{prog}: " if prog else ""
    sys.stderr.write(f"{prefix}{name}error: {message}\n")
    sys.stderr.flush()
