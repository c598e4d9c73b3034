"""Flags shared by mmm's programs, with the spellings already in circulation as aliases.

Configuration is typed: dataclasses whose fields carry their flags (:func:`option`). A program's
:class:`Flags` generates its parser from them and parses once; everything below takes the configs.
"""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar

from mmm.errors import ArgumentParser, Spelling

T = TypeVar("T")
# the library names the settings it refuses by field (microbatches=3); its checks take this to name
# them by these programs' flags instead (--microbatches 3)
FLAGS = Spelling(flags={"schedule": "--pp-schedule"})

__all__ = [
    "FLAGS",
    "ArgumentParser",
    "Flags",
    "MeshConfig",
    "add_flags",
    "degree",
    "flag_problems",
    "fraction",
    "from_flags",
    "int_list",
    "nonnegative_int",
    "option",
    "override",
    "nonnegative_float",
    "positive_float",
    "positive_int",
    "world_size",
    "refuses",
    "seconds",
    "shell_words",
    "random_seed",
    "nonempty_text",
]


def refuses(*bad: str) -> Callable[[Callable[[str], T]], Callable[[str], T]]:
    """Mark a flag parser with values it refuses: the bad-input campaign (tests/test_bad_input.py) tries
    each on every flag that uses the parser, and every flag of every command must have such a parser
    (or choices, or be a switch), so a new flag cannot go untried."""

    def mark(parse: Callable[[str], T]) -> Callable[[str], T]:
        parse.bad = bad  # type: ignore[attr-defined]
        return parse

    return mark


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


@refuses("x", "", "1.5", "0", "-1")
def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


MAX_WORLD = 1 << 20  # ranks a job may have for the planner and simulator: more than any machine holds


@refuses("x", "", "0", "-1", str(MAX_WORLD + 1))
def world_size(text: str) -> int:
    """A job's number of ranks, 1 to :data:`MAX_WORLD` (a larger one is a typo: its layouts would take
    minutes to list)."""
    value = positive_int(text)
    if value > MAX_WORLD:
        raise argparse.ArgumentTypeError(f"{value} ranks is more than any machine holds; at most {MAX_WORLD}")
    return value


@refuses("x", "", "1.5", "-1")
def nonnegative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


@refuses("x", "", "-1", str(2**64))
def random_seed(text: str) -> int:
    """A random seed: an integer from 0 to 2**63 - 1 (what torch.manual_seed takes)."""
    value = _integer(text)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{value} is not a seed: use an integer from 0 to 2**63 - 1")
    return value


@refuses("x", "", "0", "-2")
def degree(text: str) -> int:
    value = _integer(text)
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"{value} is not a degree: use a positive integer, or -1 to infer it")
    return value


@refuses("x", "1,y", ",")
def int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")
    return out


@refuses("x", "", "0", "-1", "inf", "nan")
def positive_float(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value:g} must be > 0")
    return value


@refuses("x", "", "-1", "inf", "nan")
def nonnegative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g} must be >= 0")
    return value


@refuses("x", "", "-0.1", "1", "nan")
def fraction(text: str) -> float:
    """A probability or share: 0 <= value < 1."""
    value = _number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value:g} must be in [0, 1)")
    return value


MAX_SECONDS = 2_000_000.0  # 23 days: what a C int of milliseconds holds (gloo's and NCCL's timeouts)


@refuses("x", "", "0", "-5", "inf", "nan", "1e20")
def seconds(text: str) -> float:
    """A duration: more than 0 and at most :data:`MAX_SECONDS`."""
    value = _number(text)
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{value:g} must be a number of seconds in (0, {MAX_SECONDS:.0f}]")
    return value


