"""Parallelism over a named DeviceMesh, for any model.

    from mmm.parallel import ParallelSpec, build_pipeline, init_mesh, parallelize

``init_mesh`` builds the one named mesh; ``parallelize`` applies TP -> activation checkpointing ->
compile -> FSDP/HSDP/DDP to a model (:mod:`mmm.parallel.compose`); ``build_pipeline`` splits a model into
stages and puts each through ``parallelize`` (:mod:`mmm.parallel.pipeline`). TP plans are data
(:mod:`mmm.parallel.tensor`: ``apply_tp_plan``, ``hf_tp_plan``); the plans of models live beside them
(``mmm.models.llama.llama_tp_plan``, ``mmm.models.vit.VIT_TP_PLAN``, ``mmm.models.hf.HF_LLAMA_TP_PLAN``).

``from mmm.parallel import init_mesh`` stays light: the names below load their modules on first use.
"""

from __future__ import annotations

import importlib
import warnings

from mmm.parallel.mesh import AXES, FLAT_VIEWS, Mesh, MeshError, ParallelDims, check_degrees, init_mesh

_LAZY = {
    "ParallelSpec": "mmm.parallel.compose",
    "parallelize": "mmm.parallel.compose",
    "compose_problems": "mmm.parallel.compose",
    "find_blocks": "mmm.parallel.compose",
    "build_pipeline": "mmm.parallel.pipeline",
    "Pipeline": "mmm.parallel.pipeline",
    "apply_tp_plan": "mmm.parallel.tensor",
    "hf_tp_plan": "mmm.parallel.tensor",
    "context_parallel": "mmm.parallel.context",
    "shard_sequence": "mmm.parallel.context",
    "meta_init": "mmm.parallel.meta",
    "materialize": "mmm.parallel.meta",
    "describe_sharding": "mmm.parallel.report",
    "clip_grad_norm_": "mmm.parallel.grad_clip",
}

__all__ = ["AXES", "FLAT_VIEWS", "Mesh", "MeshError", "ParallelDims", "check_degrees", "init_mesh", *_LAZY]


# moved beside the models they are for; the old names work for one release, with a warning
_MOVED = {"HF_LLAMA_TP_PLAN": "mmm.models.hf"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _MOVED:
        warnings.warn(
            f"mmm.parallel.{name} moved to {_MOVED[name]}.{name}; the old name goes after mmm 0.2",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'mmm.parallel' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
