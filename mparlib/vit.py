"""A small Vision Transformer for Fashion-MNIST: the model of the chapters on sharding and model parallelism.

A 28x28 image is cut into 7x7 = 49 patches of 4x4 pixels; each patch becomes a token of width ``dim``; a stack of
identical transformer blocks (attention, then an MLP, each with a residual connection) mixes the tokens; the mean
token is classified. Transformer blocks are the unit that FSDP shards and that tensor and pipeline parallelism
split, and their sizes are easy to reason about: a block holds ``4 dim^2 + 2 dim hidden`` weights (plus biases and
norms). Explained in 09_sharding.
"""
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F

from .checks import one_of, positive_int
from .errors import ConfigError
from .lang import tr


@dataclass(frozen=True)
class ViTConfig:
    """The sizes of a :class:`ViT`; ``SIZES`` names the course's two. Explained in 09_sharding."""

    dim: int = 64  # width of every token
    depth: int = 4  # number of transformer blocks
    heads: int = 4  # attention heads (dim must divide by heads)
    hidden: int = 128  # width of the MLP inside a block
    patch: int = 4  # side of a square patch in pixels (28 must divide by it)
    classes: int = 10

    def check(self):
        """Raise a clear error for sizes that cannot build a model."""
        for name in ("dim", "depth", "heads", "hidden", "patch", "classes"):
            positive_int(getattr(self, name), name, getattr(ViTConfig, name), "ViTConfig")
        if self.dim % self.heads:
            raise ConfigError(tr(f"ViTConfig: dim={self.dim} does not divide into heads={self.heads}; each head takes "
                                 "dim / heads features.",
                                 f"ViTConfig: dim={self.dim} は heads={self.heads} で割り切れません。各ヘッドは "
                                 "dim / heads 個の特徴を受け持ちます。"))
        if 28 % self.patch:
            raise ConfigError(tr(f"ViTConfig: patch={self.patch} does not tile a 28x28 image; use 2, 4, 7 or 14.",
                                 f"ViTConfig: patch={self.patch} では 28x28 の画像を敷き詰められません。2、4、7、14 の"
                                 "どれかを使ってください。"))
        return self


SIZES = {
    "smoke": ViTConfig(dim=64, depth=4, heads=4, hidden=128),  # about 0.14 M parameters: learns in seconds on a CPU
    "small": ViTConfig(dim=256, depth=6, heads=8, hidden=512),  # about 3.2 M parameters
}


class Attention(nn.Module):
    """Multi-head self-attention with separate query, key, value and output projections. Explained in 10_model_parallel.

    ``(B, T, dim) -> (B, T, dim)``. The projections are kept apart (not one fused ``qkv`` matrix) so that tensor
    parallelism can split them by heads: ``q``, ``k``, ``v`` by output columns and ``out`` by input rows. A rank
    that holds ``heads / n`` of the heads sets ``heads`` to that number. ``attend`` is the function that mixes the
    heads' tokens, ``F.scaled_dot_product_attention`` unless replaced: context parallelism sets it to ring attention.
    """

    attend = staticmethod(F.scaled_dot_product_attention)  # (B, heads, T, d) x 3 -> (B, heads, T, d)

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        # (B, T, dim) -> (B, heads, T, dim / heads)
        split = lambda t: t.view(B, T, self.heads, -1).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        y = self.attend(q, k, v)  # (B, heads, T, dim / heads)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))  # heads side by side again: (B, T, dim)


class MLP(nn.Module):
    """The block's feed-forward part: ``Linear(dim, hidden)``, GELU, ``Linear(hidden, dim)``. Explained in 10_model_parallel."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``. Explained in 09_sharding."""

    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim, hidden)

    def forward(self, x):  # (B, T, dim) -> (B, T, dim)
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patches -> tokens -> ``depth`` blocks -> mean token -> class scores. Explained in 09_sharding.

    ``ViT(SIZES["smoke"])`` maps images ``(B, 1, 28, 28)`` to logits ``(B, 10)``. ``blocks`` is an ``nn.ModuleList``,
    so ``for block in model.blocks`` reaches the units that FSDP wraps one by one.
    """

    def __init__(self, config=SIZES["smoke"]):
        super().__init__()
        c = self.config = config.check()
        tokens = (28 // c.patch) ** 2
        self.embed = nn.Conv2d(1, c.dim, kernel_size=c.patch, stride=c.patch)  # one token per patch
        self.pos = nn.Parameter(torch.zeros(1, tokens, c.dim))
        self.blocks = nn.ModuleList(Block(c.dim, c.heads, c.hidden) for _ in range(c.depth))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.classes)
        nn.init.normal_(self.pos, std=0.02)

    def tokens(self, x):
        """Images ``(B, 1, 28, 28)`` -> tokens ``(B, T, dim)``: patch embedding plus position. Explained in 11_sequence_context_experts."""
        return self.embed(x).flatten(2).transpose(1, 2) + self.pos

    def forward(self, x):
        x = self.tokens(x)  # (B, 1, 28, 28) -> (B, 49, dim) with 4x4 patches
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))  # (B, classes)


def vit(size="smoke", **changes):
    """A :class:`ViT` of a named size (``"smoke"`` or ``"small"``), optionally with changed fields. Explained in 09_sharding."""
    return ViT(replace(SIZES[one_of(size, "size", tuple(SIZES), "vit")], **changes))
