"""One rank of an N-rank job of a recipe's trainer, simulated in this process on a fake process group: its state, its
step on fake tensors (communication, saved activations, peak memory, device work) and, under a
pipeline, the shapes its stages trade first. The planner's simulation (:mod:`mmm.plan.simulate`)."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from difflib import SequenceMatcher
from itertools import accumulate

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor._redistribute import _gen_transform_infos

from mmm import dist as mdist
from mmm import env as mmm_env
from mmm.errors import UsageError
from mmm.log import get_logger
from mmm.measure import CommCounter, DeviceWork, PeakMemory, SavedActivations
from mmm.parallel import init_mesh, meta_init
from mmm.parallel.experts import plan_routing
from mmm.parallel.optim import fused_problem, say_choice
from mmm.parallel.pipeline import stage_ids, stage_layer_ranges
from mmm.parallel.tensor import loss_parallel_context
from mmm.plan.hardware import Hardware
from mmm.plan.predict import predict
from mmm.training.config import Config
from mmm.training.step import StepSync, train_step


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


def accelerated(hardware: Hardware | None) -> bool:
    """Whether ranks on ``hardware`` are accelerators, whose torch runs ``F.rms_norm`` as one fused kernel
    each way (CUDA, ROCm): a preset or file without ``cores_per_node``. Without ``--hardware``, a rank is
    simulated as this CPU build runs it."""
    return hardware is not None and not hardware.cores_per_node


def num_params(recipe, model_config) -> int:
    """Parameters of ``recipe``'s model of ``model_config`` (built on meta: no memory)."""
    with meta_init():
        return sum(p.numel() for p in recipe.build(model_config).parameters())


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def simulate_rank(
    config: Config,
    *,
    world: int,
    rank: int,
    devices_per_node: int = 8,
    step: bool = True,
    hardware: Hardware | None = None,
    mailbox: dict | None = None,
    blocks: int | None = None,
    shapes_only: bool = False,
    expert_load: float = 1.0,
    fused_norms: bool | None = None,
) -> RankReport | None:
    """Rank ``rank`` of a ``world``-rank job with ``config`` (of ``config.recipe``'s model), simulated in
    this process: it joins a fake process group of ``world`` ranks, which it leaves before returning (so
    the next rank can). ``blocks``: a model of that many blocks (checked at its full size elsewhere).
    ``shapes_only``: a pipeline rank that only sends its stages' shapes into ``mailbox`` (what a rank
    simulated after it waits for); no report. A mixture of experts routes by plan (tensors have no
    values): ``expert_load`` x the mean to each rank's first expert, the rest evenly
    (:func:`mmm.parallel.experts.plan_routing`). ``fused_norms``: norms as one fused kernel each way
    (:func:`fake_step`); by default where ``hardware`` is an accelerator (:func:`accelerated`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's test helper: load it only here

    what, how, recipe = config.train, config.parallel, config.recipe
    if how.float8:
        raise UsageError("--float8 is not simulated (torchao's float8 matmuls need a CUDA device); drop it")
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
    found = recipe.problems(config, world) if blocks is None else []  # with blocks: checked at full size
    if found:
        raise UsageError("; ".join(found))
    times = {}
    t0 = time.perf_counter()
    mesh = init_mesh(**how.degrees, device_type="cpu", log_coordinates=False)
    times["mesh"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cfg = recipe.model_config(what)
    if blocks is not None:  # a model of fewer blocks (simulate_by_blocks), checked at full size
        cfg = recipe.with_blocks(cfg, blocks)
    with meta_init():
        model = recipe.build(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    times["model"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    recipe.prepare(model, mesh, cfg, how)  # as the trainer does (e.g. ring attention under cp)
    spec = recipe.spec(how, cfg).replace(compile=False)  # the trainer's own, run eager
    # the trainer's engine, sharded on meta: exact shapes, no memory
    engine = recipe.make_engine(model, mesh, config, device=torch.device("meta"), spec=spec)
    del model
    module = engine.module
    for whole in module.parts if engine.pipeline is not None else [module]:  # stages: every module
        plan_routing(whole, load=expert_load)  # a mixture of experts: tokens per expert by plan
    times["parallelize"] = time.perf_counter() - t0
    params = [p for p in module.parameters() if p.requires_grad]
    param_bytes = sum(_local_bytes(p) for p in module.parameters())
    grad_bytes = sum(_local_bytes(p) for p in params)  # fp32 gradients, shaped as the parameters (at first)
    optim_bytes = 2 * sum(_local_bytes(p) for p in params)  # AdamW: exp_avg and exp_avg_sq (fp32)
    coords = {axis: mesh.coord(axis) for axis in mesh.dims.enabled_axes()}
    axes = {"world": {"size": world, "crosses_nodes": world > devices_per_node}}
    groups = mesh.named_groups()
    if mesh.group("ep") is not None:  # the experts' exchange is counted as ep's even where its group is named
        groups.setdefault("ep", mesh.group("ep"))  # otherwise
    for name, group in groups.items():
        ranks = dist.get_process_group_ranks(group)
        axes[name] = {"size": len(ranks), "crosses_nodes": len({r // devices_per_node for r in ranks}) > 1}
    simulated = None
    if step:
        t0 = time.perf_counter()
        mailbox = mailbox if mailbox is not None else {}

        def batch():  # this rank's batch (made on fake tensors: no memory)
            return recipe.example_batch(cfg, rows=what.batch_size // mesh.dp, cp=mesh.cp)

        simulated = fake_step(
            engine,
            mesh,
            recipe.loss,
            batch,
            mailbox=mailbox,
            trace=blocks is not None,
            shapes_only=shapes_only,
            fused_norms=accelerated(hardware) if fused_norms is None else fused_norms,
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


def step_terms(config, cfg, world: int) -> dict:
    """What :func:`mmm.plan.predict.predict` takes of a layout besides its simulated step."""
    what, how, recipe = config.train, config.parallel, config.recipe
    pp = how.degrees.get("pp", 1)
    return dict(
        flops=(recipe.flops_per_unit(cfg) or 0.0) * recipe.per_step(what, cfg) / world,
        recompute=4 / 3 if how.ac == "full" else 1.0,
        dtype=how.dtype,
        pp=pp,
        microbatches=how.microbatches or pp,  # the trainer's default
        stages_per_rank=how.stages_per_rank,
    )


def predict_rank(step: dict, axes: dict, config, cfg, world: int, hardware: Hardware, devices_per_node: int) -> dict:
    """The step time of a simulated rank of ``config`` (model shape ``cfg``) on ``hardware``."""
    terms = step_terms(config, cfg, world)
    n_layers = max(1, config.recipe.shape(cfg).blocks // terms["pp"])  # the blocks this rank holds
    per_node = min(world, devices_per_node)  # a job smaller than a node has only its own ranks there
    return predict(step, axes, hardware, **terms, n_layers=n_layers, ranks_per_node=per_node).as_dict()


def simulate_by_blocks(
    config: Config,
    *,
    world: int,
    ranks: Sequence[int],
    devices_per_node: int = 8,
    hardware: Hardware | None = None,
    expert_load: float = 1.0,
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
    of at most four blocks, or without repeated blocks, is simulated whole."""
    recipe, how = config.recipe, config.parallel
    cfg = recipe.model_config(config.train)
    pp, per_rank = how.degrees.get("pp", 1), how.stages_per_rank
    chunks = pp * per_rank  # pipeline stages in all
    n_blocks = recipe.shape(cfg).blocks
    sizes = [b - a for a, b in stage_layer_ranges(n_blocks, chunks, how.split_points)] if n_blocks else [0]
    if min(sizes) <= 4:
        return simulate_ranks(
            config,
            world=world,
            ranks=ranks,
            devices_per_node=devices_per_node,
            hardware=hardware,
            expert_load=expert_load,
        )
    found = recipe.problems(config, world)
    if found:
        raise UsageError("; ".join(found))
    even = replace(config, parallel=replace(how, split_points=None))  # k blocks in every stage
    one, two = (
        simulate_ranks(
            even,
            world=world,
            ranks=ranks,
            devices_per_node=devices_per_node,
            blocks=k * chunks,
            expert_load=expert_load,
            fused_norms=accelerated(hardware),  # predicted below, as the whole model's step would be
        )
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
            grown = ("activation_bytes", "activation_peak_bytes", "matmul_flops", "memory_bytes")
            step |= {k: grow(a.step[k], b.step[k], n) for k in grown}
            peak = grow(a.step["peak"], b.step["peak"], n)
            carried = carried_peak(a.step["memory_trace"], b.step["memory_trace"], (n - 4 * per_rank) / per_rank)
            peak["total"] = max(peak["total"], carried)
            step |= {"peak": peak, "extrapolated_from_blocks": [3, 4]}
        state = {k: grow(getattr(a, k), getattr(b, k), n) for k in ("param_bytes", "grad_bytes", "optim_bytes")}
        report = replace(
            b,
            num_params=num_params(recipe, cfg),
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


def simulate_ranks(config: Config, *, world: int, ranks: Sequence[int], **kw) -> list[RankReport]:
    """:func:`simulate_rank` for each of ``ranks``, in this process one after another. Under pipeline
    parallel a stage's first step needs its neighbours' shapes (the stage before sends its output's,
    the stage after its gradient's): first the ranks of one rank's pipeline (the same coordinates on
    the other axes: the same shapes) are simulated only as far as their stages send them, in sweeps
    down the pipeline and back up, each rank until it has sent all (what it sent before it waited
    stays in the mailbox), each of ``ranks`` among them running its counted step once it has its
    shapes; then the others of ``ranks``. A pipeline of 16 stages: 2 steps (not 16) and 28 runs for
    shapes; with v stages per rank, 4v - 2 sweeps."""
    mailbox: dict = {}
    pp = config.parallel.degrees.get("pp", 1)

    def simulated(rank: int, shapes_only: bool = False) -> RankReport | None:
        try:
            with process_kept():
                return simulate_rank(config, world=world, rank=rank, mailbox=mailbox, shapes_only=shapes_only, **kw)
        finally:
            mdist.teardown()
            forget_meshes()

    done: dict[int, RankReport | None] = {}
    if pp > 1 and ranks and kw.get("step", True):  # without a step no stage waits for shapes
        stride = world // pp  # pp is the outermost mesh axis
        pipeline = [stage * stride + ranks[0] % stride for stage in range(pp)]
        waiting, down = list(pipeline), True
        while waiting:  # a sweep that lets no rank send more ends it: a stage waits for what none sends
            before = (len(mailbox), len(waiting))
            for rank in list(waiting if down else waiting[::-1]):
                with contextlib.suppress(MissingMessage):  # an asked rank runs its step once it has its shapes
                    done[rank] = simulated(rank, shapes_only=rank not in ranks)
                    waiting.remove(rank)
            if (len(mailbox), len(waiting)) == before:
                raise RuntimeError(f"pipeline ranks {waiting} never received their neighbours' shapes")
            down = not down
    return [done[rank] if done.get(rank) is not None else simulated(rank) for rank in ranks]


@contextlib.contextmanager
def process_kept():
    """Put ``sys.excepthook`` back afterwards: each ``init_process_group`` wraps it with its rank's prefix,
    and a process that simulates many ranks would print a traceback with one prefix per rank. And the
    ``mmm`` logger and Python's warning filters: a simulated rank other than 0 sets them as a rank that
    stays quiet (the planner's own lines after it would not be printed)."""
    hook, logger = sys.excepthook, get_logger()
    level, handlers, propagate = logger.level, list(logger.handlers), logger.propagate
    try:
        with warnings.catch_warnings():
            yield
    finally:
        sys.excepthook = hook
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate = propagate


@contextlib.contextmanager
def setup_lines_left_out():
    """A simulated layout's own setup lines (its mesh, its optimizer: a few per layout, dozens of layouts in
    a ranking, and the floors' meshes) are not the planner's: at the INFO level they are left out (with
    MMM_LOG_LEVEL=DEBUG they stay)."""
    logger = get_logger()
    if logger.getEffectiveLevel() != logging.INFO:  # DEBUG: wanted; WARNING or quieter: already left out
        yield
        return
    before, level = mmm_env.get("MMM_LOG_LEVEL"), logger.level
    os.environ["MMM_LOG_LEVEL"] = "WARNING"  # for each simulated rank's own logging set-up
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MMM_LOG_LEVEL", None)
        else:
            os.environ["MMM_LOG_LEVEL"] = str(before)
        logger.setLevel(level)


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions and redistribution plans. They are keyed by meshes,
    and a mesh compares equal to the same-shaped mesh of the previous simulated rank, whose process
    groups are gone: a cached plan would send the next rank's collectives to a group that no longer exists."""

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
    batch,
    mailbox: dict | None = None,
    trace: bool = False,
    shapes_only: bool = False,
    fused_norms: bool = False,
) -> dict:
    """A training step of ``engine`` (sharded on meta) on fake tensors of ``batch()``'s (inputs,
    targets), as every step after the first (the optimizer state exists: :func:`_optimizer_state`):
    what it communicates by mesh axis, what it saves for backward, its peak memory, and the
    parameter, gradient and optimizer bytes it holds after backward (as the trainer reads them). The
    engine's parameters become fake tensors (no memory); it is not usable for real work afterwards.
    ``shapes_only``: under a pipeline, only the first step's shape exchange (what the stages send
    through ``mailbox``), nothing counted: ``{}``. ``fused_norms``: ``F.rms_norm`` runs as an accelerator's
    fused kernel (:class:`mmm.measure.FusedNorms`: its traffic, and the input and ``rstd`` kept for
    backward), not as the elementwise ops this CPU build splits it into."""
    if engine.pipeline is not None:
        _pipeline_by_mail(engine.pipeline, {} if mailbox is None else mailbox)
    with FakeTensorMode(allow_non_fake_inputs=True):  # buffers (rotary tables) stay real: they are read only
        names = {id(p): name for name, p in engine.module.named_parameters()}
        engine.module.to_empty(device="cpu")
        # plain (not FSDP-managed) parameters come back as new objects: the optimizer must step those
        now = dict(engine.module.named_parameters())
        for group in engine.optimizer.param_groups:
            group["params"] = [now[names[id(p)]] if id(p) in names else p for p in group["params"]]
        _fused_as_on_a_device(engine.optimizer)
        engine.train()
        inputs, targets = batch()
        sync = StepSync.for_engine(engine, device=torch.device("cpu"))
        if not shapes_only:  # what a first step leaves: the AdamW state
            _optimizer_state(engine.optimizer)
        if engine.pipeline is not None:  # and, under a pipeline, the shapes its stages traded
            _pipeline_shapes(engine.pipeline, inputs, targets)
            if shapes_only:
                return {}
        existing = held_before_step(engine, inputs, targets)
        held: dict[str, int] = {}  # what the trainer's summary.json reads while the gradients exist
        with (
            PeakMemory(existing, trace=trace) as memory,
            CommCounter(mesh.named_groups()) as comm,
            SavedActivations() as saved,
            DeviceWork(fused_norms=fused_norms) as work,
        ):
            train_step(  # a steady step, as --measure watches step 2
                engine, inputs, targets, loss_fn, sync=sync, after_backward=lambda: held.update(engine.state_bytes())
            )
    return {
        "comm_bytes": comm.result(),
        "comm_calls": dict(sorted(comm.calls.items())),
        "comm_by_kind": dict(sorted(comm.by_kind.items())),
        "activation_bytes": saved.bytes,
        "activation_peak_bytes": saved.peak_bytes,  # the most held at once (one microbatch's, accumulating)
        "matmul_flops": work.matmul_flops,
        "memory_bytes": work.memory_bytes,
        "peak": {"total": memory.peak, "before_step": memory.start},
        "state_bytes": {k: held[k] for k in ("param_bytes", "grad_bytes", "optim_bytes")},
        **({"memory_trace": memory.trace} if trace else {}),
    }


def _fused_as_on_a_device(optimizer) -> None:
    """AdamW built over parameters on meta (no fused kernel there) steps as the trainer's would on a real
    device: fused where :func:`mmm.parallel.optim.adamw` finds the (now fake CPU) parameters allow it, so the
    simulated step's optimizer moves what the fused kernel moves (each parameter, gradient and moment read
    once, the parameter and moments written once) rather than the foreach form's several passes."""
    if type(optimizer) is not torch.optim.AdamW or any(
        g.get("fused") or g.get("foreach") for g in optimizer.param_groups
    ):
        return  # another optimizer, or an implementation the caller chose
    params = [p for g in optimizer.param_groups for p in g["params"]]
    problem = fused_problem(params)
    say_choice(problem)
    if problem is None:
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False


def held_before_step(engine, inputs, targets=None) -> list[torch.Tensor]:
    """What a rank holds as a step starts (parameters, buffers, the AdamW state, the batch): the
    storages ``PeakMemory`` counts from the start."""
    held = [*engine.module.parameters(), *engine.module.buffers(), inputs]
    if targets is not None and targets is not inputs:
        held.append(targets)
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
