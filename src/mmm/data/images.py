"""Image data: handwritten digits (MNIST IDX files, else scikit-learn's bundled 8x8 digits) and
learnable synthetic images. Like the token data, each global batch is a function of the seed and
the step (or epoch), and a data-parallel rank takes its contiguous slice.
"""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from mmm.data.seeds import step_seed
from mmm.errors import UsageError

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


@dataclass
class Split:
    images: torch.Tensor  # (N, 1, H, W) float32, normalised
    labels: torch.Tensor  # (N,) int64


@dataclass
class Digits:
    name: str
    train: Split
    test: Split

    @property
    def img_size(self) -> int:
        return self.train.images.shape[-1]


def _read_idx(path: Path) -> torch.Tensor:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise UsageError(f"{path} is not an unsigned-byte IDX file (header {data[:4].hex()})")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = data[4 + 4 * ndim :]
    if len(body) != torch.Size(shape).numel():
        raise UsageError(f"{path} is truncated: header says {shape}, found {len(body)} bytes")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(shape)


def _find(data_dir: Path, stem: str) -> Path | None:
    for cand in (
        data_dir / stem,
        data_dir / f"{stem}.gz",
        data_dir / "MNIST" / "raw" / stem,
        data_dir / "MNIST" / "raw" / f"{stem}.gz",
    ):
        if cand.is_file():
            return cand
    return None


def _normalise(images: torch.Tensor, scale: float) -> torch.Tensor:
    x = images.float() / scale
    return ((x - x.mean()) / x.std()).unsqueeze(1)


def load_mnist(data_dir: str | Path) -> Digits:
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise UsageError(f"--data-dir {str(data_dir)!r} is not a directory")
    paths = {k: _find(data_dir, v) for k, v in MNIST_FILES.items()}
    missing = [MNIST_FILES[k] for k, p in paths.items() if p is None]
    if missing:
        raise UsageError(
            f"--data-dir {str(data_dir)!r} holds no MNIST: missing {', '.join(missing)} (or .gz); "
            "leave --data-dir out to use the bundled 8x8 digits"
        )
    t = {k: _read_idx(p) for k, p in paths.items()}
    return Digits(
        "mnist",
        Split(_normalise(t["train_images"], 255.0), t["train_labels"].long()),
        Split(_normalise(t["test_images"], 255.0), t["test_labels"].long()),
    )


def load_sklearn_digits(test_fraction: float = 0.2, split_seed: int = 0) -> Digits:
    """scikit-learn's bundled 1,797 8x8 digits (no download), split train/test with a fixed seed."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UsageError(
            "the bundled digits need scikit-learn (pip install scikit-learn), or pass --data-dir with MNIST files"
        ) from None
    d = load_digits()
    images = torch.tensor(d.images, dtype=torch.float32)
    labels = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    n_test = int(len(labels) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    x = _normalise(images, 16.0)
    return Digits("sklearn-digits", Split(x[train], labels[train]), Split(x[test], labels[test]))


def load_digits_data(data_dir: str | Path | None) -> Digits:
    return load_mnist(data_dir) if data_dir is not None else load_sklearn_digits()


def epoch_batches(n: int, *, global_batch: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """Index batches of one epoch: a permutation fixed by (seed, epoch), full global batches only."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(step_seed(seed, epoch)))
    return [perm[i : i + global_batch] for i in range(0, n - global_batch + 1, global_batch)]


def padded_shard(n: int, *, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of ``range(n)`` padded to the same length on every rank (so every rank runs
    the same number of forward passes); the mask marks real samples."""
    per = -(-n // world)
    idx = torch.arange(rank * per, (rank + 1) * per)
    mask = idx < n
    return torch.where(mask, idx, torch.zeros_like(idx)), mask


@dataclass
class SyntheticImages:
    """Learnable images: a fixed random template per class plus noise."""

    img_size: int
    num_classes: int
    channels: int = 3
    noise: float = 1.0
    template_seed: int = 1234

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.template_seed)
        self.templates = torch.randn(self.num_classes, self.channels, self.img_size, self.img_size, generator=g)

    def global_batch(self, seed: int, step: int, batch: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s images and labels; ``split="val"``: a held-out stream (the same classes)."""
        g = torch.Generator().manual_seed(step_seed(seed, step, split))
        labels = torch.randint(0, self.num_classes, (batch,), generator=g)
        noise = torch.randn(batch, self.channels, self.img_size, self.img_size, generator=g)
        return self.templates[labels] + self.noise * noise, labels
