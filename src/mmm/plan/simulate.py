"""Simulate ranks of an N-rank fsdp_tp job in this machine's processes, before the job queues.

    python -m mmm.plan.simulate --world 512 --tp 8 --init-from ~/models/Llama-3.1-8B   # config.json is enough
    python -m mmm.plan.simulate --world 16384 --tp 8 --dp-replicate 64 --strategy hsdp --dim 4096 ...
    python -m mmm.plan.simulate --world 8 --pp 2 --tp 2 --ranks 0,7 --json sim.json
    python -m mmm.plan.simulate --world 64 --init-from ~/models/Llama-3.1-8B --dtype bf16 --hardware h100

Each simulated rank joins, in this process and one after another, a fake process group of --world
ranks (collectives return at once, nothing is sent). It runs the trainer's own checks, the real
``init_mesh`` and the real ``parallelize`` (``build_pipeline`` under --pp) on the model built on
meta, and reads what the rank would hold from the sharded parameters themselves (shapes and
placements exact, no memory used): parameter, gradient and AdamW state bytes, in the trainer's own
accounting (``summary.json``'s ``memory_per_rank``). A layout that cannot start at that scale (a
shape that does not split, a plan that does not match) fails here with the trainer's one-line
error. It also times mmm's setup on that rank (mesh, model, parallelize) and reads its peak host
memory: what grows with the world size shows here. By default rank 0 and the last rank (the first
and last pipeline stage) are simulated. Every model and parallel flag of
``python -m mmm.examples.fsdp_tp`` is accepted; --init-from needs only the Hugging Face
config.json (no weights are read).

Then, unless --no-step, the rank runs one training step on fake tensors (``FakeTensorMode``: shapes,
dtypes and devices are tracked, no memory is used and nothing is computed): the trainer's own
engine, forward, loss, backward, the packed all-reduce and the AdamW step. What the step issues is
counted as ``--measure`` counts it in a real run (:mod:`mmm.measure`): payload bytes and calls of each
collective by mesh axis, and the bytes autograd saves for backward; and the rank's peak memory
during the step: the most bytes of tensor storage alive at once, parameters, optimizer state,
gradients, activations, gathered parameters and temporaries (``mmm.measure.PeakMemory``).
Communication equals a real run's byte for byte (tested). Under ``--pp`` a stage's first step trades
tensor shapes with its neighbours by value: the ranks of the stages it needs are simulated first and
their messages kept (:func:`simulate_ranks`). DDP and the ZeRO strategies are not simulated (both
need real collectives to wrap the model), nor ``--compile`` (the step runs eager: a compiled step
saves fewer activations). With ``--hardware`` (a preset or a JSON file,
:mod:`mmm.plan.hardware`) each rank's step time, MFU and whether its peak fits are predicted from
the simulated step (:mod:`mmm.plan.predict` states the model).
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import resource
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from difflib import SequenceMatcher
from itertools import accumulate
from pathlib import Path

import torch
import torch.distributed as dist

from mmm import dist as mdist
from mmm.cli import ArgumentParser, flag_fields, positive_int, without_flags
from mmm.errors import UsageError, print_error
from mmm.flops import llama_flops_per_token
from mmm.history import atomic_write_text
from mmm.log import configure, get_logger
from mmm.measure import CommCounter, DeviceWork, PeakMemory, SavedActivations
from mmm.models.llama import Llama, apply_cp_llama
from mmm.parallel import ParallelDims, init_mesh, meta_init, parallelize
from mmm.parallel.context import ring_attention
from mmm.parallel.pipeline import stage_ids, stage_layer_ranges
from mmm.parallel.strategy import state_bytes_per_param
from mmm.parallel.tensor import loss_parallel_context
from mmm.plan import AXES, Combo, plan
from mmm.plan.hardware import Hardware, load_hardware
from mmm.plan.predict import MEMORY_MARGIN, axis_time, pipeline_bubble, predict, step_floor
from mmm.training import llama as recipe
from mmm.training.config import Config
from mmm.training.llama import LlamaTrainConfig, command_line
from mmm.training.step import StepSync, train_step

MIB = 2**20


@dataclass
class RankReport:
    """What one simulated rank holds and what its setup cost."""

    rank: int
    world: int
    coords: dict[str, int]
    """This rank's coordinate on each enabled mesh axis."""
    num_params: int
    """Parameters of the whole model."""
    local_params: int
    """Parameter elements this rank holds (its TP shard of its pipeline stage, over its FSDP share)."""
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    total_bytes: int
    setup_s: dict[str, float] = field(default_factory=dict)
    """Seconds of mmm's setup on this rank: mesh, model (on meta), parallelize; and the simulated step."""
    peak_rss_bytes: int = 0
    """Peak host memory of this process so far (the simulation's own cost, not the rank's)."""
    step: dict | None = None
    """The simulated step (None under --no-step): ``comm_bytes`` / ``comm_calls`` by mesh axis (as
    summary.json's ``measured_per_rank``), ``activation_bytes`` saved for backward, and ``peak``: the
    ``total`` bytes of tensors alive at once during the step, and those alive ``before_step``."""
    axes: dict = field(default_factory=dict)
    """Each process group the rank uses, by mesh axis: ``size`` and whether it ``crosses_nodes``."""
    prediction: dict | None = None
    """With --hardware: the step time, its parts and whether memory fits (:mod:`mmm.plan.predict`)."""


