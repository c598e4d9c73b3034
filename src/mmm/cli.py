"""Flags shared by mmm's programs, with the spellings already in circulation as aliases."""

from __future__ import annotations

import argparse

from mmm.errors import ArgumentParser

__all__ = ["ArgumentParser", "add_mesh_args", "positive_int"]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def degree(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"{value} is not a degree: use a positive integer, or -1 to infer it")
    return value


def add_mesh_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--tp/--tpsize``, ``--pp/--ppsize``, ``--cp/--cpsize``, ``--dp-replicate``, ``--dp-shard``."""
    g = parser.add_argument_group("device mesh (pp x dp_replicate x dp_shard x cp x tp = world size)")
    g.add_argument("--tp", "--tpsize", dest="tp", type=degree, default=1, metavar="N",
                   help="tensor-parallel degree (innermost axis, keep within a node) [1]")
    g.add_argument("--pp", "--ppsize", dest="pp", type=degree, default=1, metavar="N",
                   help="pipeline-parallel degree (outermost axis) [1]")
    g.add_argument("--cp", "--cpsize", dest="cp", type=degree, default=1, metavar="N",
                   help="context-parallel degree (sequence split across ranks) [1]")
    g.add_argument("--dp-replicate", "--dp_replicate", dest="dp_replicate", type=degree, default=1, metavar="N",
                   help="data-parallel replicas (HSDP outer axis) [1]")
    g.add_argument("--dp-shard", "--dp_shard", dest="dp_shard", type=degree, default=-1, metavar="N",
                   help="data-parallel shards (FSDP axis); -1 infers it from the world size [-1]")
    return g
