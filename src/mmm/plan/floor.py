"""What a layout's predicted step cannot go under, known before its step is simulated: the state a rank
holds at least, and the step's floor (the matrix multiplies, the pipeline's bubble, the ring attention's
or the blocks' memory-bound ops), each part simulated alone in a second. :mod:`mmm.plan.ranking` prunes
with them."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from mmm import dist as mdist
from mmm.measure import CommCounter, DeviceWork
from mmm.parallel import ParallelDims, init_mesh, meta_init, parallelize
from mmm.parallel.compose import fsdp_wraps
from mmm.parallel.context import ring_attention
from mmm.parallel.experts import plan_routing
from mmm.parallel.pipeline import stage_ids, stage_layer_ranges
from mmm.parallel.strategy import state_bytes_per_param
from mmm.parallel.tensor import loss_parallel_context
from mmm.plan import Combo
from mmm.plan.fake import forget_meshes, num_params, process_kept, setup_lines_left_out, step_terms
from mmm.plan.hardware import Hardware
from mmm.plan.predict import axis_time, step_floor
from mmm.training.config import Config


def block_params(recipe, model_config) -> int:
    """Parameters in the repeated blocks of ``recipe``'s model (one block's, from models of one and two
    blocks built on meta, times the blocks; 0 for a model without repeated blocks)."""
    n = recipe.shape(model_config).blocks
    if not n:
        return 0
    one, two = (num_params(recipe, recipe.with_blocks(model_config, k)) for k in (1, 2))
    return n * (two - one)


def state_floor(config: Config, world: int, combo: Combo, blocks: int | None = None) -> float:
    """Bytes of parameters, gradients and AdamW state a rank of ``combo`` holds at least: its share of
    the blocks' parameters (``blocks``: :func:`block_params`, worked out if not given), in the trainer's
    accounting (:func:`mmm.parallel.strategy.state_bytes_per_param`)."""
    if blocks is None:
        blocks = block_params(config.recipe, config.recipe.model_config(config.train))
    dims = ParallelDims(world, **combo.degrees)
    return sum(state_bytes_per_param(combo.strategy, dims)) * blocks / (dims.tp * dims.pp)


def trial_config(config: Config, combo: Combo, ac: str | None = None) -> Config:
    """``config`` with ``combo``'s degrees, strategy and microbatches (if it sets them), and ``ac`` if given."""
    extra = {"ac": ac} if ac else {}
    if combo.microbatches:
        extra["microbatches"] = combo.microbatches
    return replace(config, parallel=replace(config.parallel, **combo.degrees, strategy=combo.strategy, **extra))


def _rank0_share(config: Config, world: int, combo: Combo) -> tuple[int, int, int]:
    """Rank 0's part of a step of ``combo``: the blocks its pipeline stages hold, the microbatches (a
    pipeline's, or gradient accumulation's), and the sequences in each."""
    how, d = config.parallel, combo.degrees
    pp = d["pp"]
    microbatches = how.microbatches or pp  # without a pipeline, those of gradient accumulation (default 1)
    recipe = config.recipe
    n_blocks = recipe.shape(recipe.model_config(config.train)).blocks
    ranges = stage_layer_ranges(n_blocks, pp * how.stages_per_rank, how.split_points)
    blocks = sum(ranges[i][1] - ranges[i][0] for i in stage_ids(0, pp, how.stages_per_rank))
    dp = world // (pp * d["cp"] * d["tp"])
    return blocks, microbatches, config.train.batch_size // dp // microbatches