def build_parser() -> ArgumentParser:
    p = command_line().parser()
    p.prog = "python -m mmm.plan.simulate"
    p.description = __doc__.split("\n\n")[0]
    p.epilog = __doc__.split("\n\n", 2)[2]
    g = p.add_argument_group("simulation")
    g.add_argument("--world", type=positive_int, required=True, help="ranks of the job to simulate")
    g.add_argument(
        "--ranks",
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
        "selective, full; --ac given holds) and pipelines with 1, 2 and 4 microbatches per stage "
        "(--microbatches given holds), rank them by predicted step time among those that fit, explain "
        "the best few and print the pick's flags",
    )
    g.add_argument(
        "--jobs",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --pick: layouts simulated at once, each in a process of its own [the cores this process may "
        "use, when the others at the first layout's pace would take over 10 s; else 1]",
    )
    g.add_argument(
        "--every",
        action="store_true",
        help="with --pick: also simulate the layouts with a pipeline or context parallel whose floor shows they "
        "cannot be the pick (to compare every layout's prediction; the pick is the same)",
    )
    g.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="also write the reports as JSON")
    # given or not: --pick holds what is given
    p.set_defaults(tp=None, pp=None, cp=None, dp_replicate=None, dp_shard=None, strategy=None)
    return p


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def simulate_rank(
    config: Config[LlamaTrainConfig],
    *,
    world: int,
    rank: int,
    devices_per_node: int = 8,
    step: bool = True,
    hardware: Hardware | None = None,
    mailbox: dict | None = None,
    n_layers: int | None = None,
    shapes_only: bool = False,
) -> RankReport | None:
    """Rank ``rank`` of a ``world``-rank job with ``config``, simulated in this process: it joins a fake
    process group of ``world`` ranks, which it leaves before returning (so the next rank can).
    ``shapes_only``: a pipeline rank that only sends its stages' shapes into ``mailbox`` (what a rank
    simulated after it waits for); no report."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's test helper: load it only here

    what, how = config.train, config.parallel
    if how.strategy.startswith("zero") or how.strategy == "ddp":
        why = (
            "DDP compares parameters across ranks with real collectives when it wraps the model"
            if how.strategy == "ddp"
            else "DeepSpeed needs real collectives to build its engine"
        )
        raise UsageError(
            f"--strategy {how.strategy} is not simulated ({why}); simulate fsdp or hsdp, "
            "or estimate it with python -m mmm.plan"
        )
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % devices_per_node),
        LOCAL_WORLD_SIZE=str(min(devices_per_node, world)),
        MMM_DEVICE="cpu",
    )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    mdist.setup(seed=config.run.seed)
    found = recipe.problems(config, world) if n_layers is None else []  # with n_layers: checked at full size
    if found:
        raise UsageError("; ".join(found))
    times = {}
    t0 = time.perf_counter()
    mesh = init_mesh(**how.degrees, device_type="cpu", log_coordinates=False)
    times["mesh"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cfg = what.model_config()
    if n_layers is not None:  # a model of fewer blocks (simulate_by_blocks), checked above at full size
        cfg = replace(cfg, n_layers=n_layers)
    with meta_init():
        model = Llama(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    times["model"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if mesh.cp_enabled:
        apply_cp_llama(model, mesh["cp"], seq_len=cfg.seq_len)
    spec = recipe.parallel_spec(how).replace(compile=False)  # the trainer's own, run eager
    # the trainer's engine, sharded on meta: exact shapes, no memory
    engine = recipe.make_engine(model, mesh, config, device=torch.device("meta"), spec=spec)
    del model
    module = engine.module
    times["parallelize"] = time.perf_counter() - t0
    params = [p for p in module.parameters() if p.requires_grad]
    param_bytes = sum(_local_bytes(p) for p in module.parameters())
    grad_bytes = sum(_local_bytes(p) for p in params)  # fp32 gradients, shaped as the parameters (at first)
    optim_bytes = 2 * sum(_local_bytes(p) for p in params)  # AdamW: exp_avg and exp_avg_sq (fp32)
    coords = {axis: mesh.coord(axis) for axis in mesh.dims.enabled_axes()}
    axes = {"world": {"size": world, "crosses_nodes": world > devices_per_node}}
    for name, group in mesh.named_groups().items():
        ranks = dist.get_process_group_ranks(group)
        axes[name] = {"size": len(ranks), "crosses_nodes": len({r // devices_per_node for r in ranks}) > 1}
    simulated = None
    if step:
        t0 = time.perf_counter()
        tokens = (what.batch_size // mesh.dp, cfg.seq_len // mesh.cp)
        mailbox = mailbox if mailbox is not None else {}
        simulated = fake_step(
            engine, mesh, recipe.loss_fn, tokens, mailbox=mailbox, trace=n_layers is not None, shapes_only=shapes_only
        )
        if shapes_only:
            return None
        # the gradients as the step made them: one may be placed otherwise than its parameter
        param_bytes, grad_bytes, optim_bytes = simulated.pop("state_bytes").values()
        times["step"] = time.perf_counter() - t0
    prediction = None
    if simulated is not None and hardware is not None:
        prediction = predict_rank(simulated, axes, config, cfg, world, hardware, devices_per_node)
    return RankReport(
        rank=rank,
        world=world,
        coords=coords,
        num_params=num_params,
        local_params=sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.parameters()),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optim_bytes=optim_bytes,
        total_bytes=param_bytes + grad_bytes + optim_bytes,
        setup_s=times,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        step=simulated,
        axes=axes,
        prediction=prediction,
    )


def _step_terms(config, cfg, world: int) -> dict:
    """What :func:`mmm.plan.predict.predict` takes of a layout besides its simulated step."""
    what, how = config.train, config.parallel
    pp = how.degrees.get("pp", 1)
    return dict(
        flops=llama_flops_per_token(cfg) * what.batch_size * cfg.seq_len / world,
        recompute=4 / 3 if how.ac == "full" else 1.0,
        dtype=how.dtype,
        pp=pp,
        microbatches=how.microbatches or pp,  # the trainer's default
        stages_per_rank=how.stages_per_rank,
    )


def predict_rank(step: dict, axes: dict, config, cfg, world: int, hardware: Hardware, devices_per_node: int) -> dict:
    """The step time of a simulated rank of ``config`` (model shape ``cfg``) on ``hardware``."""
    terms = _step_terms(config, cfg, world)
    n_layers = max(1, cfg.n_layers // terms["pp"])  # the blocks this rank holds
    per_node = min(world, devices_per_node)  # a job smaller than a node has only its own ranks there
    return predict(step, axes, hardware, **terms, n_layers=n_layers, ranks_per_node=per_node).as_dict()


def simulate_by_blocks(
    config: Config[LlamaTrainConfig],
    *,
    world: int,
    ranks: Sequence[int],
    devices_per_node: int = 8,
    hardware: Hardware | None = None,
) -> list[RankReport]:
    """:func:`simulate_ranks` for a model of many identical blocks, at a fraction of the cost: each rank
    is simulated holding three blocks per pipeline stage and holding four, and what grows with the blocks
    (state, communication bytes and calls, saved activations: each a fixed part plus one part per block)
    is carried on to the blocks the rank's stages hold (uneven stages and --split-points too: each rank
    by its own); the peak memory op by op (:func:`carried_peak`: where it is moves with the blocks).
    Equal to simulating the whole model, tested (activation checkpointing's first blocks differ: hence
    three and four); measured exceptions, both above: a pipeline of 16 microbatches, its peak by 1%
    (Llama-3-8B, 4 stages of 8 blocks), and under an interleaved schedule a rank whose stages hold
    different block counts, by 0.6%. The model's checks run at its full size first. A model with a stage
    of at most four blocks is simulated whole."""
    cfg = config.train.model_config()
    how = config.parallel
    pp, per_rank = how.degrees.get("pp", 1), how.stages_per_rank
    chunks = pp * per_rank  # pipeline stages in all
    sizes = [b - a for a, b in stage_layer_ranges(cfg.n_layers, chunks, how.split_points)]
    if min(sizes) <= 4:
        return simulate_ranks(config, world=world, ranks=ranks, devices_per_node=devices_per_node, hardware=hardware)
    found = recipe.problems(config, world)
    if found:
        raise UsageError("; ".join(found))
    even = replace(config, parallel=replace(how, split_points=None))  # k blocks in every stage
    one, two = (
        simulate_ranks(even, world=world, ranks=ranks, devices_per_node=devices_per_node, n_layers=k * chunks)
        for k in (3, 4)
    )

    def held(rank: int) -> int:  # the blocks of this rank's stages
        return sum(sizes[i] for i in stage_ids(rank // (world // pp), pp, per_rank))

    def grow(x, y, blocks: int):  # the fixed part plus the blocks times the part per block, from 3 and 4 per stage
        if isinstance(x, dict):
            return {k: grow(x[k], y[k], blocks) for k in x}
        return x + round((blocks - 3 * per_rank) * (y - x) / per_rank)

    out = []
    for a, b in zip(one, two, strict=True):
        n = held(a.rank)
        step = None
        if a.step is not None:
            step = {k: grow(a.step[k], b.step[k], n) for k in ("comm_bytes", "comm_calls", "comm_by_kind")}
            step |= {k: grow(a.step[k], b.step[k], n) for k in ("activation_bytes", "matmul_flops", "memory_bytes")}
            peak = grow(a.step["peak"], b.step["peak"], n)
            carried = carried_peak(a.step["memory_trace"], b.step["memory_trace"], (n - 4 * per_rank) / per_rank)
            peak["total"] = max(peak["total"], carried)
            step |= {"peak": peak, "extrapolated_from_blocks": [3, 4]}
        state = {k: grow(getattr(a, k), getattr(b, k), n) for k in ("param_bytes", "grad_bytes", "optim_bytes")}
        report = replace(
            b,
            num_params=cfg.num_params(),
            local_params=grow(a.local_params, b.local_params, n),
            total_bytes=sum(state.values()),
            step=step,
            setup_s={k: a.setup_s.get(k, 0.0) + v for k, v in b.setup_s.items()},
            **state,
        )
        if step is not None and hardware is not None:
            report.prediction = predict_rank(step, b.axes, config, cfg, world, hardware, devices_per_node)
        out.append(report)
    return out


# where the memory traces are cut to be aligned: after each matrix multiply, gathered block and FSDP hook
_CUTS = {"mm.default", "addmm.default", "resize_", "_record_function_enter_new.default"}


def _pieces(trace: list[tuple[str, int]]) -> list[tuple[str, ...]]:
    pieces, piece = [], []
    for op, _ in trace:
        piece.append(op)
        if op in _CUTS:
            pieces.append(tuple(piece))
            piece = []
    return [*pieces, tuple(piece)]


def carried_peak(three: list[tuple[str, int]], four: list[tuple[str, int]], more: float) -> int:
    """The peak memory of a rank holding ``more`` blocks per stage beyond four, from its steps' memory
    traces (``(op, bytes alive)``) at three and four: the ops of the step at three blocks are found in
    the step at four (the longest common sequence of pieces of ops, each ending at a matrix multiply:
    a tenth of a second where a sequence of the ops themselves takes minutes), and each op of the step
    at four is carried on by what one block more added to the bytes alive at it (an op of the added
    block by the larger of the matched ops' either side). The peak is the highest of them: where it is
    may move with the blocks (the logits' gradient at a few blocks, the start of backward with every
    block's saved activations at many), which a peak carried on from two peaks would miss."""
    a, b = _pieces(three), _pieces(four)
    starts_a, starts_b = ([0, *accumulate(map(len, pieces))] for pieces in (a, b))
    added: list[int | None] = [None] * len(four)
    for i, j, size in SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        x, y = starts_a[i], starts_b[j]
        for k in range(starts_b[j + size] - y):
            added[y + k] = four[y + k][1] - three[x + k][1]
    before = after = 0  # an op of the added block: the larger growth of the matched ops either side
    nxt = [0] * len(four)
    for j in range(len(four) - 1, -1, -1):
        after = after if added[j] is None else added[j]
        nxt[j] = after
    peak = 0
    for j, ((_, alive), grew) in enumerate(zip(four, added, strict=True)):
        if grew is not None:
            before = grew
        peak = max(peak, alive + round(more * (grew if grew is not None else max(before, nxt[j]))))
    return peak


def simulate_ranks(config: Config[LlamaTrainConfig], *, world: int, ranks: Sequence[int], **kw) -> list[RankReport]:
    """:func:`simulate_rank` for each of ``ranks``, in this process one after another. Under pipeline
    parallel a stage's first step needs its neighbours' shapes (the stage before sends its output's,
    the stage after its gradient's): first the ranks of one rank's pipeline (the same coordinates on
    the other axes: the same shapes) are simulated only as far as their stages send them, in sweeps
    down the pipeline and back up, each rank until it has sent all (what it sent before it waited
    stays in the mailbox); then each of ``ranks``, its step counted. A pipeline of 16 stages: 31
    such runs and 2 steps (not 16 steps); with v stages per rank, 4v - 2 sweeps."""
    mailbox: dict = {}
    pp = config.parallel.degrees.get("pp", 1)

    def simulated(rank: int, shapes_only: bool = False) -> RankReport | None:
        try:
            with _excepthook_kept():
                return simulate_rank(config, world=world, rank=rank, mailbox=mailbox, shapes_only=shapes_only, **kw)
        finally:
            mdist.teardown()
            forget_meshes()

    if pp > 1:
        stride = world // pp  # pp is the outermost mesh axis
        pipeline = [stage * stride + ranks[0] % stride for stage in range(pp)]
        waiting, down = list(pipeline), True
        while waiting:  # a sweep that lets no rank send more ends it: a stage waits for what none sends
            before = (len(mailbox), len(waiting))
            for rank in list(waiting if down else waiting[::-1]):
                with contextlib.suppress(MissingMessage):
                    simulated(rank, shapes_only=True)
                    waiting.remove(rank)
            if (len(mailbox), len(waiting)) == before:
                raise RuntimeError(f"pipeline ranks {waiting} never received their neighbours' shapes")
            down = not down
    return [simulated(rank) for rank in ranks]


@contextlib.contextmanager
def _excepthook_kept():
    """Put ``sys.excepthook`` back afterwards: each ``init_process_group`` wraps it with its rank's prefix,
    and a process that simulates many ranks would print a traceback with one prefix per rank. And the
    ``mmm`` logger and Python's warning filters: a simulated rank other than 0 sets them as a rank that
    stays quiet (the planner's own lines after it would not be printed)."""
    hook, logger = sys.excepthook, get_logger()
    level, handlers, filters = logger.level, list(logger.handlers), list(warnings.filters)
    try:
        yield
    finally:
        sys.excepthook = hook
        logger.setLevel(level)
        logger.handlers[:] = handlers
        warnings.filters[:] = filters


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions and redistribution plans. They are keyed by meshes,
    and a mesh compares equal to the same-shaped mesh of the previous simulated rank, whose process
    groups are gone: a cached plan would send the next rank's collectives to a group that no longer exists."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch's own
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


class MissingMessage(Exception):
    """A simulated pipeline stage waits for a message (tensor shapes) from a stage not simulated yet."""

    def __init__(self, src_stage: int) -> None:
        super().__init__(f"stage {src_stage}'s shapes are not known yet")
        self.src_stage = src_stage


def _stages_of(schedule) -> list:
    """The stages a pipeline schedule runs on this rank (one, or several under an interleaved schedule)."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def _pipeline_by_mail(pipeline, mailbox: dict) -> None:
    """Let a pipeline's stages run their first step on fake tensors. On it they agree by vote whether
    shapes are static and trade their output and gradient shapes with their neighbours, by value
    (``.item()``), which fake tensors do not have: here each stage takes its own vote (mmm builds every
    stage alike) and the shapes travel through ``mailbox`` (``(from stage, to stage) -> message``), which
    outlives a simulated rank, so that ranks simulated later read what earlier ones sent. A stage whose
    message is missing raises :class:`MissingMessage` (simulate the sender first). Neither exchange
    belongs to the steady step that is counted."""
    try:
        from torch.distributed.pipelining._utils import InferenceMode
    except ImportError:  # the stages' shape exchange of another PyTorch
        raise UsageError(
            f"simulating a pipeline needs the stage shape exchange of PyTorch 2.13 (torch.distributed.pipelining's "
            f"InferenceMode); this is PyTorch {torch.__version__}: simulate without --pp, or with PyTorch 2.13"
        ) from None

    schedule = pipeline.schedule
    stages = _stages_of(schedule)
    cpu = torch.device("cpu")
    pipeline.device = cpu
    for stage in stages:
        stage.device = cpu

        def send(meta, dst_stage, stage=stage):
            mailbox[(stage.stage_index, dst_stage)] = meta

        def recv(src_stage, stage=stage):
            if (src_stage, stage.stage_index) not in mailbox:
                raise MissingMessage(src_stage)
            return mailbox[(src_stage, stage.stage_index)]

        stage._send_meta, stage._recv_meta = send, recv

    def vote(stages, has_backward, p2p_done=False):
        for stage in stages:
            dynamic = InferenceMode.needs_dynamic(stage._user_meta, has_backward)
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    schedule._warmup_p2p = vote


def _pipeline_shapes(pipeline, inputs, targets) -> None:
    """What a pipeline's first step does before its first microbatch: its stages infer their
    inputs', outputs' and gradients' shapes (running a microbatch's forward and backward on them)
    and trade them with their neighbours. Done here, before the step that is counted, so that
    the counted step is a steady one, as every step after the first."""
    schedule = pipeline.schedule
    n = pipeline.microbatches
    args = (inputs[: len(inputs) // n],) if pipeline.has_first else ()
    target = targets[: len(targets) // n] if pipeline.has_last else None
    init = getattr(schedule, "_initialize_stages", None) or schedule._initialize_stage
    for stage in _stages_of(schedule):
        stage.has_backward = schedule._has_backward  # as the schedule's step sets it
    with loss_parallel_context(pipeline.loss_parallel):
        init(args, {}, target)


def fake_step(
    engine,
    mesh,
    loss_fn,
    tokens: tuple[int, int],
    mailbox: dict | None = None,
    trace: bool = False,
    shapes_only: bool = False,
) -> dict:
    """A training step of ``engine`` (sharded on meta) on fake tensors, as every step after the first
    (the optimizer state exists: :func:`_optimizer_state`): what it communicates by mesh axis, what it
    saves for backward, its peak memory, and the parameter, gradient and optimizer bytes it holds
    after backward (as the trainer reads them). The engine's parameters become fake tensors (no
    memory); it is not usable for real work afterwards. ``shapes_only``: under a pipeline, only the
    first step's shape exchange (what the stages send through ``mailbox``), nothing counted: ``{}``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if engine.pipeline is not None:
        _pipeline_by_mail(engine.pipeline, {} if mailbox is None else mailbox)
    with FakeTensorMode(allow_non_fake_inputs=True):  # buffers (rotary tables) stay real: they are read only
        names = {id(p): name for name, p in engine.module.named_parameters()}
        engine.module.to_empty(device="cpu")
        # plain (not FSDP-managed) parameters come back as new objects: the optimizer must step those
        now = dict(engine.module.named_parameters())
        for group in engine.optimizer.param_groups:
            group["params"] = [now[names[id(p)]] if id(p) in names else p for p in group["params"]]
        engine.train()
        inputs = torch.zeros(tokens, dtype=torch.long)
        sync = StepSync.for_engine(engine, device=torch.device("cpu"))
        _optimizer_state(engine.optimizer)  # what a first step leaves: the AdamW state
        if engine.pipeline is not None:  # and, under a pipeline, the shapes its stages traded
            _pipeline_shapes(engine.pipeline, inputs, inputs)
            if shapes_only:
                return {}
        existing = held_before_step(engine, inputs)
        held: dict[str, int] = {}  # what the trainer's summary.json reads while the gradients exist
        with (
            PeakMemory(existing, trace=trace) as memory,
            CommCounter(mesh.named_groups()) as comm,
            SavedActivations() as saved,
            DeviceWork() as work,
        ):
            train_step(  # a steady step, as --measure watches step 2
                engine, inputs, inputs, loss_fn, sync=sync, after_backward=lambda: held.update(engine.state_bytes())
            )
    return {
        "comm_bytes": comm.result(),
        "comm_calls": dict(sorted(comm.calls.items())),
        "comm_by_kind": dict(sorted(comm.by_kind.items())),
        "activation_bytes": saved.bytes,
        "matmul_flops": work.matmul_flops,
        "memory_bytes": work.memory_bytes,
        "peak": {"total": memory.peak, "before_step": memory.start},
        "state_bytes": {k: held[k] for k in ("param_bytes", "grad_bytes", "optim_bytes")},
        **({"memory_trace": memory.trace} if trace else {}),
    }


