"""Extra L0 cases L0-FSDP2-*, beyond the plan: FSDP2's controls of the gradient reduction -- the all-reduce
hook (HSDP), the gradient divide factor, force-sum reduction and upstream's gradient scaling factor.
Each trains a small MLP against DDP whose grads are scaled as the setting promises.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.checks import refused_with
from tests.kit.judging.layout import padded_shard_numel
from tests.kit.judging.reference import ddp_of, named_params
from tests.kit.judging.surface import impl
from tests.kit.workloads.models import DIMS, MLP
from tests.kit.workloads.training import (
    BackwardRecorder,
    distinct_batches,
    shard_nested,
    sharded_modules,
    square_mean,
    train_against,
)

STEPS = 2


def _scale_grads(model: Any, factor: float) -> None:
    """Multiply every grad of ``model`` (a reference) by ``factor`` in place."""
    for param in named_params(model).values():
        if param.grad is not None:
            param.grad.mul_(factor)


def _require_factor_changes_grads(ctx: CaseContext, reference: Any, factor: float) -> None:
    """Precondition: scaling the reference's grads by ``factor`` moves some grad by more than the tolerance."""
    moved = max(float((p.grad * (factor - 1)).abs().max()) for p in named_params(reference).values())
    ctx.require(f"a factor of {factor:g} changes the grads beyond the tolerance", moved > ctx.tol.grad, f"{moved:.3g}")


def _scaled_reference(ctx: CaseContext, reference: Any, factors: Sequence[float]) -> Callable[[int], None]:
    """An ``after_backward`` that scales the reference's grads of step ``i`` by ``factors[i]`` (what the
    model's setting promises), after checking at the first step that the factor matters."""

    def scale(step: int) -> None:
        if step == 0:
            _require_factor_changes_grads(ctx, reference, factors[0])
        _scale_grads(reference, factors[step])

    return scale


# -- all-reduce hook (HSDP) ----------------------------------------------------------------------
def _scaling_hook(calls: Counter, name: str, sizes: dict[str, list[int]], scale: float) -> Callable:
    """A hook counting its calls and the sizes it saw under ``name``, scaling the reduced grads in place."""

    def hook(output: torch.Tensor) -> None:
        calls[name] += 1
        sizes.setdefault(name, []).append(output.numel())
        output.mul_(scale)

    return hook


@case(
    "L0-FSDP2-all_reduce_hook",
    "test_fsdp2_all_reduce_hook",
    world_size=4,
    mesh={"replicate": 2, "shard": 2},
    config="HSDP 2D fp32",
    needs=("hsdp", "all_reduce_hook"),
)
def all_reduce_hook(ctx: CaseContext) -> None:
    """HSDP 2x2, set_all_reduce_hook on each group scaling its reduced grads by 0.5 in place: called once
    per group per backward, grads and training equal DDP's grads times 0.5."""
    scale = 0.5
    ddp = ddp_of(MLP(DIMS))
    model = MLP(DIMS)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    calls, sizes = Counter(), {}
    names = [f"layers.{i}" for i in range(len(model.layers))]
    for name, layer in zip(names, model.layers, strict=True):
        layer.set_all_reduce_hook(_scaling_hook(calls, name, sizes, scale))
    scale_reference = _scaled_reference(ctx, ddp, [scale] * STEPS)

    def after_backward(step: int) -> None:
        for name in names:
            ctx.equal(f"step {step}: {name} hook calls so far", calls[name], step + 1)
        scale_reference(step)

    train_against(ctx, model, ddp, distinct_batches(ctx), square_mean, ctx.tol, after_backward=after_backward)
    with ctx.extra("FSDP2 hands the hook the group's flat reduced shard (one tensor per group)"):
        for name, layer in zip(names, MLP(DIMS).layers, strict=True):
            expected = padded_shard_numel(layer, ctx.case.mesh["shard"])
            ctx.equal(f"{name}: elements the hook saw", str(sizes.get(name)), str([expected] * STEPS))


# -- gradient divide factor, force-sum reduction, gradient scaling factor ------------------------
def _train_with(
    ctx: CaseContext, label: str, setting: Callable[[nn.Module, int], None], factors: Sequence[float]
) -> None:
    """An MLP sharded (nested), ``setting(module, step)`` applied to every sharded module before each
    step, trained against DDP whose grads of step ``i`` are scaled by ``factors[i]``."""
    model, ddp = MLP(DIMS), ddp_of(MLP(DIMS))
    shard_nested(model, model.layers, mesh=ctx.mesh)

    def before_step(step: int) -> None:
        for module in sharded_modules(model):
            setting(module, step)

    after = _scaled_reference(ctx, ddp, factors) if any(f != 1 for f in factors) else None
    batches = distinct_batches(ctx, steps=len(factors))
    train_against(
        ctx, model, ddp, batches, square_mean, ctx.tol, label=label, before_step=before_step, after_backward=after
    )


def _divide_factor(ctx: CaseContext, factor: float, force_sum: bool | None) -> None:
    """set_gradient_divide_factor(factor) (and force-sum if given): grads = DDP's x world / factor."""

    def setting(module: nn.Module, step: int) -> None:
        if factor:
            module.set_gradient_divide_factor(factor)
        if force_sum is not None:
            module.set_force_sum_reduction_for_comms(force_sum)

    label = f"divide factor {factor:g}" if factor else "no divide factor"
    label += ", force-sum" if force_sum else ""
    _train_with(ctx, label, setting, [ctx.world_size / factor if factor else 1.0] * STEPS)