def _ring_once(shape, seqs: int, tokens: int, tp: int, head_dim: int, dtype, cp: int) -> tuple:
    """One ring attention forward and backward on fake tensors of these shapes in a fake group of ``cp``
    ranks: the forward's and backward's messages (:class:`CommCounter`) and memory-bound work."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with process_kept():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)
    try:
        group = dist.group.WORLD
        with FakeTensorMode():
            q, k, v = (
                torch.empty(seqs, tokens, heads // tp, head_dim, dtype=dtype, requires_grad=True).transpose(1, 2)
                for heads in (shape.heads, shape.kv_heads, shape.kv_heads)
            )
            grad = torch.empty(q.shape, dtype=dtype)
            with CommCounter({"cp": group}) as comm_f, DeviceWork() as work_f:
                out = ring_attention(q, k, v, group=group)
            with CommCounter({"cp": group}) as comm_b, DeviceWork() as work_b:
                torch.autograd.grad(out, (q, k, v), grad)
    finally:
        dist.destroy_process_group()
    return comm_f, work_f, comm_b, work_b


def ring_attention_step(config: Config, world: int, combo: Combo, cache: dict | None = None) -> dict:
    """What the ring attention of a context-parallel layout alone asks of rank 0 in a step: the bytes
    its memory-bound ops move, and its messages over the cp group (payload by kind, calls). The ring
    (:func:`mmm.parallel.context.ring_attention`) runs here once forward and once backward on fake
    tensors of rank 0's shapes (one microbatch), in a fake cp group of its own, and is counted for
    every block rank 0 holds and every microbatch, its forward twice under ``--ac full`` (the
    block is recomputed). A part of the step, found in about a second: :func:`mmm.plan.ranking.rank_layouts` prunes
    with it before simulating the whole step. ``cache`` keeps one ring's counts by its shapes (layouts
    that differ in their data-parallel split, microbatches or checkpointing only run it once)."""
    how, d = config.parallel, combo.degrees
    shape = config.recipe.shape(config.recipe.model_config(config.train))
    cp, tp = d["cp"], d["tp"]
    blocks, microbatches, seqs = _rank0_share(config, world, combo)
    tokens, head_dim = shape.seq_len // cp, shape.head_dim
    dtype = torch.bfloat16 if how.dtype == "bf16" else torch.float32
    key = (seqs, tokens, shape.heads // tp, shape.kv_heads // tp, head_dim, dtype, cp)
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = _ring_once(shape, seqs, tokens, tp, head_dim, dtype, cp)
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


def _blocks_once(recipe, cfg, how, seqs: int, tp: int, fsdp: bool) -> int:
    """The bytes the memory-bound ops of one block move in one microbatch's forward and backward at
    ``tp`` (fake tensors): a model of two blocks less one of one block, each parallelised as the trainer
    does (TP and sequence parallel, its activation checkpointing) in a fake group of ``tp`` ranks,
    without FSDP's own work: with ``fsdp`` its parameters in the compute dtype, as FSDP gathers them
    (also on one data-parallel rank, for its mixed precision); without (ddp), fp32 under autocast."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dtype = torch.bfloat16 if how.dtype == "bf16" and fsdp else torch.float32
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MMM_DEVICE")
    kept = {name: os.environ.get(name) for name in names}
    os.environ.update(RANK="0", WORLD_SIZE=str(tp), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(tp), MMM_DEVICE="cpu")
    with process_kept(), setup_lines_left_out():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
        try:
            mesh = init_mesh(tp=tp, device_type="cpu", log_coordinates=False)
            spec = recipe.spec(how, cfg).replace(compile=False, dp="none", reshard_after_forward=None)
            spec = spec.replace(dtype="fp32") if fsdp else spec
            moved = []
            for blocks in (1, 2):
                with meta_init():
                    model = recipe.build(recipe.with_blocks(cfg, blocks))
                parallelize(model, mesh, spec, device=torch.device("meta"), seed=0)
                plan_routing(model)  # a mixture of experts: its tokens per expert by plan (no values to route by)
                for module in model.modules():
                    for name, p in module._parameters.items():
                        if p is not None and p.dtype != dtype:
                            module._parameters[name] = torch.nn.Parameter(p.to(dtype))
                with FakeTensorMode(allow_non_fake_inputs=True):
                    model.to_empty(device="cpu")
                    inputs, targets = recipe.example_batch(cfg, rows=seqs)
                    with DeviceWork() as work, loss_parallel_context(tp > 1 and spec.loss_parallel):
                        recipe.loss(model(inputs), targets).backward()
                moved.append(work.memory_bytes)
        finally:
            mdist.teardown()
            forget_meshes()
            for name, value in kept.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return moved[1] - moved[0]


def block_step(config: Config, world: int, combo: Combo, cache: dict | None = None) -> int:
    """The bytes the memory-bound ops of rank 0's blocks move in a step of a pipeline layout (no
    context parallel): one block's forward and backward of one microbatch (:func:`_blocks_once`, in a
    second or two) times rank 0's blocks and the microbatches. The pipeline's step runs those ops and
    more (FSDP's, the embedding's or the loss's, the schedule's): a floor that prunes pipelines whose
    matrix multiplies alone do not (Llama-3-8B at 16 stages: the blocks' memory-bound ops are a third of
    the step). ``cache`` keeps one block's bytes by its shapes."""
    recipe, how, d = config.recipe, config.parallel, combo.degrees
    cfg = recipe.model_config(config.train)
    tp = d["tp"]
    blocks, microbatches, seqs = _rank0_share(config, world, combo)
    fsdp = fsdp_wraps(ParallelDims(world, **d), combo.strategy, how.dtype)
    key = (seqs, tp, how.ac, how.dtype, fsdp)
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = _blocks_once(recipe, cfg, how, seqs, tp, fsdp)
    return blocks * microbatches * cache[key]


def layout_floor(
    config: Config,
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
    parallel by ring attention the ring's part of the step (:func:`ring_attention_step`: its memory-bound
    ops, its messages at the link rank 0's cp group crosses; all-to-all attention: none, the bare floor),
    under a pipeline without it its blocks' memory-bound ops (:func:`block_step`). Either is simulated only
    when the floor without it is under ``below``; ``cache`` keeps each ring or block run by its shapes."""
    trial = trial_config(config, combo)
    terms = step_terms(trial, trial.recipe.model_config(trial.train), world)
    per_node = min(world, devices_per_node)  # as predict_rank counts a node's ranks
    bare = step_floor(hardware, **terms, ranks_per_node=per_node)
    cp, tp = combo.degrees["cp"], combo.degrees["tp"]
    if bare >= below or (cp == 1 and combo.degrees["pp"] == 1):
        return bare
    if cp == 1:  # a pipeline: its blocks' memory-bound ops (none to count without a memory bandwidth)
        if not hardware.memory_bps:
            return bare
        moved = block_step(trial, world, combo, cache=cache)
        return step_floor(hardware, **terms, ranks_per_node=per_node, memory_bytes=moved)
    if trial.parallel.cp_attention != "ring":  # all-to-all attention: the ring's part is no floor of it
        return bare
    ring = ring_attention_step(trial, world, combo, cache=cache)
    crosses = (cp - 1) * tp // devices_per_node > 0  # rank 0's cp group: ranks 0, tp, ..., (cp - 1) tp
    comm = axis_time(hardware, ring["comm_by_kind"], ring["comm_calls"], size=cp, crosses_nodes=crosses)
    return step_floor(hardware, **terms, ranks_per_node=per_node, memory_bytes=ring["memory_bytes"], exposed_s=comm)
