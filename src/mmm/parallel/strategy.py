"""Data-parallel strategies behind one small interface, :class:`Engine`.

``ddp``, ``fsdp`` and ``hsdp`` are plain torch (DDP, FSDP2, FSDP2 on a 2-D mesh) with a torch
optimizer; ``zero1/2/3`` run through DeepSpeed's engine. A trainer calls
``engine(x)``, ``engine.backward(loss)``, ``engine.step()`` and never needs to know which.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mmm.parallel.activation_checkpoint import wrap_block
from mmm.parallel.fsdp import DTYPES, apply_ddp, apply_fsdp
from mmm.parallel.mesh import Mesh, ParallelDims
from mmm.parallel.zero import ZERO_STAGES, deepspeed_available, zero_config
from mmm.parallel.zero import initialize as zero_initialize

TORCH_STRATEGIES = ("ddp", "fsdp", "hsdp")
STRATEGIES = (*TORCH_STRATEGIES, *ZERO_STAGES)


def strategy_problems(strategy: str, dims: ParallelDims, *, offload_optimizer: bool = False) -> list[str]:
    """How a data-parallel strategy must fit the mesh, each problem naming the values and a fix."""
    if strategy not in STRATEGIES:
        return [f"unknown --strategy {strategy!r}; choose one of: {', '.join(STRATEGIES)}"]
    out = []
    if strategy == "hsdp" and dims.cp > 1:
        out.append(f"--strategy hsdp with cp={dims.cp} is not supported yet; use --strategy fsdp with --cp")
    if strategy == "hsdp" and not (dims.dp_replicate > 1 and dims.dp_shard > 1):
        out.append(f"--strategy hsdp needs dp_replicate > 1 and dp_shard > 1 (got dp_replicate={dims.dp_replicate}, "
                   f"dp_shard={dims.dp_shard}); set --dp-replicate, or use --strategy fsdp")
    if strategy in ("fsdp", *ZERO_STAGES) and dims.dp_replicate > 1:
        out.append(f"--strategy {strategy} shards over all data-parallel ranks; --dp-replicate {dims.dp_replicate} "
                   "needs --strategy hsdp")
    others = {"tp": dims.tp, "cp": dims.cp, "pp": dims.pp}
    bad = {k: v for k, v in others.items() if v > 1}
    if strategy == "ddp" and bad:
        out.append(f"--strategy ddp does not compose with tp/cp/pp (got {', '.join(f'{k}={v}' for k, v in bad.items())})"
                   ": DDP cannot hold sharded (DTensor) parameters; use --strategy fsdp")
    if strategy in ZERO_STAGES and bad:
        out.append(f"--strategy {strategy} (DeepSpeed) runs pure data parallel here; got "
                   f"{', '.join(f'--{k} {v}' for k, v in bad.items())}: use --strategy fsdp to combine with "
                   "tp/cp/pp")
    if offload_optimizer and strategy not in ZERO_STAGES:
        out.append(f"--offload-optimizer needs --strategy zero1, zero2 or zero3 (got {strategy})")
    if strategy in ZERO_STAGES and not deepspeed_available():
        out.append(f"--strategy {strategy} needs DeepSpeed, which is not installed: pip install 'mmm[deepspeed]' "
                   "(or pip install deepspeed); or use --strategy fsdp")
    return out


def compile_problems(compile: bool, dims: ParallelDims) -> list[str]:
    if compile and dims.tp > 1:
        import torch

        return [f"--compile with --tp {dims.tp} is not supported with torch {torch.__version__}: the compiled "
                "blocks' DTensor backward fails (AttributeError in DTensor redistribute); drop --compile, or "
                "compile with tp=1 (FSDP/DDP/ZeRO)"]
    return []


def uses_fsdp(mesh: Mesh, strategy: str) -> bool:
    """FSDP2 wraps the model (and so handles mixed precision) with fsdp/hsdp when dp or cp > 1
    (CP ranks hold the same parameters and average gradients like data-parallel ones)."""
    return strategy in ("fsdp", "hsdp") and (mesh.dp_enabled or mesh.cp_enabled)


def state_bytes_per_param(strategy: str, dims) -> tuple[float, float, float]:
    """Bytes per parameter (of this rank's TP shard / pipeline stage) of parameters, gradients and
    AdamW state under a strategy, fp32 (see :func:`theoretical_state_bytes`)."""
    n = dims.dp
    if strategy in ("fsdp", "hsdp"):
        shards = (dims.dp * dims.cp if strategy == "fsdp" else dims.dp_shard) if uses_fsdp(dims, strategy) else 1
        return 4 / shards, 4 / shards, 8 / shards
    return {"ddp": (4, 4, 8), "zero1": (4, 4, 12 / n), "zero2": (4, 4 / n, 12 / n),
            "zero3": (4 / n, 4 / n, 12 / n)}[strategy]


def theoretical_state_bytes(strategy: str, *, num_params: int, mesh: Mesh) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer state that a strategy should hold,
    for fp32 training with Adam (the ZeRO paper's accounting; DeepSpeed keeps an fp32 master
    partition, 4 bytes per parameter, beside the two 4-byte moments):

    ddp 4+4+8; fsdp/hsdp (4+4+8)/shards; zero1 4+4+12/N; zero2 4+(4+12)/N; zero3 (4+4+12)/N,
    with TP dividing everything by tp, and PP by pp (stages of equal block counts; the embedding
    and output sit on the end stages, so the figure is approximate under PP).
    """
    p, g, o = state_bytes_per_param(strategy, mesh)
    psi = num_params / (mesh.tp * mesh.pp)  # pipeline stages split the blocks (about evenly)
    return {"param_bytes": p * psi, "grad_bytes": g * psi, "optim_bytes": o * psi, "total_bytes": (p + g + o) * psi}


def data_parallel_mesh(mesh: Mesh, strategy: str):
    """The mesh FSDP shards over: 1-D ``dp`` (``dp_cp`` with context parallel) for fsdp/ddp, 2-D
    (dp_replicate, dp_shard) for hsdp."""
    if strategy == "hsdp":
        return mesh.root["dp_replicate", "dp_shard"]
    return mesh.get("dp_cp") if mesh.cp_enabled else mesh.get("dp")


class Engine:
    """A model ready to train: forward, backward, optimizer step, whatever the strategy."""

    strategy: str
    module: nn.Module
    grad_norm: float | None = None  # the global gradient norm of the last step, when clipping is on

    def __call__(self, *args, **kwargs):
        with self.autocast():
            return self.module(*args, **kwargs)

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def skip_step(self) -> None:
        """Drop this step's gradients without updating (a non-finite loss with --on-nonfinite skip)."""
        raise NotImplementedError(f"{self.strategy} cannot skip a step")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def state_bytes(self) -> dict[str, int]:
        raise NotImplementedError


class TorchEngine(Engine):
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, strategy: str,
                 autocast_dtype: torch.dtype | None = None, device_type: str = "cpu", max_grad_norm: float = 0.0,
                 pp_group=None) -> None:
        self.module, self.optimizer, self.strategy = module, optimizer, strategy
        self._autocast_dtype, self._device_type = autocast_dtype, device_type
        self.max_grad_norm, self.pp_group = max_grad_norm, pp_group

    def autocast(self):
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=self._autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        if self.max_grad_norm > 0:
            from mmm.parallel.grad_clip import clip_grad_norm_

            self.grad_norm = clip_grad_norm_(self.module.parameters(), self.max_grad_norm, pp_group=self.pp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_bytes(self) -> dict[str, int]:
        from mmm.training import state_bytes

        return state_bytes(self.module, self.optimizer)


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

    def step(self) -> None:
        self.ds.step()  # also zeroes gradients (and clips, when the config says so)
        if self.ds.gradient_clipping() > 0:
            norm = self.ds.get_global_grad_norm()
            self.grad_norm = float(norm) if norm is not None else None

    @property
    def param_groups(self):
        return self.ds.optimizer.param_groups

    def state_bytes(self) -> dict[str, int]:
        from mmm.parallel.zero_memory import zero_state_bytes

        held = zero_state_bytes(self.ds)
        if self._grad_peak:  # the most held during the probed backward (see arm_memory_probe)
            held["grad_peak_bytes"] = max(self._grad_peak, held["grad_bytes"])
        return held


def build_engine(model: nn.Module, mesh: Mesh, *, strategy: str, make_optimizer: Callable[[Any], torch.optim.Optimizer],
                 device: torch.device, dtype: str = "fp32", blocks_attr: str | None = None,
                 tp_plan: Callable[[nn.Module, Any], nn.Module] | None = None, ac: str = "none",
                 compile: bool = False, global_batch: int | None = None, offload_optimizer: bool = False,
                 optimizer_args: dict[str, Any] | None = None, reshard_after_forward: bool | None = None,
                 max_grad_norm: float = 0.0) -> Engine:
    """Apply parallelism in torchtitan's order (TP -> activation checkpointing -> compile -> data
    parallel) and pair the model with its optimizer.

    ``blocks_attr`` names the ``ModuleDict``/``ModuleList`` of repeated blocks (FSDP units,
    checkpoint and compile units); ``tp_plan(model, tp_mesh)`` shards it over ``mesh["tp"]``.
    ``reshard_after_forward`` (FSDP): None frees block parameters after forward and keeps the
    root's; True/False applies to every unit.
    """
    if tp_plan is not None and mesh.tp_enabled:
        tp_plan(model, mesh["tp"])
    blocks = getattr(model, blocks_attr) if blocks_attr else None
    if blocks is not None:
        items = blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks)
        for key, block in list(items):
            block = wrap_block(block, ac)
            blocks[key] = torch.compile(block) if compile else block
    if strategy in ZERO_STAGES:
        args = optimizer_args or {}
        cfg = zero_config(stage=ZERO_STAGES[strategy], global_batch=global_batch, dp=mesh.dp, dtype=dtype,
                          offload_optimizer=offload_optimizer, gradient_clipping=max_grad_norm, **args)
        optimizer = None if offload_optimizer else make_optimizer(model.parameters())
        return DeepSpeedEngine(zero_initialize(model, optimizer, config=cfg, device_type=device.type),
                               strategy=strategy)
    dp_mesh = data_parallel_mesh(mesh, strategy)
    autocast_dtype = None
    if uses_fsdp(mesh, strategy):
        units = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks or [])
        apply_fsdp(model, dp_mesh, blocks=units, param_dtype=DTYPES[dtype], reshard_after_forward=reshard_after_forward)
    else:
        if strategy == "ddp" and dp_mesh is not None:
            model = apply_ddp(model, dp_mesh, device=device)
        autocast_dtype = DTYPES[dtype] if dtype != "fp32" else None
    return TorchEngine(model, make_optimizer(model.parameters()), strategy=strategy, autocast_dtype=autocast_dtype,
                       device_type=device.type, max_grad_norm=max_grad_norm)
