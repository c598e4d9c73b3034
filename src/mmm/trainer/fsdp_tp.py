"""Alias of :mod:`mmm.examples.fsdp_tp` (same flags, same outputs)."""

from mmm.examples.fsdp_tp import EXAMPLE, build_parser, main  # noqa: F401

if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog="python -m mmm.trainer.fsdp_tp")
