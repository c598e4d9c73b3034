"""Token data for the language-model trainers, deterministic per (seed, step, sample).

Each step's GLOBAL batch is defined by the seed and the step alone; a data-parallel rank
takes its contiguous slice of it. So the same seed and global batch give the same
training data on any mesh (the basis of mmm's loss-equality checks), DP ranks see
disjoint samples, and TP/CP/PP peers (same dp rank) see identical ones.

Datasets:
- ``synthetic``: learnable sequences ``x[t+1] = (5 * x[t] + c) mod V`` with a per-sequence
  offset ``c`` in 1..8 to infer from context; the loss falls quickly towards 0.
- ``pydoc``: real English text, byte-level (vocab 256): the Python reference topics that
  ship with CPython itself (``pydoc_data.topics``, ~466 KB), so no download is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

DATASETS = ("synthetic", "pydoc")
BYTE_VOCAB = 256
_STEP_STRIDE = 1_000_003  # steps per seed before generator seeds repeat


def _step_generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * _STEP_STRIDE + step) % 2**63)
    return g


@dataclass
class SyntheticTokens:
    vocab_size: int
    seq_len: int
    name: str = "synthetic"

    def global_batch(self, seed: int, step: int, batch: int, rows: slice = slice(None)) -> torch.Tensor:
        """Step ``step``'s global batch of ``batch`` sequences, or only its ``rows`` (the same values:
        the per-row draws are made for the whole batch, the sequences built for the rows asked)."""
        g = _step_generator(seed, step)
        x0 = torch.randint(0, self.vocab_size, (batch, 1), generator=g)[rows]
        c = torch.randint(1, 9, (batch, 1), generator=g)[rows]
        seq = [x0]
        for _ in range(self.seq_len):
            seq.append((5 * seq[-1] + c) % self.vocab_size)
        return torch.cat(seq, dim=1)


class ByteCorpus:
    """Random windows of a byte string (vocab 256)."""

    vocab_size = BYTE_VOCAB

    def __init__(self, data: bytes, seq_len: int, name: str) -> None:
        if len(data) < seq_len + 2:
            raise ValueError(f"corpus {name!r} has {len(data)} bytes, fewer than --seq-len {seq_len} + 2")
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq_len = seq_len
        self.name = name

    def global_batch(self, seed: int, step: int, batch: int, rows: slice = slice(None)) -> torch.Tensor:
        g = _step_generator(seed, step)
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (batch,), generator=g)[rows]
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        return self.data[idx].long()


def pydoc_text() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def make_dataset(name: str, *, vocab_size: int, seq_len: int):
    if name == "synthetic":
        return SyntheticTokens(vocab_size, seq_len)
    if name == "pydoc":
        return ByteCorpus(pydoc_text(), seq_len, "pydoc")
    raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")


def dataset_problems(name: str, *, vocab_size: int) -> list[str]:
    if name in ("pydoc",) and vocab_size < BYTE_VOCAB:
        return [f"--dataset {name} is byte-level and needs --vocab-size >= {BYTE_VOCAB} (got {vocab_size})"]
    return []


def local_batches(dataset, *, seed: int, global_batch: int, dp_rank: int, dp_size: int, start_step: int = 0,
                  device: torch.device | str = "cpu") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) for this dp rank, step after step: rows [dp_rank*b, (dp_rank+1)*b) of each global
    batch, built for those rows only."""
    local = global_batch // dp_size
    mine = slice(dp_rank * local, (dp_rank + 1) * local)
    step = start_step
    while True:
        rows = dataset.global_batch(seed, step, global_batch, rows=mine).to(device, non_blocking=True)
        yield rows[:, :-1], rows[:, 1:]
        step += 1
