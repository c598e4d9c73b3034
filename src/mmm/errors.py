"""Errors a user can fix, and how a command-line program reports them."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn


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


DIVERGED_EXIT = 65  # a run that stopped itself on a non-finite loss; `launch --retries` does not replay it


class DivergedError(RunError):
    """The loss became non-finite and the run stopped itself: deterministic, so a relaunch from the last
    checkpoint would diverge again; exit code :data:`DIVERGED_EXIT`."""

    exit_code = DIVERGED_EXIT


class Spelling:
    """How a check names the settings it refuses, so that one rule keeps one message in two vocabularies.

    The library speaks its API, keyword arguments (:data:`API`: ``microbatches=3``, ``dp_replicate``);
    a command line passes its flags instead (:data:`mmm.cli.FLAGS`: ``--microbatches 3``,
    ``--dp-replicate``). ``flags`` maps a field to a flag of another name (``schedule`` ->
    ``--pp-schedule``); any other field is its own name with dashes. ``keywords`` does the same for
    keyword arguments of another name (``schedule`` -> ``pp_schedule``). Either may map a field to ""
    where the caller cannot set it (its name is then empty: a check leaves that fix out). ``facts``
    describes fields that are facts of the model rather than settings, as a format of the value
    (``n_layers`` -> ``"the model's {} blocks"``).
    """

    def __init__(
        self,
        *,
        flags: Mapping[str, str] | None = None,
        keywords: Mapping[str, str] | None = None,
        facts: Mapping[str, str] | None = None,
    ) -> None:
        self.flags = flags  # None: keyword arguments
        self.keywords = dict(keywords or {})
        self.facts = dict(facts or {})

    def name(self, field: str) -> str:
        """The setting alone: ``stages_per_rank`` or ``--stages-per-rank`` ("" where the caller cannot set it)."""
        if self.flags is None:
            return self.keywords.get(field, field)
        return self.flags.get(field, "--" + field.replace("_", "-"))

    def __call__(self, field: str, value: Any) -> str:
        """The setting and its value: ``split_points=[2, 4]`` or ``--split-points 2,4`` (a switch: ``--compile``)."""
        if field in self.facts:
            return self.facts[field].format(value)
        if self.flags is None:
            return f"{self.name(field)}={value!r}"
        if value is True:
            return self.name(field)
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        return f"{self.name(field)} {value}"


API = Spelling(facts={"n_layers": "the model's {} blocks"})  # a block count is not an argument of the API


_ROLE = re.compile(r":(?:class|func|mod|meth|attr|data|exc|obj):`(~?)([^`]+)`")


def plain_text(text: str) -> str:
    """A docstring as a terminal shows it: ``:func:`mmm.verify``` -> ``mmm.verify``, double backquotes
    dropped (``~`` roles keep the last name)."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return text.replace("``", "")


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as a single line (usage is one `--help` away), and takes only
    whole flag names: an abbreviation (``--hard`` for ``--hardware``) would slip past commands that pass
    their flags on to another (``mmm.cli.without_flags``), and a later flag could change its meaning."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.not_here: dict[str, str] = {}
        """Flags other commands of mmm take and this one does not -> why (said when one is given)."""

    def format_help(self) -> str:
        for text in ("description", "epilog"):  # often a module's docstring, read in a terminal
            if getattr(self, text):
                setattr(self, text, plain_text(getattr(self, text)))
        return super().format_help()

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        self._given = list(sys.argv[1:] if args is None else args)
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}" + "".join(f"; {h}" for h in self._hints(extras)))
        return namespace

    def _hints(self, extras: Sequence[str]) -> list[str]:
        """For each unknown flag: why this command does not take it (:attr:`not_here`), or the nearest flag
        it takes (``--moe_experts``, ``--moe-expert``: ``--moe-experts``)."""
        ours = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        why: dict[str, list[str]] = {}
        near = []
        for arg in extras:
            flag = arg.split("=", 1)[0]
            if not flag.startswith("--") or flag in ours:
                continue
            if flag in self.not_here:
                why.setdefault(self.not_here[flag], []).append(flag)
                continue
            close = difflib.get_close_matches(flag.replace("_", "-"), ours, n=1, cutoff=0.75)
            if close:
                near.append(f"{flag}: did you mean {close[0]}?")
        return [f"{', '.join(flags)}: {reason}" for reason, flags in why.items()] + near

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message}{self._dash_value(message)} (see {self.prog} --help)")

    def _dash_value(self, message: str) -> str:
        """argparse takes a value that begins with '-' (``--mpi-args --oversubscribe``) for a flag: say how to
        give it."""
        found = re.match(r"argument (\S+): expected one argument$", message)
        given = getattr(self, "_given", [])
        ours = {o for a in self._actions for o in a.option_strings}
        for flag in found.group(1).split("/") if found else ():
            at = given.index(flag) if flag in given else -1
            after = given[at + 1] if 0 <= at < len(given) - 1 else ""
            if after.startswith("-") and after.split("=", 1)[0] not in ours:  # not a flag of ours: its value
                return f"; a value that begins with '-' goes after '=': {flag}={after}"
        return ""


def only_with(given: Sequence[str], needs: str, fix: str) -> str:
    """The problem of settings ``given`` (spelled as the user wrote them) that only matter ``needs`` (e.g.
    ``"with --pp > 1 (got pp=1)"``): one line saying so, ``fix`` (e.g. ``"add --pp N"``) or drop them."""
    verb, them = ("applies", "it") if len(given) == 1 else ("apply", "them")
    return f"{', '.join(given)} only {verb} {needs}; {fix} or drop {them}"


def folder_problem(where: str, path: str | os.PathLike) -> str | None:
    """Why the folder ``path`` cannot be made or written (``where`` names it in the message, e.g.
    ``"--outdir 'x'"``), or None. Nothing is created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{where} is a file; pass a directory (it is created if missing)"
    return _nearest_folder_problem(where, [path, *path.parents])


def file_problem(where: str, path: str | os.PathLike) -> str | None:
    """Why the file ``path`` cannot be written (its folders are created if missing), or None."""
    path = Path(path)
    if path.is_dir():
        return f"{where} is a directory; give a file name (e.g. {str(path / 'out.json')!r})"
    return _nearest_folder_problem(where, path.parents)  # written beside, then renamed: the folder counts


def _nearest_folder_problem(where: str, candidates) -> str | None:
    """The first of ``candidates`` that exists must be a folder this process can write in."""
    nearest = next((p for p in candidates if p.exists()), None)
    if nearest is not None and not nearest.is_dir():
        return f"{where}: {str(nearest)!r} is a file, not a directory"
    if nearest is not None and not os.access(nearest, os.W_OK):
        return f"{where}: cannot write in {str(nearest)!r}"
    return None


def print_error(message: str, *, prog: str | None = None, rank: int | None = None) -> None:
    prefix = f"[rank {rank}] " if rank is not None else ""
    name = f"{prog}: " if prog else ""
    sys.stderr.write(f"{prefix}{name}error: {message}\n")
    sys.stderr.flush()


def run_command(main: Callable[[], int | None], prog: str) -> NoReturn:
    """A one-process command's entry point: ``sys.exit(main())``; a :class:`UsageError` ends it with one line
    and exit 2, Ctrl-C with exit 130 (no traceback for either)."""
    try:
        code = main()
    except UsageError as e:
        print_error(str(e), prog=prog)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code or 0)


def first_line(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
