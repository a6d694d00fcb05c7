"""Shared models and seeded data for cases and engine tests (built identically on every rank).

Sizes are the plan's "simple MLP" scale: small enough for several CPU ranks on 2 cores. ``DIMS``
shard evenly over 2 and 4 ranks (so a case about another feature does not also need padding);
``UNEVEN_DIMS`` have odd sizes and a layer with fewer rows than ranks, for the unevenness cases.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class SelfCastingLinear(nn.Linear):
    """A Linear that casts its input to its own weight's dtype (for ``cast_forward_inputs=False``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


# weights (16, 8), (12, 16), (4, 12): every row and column count divides by 2 and 4; the per-rank
# shard sizes of every param and every layer differ, so a recorded all-gather names its layer
DIMS = (8, 16, 12, 4)
# 13 rows over 2 ranks: 7 + 6; over 4: 4 + 4 + 4 + 1; the last layer has 1 row, fewer than the ranks
UNEVEN_DIMS = (7, 13, 5, 1)


class MLP(nn.Module):
    """Linear+ReLU stack; ``layers`` are the natural units to shard one by one."""

    def __init__(self, dims: tuple[int, ...] = DIMS, seed: int = 1, self_casting: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        linear = SelfCastingLinear if self_casting else nn.Linear
        self.layers = nn.ModuleList(linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class TiedEmbeddingNet(nn.Module):
    """Embedding -> Linear -> output projection tied to the embedding weight."""

    def __init__(self, vocab: int = 11, hidden: int = 6, seed: int = 2) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.embed(tokens))))


class NestedInputs(nn.Module):
    """A root whose forward takes a tensor, a dict of tensors, a keyword tensor and integer token ids,
    and remembers the dtypes it received: what a mixed-precision policy's input casting reaches."""

    def __init__(self, dim: int = 8, vocab: int = 16, seed: int = 7) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.lin = nn.Linear(dim, dim)
        self.received: dict[str, str] = {}

    def forward(self, x: torch.Tensor, extras: dict[str, torch.Tensor], *, scale: torch.Tensor, tokens: torch.Tensor):
        self.received = {
            "x": str(x.dtype),
            "extras['y']": str(extras["y"].dtype),
            "scale (keyword)": str(scale.dtype),
            "tokens": str(tokens.dtype),
        }
        return self.lin(x + extras["y"]) * scale + self.embed(tokens)


class BranchyNet(nn.Module):
    """A trunk and two heads; ``forward(x, head)`` uses one head, leaving the other unused."""

    def __init__(self, dim: int = 6, seed: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(dim, dim)
        self.head_a = nn.Linear(dim, 3)
        self.head_b = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor, head: str = "a") -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.head_a(h) if head == "a" else self.head_b(h)


class ResidualFeedForward(nn.Module):
    """``x + down(relu(up(x)))``: the column-parallel / row-parallel pair of tensor parallelism."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class FeedForwardStack(nn.Module):
    """``depth`` residual feed-forward blocks and a final LayerNorm (tensor parallel + FSDP)."""

    def __init__(self, dim: int = 8, hidden: int = 12, depth: int = 2, seed: int = 5) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(ResidualFeedForward(dim, hidden) for _ in range(depth))
        self.out_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out_norm(x)


class Checkpointed(nn.Module):
    """Runs ``inner`` under torch's activation checkpoint (reentrant or not; with ``context_fn``,
    torch's selective checkpointing of ops) while ``enabled``; a disabled copy is the same model
    without AC, for the reference."""

    def __init__(self, inner: nn.Module, use_reentrant: bool, context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.use_reentrant = use_reentrant
        self.context_fn = context_fn
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return self.inner(x)
        if self.context_fn is not None:
            return checkpoint(self.inner, x, use_reentrant=False, context_fn=self.context_fn)
        return checkpoint(self.inner, x, use_reentrant=self.use_reentrant)


def without_checkpointing(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every ``Checkpointed`` disabled (same params, same names)."""
    copy = deepcopy(model)
    for module in copy.modules():
        if isinstance(module, Checkpointed):
            module.enabled = False
    return copy


def rank_batch(step: int, rank: int, shape: tuple[int, ...], seed: int = 1000) -> torch.Tensor:
    """A batch that differs per rank and per step and is reproducible anywhere."""
    generator = torch.Generator().manual_seed(seed + 7919 * step + rank)
    return torch.randn(shape, generator=generator)


def rank_tokens(step: int, rank: int, shape: tuple[int, ...], vocab: int, seed: int = 2000) -> torch.Tensor:
    """Token ids that differ per rank and per step."""
    generator = torch.Generator().manual_seed(seed + 7919 * step + rank)
    return torch.randint(0, vocab, shape, generator=generator)


def rank_batches(rank: int, shape: tuple[int, ...], steps: int = 2, first: int = 0) -> list[torch.Tensor]:
    """``rank_batch`` for steps ``first .. first + steps - 1``."""
    return [rank_batch(step, rank, shape) for step in range(first, first + steps)]
