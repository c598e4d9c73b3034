"""A simulated rank's step time on given hardware: compute, communication by mesh axis, overlap.

The model, stated so it can be checked (every term is in :class:`Prediction`):

- **compute**: the rank's share of the model's training FLOPs (:func:`mmm.flops.llama_flops_per_token`
  x the global batch's tokens / world; full activation checkpointing runs each block's forward
  twice: x 4/3) at ``peak(dtype) x hardware.matmul_efficiency``, plus the bytes the simulated step's
  memory-bound ops read and write (:class:`mmm.measure.DeviceWork`: elementwise ops, norms, softmax,
  casts, the optimizer; recomputation included) at ``hardware.memory_bps x memory_efficiency``: eager
  kernels run one after another. Under pipeline parallel the
  schedule's bubble, ``(pp - 1) / (microbatches + pp - 1)`` of the step, is added; where ranks share a
  node's cores (``hardware.cores_per_node``), an idle rank's share goes to the busy ones and the
  bubble costs only what the critical path at a whole core's rate exceeds the shared work.
- **communication** of each mesh axis, from the simulated step's payloads by collective: a ring
  all-gather or reduce-scatter moves ``(n-1)/n`` of its payload per rank, an all-reduce twice that,
  a send its payload; at the intra-node bandwidth when the axis's group stays in one node, at the
  inter-node one when it spans nodes; plus one latency per call.
- **overlap**: FSDP / HSDP (the ``dp*`` groups, flattened ones included) prefetch the next block's parameters and reduce
  gradients while computing, so only what exceeds the compute is exposed, and never less than one
  block's share (the first all-gather and the last reduce-scatter wait). Tensor- and
  context-parallel collectives sit on the critical path (TP's all-reduces and all-gathers are not
  overlapped in eager PyTorch), and so does the step's own packed all-reduce. Where ranks share a
  node's cores (CPU ranks, more of them than cores: ``hardware.cores_per_node``) nothing overlaps:
  a transfer needs a core (gloo's threads copy the data), and none is idle while the ranks compute.
- **memory** fits when the simulated peak is under ``(1 - margin)`` of the device's memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mmm.plan.hardware import Hardware

RING = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n}
RING["all_reduce"] = lambda n: 2 * (n - 1) / n
RING["all_to_all"] = lambda n: (n - 1) / n  # each rank keeps its own share, sends the rest
MEMORY_MARGIN = 0.10


@dataclass
class Prediction:
    hardware: str
    step_s: float
    compute_s: float
    """``matmul_s + memory_s``."""
    matmul_s: float
    memory_s: float
    """The memory-bound ops' time (0 where the hardware gives no ``memory_bps``)."""
    bubble_s: float
    comm_s: dict[str, float]
    """Time each mesh axis's collectives take, overlapped or not."""
    exposed_s: dict[str, float]
    """What of ``comm_s`` the step waits for."""
    crosses_nodes: dict[str, bool]
    mfu: float
    """Model FLOPs of the step over (step time x the device's peak)."""
    peak_bytes: int
    memory_bytes: float
    fits: bool

    def as_dict(self) -> dict:
        return asdict(self)


def ring_factor(kind: str, n: int) -> float:
    return RING[kind](n) if kind in RING and n > 1 else (0.0 if kind in RING else 1.0)


def pipeline_bubble(
    compute: float, hw: Hardware, *, pp: int, microbatches: int, stages_per_rank: int, ranks_per_node: int | None
) -> float:
    """The time a pipeline's ranks wait, on top of ``compute``, in a step (never less for more ``compute``)."""
    # an interleaved schedule (several stages per rank) divides the bubble by the stages each rank holds
    bubble = compute * (pp - 1) / (microbatches * stages_per_rank) if pp > 1 else 0.0
    per_node = ranks_per_node or hw.devices_per_node
    if bubble and hw.cores_per_node and per_node > hw.cores_per_node:
        # ranks share the cores (``compute`` is at the shared rate): a rank idle in the bubble leaves its
        # share to the busy ones, so the step is the longer of the shared work and the critical path at
        # the rate of a rank with the cores to itself
        share = hw.cores_per_node / per_node
        bubble = max(0.0, (compute + bubble) * share - compute)
    return bubble


def axis_time(hw: Hardware, by_kind: dict[str, float], calls: int, *, size: int, crosses_nodes: bool) -> float:
    """Time one mesh axis's collectives take: payload bytes by collective kind (a ring's share of
    each), at the link its group crosses, plus one latency per call."""
    link = hw.link_bps(crosses_nodes)
    return sum(payload * ring_factor(kind, size) / link for kind, payload in by_kind.items()) + calls * hw.latency_s