def held_before_step(engine, inputs) -> list[torch.Tensor]:
    """What a rank holds as a step starts (parameters, buffers, the AdamW state, the batch): the
    storages ``PeakMemory`` counts from the start."""
    held = [*engine.module.parameters(), *engine.module.buffers(), inputs]
    return held + [v for state in engine.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def _optimizer_state(optimizer) -> None:
    """Create ``optimizer``'s state as its first step does (AdamW makes its moments there), by one step
    on zero gradients shaped as the parameters (on fake tensors: no arithmetic). A simulated step then
    runs as every step after the first: it holds the state throughout."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


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


@dataclass
class Ranked:
    """A layout and its simulated ranks, ranked by :func:`rank_layouts`."""

    combo: Combo
    reports: list[RankReport]
    ac: str | None = None
    """The activation checkpointing the pick chose for this layout where not the config's (None: the config's)."""

    @property
    def label(self) -> str:
        return self.combo.label + (f"-ac{self.ac}" if self.ac else "")

    @property
    def flags(self) -> list[str]:
        return [*self.combo.flags, *(["--ac", self.ac] if self.ac else [])]

    @property
    def step_s(self) -> float:
        return max(r.prediction["step_s"] for r in self.reports)

    @property
    def fits(self) -> bool:
        return all(r.prediction["fits"] for r in self.reports)

    def why(self) -> str:
        """The slowest rank's step time, split into its parts."""
        p = max((r.prediction for r in self.reports), key=lambda p: p["step_s"])
        parts = [f"compute {p['compute_s'] * 1e3:.1f} ms"]
        if p["memory_s"]:
            parts[0] += f" (memory-bound ops {p['memory_s'] * 1e3:.1f})"
        if p["bubble_s"]:
            parts.append(f"pipeline bubble {p['bubble_s'] * 1e3:.1f} ms")
        parts += [
            f"{axis} {t * 1e3:.1f} ms{' across nodes' if p['crosses_nodes'][axis] else ''}"
            for axis, t in p["exposed_s"].items()
            if t >= 0.005 * p["step_s"]
        ]
        peak = max(r.prediction["peak_bytes"] for r in self.reports)
        return f"{' + '.join(parts)}; peak {peak / 2**30:.2f} of {p['memory_bytes'] / 2**30:.0f} GiB"


