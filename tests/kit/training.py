"""Shared training loop of the cases: train the model under test beside its baseline and record
dual metrics per step (loss, global grad norm, element-wise grads, params after the step)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.kit.case import CaseContext
from tests.kit.reference import full
from tests.kit.tolerances import Tolerance


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


def train_against(
    ctx: CaseContext,
    model: nn.Module,
    reference: Any,
    batches: Sequence[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    tol: Tolerance,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    params: bool = True,
) -> None:
    """One optimizer step per batch on both; record loss, grad norm, grads and params per step."""
    make_optimizer = make_optimizer or (lambda ps: torch.optim.Adam(ps, lr=1e-2))
    opt, ref_opt = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    for step, batch in enumerate(batches):
        ref_loss = loss_fn(reference, batch)
        ref_loss.backward()
        loss = loss_fn(model, batch)
        loss.backward()
        ctx.step("loss", loss, ref_loss)
        ctx.close(f"step {step} loss", loss, ref_loss, tol.loss)
        ctx.close(f"step {step} grad norm", grad_norm(model), grad_norm(reference), tol.grad)
        record_grads(ctx, f"step {step}", model, reference, tol.grad)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if params:
            record_params(ctx, f"step {step}", model, reference, tol.grad)
