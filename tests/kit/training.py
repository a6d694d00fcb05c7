"""Shared training loops of the cases: train the model under test beside its baseline and record
dual metrics per step (loss, global grad norm, element-wise grads, params after the step), plainly
or over accumulated micro-batches; plus the small helpers every case needs (its mesh, nested
sharding, rank-data preconditions, the expected shard layout)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from tests.kit.api import HSDPModule, fully_shard
from tests.kit.case import CaseContext
from tests.kit.recorder import CollectiveRecorder, record_collectives
from tests.kit.reference import SameDtypeReference, full
from tests.kit.tolerances import Tolerance


def square_mean(model: Any, x: Any) -> torch.Tensor:
    """The cases' default loss: mean of the squared (fp32) output."""
    return model(x).float().square().mean()


def case_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> DeviceMesh:
    """A DeviceMesh of ``shape`` over the case's ranks, on the device type of its process group."""
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def shard_nested(model: nn.Module, children: Iterable[nn.Module], **kwargs: Any) -> HSDPModule:
    """``fully_shard`` each child (bottom-up), then the root with the same arguments; the root's
    group holds whatever params the children do not."""
    for child in children:
        fully_shard(child, **kwargs)
    return fully_shard(model, **kwargs)


def differs_across_ranks(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """True if some rank of ``group`` holds a different ``tensor`` (collective: all ranks call)."""
    local = full(tensor).detach().contiguous()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return any(not torch.equal(gathered[0], other) for other in gathered[1:])


def named_params(model: Any) -> dict[str, nn.Parameter]:
    """Params by name; DDP's ``module.`` prefix removed so names match the model under test."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return dict(inner.named_parameters())


def grad_norm(model: Any) -> torch.Tensor:
    """Global L2 norm of all grads, computed on full tensors (float64)."""
    total = torch.zeros((), dtype=torch.float64)
    for param in named_params(model).values():
        if param.grad is not None:
            total += full(param.grad).double().square().sum()
    return total.sqrt()


def record_grads(
    ctx: CaseContext, label: str, model: Any, reference: Any, tol: float, names: Iterable[str] | None = None
) -> None:
    """Element-wise grad checks, one per param (or the ``names`` given)."""
    ours, ref = named_params(model), named_params(reference)
    for name in names if names is not None else ref:
        if ours[name].grad is None or ref[name].grad is None:
            ctx.true(
                f"{label} grad {name} present",
                ours[name].grad is not None and ref[name].grad is not None,
                ours[name].grad is not None,
                ref[name].grad is not None,
            )
            continue
        ctx.close(f"{label} grad {name}", ours[name].grad, ref[name].grad, tol)


def record_params(ctx: CaseContext, label: str, model: Any, reference: Any, tol: float) -> None:
    ours, ref = named_params(model), named_params(reference)
    for name, param in ref.items():
        ctx.close(f"{label} param {name}", ours[name], param, tol)


Optimizers = tuple[torch.optim.Optimizer, torch.optim.Optimizer]


def _adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def _backward_reference(reference: Any, loss: torch.Tensor, sync: bool = True) -> None:
    """Backward of the baseline; DDP skips its all-reduce (``no_sync``) and a
    ``SameDtypeReference`` keeps its grads unreduced unless ``sync``."""
    accumulating = not sync and isinstance(reference, DistributedDataParallel)
    with reference.no_sync() if accumulating else contextlib.nullcontext():
        loss.backward()
    if isinstance(reference, SameDtypeReference):
        reference.reduce_grads(sync=sync)


def _check_grads_and_step(
    ctx: CaseContext, prefix: str, model: Any, reference: Any, opts: Optimizers, tol: Tolerance, params: bool
) -> None:
    """Grad norm and element-wise grads against the reference, one optimizer step on both, params."""
    ctx.close(f"{prefix} grad norm", grad_norm(model), grad_norm(reference), tol.grad)
    record_grads(ctx, prefix, model, reference, tol.grad)
    for opt in opts:
        opt.step()
        opt.zero_grad()
    if params:
        record_params(ctx, prefix, model, reference, tol.grad)


def train_against(
    ctx: CaseContext,
    model: nn.Module,
    reference: Any,
    batches: Sequence[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    tol: Tolerance,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    params: bool = True,
    label: str = "",
    recorders: list[CollectiveRecorder] | None = None,
    after_backward: Callable[[int], None] | None = None,
) -> Optimizers:
    """One optimizer step per batch on both; record loss, grad norm, grads and params per step.

    ``label`` prefixes the check names (several trainings in one case). A ``SameDtypeReference``
    has its grads reduced after its backward. With ``recorders``, the collectives of the model's
    forward + backward of each step are recorded and appended to it (the reference's are not).
    ``after_backward(step)`` runs after both backwards, before the optimizer step (to inspect
    the grads). Returns both optimizers, to continue training or to checkpoint them.
    """
    make_optimizer = make_optimizer or _adam
    opts = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    prefix = f"{label} " if label else ""
    for step, batch in enumerate(batches):
        ref_loss = loss_fn(reference, batch)
        _backward_reference(reference, ref_loss)
        with record_collectives() as recorder:
            loss = loss_fn(model, batch)
            loss.backward()
        if recorders is not None:
            recorders.append(recorder)
        if after_backward is not None:
            after_backward(step)
        ctx.step(f"{prefix}loss", loss, ref_loss)
        ctx.close(f"{prefix}step {step} loss", loss, ref_loss, tol.loss)
        _check_grads_and_step(ctx, f"{prefix}step {step}", model, reference, opts, tol, params)
    return opts


def train_accumulating_against(
    ctx: CaseContext,
    model: nn.Module,
    reference: Any,
    step_batches: Sequence[Sequence[Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    tol: Tolerance,
    accumulate: Callable[[bool], None],
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    label: str = "",
    after_micro: Callable[[int, int, CollectiveRecorder], None] | None = None,
) -> Optimizers:
    """One optimizer step per list of micro-batches, grads accumulated over them.

    Every micro-batch but the last runs after ``accumulate(True)`` (the model's way of holding
    back its reduction), the last after ``accumulate(False)``; the reference accumulates with
    DDP's ``no_sync`` (or unreduced ``SameDtypeReference`` grads). Records each micro-batch's
    loss, then the accumulated grad norm and grads, and the params after the step.
    ``after_micro(step, micro, recorder)`` runs right after each micro-batch's backward, with the
    collectives of the model's forward + backward.
    """
    make_optimizer = make_optimizer or _adam
    opts = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    prefix = f"{label} " if label else ""
    for step, micro_batches in enumerate(step_batches):
        for micro, batch in enumerate(micro_batches):
            last = micro == len(micro_batches) - 1
            ref_loss = loss_fn(reference, batch)
            _backward_reference(reference, ref_loss, sync=last)
            accumulate(not last)
            with record_collectives() as recorder:
                loss = loss_fn(model, batch)
                loss.backward()
            ctx.step(f"{prefix}loss", loss, ref_loss)
            ctx.close(f"{prefix}step {step} micro {micro} loss", loss, ref_loss, tol.loss)
            if after_micro is not None:
                after_micro(step, micro, recorder)
        _check_grads_and_step(ctx, f"{prefix}step {step}", model, reference, opts, tol, params=True)
    return opts


# -- expected layouts (torch.chunk / DTensor Shard semantics) ---------------------------------
def shard_shape(shape: torch.Size | tuple[int, ...], world: int, rank: int, dim: int = 0) -> tuple[int, ...]:
    """The local shape ``rank`` holds of a tensor sharded on ``dim`` over ``world`` ranks: chunks
    of ``ceil(n / world)`` rows, the last ones shorter or empty."""
    rows = shape[dim]
    chunk = -(-rows // world)
    held = max(0, min(rows, (rank + 1) * chunk) - rank * chunk)
    return tuple(held if d == dim else size for d, size in enumerate(shape))


def padded_shard_numel(module: nn.Module, world: int) -> int:
    """What each rank contributes to a fused all-gather of ``module``'s (full, dim-0 sharded)
    params: every shard padded to ``ceil(rows / world)`` rows."""
    return sum(math.prod(shard_shape(p.shape, world, 0)) for p in module.parameters())
