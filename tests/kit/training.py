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
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from tests.kit.api import HSDPModule, fully_shard
from tests.kit.case import CaseContext
from tests.kit.recorder import CollectiveRecorder, record_collectives
from tests.kit.reference import SameDtypeReference, full, gather_from, named_params
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
    gathered = gather_from(tensor, group)
    return any(not torch.equal(gathered[0], other) for other in gathered[1:])


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a (scalar) tensor over all ranks, in float64 (collective)."""
    total = full(value).detach().double().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def sharded_modules(model: nn.Module) -> list[HSDPModule]:
    """The modules of ``model`` given to fully_shard, outermost first."""
    return [m for m in model.modules() if isinstance(m, HSDPModule)]


def raises_nothing(ctx: CaseContext, name: str, action: Callable[[], Any]) -> Any:
    """Run ``action`` and record the check ``name``: it raised nothing (else what it raised is the
    measured value, and the result is None)."""
    try:
        result = action()
    except Exception as exc:  # the check reports it; the checks that follow show what it broke
        ctx.true(name, False, repr(exc), "no exception")
        return None
    ctx.true(name, True, "no exception", "no exception")
    return result


def local_numel(param: torch.Tensor) -> int:
    """Elements this rank actually holds of a registered param: its shard for a DTensor, else the
    elements its storage holds (a freed unsharded param holds none)."""
    if isinstance(param, DTensor):
        return param.to_local().numel()
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
    """Element-wise grad checks, one per param (or the ``names`` given). A param without a grad
    must lack it on both sides (a module unused in the step), else the check fails."""
    ours, ref = named_params(model), named_params(reference)
    for name in names if names is not None else ref:
        if ours[name].grad is None or ref[name].grad is None:
            ctx.equal(f"{label} grad {name} present", ours[name].grad is not None, ref[name].grad is not None)
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
    """Grad norm and element-wise grads against the reference, one optimizer step on both, params.
    ``model``: the model, or its params by name."""
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
    before_step: Callable[[int], None] | None = None,
    mean_loss_over_ranks: bool = False,
) -> Optimizers:
    """One optimizer step per batch on both; record loss, grad norm, grads and params per step.

    ``label`` prefixes the check names (several trainings in one case). A ``SameDtypeReference``
    has its grads reduced after its backward. With ``recorders``, the collectives of the model's
    forward + backward of each step are recorded and appended to it (the reference's are not).
    ``before_step(step)`` runs before the model's forward (to change its controls);
    ``after_backward(step)`` runs after both backwards, before the optimizer step (to inspect
    the grads). ``mean_loss_over_ranks`` compares the mean of the model's per-rank losses (what a
    ``GlobalBatchReference`` computes). Returns both optimizers, to continue training or to
    checkpoint them.
    """
    make_optimizer = make_optimizer or _adam
    opts = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    # the params the optimizer steps: the module may hold other (unsharded) ones between steps
    stepped = named_params(model)
    prefix = f"{label} " if label else ""
    for step, batch in enumerate(batches):
        ref_loss = loss_fn(reference, batch)
        _backward_reference(reference, ref_loss)
        if before_step is not None:
            before_step(step)
        with record_collectives() as recorder:
            loss = loss_fn(model, batch)
            loss.backward()
        if recorders is not None:
            recorders.append(recorder)
        if after_backward is not None:
            after_backward(step)
        if mean_loss_over_ranks:
            loss = mean_over_ranks(loss)
        ctx.step(f"{prefix}loss", loss, ref_loss)
        ctx.close(f"{prefix}step {step} loss", loss, ref_loss, tol.loss)
        _check_grads_and_step(ctx, f"{prefix}step {step}", stepped, reference, opts, tol, params)
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
    sync_micro: Callable[[int], bool] | None = None,
) -> Optimizers:
    """One optimizer step per list of micro-batches, grads accumulated over them.

    Every micro-batch but the last runs after ``accumulate(True)`` (the model's way of holding
    back its reduction), the last after ``accumulate(False)``; the reference accumulates with
    DDP's ``no_sync`` (or unreduced ``SameDtypeReference`` grads). ``sync_micro(micro)`` chooses
    other micro-batches that reduce too (reduced grads then accumulate in the sharded grads);
    the last one always does. Records each micro-batch's loss, then the accumulated grad norm and
    grads, and the params after the step. ``after_micro(step, micro, recorder)`` runs right after
    each micro-batch's backward, with the collectives of the model's forward + backward.
    """
    make_optimizer = make_optimizer or _adam
    opts = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    stepped = named_params(model)  # the params the optimizer steps
    prefix = f"{label} " if label else ""
    for step, micro_batches in enumerate(step_batches):
        for micro, batch in enumerate(micro_batches):
            last = micro == len(micro_batches) - 1
            sync = last or (sync_micro is not None and sync_micro(micro))
            ref_loss = loss_fn(reference, batch)
            _backward_reference(reference, ref_loss, sync=sync)
            accumulate(not sync)
            with record_collectives() as recorder:
                loss = loss_fn(model, batch)
                loss.backward()
            ctx.step(f"{prefix}loss", loss, ref_loss)
            ctx.close(f"{prefix}step {step} micro {micro} loss", loss, ref_loss, tol.loss)
            if after_micro is not None:
                after_micro(step, micro, recorder)
        _check_grads_and_step(ctx, f"{prefix}step {step}", stepped, reference, opts, tol, params=True)
    return opts


# -- expected layouts (torch.chunk / DTensor Shard semantics) ---------------------------------
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
