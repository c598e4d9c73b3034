"""A small convolutional classifier for handwritten digits (8x8 bundled digits or 28x28 MNIST).

The shape of PyTorch's MNIST example: two 3x3 convolutions, max-pool, two linear layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DigitsCNN(nn.Module):
    def __init__(
        self, img_size: int = 8, num_classes: int = 10, width: int = 32, hidden: int = 128, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(dropout),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(2 * width * (img_size // 2) ** 2, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def init_weights(self) -> None:
        """PyTorch's default initialisation of every convolution and linear layer."""
        for mod in self.modules():
            if isinstance(mod, (nn.Conv2d, nn.Linear)):
                mod.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def log_softmax_nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(F.log_softmax(logits.float(), dim=1), target)
