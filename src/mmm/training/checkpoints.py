"""A trainer's checkpoints: where they go, which step a run starts from, when one is due, and the
last good one a stop can name (:class:`CheckpointPolicy`); the full model gathered into one file."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import torch

from mmm import dist, env
from mmm.errors import RunError
from mmm.files import write_atomic
from mmm.log import get_logger
from mmm.parallel.checkpoint import Checkpointer
from mmm.parallel.checkpoint_folder import disk_full, latest_step, no_space, step_dir
from mmm.training.startup import Startup, restart_attempt


def make_checkpointer(
    engine, *, directory: str | None, keep_last: int = 0, meta: dict[str, Any], log=None, async_save: bool = False
):
    """A :class:`mmm.parallel.checkpoint.Checkpointer` saving under ``directory`` (``--checkpoint-dir``;
    None without one), keeping the ``keep_last`` newest (0: all), writing in the background with
    ``async_save`` (``--checkpoint-async``; torch strategies only)."""
    if not directory:
        return None

    if hasattr(engine, "ds"):
        return Checkpointer(directory, deepspeed_engine=engine.ds, meta=meta, keep_last=keep_last, log=log)
    return Checkpointer(
        directory,
        model=engine.module,
        optimizer=engine.optimizer,
        meta=meta,
        keep_last=keep_last,
        log=log,
        async_save=async_save,
    )


def resume(
    checkpointer, which: str | None, startup: Startup | None = None, check=None
) -> tuple[int, dict[str, Any] | None]:
    """The first step to run: 1, or one past the checkpoint ``which`` names ('latest' or a step
    number, ``--resume``; loading it is a startup phase of its own, ``resume``), and that checkpoint's
    metadata (None: none loaded). ``check(metadata)`` may refuse the checkpoint before it is read. A job
    relaunched by ``launch --retries`` (``MMM_RESTART`` >= 1) resumes from the latest checkpoint, whatever
    ``which`` said."""
    lineage = None
    if checkpointer is not None and restart_attempt():
        # the newest checkpoint this job saved; before its first save, where it started (a rollback to
        # an earlier step must not continue the abandoned branch that is still on disk)
        lineage = env.get("MMM_RUN_ID") or env.get("MMM_RUN_STAMP")
        which = which or "latest"
        if dist.info().is_main:
            get_logger().info(
                "restart %d (launch --retries): resuming from this run's newest checkpoint in %s (else %s)",
                restart_attempt(),
                checkpointer.root,
                which,
            )
    if checkpointer is None or not which:
        return 1, None
    saved = checkpointer.load(which, lineage=lineage, check=check)
    if saved is None:
        return 1, None
    if startup is not None:
        startup.mark("resume")
    return int(saved["step"]) + 1, saved


class CheckpointPolicy:
    """When a run saves (every ``checkpoint_every`` steps, the last step, a stop: ``RunConfig``'s
    checkpoint settings) and what: the step, its loss and ``extra_at(step)`` in the checkpoint's
    metadata. With no ``--checkpoint-dir`` (``checkpointer`` None) nothing is ever due."""

    def __init__(
        self,
        checkpointer: Checkpointer | None,
        *,
        every: int = 0,
        extra_at=None,
        resumed: dict | None = None,
        continues: bool = False,
    ) -> None:
        self.checkpointer, self.every = checkpointer, every
        self.extra_at: Callable[[int], dict[str, Any]] | None = extra_at
        self.resumed = resumed
        """The metadata of the checkpoint the run resumed from (``mmm.json``: its step, its loss...), or None."""
        self.continues = continues
        """The resumed checkpoint is where the run's line left off (``--resume latest``, a relaunch, or the
        newest checkpoint by number), not a rollback to an earlier step."""

    def periodic(self, step: int) -> bool:
        """A save every ``every`` steps falls on ``step`` (its values are then read at once)."""
        return self.checkpointer is not None and bool(self.every) and step % self.every == 0

    def due(self, step: int, *, last: bool, stopping: bool) -> bool:
        """Whether to save after ``step``: every ``every`` steps, the last step, a stop."""
        return self.checkpointer is not None and (last or stopping or self.periodic(step))

    def save(self, step: int, loss: float | None, *, final: bool = False) -> None:
        """Save ``step``; ``final`` (the last step, a stop): complete on disk when this returns, also when
        saves are written in the background (``--checkpoint-async``)."""
        extra = self.extra_at(step) if self.extra_at is not None else {}
        self.checkpointer.save(step, {"loss": loss, **extra})
        if final:
            self.checkpointer.wait()

    def finish(self) -> None:
        """Wait for a save still being written in the background, and commit it (a collective)."""
        if self.checkpointer is not None:
            self.checkpointer.close()

    def last_good(self) -> str:
        """Where a stopped run can go back to, in words (a collective when a save is being written in the
        background: it is waited for, it is the newest good one)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()
            last = latest_step(self.checkpointer.root)
            if last is not None:
                return f"the last good checkpoint is {step_dir(self.checkpointer.root, last)} (--resume {last})"
        return "no checkpoint was saved"


def save_full_model(engine, path) -> None:
    """Gather the full (unsharded) weights and save them on rank 0 (every rank calls it)."""
    if engine.strategy.startswith("zero"):
        state = (
            engine.ds._zero3_consolidated_16bit_state_dict()
            if engine.strategy == "zero3"
            else engine.ds.module.state_dict()
        )
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def write() -> None:  # rank 0; its failure (a full disk) raised on every rank at once
        try:  # an earlier model.pt is replaced only by a whole one
            write_atomic(path, lambda f: torch.save({k: v.detach().cpu() for k, v in state.items()}, f))
        except BaseException as e:
            if no_space(e) or disk_full(path.parent):
                free = shutil.disk_usage(path.parent).free / 2**20
                raise RunError(
                    f"saving the model to {str(path)!r}: no space left ({free:.1f} MiB free); an earlier model there "
                    "is intact: free space and rerun"
                ) from None
            raise

    dist.on_rank0(write)  # a collective: every rank calls save_full_model, rank 0 writes


def open_checkpoints(
    engine, options, *, meta: dict[str, Any], startup: Startup | None = None, extra_at=None, log=None, check=None
):
    """A run's :class:`CheckpointPolicy` from its ``RunConfig`` (``--checkpoint-dir``, ``--keep-last``,
    ``--checkpoint-every``, ``--checkpoint-async``), and the first step to run (after ``--resume``, or a relaunch).
    ``check(metadata)``: run on the checkpoint to resume before it is read (it raises to refuse it)."""
    checkpointer = make_checkpointer(
        engine,
        directory=options.checkpoint_dir,
        keep_last=options.keep_last,
        meta=meta,
        log=log,
        async_save=options.checkpoint_async,
    )
    start, saved = resume(checkpointer, options.resume, startup, check)
    continues = saved is not None and (
        options.resume == "latest" or bool(restart_attempt()) or saved["step"] == latest_step(checkpointer.root)
    )
    policy = CheckpointPolicy(
        checkpointer, every=options.checkpoint_every, extra_at=extra_at, resumed=saved, continues=continues
    )
    return policy, start