def state_floor(config: Config[LlamaTrainConfig], world: int, combo: Combo) -> float:
    """Bytes of parameters, gradients and AdamW state a rank of ``combo`` holds at least: its share of
    the blocks (the trainer's accounting, :func:`mmm.parallel.strategy.state_bytes_per_param`)."""
    cfg = config.train.model_config()
    dims = ParallelDims(world, **combo.degrees)
    blocks = cfg.num_params(embedding=False) - cfg.dim - cfg.vocab_size * cfg.dim  # less final norm + output
    return sum(state_bytes_per_param(combo.strategy, dims)) * blocks / (dims.tp * dims.pp)


PARALLEL_AFTER_S = 10.0
"""When the other layouts, at the pace of the first (the cheapest), would take longer than this to
simulate one after another, they are simulated at once (a process starts in ~2 s)."""


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# activation checkpointing, least recomputation first: --pick without --ac takes the first that fits
AC_ORDER = ("none", "selective", "full")
# a pipeline's microbatches per stage that --pick without --microbatches ranks (1: the trainer's default)
MICROBATCHES_PER_STAGE = (1, 2, 4)
# variants with more microbatches of pipelines left out by their floor that --pick simulates, at most
REVIVED_AT_MOST = 4


def _microbatch_variants(config: Config[LlamaTrainConfig], world: int, combo: Combo) -> list[Combo]:
    """``combo``, and under a pipeline the same layout with more microbatches (:data:`MICROBATCHES_PER_STAGE`)
    where the trainer accepts them (the per-dp-rank batch splits so, the schedule takes them)."""
    pp = combo.degrees["pp"]
    out = [combo]
    for per_stage in MICROBATCHES_PER_STAGE[1:] if pp > 1 else ():
        variant = replace(combo, microbatches=per_stage * pp)
        if not recipe.problems(_trial(config, variant), world):
            out.append(variant)
    return out


