"""Token data for the language-model trainers, deterministic per (seed, step, sample).

Each step's GLOBAL batch is defined by the seed and the step alone; a data-parallel rank
takes its contiguous slice of it. So the same seed and global batch give the same
training data on any mesh (the basis of mmm's loss-equality checks), DP ranks see
disjoint samples, and TP/CP/PP peers (same dp rank) see identical ones.

Datasets:
- ``synthetic``: learnable sequences ``x[t+1] = (5 * x[t] + c) mod V`` with a per-sequence
  offset ``c`` in 1..8 to infer from context; the loss falls quickly towards 0.
- ``pydoc``: real English text, byte-level (vocab 256): the Python reference topics that
  ship with CPython itself (``pydoc_data.topics``, ~466 KB), so no download is needed; the last
  tenth is the held-out ``val`` split.
- ``bin``: nanoGPT-style token files ``DIR/train.bin`` / ``DIR/val.bin`` (uint16, or uint32 as
  ``meta.json`` or the file name says), read through a memory map (:mod:`mmm.data.tokens`).
- ``hf``: a Hugging Face dataset saved with ``save_to_disk``: a text column tokenised at load
  (``tokenizer.json`` or bytes), or pre-tokenised ``input_ids`` as they are.

``bin`` and ``hf`` sample random windows of ``seq_len + 1`` tokens, the starts drawn per (seed,
step) for the whole global batch. ``python -m mmm.data prepare`` writes token files from text.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mmm.data.seeds import step_generator, step_seed  # noqa: F401  (step_seed: public here)
from mmm.errors import UsageError, only_with

DATASETS = ("synthetic", "pydoc", "bin", "hf")
ON_DISK = ("bin", "hf")  # datasets read from --data-dir
BYTE_VOCAB = 256


@dataclass
class SyntheticTokens:
    vocab_size: int
    seq_len: int
    name: str = "synthetic"
    split: str = "train"  # "val": sequences from a stream of their own (the same rule: a held-out set)

    def global_batch(self, seed: int, step: int, batch: int, rows: slice = slice(None)) -> torch.Tensor:
        """Step ``step``'s global batch of ``batch`` sequences, or only its ``rows`` (the same values:
        the per-row draws are made for the whole batch, the sequences built for the rows asked)."""
        g = step_generator(seed, step, self.split)
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
        g = step_generator(seed, step)
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (batch,), generator=g)[rows]
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        return self.data[idx].long()


def pydoc_text() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def make_dataset(
    name: str,
    *,
    vocab_size: int,
    seq_len: int,
    data_dir=None,
    split: str = "train",
    text_column: str | None = None,
    tokenizer: str | None = None,
):
    """The dataset ``name``; ``bin`` and ``hf`` read ``data_dir`` (its ``split``: ``train``, or ``val``
    for evaluation). Token ids are checked against ``vocab_size`` once, here (a UsageError names the
    file, the id and the fix)."""
    if name == "synthetic":
        return SyntheticTokens(vocab_size, seq_len, split=split)
    if name == "pydoc":  # the last tenth is held out for evaluation
        text = pydoc_text()
        cut = len(text) * 9 // 10
        return ByteCorpus(
            text[:cut] if split == "train" else text[cut:], seq_len, "pydoc" if split == "train" else "pydoc-val"
        )
    if name == "bin":
        from mmm.data.tokens import bin_tokens

        return bin_tokens(data_dir, seq_len=seq_len, vocab_size=vocab_size, split=split)
    if name == "hf":
        from mmm.data.tokens import hf_tokens

        return hf_tokens(
            data_dir, seq_len=seq_len, vocab_size=vocab_size, split=split, text_column=text_column, tokenizer=tokenizer
        )
    raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")


def data_vocab_size(name: str, *, data_dir=None, tokenizer: str | None = None) -> tuple[int | None, str]:
    """The vocabulary the data declares and where (meta.json, the tokenizer), or (None, "")."""
    if name not in ON_DISK:
        return (BYTE_VOCAB, f"--dataset {name} is byte-level") if name == "pydoc" else (None, "")
    from mmm.data.tokens import data_vocab_size as on_disk

    return on_disk(name, data_dir=data_dir, tokenizer=tokenizer)


def data_tokenizer(name: str, data_dir) -> Path | None:
    """The tokenizer.json that came with a token folder (``--dataset bin``): the one ``prepare`` wrote beside
    the tokens, if meta.json names it (a folder without meta.json: its tokenizer.json, if any); None when
    meta.json says the tokens are another tokenizer's (``bytes``: an earlier prepare's file may be left)."""
    if name != "bin" or not data_dir:
        return None
    from mmm.data.tokens import read_meta

    file = Path(data_dir) / "tokenizer.json"
    named = read_meta(file.parent).get("tokenizer", file.name)
    return file if named == file.name and file.is_file() else None


def dataset_problems(
    name: str, *, vocab_size: int, data_dir=None, text_column: str | None = None, tokenizer: str | None = None
) -> list[str]:
    """Problems with the data flags that need no data read (beyond meta.json or the tokenizer)."""
    out = []
    if name not in ON_DISK:
        if data_dir is not None:
            needs = f"with --dataset bin or hf (got --dataset {name})"
            out.append(only_with(["--data-dir"], needs, "pick one of those"))
        given = [f for f, v in (("--text-column", text_column), ("--tokenizer", tokenizer)) if v is not None]
        if given:
            out.append(only_with(given, f"with --dataset hf (got --dataset {name})", "pick it"))
    elif name == "bin" and (text_column is not None or tokenizer is not None):
        out.append(
            "--text-column and --tokenizer apply to --dataset hf; token files (--dataset bin) are already "
            "tokenised (python -m mmm.data prepare --tokenizer ... makes them)"
        )
    try:
        declared, where = data_vocab_size(name, data_dir=data_dir, tokenizer=tokenizer)
    except UsageError as err:
        return out + [str(err)]
    if declared is not None and vocab_size < declared:
        out.append(
            f"{where} and needs --vocab-size >= {declared} (got {vocab_size})"
            if name == "pydoc"
            else f"--vocab-size {vocab_size} is smaller than the data's vocabulary {declared} ({where}); use "
            f"--vocab-size {declared} or more, or leave it out to take the data's"
        )
    return out


def rank_rows(batch: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """This data-parallel rank's part of a global batch: its rows [rank*b, (rank+1)*b), b = rows / ranks."""
    local = batch.shape[0] // ranks
    return batch[rank * local : (rank + 1) * local]


def local_batches(
    dataset,
    *,
    seed: int,
    global_batch: int,
    dp_rank: int,
    dp_size: int,
    start_step: int = 0,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) for this dp rank, step after step: rows [dp_rank*b, (dp_rank+1)*b) of each global
    batch, built for those rows only."""
    local = global_batch // dp_size
    mine = slice(dp_rank * local, (dp_rank + 1) * local)
    step = start_step
    while True:
        rows = dataset.global_batch(seed, step, global_batch, rows=mine).to(device, non_blocking=True)
        yield rows[:, :-1], rows[:, 1:]
        step += 1
