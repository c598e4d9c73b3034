"""Context parallel for Llama: ring or all-to-all attention through its ``attn_fn`` hooks, and the
rotary table cut to this rank's load-balanced positions (:mod:`mmm.parallel.context`)."""

from __future__ import annotations

from mmm.models.llama.model import Llama
from mmm.parallel.context import context_parallel


def apply_cp_llama(model: Llama, cp_mesh, *, seq_len: int, kind: str = "ring") -> Llama:
    """Context-parallel a :class:`~mmm.models.llama.Llama` (in place): ring or all-to-all (``kind``
    ulysses) attention through its ``attn_fn`` hooks, rotary table re-indexed to this rank's
    load-balanced positions. Shard its inputs and labels with :func:`mmm.parallel.context.shard_sequence`."""
    context_parallel(model, cp_mesh, kind=kind, seq_len=seq_len)  # Llama.shard_positions: its rotary rows
    return model
