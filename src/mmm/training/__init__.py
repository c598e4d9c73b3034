"""What every mmm trainer shares, one concern a module:

- :mod:`~mmm.training.startup`: the job set up, the config checked, the output folder, the startup clock;
- :mod:`~mmm.training.step`: one lean training step (the engine's forward and backward, one packed
  all-reduce, the optimizer step) and the held-out evaluation;
- :mod:`~mmm.training.loop`: :func:`fit`, the loop every trainer runs;
- :mod:`~mmm.training.recorder`: :class:`Recorder`, what a run records of its steps;
- :mod:`~mmm.training.checkpoints`: when a run saves and where it starts from;
- :mod:`~mmm.training.summary`: ``summary.json``, the plots and the closing line;
- :mod:`~mmm.training.config`, :mod:`~mmm.training.schedule`, :mod:`~mmm.training.evaluation`: typed flags.

The names below are the ones a trainer of one's own needs most.
"""

from __future__ import annotations

from mmm.training.checkpoints import CheckpointPolicy, open_checkpoints, save_full_model
from mmm.training.loop import fit
from mmm.training.recorder import Recorder, format_step, mean_over
from mmm.training.startup import Startup, batch_problems, start
from mmm.training.step import StepSync, evaluate, train_step
from mmm.training.summary import write_summary

__all__ = [
    "CheckpointPolicy",
    "Recorder",
    "Startup",
    "StepSync",
    "batch_problems",
    "evaluate",
    "fit",
    "format_step",
    "mean_over",
    "open_checkpoints",
    "save_full_model",
    "start",
    "train_step",
    "write_summary",
]