@refuses("", " ")
def nonempty_text(value: str) -> str:
    """Any text but an empty one (a name, a path, a pattern)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty value; give one, or leave the flag out")
    return value


@refuses('"x', "a'b")
def shell_words(value: str) -> list[str]:
    """Flags for another program in one string, split as a shell would (``"--cpu-bind depth -d 8"``)."""
    try:
        return shlex.split(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value!r} cannot be split as a shell would ({e}); close the quote") from None


CHECKED = (positive_int, nonnegative_int, random_seed, degree, positive_float, nonnegative_float, fraction, seconds)


# --------------------------------------------------------------------------- config fields as flags
def option(
    default: Any,
    *flags: str,
    help: str,
    group: str,
    parse: Callable[[str], Any] | None = None,
    choices: Sequence[Any] | None = None,
    metavar: str | None = None,
    shown: str | None = None,
    const: Any = None,
) -> Any:
    """A config dataclass field that is also a command-line flag.

    ``flags``: its spellings, the documented one first, then those in circulation (accepted as
    aliases). ``help``: what it does; ``--help`` adds ``[default]`` (``shown`` replaces the default's
    text; ``{example}`` in either becomes the program's example name). ``group``: its section of
    ``--help`` (a key of :data:`GROUPS`). ``parse``: text -> value (default: the default's type; a
    bool default makes a switch). ``const``: the value of the bare flag (``--resume`` = latest)."""
    meta = {"flags": flags, "help": help, "group": group, "parse": parse, "choices": choices}
    meta.update(metavar=metavar, shown=shown, const=const)
    return field(default=default, metadata=meta)


def override(cls: type, name: str, default: Any = MISSING, **changes: Any) -> Any:
    """Field ``name`` of config ``cls`` again, for a subclass: same flags and help, another
    ``default`` (or other :func:`option` settings, e.g. ``choices``)."""
    old = {f.name: f for f in fields(cls)}[name]
    return field(default=old.default if default is MISSING else default, metadata={**old.metadata, **changes})


# The sections of --help, in this order (a group not listed here comes after them).
GROUPS = {
    "mesh": "device mesh (pp x dp_replicate x dp_shard x cp x tp = world size)",
    "dp": "data parallelism",
    "pipeline": "microbatches (gradient accumulation; a pipeline's with --pp > 1) and pipeline parallel",
    "model": "model",
    "training": "training",
    "schedule": "learning-rate schedule",
    "eval": "evaluation",
    "output": "output",
    "tracking": "tracking (rank 0 only, fed by the history; optional extras)",
    "checkpoint": "checkpointing (torch Distributed Checkpoint; DeepSpeed's own for zero1/2/3)",
    "failures": "failures",
}


@dataclass
class MeshConfig:
    """The device mesh's degrees (pp x dp_replicate x dp_shard x cp x tp = world size; one of them
    may be -1, inferred from the world size). Every mmm program takes them as flags."""

    tp: int = option(
        1,
        "--tp",
        "--tpsize",
        parse=degree,
        group="mesh",
        help="tensor-parallel degree (innermost axis, keep within a node)",
    )
    pp: int = option(
        1, "--pp", "--ppsize", parse=degree, group="mesh", help="pipeline-parallel degree (outermost axis)"
    )
    cp: int = option(
        1, "--cp", "--cpsize", parse=degree, group="mesh", help="context-parallel degree (sequence split across ranks)"
    )
    dp_replicate: int = option(
        1, "--dp-replicate", parse=degree, group="mesh", help="data-parallel replicas (HSDP outer axis)"
    )
    dp_shard: int = option(
        -1,
        "--dp-shard",
        parse=degree,
        group="mesh",
        help="data-parallel shards (FSDP axis); -1 infers it from the world size",
    )
    ep: int = option(
        1,
        "--ep",
        parse=positive_int,  # not inferred: no -1
        group="mesh",
        help="expert-parallel degree: a mixture of experts' routed experts split over this many of the dp-shard x "
        "cp ranks (tokens sent to their experts by all-to-all); dividing dp-shard x cp",
    )

    @property
    def degrees(self) -> dict[str, int]:
        """The degrees by axis, outermost first, and ep when given (``init_mesh(**degrees)``)."""
        out = {a: getattr(self, a) for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
        return out | {"ep": self.ep} if self.ep != 1 else out


def flag_fields(cls: type, only: Collection[str] | None = None) -> list[Field]:
    """The fields of config ``cls`` that are flags (all of them, or those named in ``only``)."""
    out = [f for f in fields(cls) if f.metadata.get("flags")]
    if only is not None:
        unknown = set(only) - {f.name for f in out}
        if unknown:
            raise ValueError(f"{cls.__name__} has no flag field {', '.join(sorted(unknown))}")
        out = [f for f in out if f.name in only]
    return out


def _shown(f: Field) -> str | None:
    m = f.metadata
    if m["shown"] is not None:
        return m["shown"]
    if f.default is None or isinstance(f.default, bool):
        return None
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def add_flags(
    parser: argparse.ArgumentParser,
    *sections: tuple[type, Collection[str] | None],
    titles: Mapping[str, str] | None = None,
    example: str = "",
) -> None:
    """Add the flag fields of each (config class, fields to offer or None for all) to ``parser``,
    one ``--help`` section per group (:data:`GROUPS` order; ``titles`` renames one)."""
    entries = [f for cls, only in sections for f in flag_fields(cls, only)]
    names = [f.name for f in entries]
    if len(names) != len(set(names)):
        raise ValueError(f"two config fields share a name: {sorted(n for n in set(names) if names.count(n) > 1)}")
    seen = list(dict.fromkeys(f.metadata["group"] for f in entries))
    keys = sorted(seen, key=lambda k: list(GROUPS).index(k) if k in GROUPS else len(GROUPS) + seen.index(k))
    titles = {**GROUPS, **(titles or {})}
    for key in keys:
        group = parser.add_argument_group(titles.get(key, key))
        for f in (f for f in entries if f.metadata["group"] == key):
            m = f.metadata
            shown = _shown(f)
            text = (m["help"] + (f" [{shown}]" if shown is not None else "")).replace("{example}", example)
            text = text.replace("%", "%%")  # argparse formats help with %
            kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": text}
            if isinstance(f.default, bool):
                kw["action"] = "store_true"
            else:
                typed = f.default is not None and not isinstance(f.default, str)
                parse = m["parse"] or (type(f.default) if typed else nonempty_text)
                if m["choices"] is not None:
                    kw["choices"] = list(m["choices"])
                if m["choices"] is None or m["parse"] is not None:
                    kw["type"] = parse
                if m["metavar"] is not None:
                    kw["metavar"] = m["metavar"]
                elif m["choices"] is None and parse in (int, positive_int, nonnegative_int, random_seed, degree):
                    kw["metavar"] = "N"
                if m["const"] is not None:
                    kw.update(nargs="?", const=m["const"])
            group.add_argument(*m["flags"], **kw)


def from_flags(cls: type[T], namespace: argparse.Namespace) -> T:
    """An instance of config ``cls`` from parsed flags (a field that is not a flag here keeps its default)."""
    given = vars(namespace)
    return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})


def flag_problems(config: Any) -> list[str]:
    """Values of a config built in code (not parsed) that its flags would have refused, e.g. a
    ``positive_int`` field holding 0; each names the flag."""
    out = []
    for f in flag_fields(type(config)):
        value, m = getattr(config, f.name), f.metadata
        if value is None:
            continue
        if m["choices"] is not None and value not in m["choices"]:
            out.append(f"{m['flags'][0]} {value!r}: choose from {', '.join(map(str, m['choices']))}")
        elif m["parse"] in CHECKED:
            try:
                m["parse"](str(value))
            except argparse.ArgumentTypeError as e:
                out.append(f"{m['flags'][0]} {e}")
    return out


class Flags:
    """A program's command line made from config dataclasses: ``sections`` maps a name to (config
    class, the fields it offers as flags, None for all). :meth:`parse` parses once and returns
    ``into(**{name: config})``; nothing below it sees argparse."""

    def __init__(
        self,
        *,
        prog: str,
        doc: str,
        sections: Mapping[str, tuple[type, Collection[str] | None]],
        into: Callable[..., Any] = dict,
        example: str = "",
        titles: Mapping[str, str] | None = None,
        why_not: Mapping[str, str] | None = None,
    ) -> None:
        self.prog, self.doc, self.sections, self.into = prog, doc, dict(sections), into
        self.example, self.titles, self.why_not = example, dict(titles or {}), dict(why_not or {})

    def parser(self) -> ArgumentParser:
        """A fresh parser (``--help``: the doc's first paragraph, the flags, the doc's third paragraph on).
        A flag of a section's class that this command does not offer is refused with its reason (``why_not``:
        field -> why), not as a typo."""
        parts = self.doc.split("\n\n", 2)
        p = ArgumentParser(prog=self.prog, description=parts[0], epilog=parts[2] if len(parts) > 2 else None)
        add_flags(p, *self.sections.values(), titles=self.titles, example=self.example)
        for cls, only in self.sections.values():
            for f in flag_fields(cls) if only is not None else ():
                if f.name not in only:
                    why = self.why_not.get(f.name, f"{self.prog} does not take it")
                    p.not_here.update(dict.fromkeys(f.metadata["flags"], why))
        return p

    def configs(self, namespace: argparse.Namespace) -> Any:
        return self.into(**{name: from_flags(cls, namespace) for name, (cls, _) in self.sections.items()})

    def parse(self, argv: Sequence[str] | None = None) -> Any:
        return self.configs(self.parser().parse_args(argv))


def without_flags(argv: Sequence[str], valued: Collection[str], bare: Collection[str] = ()) -> list[str]:
    """``argv`` without the ``valued`` flags (and their values, ``--f v`` or ``--f=v``) and the ``bare``
    ones: what a wrapping command passes on to the command it wraps."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in bare:
            continue
        if name in valued:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out
