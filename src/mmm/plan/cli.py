"""List every parallel layout of N ranks for a model's trainer, with per-rank memory and
communication estimates, and the reason each excluded layout is invalid.

    python -m mmm.plan --world 8                          # the fsdp_tp trainer's default model
    python -m mmm.plan --world 8 --dim 1024 --n-layers 16 --seq-len 2048 --batch-size 32
    python -m mmm.plan --world 8 --tp 2                   # only layouts with tp=2
    python -m mmm.plan --world 8 --strategies fsdp,hsdp --json plan.json

Mesh flags (--tp, --pp, --cp, --dp-replicate, --dp-shard) and --strategy hold that value; the
rest vary. Every model and training flag of `python -m mmm.examples.fsdp_tp` is accepted and
shapes the estimates; --recipe plans for another model (its flags then), checked by its trainer's
own rules and estimated where the recipe has a closed-form model (mmm's Llama has). Memory is per
rank (the busiest one): parameters, gradients and AdamW state in fp32 plus activations saved for
backward; communication is payload bytes per training step by process group (see mmm.models.llama.estimate
for the formulas and what they leave out).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mmm.cli import ArgumentParser, nonempty_text, world_size
from mmm.errors import UsageError, file_problem, print_error
from mmm.files import write_atomic
from mmm.parallel.strategy import STRATEGIES
from mmm.plan import AXES, Combo, plan, run_only_flags
from mmm.training.config import Config
from mmm.training.recipe import Recipe, add_recipe_flag, recipe_from_argv

MIB = 2**20


def build_parser(recipe: Recipe | None = None) -> ArgumentParser:
    recipe = recipe or recipe_from_argv([])[0]
    p = recipe.command_line().parser()
    p.prog = "python -m mmm.plan"
    p.description = __doc__.split("\n\n")[0]
    p.epilog = __doc__.split("\n\n", 2)[2]
    # mesh flags and --strategy select (hold) rather than default
    p.set_defaults(tp=None, pp=None, cp=None, dp_replicate=None, dp_shard=None, ep=None, strategy=None)
    add_recipe_flag(p)
    g = p.add_argument_group("planner")
    g.add_argument("--world", type=world_size, required=True, help="number of ranks (processes) to plan for")
    g.add_argument(
        "--strategies",
        type=nonempty_text,
        default=None,
        metavar="S,S,...",
        help="data-parallel strategies to consider, comma-separated [all]",
    )
    g.add_argument("--valid-only", action="store_true", help="leave the invalid layouts out of the listing")
    g.add_argument(
        "--json",
        dest="json_path",
        type=nonempty_text,
        default=None,
        metavar="PATH",
        help="also write every layout with its estimates or problems as JSON ('-' for stdout)",
    )
    return p


@dataclass
class PlanRequest:
    """What ``python -m mmm.plan`` is asked: layouts of ``world`` ranks for the trainer's ``config``
    (whose degrees and strategy the planner varies), holding the degrees in ``fixed`` (None: varied)
    and ``strategy``, or considering ``strategies`` (comma-separated)."""

    world: int
    config: Config
    fixed: dict[str, int | None]
    strategy: str | None = None
    strategies: str | None = None
    valid_only: bool = False
    json_path: str | None = None


def parse_request(argv: Sequence[str] | None = None) -> PlanRequest:
    """The planner's flags, parsed once."""
    recipe, argv = recipe_from_argv(sys.argv[1:] if argv is None else argv)
    ns = build_parser(recipe).parse_args(argv)
    check_json_path(ns.json_path)
    # the trainer's config for the rest; its degrees and strategy are placeholders the planner varies
    placeholders = {a: 1 for a in (*AXES, "ep") if a in vars(ns)} | {"strategy": "fsdp"}
    config = recipe.command_line().configs(argparse.Namespace(**{**vars(ns), **placeholders}))
    if recipe.picks_layout(config):
        raise UsageError(
            "--pick-layout is the trainer's; to rank layouts on hardware use "
            "python -m mmm.plan.simulate --pick --hardware HARDWARE"
        )
    return PlanRequest(
        world=ns.world,
        config=config,
        fixed={a: vars(ns).get(a) for a in (*AXES, "ep")},
        strategy=ns.strategy,
        strategies=ns.strategies,
        valid_only=ns.valid_only,
        json_path=ns.json_path,
    )


def check_json_path(path: str | None) -> None:
    """``--json PATH`` refused at the start, before any work, when it cannot be written ('-': stdout)."""
    problem = path and path != "-" and file_problem(f"--json {path!r}", path)
    if problem:
        raise UsageError(problem)


def table_stream(json_path: str | None):
    """Where the human table goes: stdout, or stderr when the JSON takes stdout (``--json -``)."""
    return sys.stderr if json_path == "-" else sys.stdout


def write_json(path: str, text: str) -> None:
    """``text`` to ``path`` (its folders made), atomically; ``-``: to standard output."""
    if path == "-":
        print(text)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(path), text + "\n")