def _trial(config: Config[LlamaTrainConfig], combo: Combo, ac: str | None = None) -> Config[LlamaTrainConfig]:
    """``config`` with ``combo``'s degrees, strategy and microbatches (if it sets them), and ``ac`` if given."""
    extra = {"ac": ac} if ac else {}
    if combo.microbatches:
        extra["microbatches"] = combo.microbatches
    return replace(config, parallel=replace(config.parallel, **combo.degrees, strategy=combo.strategy, **extra))


def _simulate_layout(task) -> tuple[list[RankReport] | None, str | None, str | None]:
    """One layout of :func:`rank_layouts`: its reports, or why the simulator refused it; and the
    activation checkpointing chosen (the first of ``acs`` whose peak fits; None: ``config``'s). With
    ``stops`` (each AC's floor) and ``best``: no reports (nor reason) once the AC to try next has a floor
    no faster than ``best`` (the layout cannot be the pick with that much recomputation or more)."""
    config, combo, world, per_node, hardware, acs, stops, best = task
    # rank 0 (FSDP's first shards are the largest when a dimension does not split evenly); under a
    # pipeline also the rank of the same coordinates in the last stage (rank 0's first step waits for
    # its shapes: it is simulated first, once)
    ranks = [0, world - world // combo.degrees["pp"]] if combo.degrees["pp"] > 1 else [0]
    reports = None
    for ac in acs or (None,):
        if stops and stops[ac] >= best:
            return None, None, ac
        try:
            trial = _trial(config, combo, ac)
            reports = simulate_by_blocks(trial, world=world, ranks=ranks, devices_per_node=per_node, hardware=hardware)
        except UsageError as e:
            return None, str(e), ac
        if all(r.prediction["fits"] for r in reports):  # less recomputation is faster: the first that fits
            break
    return reports, None, (ac if ac != config.parallel.ac else None)


def _end_with_parent(parent: int) -> None:
    """This process ends when ``parent`` does: a pool worker with the planner, the planner with the
    trainer rank that asked for a pick (``MMM_END_WITH_PARENT``); none is left simulating for minutes
    on its own. Linux: the kernel's parent-death signal."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the planner ended before the signal was asked for
        print(
            f"mmm.plan.simulate: process {parent}, which started this one, has ended: nothing to plan for",
            file=sys.stderr,
        )
        os._exit(1)


def _simulate_layouts(
    combos, config, world: int, per_node: int, hardware, jobs: int | None, acs=None, stops=None, best=math.inf
):
    """Each of ``combos`` simulated (:func:`_simulate_layout`), paired with its result. ``jobs``: processes
    at once (``None``: decided here, by how long the first, cheapest layout took). ``stops``: each
    layout's floor per activation checkpointing, by label; ``best``: the step to beat."""
    # the simulated step's ops grow with the ring attention's steps and the pipeline's stages: the
    # cheapest layout first (it decides whether to use more processes), the rest longest first
    combos = sorted(combos, key=lambda c: c.degrees["cp"] * c.degrees["pp"])
    stops = stops or {}
    tasks = [(config, c, world, per_node, hardware, acs, stops.get(c.label), best) for c in combos]
    first = []
    if jobs is None and tasks:  # the first layout here; the others at once if they take longer than starting processes
        t0 = time.perf_counter()
        first = [(combos[0], _simulate_layout(tasks[0]))]
        jobs = _usable_cores() if (time.perf_counter() - t0) * (len(tasks) - 1) > PARALLEL_AFTER_S else 1
    rest = tasks[len(first) :][::-1]
    if min(jobs or 1, len(rest)) > 1:  # fresh interpreters: each simulation sets up a process group of its own
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            min(jobs, len(rest)), mp_context=spawn, initializer=_end_with_parent, initargs=(os.getpid(),)
        ) as pool:
            results = list(pool.map(_simulate_layout, rest))
    else:
        results = [_simulate_layout(task) for task in rest]
    return first + [(task[1], result) for task, result in zip(rest, results, strict=True)]


