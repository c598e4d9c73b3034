"""Context parallel for Llama: ring or all-to-all attention through its ``attn_fn`` hooks, and the
rotary table cut to this rank's load-balanced positions (:mod:`mmm.parallel.context`)."""

from __future__ import annotations

from mmm.models.llama.model import Llama
from mmm.parallel.context import context_parallel, local_positions


def apply_cp_llama(model: Llama, cp_mesh, *, seq_len: int, kind: str = "ring") -> Llama:
    """Context-parallel a :class:`~mmm.models.llama.Llama` (in place): ring or all-to-all (``kind``
    ulysses) attention through its ``attn_fn`` hooks, rotary table re-indexed to this rank's
    load-balanced positions. Shard its inputs and labels with :func:`mmm.parallel.context.shard_sequence`."""
    positions = local_positions(seq_len, cp_mesh.get_local_rank(), cp_mesh.size()).to(model.rope.device)
    model.rope = model.rope[positions]
    context_parallel(model, cp_mesh, kind=kind)
    return model
