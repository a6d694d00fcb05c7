"""A toy fully-sharded engine with types of its own: a ``Mesh`` that is not torch's DeviceMesh, and
shards that are plain tensors (no DTensor) tagged with their layout. The kit can judge it only
through its adapter (``adapter.py``), which is the point: any use of torch's mesh or tensor types
on the implementation's objects would break here.

Each managed param is replaced by its dim-0 chunk on this rank. A module's forward pre-hook
all-gathers its own params through a differentiable gather (backward: reduce-scatter, average)
and hands the full tensors to the forward; the forward hook puts the shards back. 1-D meshes,
evenly divisible dim 0, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class Mesh:
    """Ranks ``0..size-1`` of the world under one name, with a process group of their own."""

    def __init__(self, size: int, name: str = "dp") -> None:
        self.size = size
        self.name = name
        self.group = dist.new_group(list(range(size)))


@dataclass(frozen=True)
class Layout:
    """Where a shard belongs: its full shape, and the mesh it is cut over (dim 0)."""

    full_shape: torch.Size
    mesh: Mesh


class HSDPModule:
    """Mixed into every module given to ``fully_shard``."""


class MixedPrecisionPolicy:
    """Not supported: refused when asked for anything but the default."""

    def __init__(self, param_dtype: Any = None, *args: Any, **kwargs: Any) -> None:
        if param_dtype is not None or args or any(kwargs.values()):
            raise NotImplementedError("mixed precision")


class OffloadPolicy:
    """The default (no offload)."""


class CPUOffloadPolicy(OffloadPolicy):
    """Not supported."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("CPU offload")


def layout_of(tensor: torch.Tensor) -> Layout | None:
    """The layout a shard (or its grad) carries, None for a plain tensor."""
    return getattr(tensor, "_toy_layout", None)


def gather(shard: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The whole tensor of a shard (a collective over its mesh), without autograd."""
    out = torch.empty((layout.mesh.size * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(out, shard.detach().contiguous(), group=layout.mesh.group)
    return out.view(layout.full_shape)


class _Gather(torch.autograd.Function):
    """Forward: all-gather the shard; backward: reduce-scatter (average) the full grad into it."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, layout: Layout) -> torch.Tensor:
        ctx.layout = layout
        return gather(shard, layout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        mesh = ctx.layout.mesh
        out = torch.empty((grad.shape[0] // mesh.size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        # SUM, then the mean: gloo before torch 2.8 has no ReduceOp.AVG
        dist.reduce_scatter_tensor(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=mesh.group)
        return out.div_(mesh.size), None


def _tag_grad(shard: torch.Tensor) -> None:
    """A shard's grad carries the shard's layout, so the adapter can read it whole."""
    if shard.grad is not None:
        shard.grad._toy_layout = shard._toy_layout


def _shard(param: nn.Parameter, mesh: Mesh) -> nn.Parameter:
    rank = dist.get_rank(mesh.group)
    rows = param.shape[0] // mesh.size
    shard = nn.Parameter(param.detach()[rank * rows : (rank + 1) * rows].clone(), requires_grad=param.requires_grad)
    shard._toy_layout = Layout(param.shape, mesh)
    shard.register_post_accumulate_grad_hook(_tag_grad)
    return shard


def _own_params(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Params of module and its descendants not already given to fully_shard."""
    found, stack = [], [module]
    while stack:
        owner = stack.pop()
        found.extend((owner, name, p) for name, p in owner._parameters.items() if p is not None)
        stack.extend(child for child in owner.children() if not isinstance(child, HSDPModule))
    return found


def fully_shard(module: nn.Module, *, mesh: Mesh | None = None, **options: Any) -> nn.Module:
    """Shard ``module``'s own params over a 1-D ``mesh`` (None: the world); other options refused."""
    asked = sorted(name for name, value in options.items() if value is not None)
    if asked:
        raise NotImplementedError(f"fully_shard options {asked}")
    if isinstance(module, (list, tuple)):
        raise NotImplementedError("list input")
    mesh = mesh or Mesh(dist.get_world_size())
    managed = []
    for owner, name, param in _own_params(module):
        if param.shape[0] % mesh.size:
            raise NotImplementedError(f"uneven dim 0 ({tuple(param.shape)} over {mesh.size} ranks)")
        shard = _shard(param, mesh)
        owner._parameters[name] = shard
        managed.append((owner, name, shard))

    def unshard(mod: nn.Module, args: Any) -> None:
        for owner, name, shard in managed:
            owner._parameters[name] = _Gather.apply(shard, shard._toy_layout)

    def reshard(mod: nn.Module, args: Any, output: Any) -> None:
        for owner, name, shard in managed:
            owner._parameters[name] = shard

    module.register_forward_pre_hook(unshard)
    module.register_forward_hook(reshard)
    module.__class__ = type(f"Toy{type(module).__name__}", (HSDPModule, type(module)), {})
    return module