def _ring_once(cfg, seqs: int, tokens: int, tp: int, head_dim: int, dtype, cp: int) -> tuple:
    """One ring attention forward and backward on fake tensors of these shapes in a fake group of ``cp``
    ranks: the forward's and backward's messages (:class:`CommCounter`) and memory-bound work."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with _excepthook_kept():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)
    try:
        group = dist.group.WORLD
        with FakeTensorMode():
            q, k, v = (
                torch.empty(seqs, tokens, heads // tp, head_dim, dtype=dtype, requires_grad=True).transpose(1, 2)
                for heads in (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads)
            )
            grad = torch.empty(q.shape, dtype=dtype)
            with CommCounter({"cp": group}) as comm_f, DeviceWork() as work_f:
                out = ring_attention(q, k, v, group=group)
            with CommCounter({"cp": group}) as comm_b, DeviceWork() as work_b:
                torch.autograd.grad(out, (q, k, v), grad)
    finally:
        dist.destroy_process_group()
    return comm_f, work_f, comm_b, work_b


def ring_attention_step(config: Config[LlamaTrainConfig], world: int, combo: Combo, cache: dict | None = None) -> dict:
    """What the ring attention of a context-parallel layout alone asks of rank 0 in a step: the bytes
    its memory-bound ops move, and its messages over the cp group (payload by kind, calls). The ring
    (:func:`mmm.parallel.context.ring_attention`) runs here once forward and once backward on fake
    tensors of rank 0's shapes (one microbatch), in a fake cp group of its own, and is counted for
    every block rank 0 holds and every microbatch, its forward twice under ``--ac full`` (the
    block is recomputed). A part of the step, found in about a second: :func:`rank_layouts` prunes
    with it before simulating the whole step. ``cache`` keeps one ring's counts by its shapes (layouts
    that differ in their data-parallel split, microbatches or checkpointing only run it once)."""
    cfg, how, d = config.train.model_config(), config.parallel, combo.degrees
    cp, tp, pp = d["cp"], d["tp"], d["pp"]
    dp = world // (pp * cp * tp)
    microbatches = (how.microbatches or pp) if pp > 1 else 1
    per_rank = how.stages_per_rank
    ranges = stage_layer_ranges(cfg.n_layers, pp * per_rank, how.split_points)
    blocks = sum(ranges[i][1] - ranges[i][0] for i in stage_ids(0, pp, per_rank))  # rank 0's stages
    seqs = config.train.batch_size // dp // microbatches
    tokens, head_dim = cfg.seq_len // cp, cfg.dim // cfg.n_heads
    dtype = torch.bfloat16 if how.dtype == "bf16" else torch.float32
    key = (seqs, tokens, cfg.n_heads // tp, cfg.n_kv_heads // tp, head_dim, dtype, cp)
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = _ring_once(cfg, seqs, tokens, tp, head_dim, dtype, cp)
    comm_f, work_f, comm_b, work_b = cache[key]
    forwards, times = 2 if how.ac == "full" else 1, blocks * microbatches
    by_kind = {
        kind: times * (forwards * comm_f.by_kind.get(("cp", kind), 0) + comm_b.by_kind.get(("cp", kind), 0))
        for kind in {kind for _, kind in [*comm_f.by_kind, *comm_b.by_kind]}
    }
    return {
        "memory_bytes": times * (forwards * work_f.memory_bytes + work_b.memory_bytes),
        "comm_by_kind": by_kind,
        "comm_calls": times * (forwards * comm_f.calls.get("cp", 0) + comm_b.calls.get("cp", 0)),
    }


def _blocks_once(cfg, how, seqs: int, tp: int) -> int:
    """The bytes the memory-bound ops of one block move in one microbatch's forward and backward at
    ``tp`` (fake tensors): a model of two blocks less one of one block, each parallelised as the trainer
    does (TP and sequence parallel, its activation checkpointing) in a fake group of ``tp`` ranks,
    without FSDP, its parameters in the compute dtype as FSDP gathers them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dtype = torch.bfloat16 if how.dtype == "bf16" else torch.float32
    os.environ.update(RANK="0", WORLD_SIZE=str(tp), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(tp), MMM_DEVICE="cpu")
    with _excepthook_kept():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
        try:
            mesh = init_mesh(tp=tp, device_type="cpu", log_coordinates=False)
            spec = recipe.parallel_spec(how).replace(dtype="fp32", compile=False, dp="none", reshard_after_forward=None)
            moved = []
            for blocks in (1, 2):
                with meta_init():
                    model = Llama(replace(cfg, n_layers=blocks))
                parallelize(model, mesh, spec, device=torch.device("meta"), seed=0)
                for module in model.modules():
                    for name, p in module._parameters.items():
                        if p is not None and p.dtype != dtype:
                            module._parameters[name] = torch.nn.Parameter(p.to(dtype))
                with FakeTensorMode(allow_non_fake_inputs=True):
                    model.to_empty(device="cpu")
                    tokens = torch.zeros(seqs, cfg.seq_len, dtype=torch.long)
                    with DeviceWork() as work, loss_parallel_context(tp > 1):
                        recipe.loss_fn(model(tokens), tokens).backward()
                moved.append(work.memory_bytes)
        finally:
            mdist.teardown()
            forget_meshes()
    return moved[1] - moved[0]


def block_step(config: Config[LlamaTrainConfig], world: int, combo: Combo, cache: dict | None = None) -> int:
    """The bytes the memory-bound ops of rank 0's blocks move in a step of a pipeline layout (no
    context parallel): one block's forward and backward of one microbatch (:func:`_blocks_once`, in a
    second or two) times rank 0's blocks and the microbatches. The pipeline's step runs those ops and
    more (FSDP's, the embedding's or the loss's, the schedule's): a floor that prunes pipelines whose
    matrix multiplies alone do not (Llama-3-8B at 16 stages: the blocks' memory-bound ops are a third of
    the step). ``cache`` keeps one block's bytes by its shapes."""
    cfg, how, d = config.train.model_config(), config.parallel, combo.degrees
    pp, tp = d["pp"], d["tp"]
    dp = world // (pp * d["cp"] * tp)
    microbatches = how.microbatches or pp
    ranges = stage_layer_ranges(cfg.n_layers, pp * how.stages_per_rank, how.split_points)
    blocks = sum(ranges[i][1] - ranges[i][0] for i in stage_ids(0, pp, how.stages_per_rank))
    seqs = config.train.batch_size // dp // microbatches
    key = (seqs, tp, how.ac, how.dtype)
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = _blocks_once(cfg, how, seqs, tp)
    return blocks * microbatches * cache[key]


def layout_floor(
    config: Config[LlamaTrainConfig],
    world: int,
    combo: Combo,
    hardware: Hardware,
    devices_per_node: int,
    *,
    below: float = math.inf,
    cache: dict | None = None,
) -> float:
    """What the predicted step of ``combo`` cannot go under (:func:`mmm.plan.predict.step_floor`), known
    before its step is simulated: the matrix multiplies, the pipeline's bubble over them; under context
    parallel the ring attention's part of the step (:func:`ring_attention_step`: its memory-bound ops,
    its messages at the link rank 0's cp group crosses), under a pipeline without it its blocks'
    memory-bound ops (:func:`block_step`). Either is simulated only when the floor without it is under
    ``below``; ``cache`` keeps each ring or block run by its shapes."""
    trial = _trial(config, combo)
    terms = _step_terms(trial, trial.train.model_config(), world)
    per_node = min(world, devices_per_node)  # as predict_rank counts a node's ranks
    bare = step_floor(hardware, **terms, ranks_per_node=per_node)
    cp, tp = combo.degrees["cp"], combo.degrees["tp"]
    if bare >= below or (cp == 1 and combo.degrees["pp"] == 1):
        return bare
    if cp == 1:  # a pipeline: its blocks' memory-bound ops
        moved = block_step(trial, world, combo, cache=cache)
        return step_floor(hardware, **terms, ranks_per_node=per_node, memory_bytes=moved)
    ring = ring_attention_step(trial, world, combo, cache=cache)
    crosses = (cp - 1) * tp // devices_per_node > 0  # rank 0's cp group: ranks 0, tp, ..., (cp - 1) tp
    comm = axis_time(hardware, ring["comm_by_kind"], ring["comm_calls"], size=cp, crosses_nodes=crosses)
    return step_floor(hardware, **terms, ranks_per_node=per_node, memory_bytes=ring["memory_bytes"], exposed_s=comm)