def _strategies(strategy: str | None, strategies: str | None) -> list[str] | None:
    if strategy is not None and strategies is not None:
        raise UsageError("give --strategy (one) or --strategies (a list), not both")
    if strategy is not None:
        return [strategy]
    if strategies is None:
        return None
    names = [s.strip() for s in strategies.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    if bad or not names:
        raise UsageError(
            f"--strategies {strategies!r}: unknown {', '.join(map(repr, bad)) or 'empty list'}; "
            f"choose from {', '.join(STRATEGIES)}"
        )
    return names


def plan_for(request: PlanRequest) -> list[Combo]:
    """The planner's layouts for a request; none valid is an error naming the reasons."""
    fixed = request.fixed
    bad = {a: v for a, v in fixed.items() if v == -1}
    if bad:
        raise UsageError(
            f"{', '.join(f'--{a.replace(chr(95), chr(45))} -1' for a in bad)}: the planner varies "
            "unset degrees itself; give a positive degree or leave the flag out"
        )
    strategies = _strategies(request.strategy, request.strategies)
    combos = plan(request.world, request.config, strategies=strategies, fixed=fixed)
    if not any(c.valid for c in combos):
        found = list(dict.fromkeys(p for c in combos for p in c.problems))
        everywhere = [p for p in found if all(p in c.problems for c in combos)]  # no layout's: the run's own
        if everywhere:
            reasons = "; ".join(everywhere)
        else:  # each layout has its own: the nearest ones (fewest problems), not a wall of every reason
            fewest = min(len(c.problems) for c in combos)
            nearest = [c for c in combos if len(c.problems) == fewest]
            reasons = "; ".join(f"{' '.join(c.flags)}: {'; '.join(c.problems)}" for c in nearest[:2])
            reasons = f"{len(combos)} layouts tried, the nearest: {reasons}"
        held = ", ".join(f"{a}={v}" for a, v in fixed.items() if v is not None)
        raise UsageError(
            f"no valid layout of {request.world} ranks{' with ' + held if held else ''}"
            f"{' and --strategy ' + request.strategy if request.strategy else ''}: {reasons}"
        )
    return combos


def format_table(combos, *, valid_only: bool = False) -> str:
    """The planner's listing: valid layouts with estimates, then invalid ones with reasons."""
    valid = [c for c in combos if c.valid]
    groups = sorted({g for c in valid for g in (c.comm or {})})
    axes = ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    axes += ["ep"] if any("ep" in c.degrees for c in combos) else []  # a mixture of experts: one row per ep
    head = ["#", "pp", "dpr", "dps", "cp", "tp", *(["ep"] if "ep" in axes else [])]
    kinds = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "total_bytes")
    estimated = any(c.memory for c in valid)  # none: the recipe has no closed-form estimate of this model
    head += ["strategy", *(["params", "grads", "optim", "activ", "total"] if estimated else [])]
    head += [f"comm:{g}" for g in groups]
    rows = []
    for i, c in enumerate(valid, 1):
        m = c.memory or {}
        rows.append(
            [
                str(i),
                *(str(c.degrees.get(a, 1)) for a in axes),
                c.strategy,
                *((f"{m[k] / MIB:.1f}" if k in m else "-" for k in kinds) if estimated else ()),
                *(f"{c.comm.get(g, 0) / MIB:.1f}" if (c.comm or {}).get(g) else "-" for g in groups),
            ]
        )
    widths = [max(len(h), *(len(r[j]) for r in rows)) for j, h in enumerate(head)]
    what = "memory per rank in MiB; comm: payload MiB per step by process group" if estimated else "no estimates"
    lines = [
        f"{len(valid)} valid layouts ({what})",
        "  ".join(h.rjust(w) for h, w in zip(head, widths)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    invalid = [c for c in combos if not c.valid]
    if invalid and not valid_only:
        lines += ["", f"{len(invalid)} invalid layouts:"]
        lines += [f"  {c.label}: {'; '.join(c.problems)}" for c in invalid]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    request = parse_request(argv)
    combos = plan_for(request)  # a refusal first: one line, no notes before it
    # the trainer's command line is welcome here; say what of it the estimates leave out
    unused = run_only_flags(request.config)
    how = request.config.parallel
    eager = [flag for flag, on in (("--compile", how.compile), ("--float8", how.float8)) if on]
    gap = request.config.recipe.not_estimated(request.config)
    notes = [
        unused
        and f"{', '.join(unused)} {'shape' if len(unused) > 1 else 'shapes'} the run, not a layout's "
        "memory or communication: not planned",
        eager
        and f"the estimates are the eager bf16 step's ({', '.join(eager)} not modelled: a compiled step "
        "saves fewer activations)",
        gap
        and f"the closed-form estimates do not model {gap}: none given below; python -m mmm.plan.simulate "
        "runs the step itself",
        how.cp_attention != "ring"
        and f"--cp-attention {how.cp_attention} applies with --cp > 1: the layouts without context parallel are "
        "invalid here (drop it to plan them)",
    ]
    for line in filter(None, notes):
        print(f"python -m mmm.plan: note: {line}", file=sys.stderr)
    print(format_table(combos, valid_only=request.valid_only), file=table_stream(request.json_path))
    if request.json_path:
        write_json(request.json_path, json.dumps([c.as_dict() for c in combos], indent=1))
    return 0


def cli() -> None:
    try:
        code = main()
    except UsageError as e:
        print_error(str(e), prog="python -m mmm.plan")
        code = 2
    except BrokenPipeError:
        code = 0
    sys.exit(code)
