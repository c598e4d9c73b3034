"""Simulate ranks of an N-rank training job in this machine's processes, before the job queues.

    python -m mmm.plan.simulate --world 512 --tp 8 --init-from ~/models/Llama-3.1-8B   # config.json is enough
    python -m mmm.plan.simulate --world 16384 --tp 8 --dp-replicate 64 --strategy hsdp --dim 4096 ...
    python -m mmm.plan.simulate --world 8 --pp 2 --tp 2 --ranks 0,7 --json sim.json
    python -m mmm.plan.simulate --world 64 --init-from ~/models/Llama-3.1-8B --dtype bf16 --hardware h100
    python -m mmm.plan.simulate --world 64 --tp 2 --recipe hf --hf-config ~/models/Qwen2-7B/config.json
    python -m mmm.plan.simulate --world 8 --recipe vit --pick --hardware h100     # mmm's ViT
    python -m mmm.plan.simulate --world 8 --recipe mypkg.train:MINE --pick --hardware h100  # your recipe

Each simulated rank joins, in this process and one after another, a fake process group of --world
ranks (collectives return at once, nothing is sent). It runs the trainer's own checks, the real
``init_mesh`` and the real ``parallelize`` (``build_pipeline`` under --pp) on the model built on
meta, and reads what the rank would hold from the sharded parameters themselves (shapes and
placements exact, no memory used): parameter, gradient and AdamW state bytes, in the trainer's own
accounting (``summary.json``'s ``memory_per_rank``). A layout that cannot start at that scale (a
shape that does not split, a plan that does not match) fails here with the trainer's one-line
error. It also times mmm's setup on that rank (mesh, model, parallelize) and reads its peak host
memory: what grows with the world size shows here. By default rank 0 and the last rank (the first
and last pipeline stage) are simulated. The model is a recipe's (``--recipe``, :mod:`mmm.training.recipe`;
mmm's Llama by default), and every flag of its trainer is accepted: for Llama those of
``python -m mmm.examples.fsdp_tp``, whose --init-from needs only the Hugging Face config.json (no
weights are read); ``--recipe hf --hf-config PATH`` builds any transformers causal LM from its
config.json on meta, with the TP plan the config carries.

Then, unless --no-step, the rank runs one training step on fake tensors (``FakeTensorMode``: shapes,
dtypes and devices are tracked, no memory is used and nothing is computed): the trainer's own
engine, forward, loss, backward, the packed all-reduce and the AdamW step. What the step issues is
counted as ``--measure`` counts it in a real run (:mod:`mmm.measure`): payload bytes and calls of each
collective by mesh axis, and the bytes autograd saves for backward; and the rank's peak memory
during the step: the most bytes of tensor storage alive at once, parameters, optimizer state,
gradients, activations, gathered parameters and temporaries (``mmm.measure.PeakMemory``).
Communication equals a real run's byte for byte (tested). Under ``--pp`` a stage's first step trades
tensor shapes with its neighbours by value: the ranks of the stages it needs are simulated first and
their messages kept (:func:`mmm.plan.fake.simulate_ranks`). DDP and the ZeRO strategies are not simulated (both
need real collectives to wrap the model), nor ``--compile`` (the step runs eager: a compiled step
saves fewer activations). With ``--hardware`` (a preset or a JSON file,
:mod:`mmm.plan.hardware`) each rank's step time, MFU and whether its peak fits are predicted from
the simulated step (:mod:`mmm.plan.predict` states the model). The step runs the kernels the trainer
would: AdamW fused where the parameters allow it, and, on an accelerator's hardware (a preset, or a file
without ``cores_per_node``), ``F.rms_norm`` as the one fused kernel each way that CUDA runs (its traffic,
and only its input and ``rstd`` kept for backward), where this CPU build splits it into elementwise ops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict

from mmm.cli import ArgumentParser, nonempty_text, positive_float, positive_int, without_flags, world_size
from mmm.errors import UsageError, print_error
from mmm.log import configure
from mmm.plan import AXES, run_only_flags
from mmm.plan.cli import check_json_path, write_json
from mmm.plan.fake import RankReport, simulate_ranks
from mmm.plan.hardware import load_hardware
from mmm.plan.ranking import format_ranking, rank_layouts
from mmm.training.recipe import add_recipe_flag, recipe_from_argv

MIB = 2**20


def _mib_or_bytes(n: int) -> str:
    return f"{n / MIB:.1f}" if n >= 0.05 * MIB else f"{n:,} bytes"


def build_parser(recipe=None) -> ArgumentParser:
    recipe = recipe or recipe_from_argv([])[0]
    p = recipe.command_line().parser()
    add_recipe_flag(p)
    p.prog = "python -m mmm.plan.simulate"
    p.description = __doc__.split("\n\n")[0]
    p.epilog = __doc__.split("\n\n", 2)[2]
    g = p.add_argument_group("simulation")
    g.add_argument("--world", type=world_size, required=True, help="ranks of the job to simulate")
    g.add_argument(
        "--ranks",
        type=nonempty_text,
        default=None,
        metavar="R,R,...",
        help="which ranks to simulate, comma-separated [0 and the last: the first and last pipeline stage]",
    )
    g.add_argument(
        "--devices-per-node",
        type=positive_int,
        default=None,
        help="ranks per host: each rank's local rank, and which groups cross hosts [--hardware's, else 8]",
    )
    g.add_argument(
        "--hardware",
        type=nonempty_text,
        default=None,
        metavar="NAME|FILE",
        help="predict the step time and whether memory fits on: h100, h200, a100, pvc, mi250x, or a JSON file "
        "(mmm.plan.hardware)",
    )
    g.add_argument(
        "--no-step",
        dest="step",
        action="store_false",
        help="only set the ranks up; skip the simulated training step (communication, activations, peak memory)",
    )
    g.add_argument(
        "--pick",
        action="store_true",
        help="with --hardware: simulate every layout of --world ranks the simulator can run (fsdp/hsdp; "
        "mesh flags given hold their value), each with the least activation checkpointing that fits (none, "
        "selective, full; --ac given holds), pipelines with 1, 2 and 4 microbatches per stage, and a step "
        "that does not fit also with gradient accumulation's microbatches, the fastest that fits winning "
        "(--microbatches given holds); rank them by predicted step time among those that fit, explain "
        "the best few and print the pick's flags",
    )
    g.add_argument(
        "--jobs",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --pick: layouts simulated at once, each in a process of its own [the cores this process may "
        "use that the machine's load leaves idle, when the others at the first layout's pace would take over "
        "10 s; else 1]",
    )
    g.add_argument(
        "--every",
        action="store_true",
        help="with --pick: also simulate the layouts with a pipeline or context parallel whose floor shows they "
        "cannot be the pick (to compare every layout's prediction; the pick is the same)",
    )
    g.add_argument(
        "--expert-load",
        type=positive_float,
        default=None,
        metavar="F",
        help="a mixture of experts (its tensors have no values to route by): each rank sends F x the mean of its "
        "tokens to its first expert and the rest evenly, so the ep rank holding expert 0 gets F x its share [1: "
        "balanced]",
    )
    g.add_argument(
        "--json",
        dest="json_path",
        type=nonempty_text,
        default=None,
        metavar="PATH",
        help="also write the reports as JSON ('-' for stdout)",
    )
    # given or not: --pick holds what is given
    p.set_defaults(tp=None, pp=None, cp=None, dp_replicate=None, dp_shard=None, ep=None, strategy=None)
    return p


def _ranks(spec: str | None, world: int) -> list[int]:
    if spec is None:
        return sorted({0, world - 1})
    try:
        ranks = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--ranks {spec!r}: give rank numbers, comma-separated (e.g. 0,{world - 1})") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise UsageError(f"--ranks {spec!r}: ranks go from 0 to {world - 1} for --world {world}")
    return ranks


def format_reports(reports: list[RankReport]) -> str:
    first = reports[0]
    lines = [
        f"{len(reports)} of {first.world} ranks simulated, model of {first.num_params:,} parameters",
        f"{'rank':>6}  {'coords':<32} {'params':>12} {'param MiB':>10} {'grad MiB':>9} {'optim MiB':>10} "
        f"{'total MiB':>10}  setup (mesh / model / parallelize)",
    ]
    for r in reports:
        coords = " ".join(f"{k}={v}" for k, v in r.coords.items()) or "-"
        s = r.setup_s
        lines.append(
            f"{r.rank:>6}  {coords:<32} {r.local_params:>12,} {r.param_bytes / MIB:>10.1f} {r.grad_bytes / MIB:>9.1f} "
            f"{r.optim_bytes / MIB:>10.1f} {r.total_bytes / MIB:>10.1f}  "
            f"{s.get('mesh', 0):.2f} / {s.get('model', 0):.2f} / {s.get('parallelize', 0):.2f} s, "
            f"peak host {r.peak_rss_bytes / MIB:.0f} MiB"
        )
    stepped = [r for r in reports if r.step is not None]
    if stepped:
        lines += ["", "one training step, simulated on fake tensors (payload bytes as --measure counts them):"]
        lines.append(  # MiB: the step's peak, what is held before it, activations saved (all, and at once)
            f"{'rank':>6}  {'peak MiB':>9} {'before step':>12} {'act. saved':>11} {'act. at once':>12}  "
            "communication by mesh axis: MiB (calls)"
        )
        for r in stepped:
            peak = r.step["peak"]
            comm = ", ".join(  # a payload under 0.05 MiB (the step's scalars): in bytes, not as 0.0
                f"{axis} {_mib_or_bytes(n)} ({r.step['comm_calls'].get(axis, 0)})"
                for axis, n in r.step["comm_bytes"].items()
            )
            held = r.step["activation_peak_bytes"]
            lines.append(
                f"{r.rank:>6}  {peak['total'] / MIB:>9.1f} {peak['before_step'] / MIB:>12.1f} "
                f"{r.step['activation_bytes'] / MIB:>11.1f} {held / MIB:>12.1f}  "
                f"{comm or '-'}   ({r.setup_s.get('step', 0):.1f} s)"
            )
    predicted = [r for r in reports if r.prediction is not None]
    if predicted:
        hw = predicted[0].prediction["hardware"]
        lines += ["", f"predicted on {hw} (mmm.plan.predict: the model and its assumptions):"]
        for r in predicted:
            p = r.prediction
            parts = ", ".join(  # an axis under 0.5% of the step (its scalars) is left out, as in --pick's
                f"{axis} {p['exposed_s'][axis] * 1e3:.1f} of {t * 1e3:.1f} ms"
                f"{' (crosses nodes)' if p['crosses_nodes'][axis] else ''}"
                for axis, t in p["comm_s"].items()
                if t >= max(0.005 * p["step_s"], 5e-5)  # and what shows as 0.0 ms
            )
            fit = "fits" if p["fits"] else "DOES NOT FIT"
            bubble = f" + bubble {p['bubble_s'] * 1e3:.1f}" if p["bubble_s"] else ""
            memory = (
                f" (matmul {p['matmul_s'] * 1e3:.1f} + memory-bound {p['memory_s'] * 1e3:.1f})" if p["memory_s"] else ""
            )
            lines.append(
                f"{r.rank:>6}  step {p['step_s'] * 1e3:.1f} ms = compute {p['compute_s'] * 1e3:.1f}{memory}{bubble}"
                " + exposed communication "
                f"({parts or 'none'}); MFU {p['mfu']:.1%}; peak {p['peak_bytes'] / 2**30:.1f} of "
                f"{p['memory_bytes'] / 2**30:.0f} GiB: {fit}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    configure()  # this process's own lines (--pick's), before any simulated rank sets up its own
    recipe, argv = recipe_from_argv(argv)
    parser = build_parser(recipe)
    ns = parser.parse_args(argv)
    check_json_path(ns.json_path)
    with _stdout_to_stderr(ns.json_path == "-"):  # --json -: stdout holds the JSON alone
        text = _simulate(recipe, ns, argv)
    if ns.json_path:
        write_json(ns.json_path, text)
    return 0


@contextlib.contextmanager
def _stdout_to_stderr(on: bool):
    """Everything written to stdout, by this process and by the processes it starts, goes to stderr."""
    if not on:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        configure()  # the log handler writes to the stream it was made with
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        configure()


def _simulate(recipe, ns: argparse.Namespace, argv: list[str]) -> str:
    """Simulates what ``ns`` asks, prints the table; returns the JSON of the reports."""
    own = {"--world", "--ranks", "--devices-per-node", "--json", "--hardware", "--jobs", "--expert-load"}
    # the trainer's flags, typed and checked as the trainer does
    config = recipe.command_line().parse(without_flags(argv, own, {"--no-step", "--pick", "--every"}))
    if recipe.picks_layout(config):
        raise UsageError("--pick-layout is the trainer's; here use --pick --hardware HARDWARE")
    if config.parallel.compile and ns.step:
        raise UsageError(
            "--compile is not simulated (the step runs eager, and a compiled step saves fewer activations); "
            "drop it for an eager estimate (an upper bound on activations), or add --no-step"
        )
    if config.parallel.float8 and ns.step:
        raise UsageError(
            "--float8 is not simulated (torchao's float8 matmuls need a CUDA device); drop it for the bf16 "
            "step's estimate, or add --no-step"
        )
    if ns.pick and config.parallel.cp_attention != "ring":  # the trainer takes the pick with the flag: cp > 1
        print(
            f"python -m mmm.plan.simulate: note: --cp-attention {config.parallel.cp_attention} applies with --cp > 1: "
            "only layouts with context parallel are ranked (drop it to rank every layout)",
            file=sys.stderr,
        )
    unused = run_only_flags(config)
    if unused:  # the trainer's command line is welcome here; say what of it a simulated step leaves out
        print(
            f"python -m mmm.plan.simulate: note: {', '.join(unused)} {'shape' if len(unused) > 1 else 'shapes'} "
            "the run, not its step: not simulated",
            file=sys.stderr,
        )
    expert_load = 1.0 if ns.expert_load is None else ns.expert_load
    if ns.expert_load is not None and not ns.step:
        raise UsageError(f"--expert-load {ns.expert_load:g} routes the simulated step's tokens; drop it or --no-step")
    if ns.expert_load is not None:
        model_config = recipe.model_config(config.train)
        experts = recipe.experts(model_config)
        if not experts:
            raise UsageError(f"--expert-load {ns.expert_load:g} applies to a mixture of experts; this model has none")
        # each token goes to top_k different experts: one expert gets at most every token, experts / top_k x the mean
        top_k = getattr(model_config, "moe_top_k", None) or getattr(
            getattr(model_config, "config", None), "num_experts_per_tok", None
        )
        top_k = top_k if isinstance(top_k, int) and top_k >= 1 else 1
        most = experts / top_k
        if not 1 <= ns.expert_load <= most:
            raise UsageError(
                f"--expert-load {ns.expert_load:g} must be between 1 (balanced) and {most:g} (every token to one "
                f"expert: {experts} experts, each token to {top_k})"
            )
    hardware = load_hardware(ns.hardware) if ns.hardware else None
    if hardware is not None and not ns.step:
        raise UsageError("--hardware predicts from the simulated step; drop --no-step")
    per_node = ns.devices_per_node or (hardware.devices_per_node if hardware else 8)
    if ns.pick:
        if hardware is None:
            raise UsageError("--pick ranks layouts by predicted step time: give --hardware (a preset or a file)")
        if ns.ranks:
            raise UsageError("--pick simulates the first and last rank of each layout; drop --ranks")
        fixed = {axis: vars(ns)[axis] for axis in (*AXES, "ep") if vars(ns).get(axis) is not None}
        strategies = [ns.strategy] if ns.strategy else ["fsdp", "hsdp"]
        if ns.strategy and ns.strategy not in ("fsdp", "hsdp"):
            raise UsageError(f"--pick: --strategy {ns.strategy} is not simulated; give fsdp or hsdp, or leave it out")
        ranked = rank_layouts(
            config,
            ns.world,
            hardware,
            devices_per_node=per_node,
            fixed=fixed,
            strategies=strategies,
            jobs=ns.jobs,
            every=ns.every,
            choose_ac=not _given(argv, "--ac"),  # --ac given holds
            choose_microbatches=not _given(argv, "--microbatches"),
            expert_load=expert_load,
        )
        print(format_ranking(ranked, hardware))
        rows = [
            {"label": r.label, "degrees": r.combo.degrees, "strategy": r.combo.strategy, "ac": r.ac}
            | {"microbatches": r.combo.microbatches}
            | {"flags": r.flags, "step_s": r.step_s, "fits": r.fits, "why": r.why()}
            | {"ranks": [_jsonable(asdict(x)) for x in r.reports]}
            for r in ranked
        ]
        return json.dumps(rows, indent=2)
    if ns.jobs:
        raise UsageError(f"--jobs {ns.jobs} sets how many layouts --pick simulates at once; without --pick drop it")
    if ns.every:
        raise UsageError("--every simulates every layout --pick ranks; without --pick drop it")
    ranks = _ranks(ns.ranks, ns.world)
    reports = simulate_ranks(
        config,
        world=ns.world,
        ranks=ranks,
        devices_per_node=per_node,
        step=ns.step,
        hardware=hardware,
        expert_load=expert_load,
    )
    print(format_reports(reports))
    return json.dumps([_jsonable(asdict(r)) for r in reports], indent=2)


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {(".".join(k) if isinstance(k, tuple) else k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def cli() -> None:
    try:
        sys.exit(main())
    except UsageError as e:
        print_error(str(e), prog="python -m mmm.plan.simulate")
        sys.exit(2)


if __name__ == "__main__":
    cli()