def rank_layouts(
    config: Config[LlamaTrainConfig],
    world: int,
    hardware: Hardware,
    *,
    devices_per_node: int | None = None,
    fixed: dict[str, int] | None = None,
    strategies: Sequence[str] = ("fsdp", "hsdp"),
    jobs: int | None = None,
    every: bool = False,
    choose_ac: bool = False,
    choose_microbatches: bool = False,
) -> list[Ranked]:
    """Every valid layout of ``world`` ranks that the simulator runs (fsdp or hsdp), each simulated (its
    first and last pipeline stage, one step, :func:`simulate_by_blocks`) and predicted on ``hardware``; fastest
    first, the ones whose memory does not fit last. Layouts without a pipeline or context parallel are
    simulated first; a layout with either whose floor (:func:`layout_floor`) is no faster than the best
    of them is left out unsimulated (one log line): it cannot be the pick. ``fixed``: degrees to hold. ``jobs``:
    layouts simulated at once, each in a process of its own (1: one after another, in this process; None:
    in each batch, the layouts without a pipeline or CP and then the others, the first here and the rest
    on every core this process may use if, at its pace, they would take more than
    :data:`PARALLEL_AFTER_S`). ``every``: none left out by its floor. ``choose_ac``: each layout takes the
    first activation checkpointing of :data:`AC_ORDER` (none, selective, full) whose peak fits, rather
    than the one in ``config`` (its floor counts none: the lowest). ``choose_microbatches``: a pipeline
    layout is also ranked with 2 and 4 microbatches per stage (:data:`MICROBATCHES_PER_STAGE`; a smaller
    bubble, smaller microbatches) where the trainer takes them."""
    per_node = devices_per_node or hardware.devices_per_node
    combos = [c for c in plan(world, config, strategies=list(strategies), fixed=fixed) if c.valid]
    if not combos:
        raise UsageError(f"no fsdp or hsdp layout of {world} ranks is valid for this model; see python -m mmm.plan")
    # a layout whose state alone cannot fit is not simulated: its rank's share of the blocks' parameters,
    # gradients and AdamW state (the embedding and output left out: a floor) against the usable memory
    usable = (1 - MEMORY_MARGIN) * hardware.memory_bytes
    held_floor = {c.label: state_floor(config, world, c) for c in combos}
    over = [c for c in combos if held_floor[c.label] > usable]
    if over:
        worst = min(over, key=lambda c: held_floor[c.label])
        get_logger().warning(
            "%d of %d layouts left out unsimulated: their parameters, gradients and AdamW state alone exceed "
            "%.0f GiB of %.0f per device (the closest, %s: %.1f GiB)",
            len(over),
            len(combos),
            usable / 2**30,
            hardware.memory_bytes / 2**30,
            worst.label,
            held_floor[worst.label] / 2**30,
        )
        combos = [c for c in combos if held_floor[c.label] <= usable]
        if not combos:
            raise UsageError(
                f"no layout of {world} ranks fits in {hardware.memory_bytes / 2**30:.0f} GiB per device: the model's "
                "state alone does not (more ranks, or a device with more memory)"
            )
    # layouts without a pipeline or context parallel first; then the others whose floor (known before
    # their step is simulated) does not already make them slower than the best of those
    acs = AC_ORDER if choose_ac else None
    plain = [c for c in combos if c.degrees["pp"] == 1 and c.degrees["cp"] == 1]
    done = _simulate_layouts(plain, config, world, per_node, hardware, jobs, acs)
    best = min((r.step_s for r in (Ranked(c, rep) for c, (rep, _, _) in done if rep) if r.fits), default=math.inf)
    floor_config = replace(config, parallel=replace(config.parallel, ac=AC_ORDER[0])) if choose_ac else config
    others = [c for c in combos if c not in plain]
    # a pipeline's variants with more microbatches (a smaller bubble), ranked once the pipeline is simulated
    variants = {c.label: _microbatch_variants(config, world, c)[1:] for c in others} if choose_microbatches else {}
    parts: dict = {}  # the rings and blocks the floors ran, by their shapes

    def floor(c: Combo, base: Config = floor_config) -> float:
        return layout_floor(base, world, c, hardware, per_node, below=best, cache=parts)

    floors = {c.label: floor(c) for c in others} if best < math.inf and not every else {}
    slower = [c for c in others if floors.get(c.label, 0.0) >= best]
    if slower:
        closest = min(slower, key=lambda c: floors[c.label])
        get_logger().info(
            "%d of %d layouts with a pipeline or context parallel not simulated: their floor (the matrix "
            "multiplies, the ring attention's memory-bound ops and messages, the pipeline's bubble; the "
            "closest, %s: %.1f ms) exceeds the best step without either (%.1f ms)",
            len(slower),
            len(others),
            closest.label,
            floors[closest.label] * 1e3,
            best * 1e3,
        )

    def stops_for(cs: list[Combo]) -> dict:
        """With AC chosen: each layout's floor per AC, to stop before the checkpointing it cannot win with."""
        if not (choose_ac and best < math.inf and not every):
            return {}
        with_ac = {ac: replace(config, parallel=replace(config.parallel, ac=ac)) for ac in AC_ORDER}
        return {c.label: {ac: floor(c, with_ac[ac]) for ac in AC_ORDER} for c in cs}

    # a pipeline left out by its floor may still win with more microbatches (a smaller bubble): those of
    # its variants whose own floor is under the best are simulated with the others
    # (the lowest floors first, at most REVIVED_AT_MOST: a floor counts no memory-bound op nor any
    # communication, and at Llama-3-70B's size nearly every variant's is under the best: hours of pipelines)
    floors |= {v.label: floor(v) for c in slower for v in variants.get(c.label, ())}
    revived = sorted(
        (v for c in slower for v in variants.get(c.label, ()) if floors[v.label] < best), key=lambda v: floors[v.label]
    )
    if len(revived) > REVIVED_AT_MOST and not every:
        get_logger().info(
            "%d variants with more microbatches of pipelines left out by their floor have their own floor under "
            "the best step: the %d lowest simulated (the lowest, %s: %.1f ms; --every simulates them all)",
            len(revived),
            REVIVED_AT_MOST,
            revived[0].label,
            floors[revived[0].label] * 1e3,
        )
        revived = revived[:REVIVED_AT_MOST]
    # jobs given or decided again: by the pace of this batch's own first layout and its own count
    left = [c for c in others if c not in slower] + revived
    more = _simulate_layouts(left, config, world, per_node, hardware, jobs, acs, stops_for(left), best)
    # then the pipelines' variants with more microbatches that could beat the best: the simulated step
    # less the bubble they save (the rest of the step does not fall with more microbatches), or, where
    # the step needed more activation checkpointing than the least (a variant's smaller microbatches
    # may fit with less), the variant's floor
    best = min([best, *(r.step_s for r in (Ranked(c, rep) for c, (rep, _, _) in more if rep) if r.fits)])
    tried = []
    for combo, (reports, _, ac) in more:
        if reports is None or not variants.get(combo.label):
            continue
        slowest = max((r.prediction for r in reports), key=lambda p: p["step_s"])
        least = not choose_ac or (ac or config.parallel.ac) == AC_ORDER[0]  # its AC: no lighter one to fit with
        for v in variants[combo.label]:
            bubble = pipeline_bubble(
                slowest["compute_s"],
                hardware,
                pp=v.degrees["pp"],
                microbatches=v.microbatches,
                stages_per_rank=config.parallel.stages_per_rank,
                ranks_per_node=min(world, per_node),
            )
            bound = slowest["step_s"] - (slowest["bubble_s"] - bubble) if least else floor(v)
            if every or bound < best:
                tried.append(v)
    if any(variants.values()):
        get_logger().info(
            "%d of %d pipeline layouts with more microbatches per stage simulated (the others: their floor, or "
            "their pipeline's simulated step less the bubble they save, is no faster than %.1f ms)",
            len(tried) + len(revived),
            sum(len(vs) for vs in variants.values()),
            best * 1e3,
        )
    more += _simulate_layouts(tried, config, world, per_node, hardware, jobs, acs, stops_for(tried), best)
    out, refused_by_reason, stopped = [], {}, []
    for combo, (reports, refused, ac) in [*done, *more]:
        if refused:  # refused once built (the planner's checks passed): out of the ranking, said why
            refused_by_reason.setdefault(refused, []).append(combo.label)
        elif reports is None:
            stopped.append(f"{combo.label} ({ac})")
        else:
            out.append(Ranked(combo, reports, ac))
    if stopped:
        get_logger().info(
            "%d layouts left out before the activation checkpointing they would need to fit: their floor with it "
            "is no faster than the best step found before them (%s)",
            len(stopped),
            ", ".join(stopped[:3]) + (", ..." if len(stopped) > 3 else ""),
        )
    for reason, labels in refused_by_reason.items():  # one line per reason
        get_logger().warning("%s left out of the ranking: %s", ", ".join(labels), reason)
    if not out:
        raise UsageError(f"none of the {len(combos)} layouts of {world} ranks could be simulated (see the warnings)")
    out.sort(key=lambda r: (not r.fits, r.step_s))
    return out