SCALES: list[Any] = [0.5, torch.tensor(0.25), None]  # a float, a one-element tensor, then off


def _scaling_factor(ctx: CaseContext) -> None:
    """set_gradient_scaling_factor: grads = DDP's x s per step (None: unscaled); a bool, a string or a
    tensor of two elements is a ValueError."""

    def setting(module: nn.Module, step: int) -> None:
        module.set_gradient_scaling_factor(SCALES[step])

    factors = [1.0 if s is None else float(s) for s in SCALES]
    _train_with(ctx, "scaling factor 0.5, tensor(0.25), None", setting, factors)
    model = MLP(DIMS)
    impl.fully_shard(model, mesh=ctx.mesh)
    for bad in (True, "2", torch.ones(2)):
        name = f"set_gradient_scaling_factor({bad!r})"
        refused_with(ctx, name, lambda bad=bad: model.set_gradient_scaling_factor(bad), ValueError)


@case(
    "L0-FSDP2-divide_factor",
    "test_fsdp2_divide_factor",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
)
def divide_factor(ctx: CaseContext) -> None:
    """Gradient factors, each part needing its own feature: set_gradient_divide_factor(8) gives DDP's grads
    x 2/8, force-sum alone DDP's grads, force-sum with the factor DDP's x 2/8, set_gradient_scaling_factor(s)
    DDP's x s (None: off; bad values a ValueError); each trains like its scaled DDP."""
    factor = 8.0
    ctx.run_part(
        "set_gradient_divide_factor(8)", ("gradient_divide_factor",), lambda: _divide_factor(ctx, factor, None)
    )
    ctx.run_part("force-sum reduction", ("force_sum_reduction",), lambda: _divide_factor(ctx, 0.0, True))
    ctx.run_part(
        "force-sum with set_gradient_divide_factor(8)",
        ("force_sum_reduction", "gradient_divide_factor"),
        lambda: _divide_factor(ctx, factor, True),
    )
    ctx.run_part("set_gradient_scaling_factor", ("gradient_scaling_factor",), lambda: _scaling_factor(ctx))


# -- set_reduce_scatter_unused_params, set_separate_reduce_scatter_group -------------------------
class BranchingMLP(MLP):
    """The kit's MLP with a side branch its forward takes on rank 0 only (conditional control flow):
    the branch's params get grads on one rank and none on the other."""

    def __init__(self) -> None:
        super().__init__(DIMS)
        self.branch = nn.Linear(DIMS[-1], DIMS[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.branch(y) if dist.get_rank() == 0 else y


def _unused_params(ctx: CaseContext) -> None:
    """set_reduce_scatter_unused_params(True): the branch rank 1 skips reduces zeros there, so every rank
    issues the same reduce-scatters, and training equals DDP with find_unused_parameters."""
    model = BranchingMLP()
    ddp = ddp_of(model, find_unused_parameters=True)
    shard_nested(model, model.layers, mesh=ctx.mesh)  # the root's own group: the branch
    model.set_reduce_scatter_unused_params(True)
    step = BackwardRecorder(square_mean)
    train_against(ctx, model, ddp, distinct_batches(ctx), square_mean, ctx.tol, label="unused", model_step=step)
    sizes = sorted(c.numel for c in step.steps[0].of("reduce_scatter"))
    every: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(every, sizes)
    ctx.equal("unused: this rank reduce-scatters the sizes rank 0 does", str(sizes), str(every[0]))


def _separate_group(ctx: CaseContext) -> None:
    """set_separate_reduce_scatter_group(): reduce-scatters run on another process group than the
    all-gathers (over the same ranks), and training equals DDP."""
    model, ddp = MLP(DIMS), ddp_of(MLP(DIMS))
    shard_nested(model, model.layers, mesh=ctx.mesh)
    model.set_separate_reduce_scatter_group(True)
    step = BackwardRecorder(square_mean)
    train_against(ctx, model, ddp, distinct_batches(ctx), square_mean, ctx.tol, label="separate", model_step=step)
    gathers = {c.group for c in step.steps[0].of("all_gather")}
    scatters = {c.group for c in step.steps[0].of("reduce_scatter")}
    ctx.require("separate: backward all-gathers and reduce-scatters", bool(gathers) and bool(scatters))
    ctx.true("separate: reduce-scatter groups apart from all-gather groups", not gathers & scatters, str(scatters))
    sizes = {c.group_size for c in step.steps[0].of("reduce_scatter")}
    ctx.equal("separate: reduce-scatter group sizes", str(sizes), str({ctx.world_size}))


@case(
    "L0-FSDP2-reduce_scatter_controls",
    "test_fsdp2_reduce_scatter_controls",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
)
def reduce_scatter_controls(ctx: CaseContext) -> None:
    """set_reduce_scatter_unused_params(True) with a branch one rank skips trains like DDP with
    find_unused_parameters, every rank reduce-scattering the same sizes; set_separate_reduce_scatter_group()
    moves the reduce-scatters to a group of their own and trains like DDP."""
    ctx.run_part("unused params", ("reduce_scatter_unused_params",), lambda: _unused_params(ctx))
    ctx.run_part("separate reduce-scatter group", ("separate_reduce_scatter_group",), lambda: _separate_group(ctx))
