"""Expected layouts of sharded params (torch.chunk / ``Shard(d)`` semantics) and what a rank
actually holds, read through the implementation surface."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from tests.kit.judging.surface import impl


def shard_shape(shape: torch.Size | tuple[int, ...], world: int, rank: int, dim: int = 0) -> tuple[int, ...]:
    """The local shape ``rank`` holds of a tensor sharded on ``dim`` over ``world`` ranks: chunks
    of ``ceil(n / world)`` rows, the last ones shorter or empty."""
    rows = shape[dim]
    chunk = -(-rows // world)
    held = max(0, min(rows, (rank + 1) * chunk) - rank * chunk)
    return tuple(held if d == dim else size for d, size in enumerate(shape))


def padded_shard_numel(module: nn.Module | Iterable[torch.Tensor], world: int) -> int:
    """What each rank contributes to a fused all-gather of ``module``'s (or these) full, dim-0
    sharded params: every shard padded to ``ceil(rows / world)`` rows."""
    params = module.parameters() if isinstance(module, nn.Module) else module
    return sum(math.prod(shard_shape(p.shape, world, 0)) for p in params)


def numels(model: nn.Module, world: int, rank: int) -> tuple[dict[str, int], dict[str, int]]:
    """Full numel, and the numel of this rank's dim-0 shard, of every param of an unsharded model."""
    full_numel = {name: p.numel() for name, p in model.named_parameters()}
    shard_numel = {name: math.prod(shard_shape(p.shape, world, rank)) for name, p in model.named_parameters()}
    return full_numel, shard_numel


def local_numel(param: torch.Tensor) -> int:
    """Elements this rank actually holds of a registered param: its shard for a sharded tensor,
    else the elements its storage holds (a freed unsharded param holds none)."""
    if impl.is_sharded(param):
        return impl.local(param).numel()
    return min(param.numel(), param.untyped_storage().nbytes() // param.element_size())


def local_numels(model: nn.Module) -> dict[str, int]:
    """``local_numel`` of every registered param of ``model``, by name."""
    return {name: local_numel(p) for name, p in model.named_parameters()}


def local_numels_after_forward(model: nn.Module) -> list[dict[str, int]]:
    """Per forward of ``model``, the local numel of each param once the forward has finished
    (register after fully_shard: the hook then runs after the module's own post-forward reshard)."""
    seen: list[dict[str, int]] = []
    model.register_forward_hook(lambda module, args, out: seen.append(local_numels(module)))
    return seen