def format_ranking(ranked: list[Ranked], hardware: Hardware, top: int = 5) -> str:
    lines = [f"{len(ranked)} layouts simulated, ranked by predicted step time on {hardware.name}:"]
    best = ranked[0].step_s
    for i, r in enumerate(ranked[:top], 1):
        fit = "" if r.fits else "  DOES NOT FIT"
        lines.append(f"{i:>3}. {r.label:<36} {r.step_s * 1e3:9.1f} ms  {r.step_s / best:5.2f}x  {r.why()}{fit}")
    if len(ranked) > top:
        lines.append(f"     ... {len(ranked) - top} more (--json has them all)")
    pick = ranked[0]
    if pick.fits:
        lines.append(f"pick: {' '.join(pick.flags)}")
    else:
        lines.append(
            "pick: none; no layout fits in memory (more activation checkpointing, a smaller --batch-size, "
            "or more ranks)"
        )
    return "\n".join(lines)


def format_reports(reports: list[RankReport]) -> str:
    first = reports[0]
    lines = [
        f"{first.world} ranks simulated ({len(reports)} shown), model of {first.num_params / 1e9:.3g}B parameters",
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
        lines.append(
            f"{'rank':>6}  {'peak MiB':>9} {'(before step)':>13} {'saved act MiB':>13}  "
            "communication by mesh axis: MiB (calls)"
        )
        for r in stepped:
            peak = r.step["peak"]
            comm = ", ".join(
                f"{axis} {n / MIB:.1f} ({r.step['comm_calls'].get(axis, 0)})"
                for axis, n in r.step["comm_bytes"].items()
            )
            lines.append(
                f"{r.rank:>6}  {peak['total'] / MIB:>9.1f} {peak['before_step'] / MIB:>13.1f} "
                f"{r.step['activation_bytes'] / MIB:>13.1f}  {comm or '-'}   ({r.setup_s.get('step', 0):.1f} s)"
            )
    predicted = [r for r in reports if r.prediction is not None]
    if predicted:
        hw = predicted[0].prediction["hardware"]
        lines += ["", f"predicted on {hw} (mmm.plan.predict: the model and its assumptions):"]
        for r in predicted:
            p = r.prediction
            parts = ", ".join(
                f"{axis} {p['exposed_s'][axis] * 1e3:.1f} of {t * 1e3:.1f} ms"
                f"{' (crosses nodes)' if p['crosses_nodes'][axis] else ''}"
                for axis, t in p["comm_s"].items()
            )
            fit = "fits" if p["fits"] else "DOES NOT FIT"
            bubble = f" + bubble {p['bubble_s'] * 1e3:.1f}" if p["bubble_s"] else ""
            memory = (
                f" (matmul {p['matmul_s'] * 1e3:.1f} + memory-bound {p['memory_s'] * 1e3:.1f})" if p["memory_s"] else ""
            )
            lines.append(
                f"{r.rank:>6}  step {p['step_s'] * 1e3:.1f} ms = compute {p['compute_s'] * 1e3:.1f}{memory}{bubble}"
                " + exposed communication "
                f"({parts}); MFU {p['mfu']:.1%}; peak {p['peak_bytes'] / 2**30:.1f} of "
                f"{p['memory_bytes'] / 2**30:.0f} GiB: {fit}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("MMM_END_WITH_PARENT", "").isdigit():  # started by a trainer's --pick-layout
        _end_with_parent(int(os.environ["MMM_END_WITH_PARENT"]))
    configure()  # this process's own lines (--pick's), before any simulated rank sets up its own
    parser = build_parser()
    ns = parser.parse_args(argv)
    own = {"--world", "--ranks", "--devices-per-node", "--json", "--hardware", "--jobs"}
    # the trainer's flags, typed and checked as the trainer does
    config = command_line().parse(without_flags(argv, own, {"--no-step", "--pick", "--every"}))
    if config.train.pick_layout:
        raise UsageError("--pick-layout is the trainer's; here use --pick --hardware HARDWARE")
    if config.parallel.compile and ns.step:
        raise UsageError(
            "--compile is not simulated (the step runs eager, and a compiled step saves fewer activations); "
            "drop it for an eager estimate (an upper bound on activations), or add --no-step"
        )
    unused = run_only_flags(config)
    if unused:  # the trainer's command line is welcome here; say what of it a simulated step leaves out
        print(
            f"python -m mmm.plan.simulate: note: {', '.join(unused)} {'shape' if len(unused) > 1 else 'shapes'} "
            "the run, not its step: not simulated",
            file=sys.stderr,
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
        fixed = {axis: getattr(ns, axis) for axis in AXES if getattr(ns, axis) is not None}
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
        )
        print(format_ranking(ranked, hardware))
        if ns.json_path:
            rows = [
                {"label": r.label, "degrees": r.combo.degrees, "strategy": r.combo.strategy, "ac": r.ac}
                | {"microbatches": r.combo.microbatches}
                | {"flags": r.flags, "step_s": r.step_s, "fits": r.fits, "why": r.why()}
                | {"ranks": [_jsonable(asdict(x)) for x in r.reports]}
                for r in ranked
            ]
            atomic_write_text(Path(ns.json_path), json.dumps(rows, indent=2) + "\n")
        return 0
    if ns.jobs:
        raise UsageError(f"--jobs {ns.jobs} sets how many layouts --pick simulates at once; without --pick drop it")
    if ns.every:
        raise UsageError("--every simulates every layout --pick ranks; without --pick drop it")
    ranks = _ranks(ns.ranks, ns.world)
    reports = simulate_ranks(
        config, world=ns.world, ranks=ranks, devices_per_node=per_node, step=ns.step, hardware=hardware
    )
    print(format_reports(reports))
    if ns.json_path:
        atomic_write_text(Path(ns.json_path), json.dumps([_jsonable(asdict(r)) for r in reports], indent=2) + "\n")
    return 0


# trainer flags that decide what a run writes, reads back or watches, not what one step holds or sends
RUN_ONLY = {"eval_every", "eval_iters", "export_hf", "measure", "max_iters", "lr_schedule", "warmup_steps"}
RUN_ONLY |= {"min_lr", "lr_decay_steps", "seed"}


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def run_only_flags(config: Config) -> list[str]:
    """The flags given (not at their default) that a simulated step does not use."""
    given = []
    for section, names in ((config.train, RUN_ONLY), (config.run, None)):
        for f in flag_fields(type(section)):
            if (names is None or f.name in names) and getattr(section, f.name) != f.default:
                given.append(f.metadata["flags"][0])
    return given


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
