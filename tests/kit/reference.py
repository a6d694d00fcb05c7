"""References and comparisons shared by cases and engine tests.

The baseline is always torch's own: DDP over the same ranks (fp32), never FSDP alone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor on every rank, whether ``t`` is a DTensor or a plain tensor."""
    if t is None:
        return None
    return t.full_tensor() if isinstance(t, DTensor) else t


def ddp_of(model: nn.Module, **kwargs) -> DistributedDataParallel:
    """A DDP replica of ``model`` (deep-copied, so sharding ``model`` later does not touch it)."""
    return DistributedDataParallel(copy.deepcopy(model), **kwargs)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != reference shape {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - b.detach().double()).abs().max().item()


def assert_close(what: str, measured: torch.Tensor, reference: torch.Tensor, tol: float) -> float:
    """Element-wise ``|measured - reference| <= tol``; returns the max error."""
    err = max_abs_diff(full(measured), full(reference))
    if not err <= tol:
        raise AssertionError(f"{what}: max abs error {err:.3e} > tol {tol:.0e} (rank {dist.get_rank()})")
    return err


def assert_params_close(
    what: str, model: nn.Module, reference: nn.Module, tol: float, grads: bool = False
) -> float:
    """Every param (or grad) of ``model`` equals the reference's, by name, within ``tol``."""
    ref = dict(_named(reference))
    worst = 0.0
    for name, param in _named(model):
        ours, theirs = (param.grad, ref[name].grad) if grads else (param, ref[name])
        if (ours is None) != (theirs is None):
            raise AssertionError(f"{what} {name}: grad None mismatch (ours {ours is None})")
        if ours is not None:
            worst = max(worst, assert_close(f"{what} {name}", ours, theirs, tol))
    return worst


def _named(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return inner.named_parameters()
