"""The random stream of each step of a run: a function of the run's seed, the step and the split alone,
so the same seed gives the same data on any mesh (a leaf module: every dataset draws from it)."""

from __future__ import annotations

import torch

_STEP_STRIDE = 1_000_003  # steps per seed before generator seeds repeat
_SPLIT_SALT = {"train": 0, "val": 0x9E3779B97F4A7C15}  # a held-out split draws from a stream of its own


def step_seed(seed: int, step: int, split: str = "train") -> int:
    """The generator seed of a run's step (or epoch) ``step`` of ``split``: a function of the run's ``seed``
    and the step alone, within what ``torch.Generator.manual_seed`` takes for any seed the flags accept."""
    return (seed * _STEP_STRIDE + step + _SPLIT_SALT[split]) % 2**63


def step_generator(seed: int, step: int, split: str = "train") -> torch.Generator:
    """A generator seeded with :func:`step_seed`."""
    return torch.Generator().manual_seed(step_seed(seed, step, split))
