"""Data-parallel strategies behind one small interface, :class:`Engine`.

``ddp``, ``fsdp`` and ``hsdp`` are plain torch (DDP, FSDP2, FSDP2 on a 2-D mesh) with a torch
optimizer; ``zero1/2/3`` run through DeepSpeed's engine. A trainer calls
``engine.forward_backward(inputs, targets, loss_fn)`` and ``engine.step()`` (or ``engine(x)`` and
``engine.backward(loss)`` itself) and never needs to know which strategy runs, nor whether a
pipeline schedule runs forward and backward over microbatches (:class:`PipelineEngine`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmm.errors import API, Spelling, UsageError
from mmm.parallel.accumulate import deferred_gradient_sync, scale_gradients_, split_batch
from mmm.parallel.compose import ParallelSpec, dp_problems, flat_dp_problems, parallelize, shards_parameters
from mmm.parallel.grad_clip import clip_with_norm_, grad_norm_, square_share
from mmm.parallel.mesh import Mesh, ParallelDims
from mmm.parallel.pipeline import build_pipeline
from mmm.parallel.tensor import loss_parallel_context
from mmm.parallel.zero import INSTALL_HINT, ZERO_STAGES, deepspeed_available, zero_config
from mmm.parallel.zero import initialize as zero_initialize
from mmm.parallel.zero_memory import zero_state_bytes

TORCH_STRATEGIES = ("ddp", "fsdp", "hsdp")
STRATEGIES = (*TORCH_STRATEGIES, *ZERO_STAGES)


def strategy_problems(
    strategy: str, dims: ParallelDims, *, offload_optimizer: bool = False, spell: Spelling = API
) -> list[str]:
    """How a data-parallel strategy must fit the mesh, each problem naming the values and a fix
    (the torch strategies' rules are :func:`mmm.parallel.compose.dp_problems`')."""
    if strategy not in STRATEGIES:
        return [f"unknown {spell('strategy', strategy)}; choose one of: {', '.join(STRATEGIES)}"]
    if strategy in TORCH_STRATEGIES:
        out = dp_problems(strategy, dims, field="strategy", spell=spell)
        if offload_optimizer:
            out.append(
                f"{spell('offload_optimizer', True)} needs {spell.name('strategy')} zero1, zero2 or zero3 "
                f"(got {strategy})"
            )
        return out
    out = flat_dp_problems(strategy, dims, field="strategy", spell=spell)
    bad = {k: v for k, v in {"tp": dims.tp, "cp": dims.cp, "pp": dims.pp, "ep": dims.ep}.items() if v > 1}
    if bad:
        out.append(
            f"{spell('strategy', strategy)} (DeepSpeed) runs pure data parallel here; got "
            f"{', '.join(spell(k, v) for k, v in bad.items())}: use {spell('strategy', 'fsdp')} to combine "
            "with tp/cp/pp/ep"
        )
    if not deepspeed_available():
        out.append(
            f"{spell('strategy', strategy)} needs DeepSpeed, which is not installed: {INSTALL_HINT}; or use "
            f"{spell('strategy', 'fsdp')}"
        )
    return out


def state_bytes_per_param(strategy: str, dims: ParallelDims) -> tuple[float, float, float]:
    """Bytes per parameter (of this rank's TP shard / pipeline stage) of parameters, gradients and
    AdamW state under a strategy, fp32 (see :func:`theoretical_state_bytes`)."""
    n = dims.dp
    if strategy in ("fsdp", "hsdp"):
        shards = (
            (dims.dp * dims.cp if strategy == "fsdp" else dims.dp_shard) if shards_parameters(dims, strategy) else 1
        )
        return 4 / shards, 4 / shards, 8 / shards
    return {"ddp": (4, 4, 8), "zero1": (4, 4, 12 / n), "zero2": (4, 4 / n, 12 / n), "zero3": (4 / n, 4 / n, 12 / n)}[
        strategy
    ]


def theoretical_state_bytes(strategy: str, *, num_params: int, mesh: Mesh) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer state that a strategy should hold,
    for fp32 training with Adam (the ZeRO paper's accounting; DeepSpeed keeps an fp32 master
    partition, 4 bytes per parameter, beside the two 4-byte moments):

    ddp 4+4+8; fsdp/hsdp (4+4+8)/shards; zero1 4+4+12/N; zero2 4+(4+12)/N; zero3 (4+4+12)/N,
    with TP dividing everything by tp, and PP by pp (stages of equal block counts; the embedding
    and output sit on the end stages, so the figure is approximate under PP).
    """
    p, g, o = state_bytes_per_param(strategy, mesh.dims)
    psi = num_params / (mesh.tp * mesh.pp)  # pipeline stages split the blocks (about evenly)
    return {"param_bytes": p * psi, "grad_bytes": g * psi, "optim_bytes": o * psi, "total_bytes": (p + g + o) * psi}


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (local shards only)."""
    params = list(model.parameters())
    out = {
        "param_bytes": sum(_local_bytes(p) for p in params),
        "grad_bytes": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optim_bytes": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out["optim_bytes"] += _local_bytes(v)
    out["total_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optim_bytes"]
    return out


class Engine:
    """A model ready to train: forward, backward, optimizer step, whatever the strategy.

    ``grad_norm`` is the global gradient L2 norm of the last step (over every shard and pipeline
    stage, as one process would compute it), measured at every step.
    """

    strategy: str
    module: nn.Module
    pipeline = None  # a mmm.parallel.pipeline.Pipeline under PP (PipelineEngine): it runs forward and backward
    grad_norm: torch.Tensor | float | None = None  # a 0-d device tensor until read (float(...))
    loss_parallel: bool = False  # the spec's loss parallel on a mesh with tp: the loss and its backward in it
    microbatches: int = 1  # > 1: gradient accumulation over as many parts of a rank's batch (not under PP)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def loss_context(self):
        """The context the loss and its backward run in: ``loss_parallel()`` when TP shards the logits."""
        return loss_parallel_context(self.loss_parallel)

    def forward_backward(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        mark: Callable[[], None] | None = None,
        poison: bool = False,
        probe_memory: bool = False,
    ) -> torch.Tensor:
        """Forward, loss and backward of this rank's batch; returns the loss. With :attr:`microbatches`
        N > 1, gradient accumulation (:mod:`mmm.parallel.accumulate`): N equal parts of the batch in turn,
        the data-parallel reductions that can wait deferred to the last, the gradients and the returned loss
        the mean over the parts. ``mark()`` is called before each part's forward, after its loss and after
        its backward (the step's dtf/dtb: their sums); ``poison`` makes the loss NaN (fault injection);
        ``probe_memory`` tracks the gradient bytes held during the (last part's) backward
        (:meth:`state_bytes`)."""
        n = self.microbatches
        parts = [(inputs, targets)] if n == 1 else self._split(inputs, targets)
        total = None
        with self.loss_context():
            for i, (x, y) in enumerate(parts):
                last = i == n - 1
                with self._accumulating(last):
                    if mark is not None:
                        mark()
                    loss = loss_fn(self(x), y)
                    if poison:
                        loss = loss * float("nan")
                    if mark is not None:
                        mark()
                    if probe_memory and last:
                        self.arm_memory_probe()
                    self.backward(loss)
                    if mark is not None:
                        mark()
                if n == 1:
                    return loss
                if not last:
                    self._micro_step()
                total = loss.detach() if total is None else total + loss.detach()
        self._average_gradients(n)
        return total / n

    def _split(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        try:
            return split_batch(inputs, targets, self.microbatches)
        except ValueError as e:  # the same on every rank: a setting, not a fault
            raise UsageError(f"gradient accumulation: {e}") from None

    def _accumulating(self, last: bool):
        """The context of one part's backward (``last``: the batch's last part)."""
        return deferred_gradient_sync(self.module, last=last)

    def _micro_step(self) -> None:
        """After each part but the last."""

    def _average_gradients(self, n: int) -> None:
        """After the last of ``n`` > 1 parts: the summed gradients become their mean."""
        scale_gradients_(self.module.parameters(), 1 / n)

    def evaluate_loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The loss of one batch, forward only (call under ``torch.no_grad()`` with the model in eval mode);
        with :attr:`microbatches` > 1 the mean over as many parts (a part's logits at a time), where they
        divide the batch."""
        with self.loss_context():
            if self.microbatches == 1 or inputs.shape[0] % self.microbatches:
                return loss_fn(self(inputs), targets)
            losses = [loss_fn(self(x), y) for x, y in self._split(inputs, targets)]
            return sum(losses) / len(losses)

    def arm_memory_probe(self) -> None:
        """Track the most gradient bytes held during the next backward (engines that free gradients
        during backward; others hold them all at its end, where :meth:`state_bytes` counts them)."""

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self, grad_square: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def skip_step(self) -> None:
        """Drop this step's gradients without updating (e.g. after a non-finite loss)."""
        raise NotImplementedError(f"{self.strategy} cannot skip a step")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def unwrapped(self) -> nn.Module:
        """The model with its parameters under their own names (no DDP or DeepSpeed wrapper)."""
        module = self.module
        while hasattr(module, "module") and isinstance(module.module, nn.Module):
            module = module.module
        return module

    def eval(self) -> Engine:
        return self.train(False)

    def state_bytes(self) -> dict[str, int]:
        raise NotImplementedError


class TorchEngine(Engine):
    """A parallelised module (or, under PP, this rank's stages and their :class:`Pipeline`) and its
    torch optimizer. ``step`` measures the global gradient norm, clips to ``max_grad_norm`` when
    it is > 0, and steps."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        strategy: str,
        max_grad_norm: float = 0.0,
        pipeline=None,
    ) -> None:
        self.module, self.optimizer, self.strategy = module, optimizer, strategy
        self.max_grad_norm, self.pipeline = max_grad_norm, pipeline

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def grad_square_share(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (summed over every rank it is the
        square of the norm): :meth:`step` takes the sum back, so the norm rides on the training
        step's one all-reduce instead of reductions of its own."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        pp = dist.get_world_size(self.pipeline.pp_group) if self.pipeline is not None else 1
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        share = square_share(grads, stage_ranks=world // pp)
        return share.to(self.pipeline.device) if self.pipeline is not None else share

    def step(self, grad_square: torch.Tensor | None = None) -> None:
        """Clip (when ``max_grad_norm`` > 0) and step; ``grad_square``: the summed
        :meth:`grad_square_share` of every rank (else the norm is reduced here)."""
        pipe = self.pipeline
        if grad_square is None:
            self.grad_norm = grad_norm_(
                self.module.parameters(),
                self.max_grad_norm,
                pp_group=pipe.pp_group if pipe else None,
                device=pipe.device if pipe else None,
            )
        else:
            self.grad_norm = grad_square.sqrt()
            if self.max_grad_norm > 0:
                clip_with_norm_(self.module.parameters(), self.max_grad_norm, self.grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_bytes(self) -> dict[str, int]:
        return state_bytes(self.module, self.optimizer)


class PipelineEngine(TorchEngine):
    """This rank's pipeline stages and their optimizer: the schedule runs forward and backward over
    the microbatches (in the pipeline's own loss-parallel context), so a step has no dtf/dtb."""

    def __init__(self, pipeline, optimizer: torch.optim.Optimizer, *, strategy: str, max_grad_norm: float = 0.0):
        super().__init__(pipeline.module, optimizer, strategy=strategy, max_grad_norm=max_grad_norm, pipeline=pipeline)
        self.loss_parallel = pipeline.loss_parallel

    def __call__(self, *args, **kwargs):
        raise RuntimeError("under pipeline parallel the schedule runs the model: use engine.forward_backward")

    def forward_backward(self, inputs, targets, loss_fn, *, mark=None, poison=False, probe_memory=False):
        """The schedule's forward and backward over every microbatch (``loss_fn`` is the pipeline's,
        given when it was built); the loss on the last stage's ranks, zero elsewhere. ``mark`` is
        never called: forward and backward interleave."""
        loss = self.pipeline.step(inputs, targets, share_loss=False)
        return loss * float("nan") if poison else loss

    def evaluate_loss(self, inputs, targets, loss_fn):
        return self.pipeline.evaluate(inputs, targets)


class DeepSpeedEngine(Engine):
    def __init__(self, ds_engine, *, strategy: str) -> None:
        self.ds, self.strategy = ds_engine, strategy
        self.module = ds_engine  # forward through the engine: ZeRO-3 gathers parameters in its hooks
        self._dtype = next((p.dtype for p in ds_engine.module.parameters()), torch.float32)
        self._probe_hooks: list = []
        self._grad_peak = 0

    def __call__(self, *args, **kwargs):
        # DeepSpeed bf16 keeps the module in bf16 and does not cast inputs
        args = tuple(a.to(self._dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        return self.ds(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)
        for h in self._probe_hooks:
            h.remove()
        self._probe_hooks = []

    def arm_memory_probe(self) -> None:
        """Track the most gradient bytes held during the next backward (``grad_peak_bytes``).

        DeepSpeed reduces gradients when a bucket fills (ZeRO-2/3, 5e8 elements by default) or when
        backward ends (ZeRO-1), then keeps only this rank's partition: after backward the state is
        partitioned, while during backward up to every full gradient is held."""
        params = [p for p in self.ds.module.parameters() if p.requires_grad]

        def on_grad(_):
            held = sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None)
            self._grad_peak = max(self._grad_peak, held)

        self._grad_peak = 0
        self._probe_hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in params]

    def _accumulating(self, last: bool):
        return contextlib.nullcontext()  # DeepSpeed reduces at its accumulation boundary (its config's)

    def _micro_step(self) -> None:
        self.ds.step()  # before the boundary: counts the part, updates nothing (DeepSpeed's accumulation)

    def _average_gradients(self, n: int) -> None:
        pass  # DeepSpeed's backward divides each part's loss by its gradient_accumulation_steps

    def grad_square_share(self) -> None:
        return None  # DeepSpeed measures (and clips) the norm itself

    def step(self, grad_square: torch.Tensor | None = None) -> None:
        self.ds.step()  # also zeroes gradients (and clips, when the config says so)
        norm = self.ds.get_global_grad_norm()
        self.grad_norm = norm  # a float or a device tensor, read when the step is recorded

    @property
    def param_groups(self):
        return self.ds.optimizer.param_groups

    def state_bytes(self) -> dict[str, int]:
        held = zero_state_bytes(self.ds)
        if self._grad_peak:  # the most held during the probed backward (see arm_memory_probe)
            held["grad_peak_bytes"] = max(self._grad_peak, held["grad_bytes"])
        return held


def build_engine(
    model: nn.Module,
    mesh: Mesh,
    spec: ParallelSpec,
    *,
    strategy: str,
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    device: torch.device,
    max_grad_norm: float = 0.0,
    global_batch: int | None = None,
    offload_optimizer: bool = False,
    optimizer_args: dict[str, Any] | None = None,
    pipeline_args: dict[str, Any] | None = None,
    microbatches: int | None = None,
    seed: int | None = None,
) -> Engine:
    """Parallelise ``model`` with ``spec`` (:func:`mmm.parallel.compose.parallelize`; under PP each
    stage, via :func:`mmm.parallel.pipeline.build_pipeline` with ``pipeline_args``) and pair it with its
    optimizer. ``strategy`` ddp/fsdp/hsdp is the spec's data-parallel mode; zero1/2/3 hand the
    (checkpointed, compiled) model to DeepSpeed, which also owns mixed precision and clipping.
    A model built on ``meta`` is materialised after sharding from ``seed`` (see :func:`parallelize`);
    DeepSpeed gets it whole (ZeRO partitions after it is built). ``microbatches``: under PP the
    pipeline's (default pp); otherwise gradient accumulation over as many parts of each rank's batch
    (default 1: none; :mod:`mmm.parallel.accumulate`), DeepSpeed's own under ZeRO."""
    pipeline_args = dict(pipeline_args or {})
    if "microbatches" in pipeline_args:  # where it was given before build_engine took it for accumulation too
        given = pipeline_args.pop("microbatches")
        if microbatches is not None and given != microbatches:
            raise UsageError(
                f"microbatches={microbatches} and pipeline_args microbatches={given}: give it once, as microbatches="
            )
        microbatches = given
    accumulate = 1 if mesh.pp_enabled or microbatches is None else microbatches
    if strategy in ZERO_STAGES:
        bare = spec.replace(dp="none", dtype="fp32", reshard_after_forward=None)  # DeepSpeed owns dp and dtype
        model = parallelize(model, mesh, bare, device=device, seed=seed)
        args = optimizer_args or {}
        cfg = zero_config(
            stage=ZERO_STAGES[strategy],
            global_batch=global_batch,
            dp=mesh.dp,
            dtype=spec.dtype,
            offload_optimizer=offload_optimizer,
            gradient_clipping=max_grad_norm,
            gradient_accumulation=accumulate,
            **args,
        )
        optimizer = None if offload_optimizer else make_optimizer(model.parameters())
        engine = DeepSpeedEngine(
            zero_initialize(model, optimizer, config=cfg, device_type=device.type), strategy=strategy
        )
        engine.loss_parallel = spec.loss_parallel and mesh.tp_enabled
        engine.microbatches = accumulate
        return engine
    spec = spec.replace(dp=strategy)
    if mesh.pp_enabled:
        pipe = build_pipeline(model, mesh, spec, device=device, seed=seed, microbatches=microbatches, **pipeline_args)
        return PipelineEngine(
            pipe, make_optimizer(pipe.module.parameters()), strategy=strategy, max_grad_norm=max_grad_norm
        )
    model = parallelize(model, mesh, spec, device=device, seed=seed)
    engine = TorchEngine(model, make_optimizer(model.parameters()), strategy=strategy, max_grad_norm=max_grad_norm)
    engine.loss_parallel = spec.loss_parallel and mesh.tp_enabled
    engine.microbatches = accumulate
    return engine
