"""A Vision Transformer: patch embedding, class token, learned positions, pre-norm blocks with SDPA.

Plain single-device code laid out for parallelism: blocks in a ``ModuleDict``, attention that
infers its local head count from the projection width (so a TP plan can shard heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ViTConfig:
    img_size: int = 32
    """Image side in pixels."""
    patch_size: int = 4
    """Patch side; must divide img_size."""
    in_chans: int = 3
    num_classes: int = 10
    depth: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    head_dim: int = 32
    mlp_ratio: int = 4

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def num_patches(self) -> int:
        return (self.img_size // self.patch_size) ** 2

    def problems(self) -> list[str]:
        out = []
        for name in ("img_size", "patch_size", "depth", "num_heads", "head_dim", "num_classes"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if not out and self.img_size % self.patch_size:
            out.append(f"--patch-size {self.patch_size} does not divide --img-size {self.img_size}")
        return out


class Attention(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t(x).view(b, n, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = Mlp(cfg.dim, cfg.mlp_ratio * cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.in_chans * cfg.patch_size**2, cfg.dim)
        self.cls_token = nn.Parameter(torch.empty(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.empty(1, cfg.num_patches + 1, cfg.dim))
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.depth)})
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        self.init_weights()

    def init_weights(self) -> None:
        """Linear and LayerNorm: PyTorch's defaults; class token zeros; positions N(0, 0.02)."""
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.LayerNorm)):
                mod.reset_parameters()
        nn.init.zeros_(self.cls_token)
        nn.init.normal_(self.pos_embed, std=0.02)

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        p = self.cfg.patch_size
        b, c, h, w = images.shape
        x = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(self.patchify(images))
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x[:, 0]))
