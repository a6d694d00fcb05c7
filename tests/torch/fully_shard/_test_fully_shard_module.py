"""Plan cases of ``_test_fully_shard_module.py``: the HSDPModule controls (L0 part)."""

from __future__ import annotations

from tests.kit.case import CaseContext, case
from tests.kit.models import MLP, rank_batches
from tests.kit.recorder import CollectiveRecorder
from tests.kit.reference import ddp_of
from tests.kit.training import (
    case_mesh,
    differs_across_ranks,
    padded_shard_numel,
    shard_nested,
    square_mean,
    train_accumulating_against,
    train_against,
)

DIMS = (7, 13, 5, 3)
MICRO_BATCHES = 2


def _micro_batches(rank: int, steps: int = 2) -> list[list]:
    """Per optimizer step, ``MICRO_BATCHES`` batches that differ per rank, step and micro-batch."""
    return [rank_batches(rank, (4, DIMS[0]), MICRO_BATCHES, first=10 * step) for step in range(steps)]


@case(
    "L0-08",
    "test_set_requires_gradient_sync",
    "_test_fully_shard_module.py",
    world_size=2,
    mesh_shape=(2,),
    config="FSDP 1D fp32",
)
def requires_gradient_sync(ctx: CaseContext) -> None:
    """set_requires_gradient_sync(False) issues no reduction and accumulates locally; the next
    syncing backward reduce-scatters every group, and the result equals DDP with no_sync."""
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=case_mesh((ctx.world_size,)))
    groups = len(model.layers)  # the root holds no params of its own
    step_batches = _micro_batches(ctx.rank)
    # equal rank data would hide a sync that reduced only the last micro-batch
    ctx.require("ranks' micro-batches differ", differs_across_ranks(step_batches[0][0]))

    def communication(step: int, micro: int, rec: CollectiveRecorder) -> None:
        syncing = micro == MICRO_BATCHES - 1
        where = f"step {step} micro {micro} sync {'on' if syncing else 'off'}"
        if syncing:
            ctx.equal(f"{where}: reduce-scatters", len(rec.of("reduce_scatter")), groups)
        else:
            ctx.equal(f"{where}: reductions", len(rec.of("reduce_scatter")) + len(rec.of("all_reduce")), 0)

    train_accumulating_against(
        ctx,
        model,
        ddp,
        step_batches,
        square_mean,
        ctx.tol,
        accumulate=lambda holding: model.set_requires_gradient_sync(not holding),
        after_micro=communication,
    )


def _prefetch_lists_order_gathers(ctx: CaseContext, mesh) -> None:
    model = MLP(DIMS)
    ddp = ddp_of(model)
    layers = len(model.layers)
    layer_of_size = {padded_shard_numel(layer, ctx.world_size): i for i, layer in enumerate(model.layers)}
    ctx.require("layers differ in all-gather size (gathers can be told apart)", len(layer_of_size) == layers)
    first, middle, last = shard_nested(model, model.layers, mesh=mesh).layers
    # natural orders: forward 0, 1, 2 and backward 2, 1, 0; the lists ask for 0, 2, 1 and 2, 0, 1
    first.set_modules_to_forward_prefetch([last, middle])
    last.set_modules_to_backward_prefetch([first, middle])
    recorders: list[CollectiveRecorder] = []

    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, label="prefetch", recorders=recorders)
    for step, rec in enumerate(recorders):
        order = [layer_of_size.get(c.numel) for c in rec.of("all_gather")]
        ctx.equal(f"prefetch step {step} forward all-gather order", str(order[:layers]), str([0, 2, 1]))
        ctx.equal(f"prefetch step {step} backward all-gather order", str(order[layers:]), str([2, 0, 1]))


def _not_last_backward_defers_reductions(ctx: CaseContext, mesh) -> None:
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=mesh)
    groups = len(model.layers)  # the root holds no params of its own

    def deferred(step: int, micro: int, rec: CollectiveRecorder) -> None:
        if micro == MICRO_BATCHES - 1:
            return
        where = f"deferred step {step} micro {micro}"
        ctx.equal(f"{where}: reduce-scatters issued", len(rec.of("reduce_scatter")), groups)
        ctx.equal(f"{where}: grads landed", sum(p.grad is not None for p in model.parameters()), 0)

    train_accumulating_against(
        ctx,
        model,
        ddp,
        _micro_batches(ctx.rank),
        square_mean,
        ctx.tol,
        accumulate=lambda holding: model.set_is_last_backward(not holding),
        label="deferred",
        after_micro=deferred,
    )


@case(
    "L0-09",
    "test_prefetch_and_last_backward",
    "_test_fully_shard_module.py",
    world_size=2,
    mesh_shape=(2,),
    config="FSDP 1D fp32",
)
def prefetch_and_last_backward(ctx: CaseContext) -> None:
    """Forward/backward prefetch lists decide the order of all-gathers; set_is_last_backward(False)
    issues the reductions but defers applying them; both train like DDP."""
    mesh = case_mesh((ctx.world_size,))
    _prefetch_lists_order_gathers(ctx, mesh)
    _not_last_backward_defers_reductions(ctx, mesh)