def step_floor(
    hw: Hardware,
    *,
    flops: float,
    recompute: float = 1.0,
    dtype: str,
    pp: int = 1,
    microbatches: int = 1,
    stages_per_rank: int = 1,
    ranks_per_node: int | None = None,
    memory_bytes: float = 0.0,
    exposed_s: float = 0.0,
) -> float:
    """What :func:`predict`'s step time cannot go under, known before the step is simulated: the matrix
    multiplies, plus ``memory_bytes`` that the step's memory-bound ops move at least, the pipeline's
    bubble over both, and ``exposed_s`` of communication the step waits for at least (what else the
    step does only adds)."""
    matmul = flops * recompute / (hw.peak(dtype) * hw.matmul_efficiency)
    compute = matmul + (memory_bytes / (hw.memory_bps * hw.memory_efficiency) if hw.memory_bps else 0.0)
    bubble = pipeline_bubble(
        compute, hw, pp=pp, microbatches=microbatches, stages_per_rank=stages_per_rank, ranks_per_node=ranks_per_node
    )
    return compute + bubble + exposed_s


def predict(
    step: dict,
    axes: dict[str, dict],
    hw: Hardware,
    *,
    flops: float,
    recompute: float = 1.0,
    dtype: str,
    n_layers: int,
    pp: int = 1,
    microbatches: int = 1,
    stages_per_rank: int = 1,
    ranks_per_node: int | None = None,
) -> Prediction:
    """``step``: a simulated step (:func:`mmm.plan.fake.fake_step`); ``axes``: each axis's group
    ``size`` and whether it ``crosses_nodes``; ``flops``: the rank's model FLOPs of the step;
    ``recompute``: the factor activation checkpointing adds to them (MFU counts the model's FLOPs only);
    ``n_layers``: the blocks this rank holds; ``ranks_per_node``: the job's (default: the hardware's)."""
    peak = hw.peak(dtype)
    matmul = flops * recompute / (peak * hw.matmul_efficiency)
    memory = step.get("memory_bytes", 0) / (hw.memory_bps * hw.memory_efficiency) if hw.memory_bps else 0.0
    compute = matmul + memory
    bubble = pipeline_bubble(
        compute, hw, pp=pp, microbatches=microbatches, stages_per_rank=stages_per_rank, ranks_per_node=ranks_per_node
    )
    by_axis: dict[str, dict[str, float]] = {}
    for (axis, kind), payload in step["comm_by_kind"].items():
        by_axis.setdefault(axis, {})[kind] = payload
    comm: dict[str, float] = {}
    for axis in dict.fromkeys([*by_axis, *step["comm_calls"]]):
        group = axes.get(axis, {})
        comm[axis] = axis_time(
            hw,
            by_axis.get(axis, {}),
            step["comm_calls"].get(axis, 0),
            size=group.get("size", 1),
            crosses_nodes=group.get("crosses_nodes", False),
        )
    # the data-parallel groups (dp_shard, dp_replicate, the flattened dp, dp_shard_cp...) and the experts'
    # efsdp carry FSDP's traffic (the experts are FSDP units of their own, prefetched as the blocks are):
    # together they hide behind the one compute, all but one block's share; each axis is charged its part
    # of what shows
    fsdp = [axis for axis in comm if axis.startswith("dp") or axis == "efsdp"]
    exposed = {axis: t for axis, t in comm.items() if axis not in fsdp}
    dp_total = sum(comm[axis] for axis in fsdp)
    if dp_total:
        shown = max(dp_total - compute, dp_total / max(n_layers, 1))
        if hw.cores_per_node and (ranks_per_node or hw.devices_per_node) > hw.cores_per_node:
            shown = dp_total  # ranks share the cores: no core is free to move data while they compute
        exposed.update({axis: comm[axis] / dp_total * shown for axis in fsdp})
    exposed = {axis: exposed[axis] for axis in comm}  # in comm's order
    step_s = compute + bubble + sum(exposed.values())
    peak_bytes = int(step["peak"]["total"])
    return Prediction(
        hardware=hw.name,
        step_s=step_s,
        compute_s=compute,
        matmul_s=matmul,
        memory_s=memory,
        bubble_s=bubble,
        comm_s=comm,
        exposed_s=exposed,
        crosses_nodes={a: bool(axes.get(a, {}).get("crosses_nodes", False)) for a in comm},
        mfu=flops / (step_s * peak),
        peak_bytes=peak_bytes,
        memory_bytes=hw.memory_bytes,
        fits=peak_bytes <= (1 - MEMORY_MARGIN) * hw.memory_bytes,
    )
