"""Plan cases of ``_test_hsdp_param.py``: how fully_shard lays out each parameter (L1-07)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.layout import shard_shape
from tests.kit.judging.recorder import CollectiveRecorder
from tests.kit.judging.reference import GlobalBatchReference
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import Tolerance, specific
from tests.kit.workloads.models import DIMS, MLP, rank_batches
from tests.kit.workloads.training import (
    differs_across_ranks,
    named_params,
    shard_nested,
    square_mean,
    train_against,
)


def _weights_by_columns(names: list[str]) -> dict[str, Any]:
    """Weights Shard(1), the biases None (the default, Shard(0))."""
    return {n: impl.Shard(1) if n.endswith("weight") else None for n in names}


def _first_biases_whole(names: list[str]) -> dict[str, Any]:
    """Weights Shard(1), the first biases Replicate(), the last bias None (the default, Shard(0))."""
    chosen: dict[str, Any] = {n: impl.Shard(1) if n.endswith("weight") else impl.Replicate() for n in names}
    chosen[names[-1]] = None
    return chosen


def _placed(ctx: CaseContext, label: str, choose: Callable[[list[str]], dict[str, Any]]) -> None:
    """Shard an MLP with a placement fn answering ``choose``'s placements: it is asked once per param;
    each param is laid out as asked; loss, grad norm, grads and params stay within 1e-5 of the
    single-device fp32 reference over 2 steps; Replicate() params are all-reduced and stay
    bitwise equal on all ranks."""
    world, rank = ctx.world_size, ctx.rank
    tol = Tolerance(loss=specific("custom placement"), grad=specific("custom placement"))
    model = MLP(DIMS)
    reference = GlobalBatchReference(model)
    params = dict(model.named_parameters())
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    chosen = choose(list(params))
    dim1 = [n for n, placement in chosen.items() if isinstance(placement, impl.Shard)]
    even = bool(dim1) and all(shapes[n][1] % world == 0 for n in dim1)
    ctx.require(f"{label}: dim-1 sharded params, each dim 1 dividing by the ranks", even)
    name_of = {id(param): name for name, param in params.items()}
    asked: list[str] = []

    def placement_fn(param) -> Any:
        asked.append(name_of[id(param)])
        return chosen[name_of[id(param)]]

    batches = rank_batches(rank, (4, DIMS[0]))
    ctx.require("ranks' batches differ (the global batch is not a rank's)", differs_across_ranks(batches[0]))
    shard_nested(model, model.layers, mesh=ctx.mesh, shard_placement_fn=placement_fn)
    ctx.equal(f"{label}: the placement fn is asked about every param", str(sorted(set(asked))), str(sorted(params)))
    with ctx.extra("our engine asks the placement fn once per param"):
        ctx.equal(f"{label}: the placement fn is asked once per param", str(sorted(asked)), str(sorted(params)))

    for name, param in named_params(model).items():
        placement, local = chosen[name], tuple(impl.local(param).shape)
        if isinstance(placement, impl.Replicate):
            ctx.equal(f"{label} {name} Replicate(): placements", str(impl.placements(param)), str((impl.Replicate(),)))
            ctx.equal(f"{label} {name} Replicate(): local shape == full shape", str(local), str(shapes[name]))
            continue
        dim = 0 if placement is None else placement.dim
        what = f"{label} {name} {'None (default Shard(0))' if placement is None else f'Shard({dim})'}"
        ctx.equal(f"{what}: placements", str(impl.placements(param)), str((impl.Shard(dim),)))
        expected = shard_shape(shapes[name], world, rank, dim)
        ctx.equal(f"{what}: local shape (chunks of ceil(n / world_size))", str(local), str(expected))
        if dim == 1:
            ctx.equal(f"{what}: local shape[1] == full_shape[1] // world_size", local[1], shapes[name][1] // world)

    recorders: list[CollectiveRecorder] = []
    train_against(
        ctx, model, reference, batches, square_mean, tol, label=label, recorders=recorders, mean_loss_over_ranks=True
    )
    replicated = [n for n, placement in chosen.items() if isinstance(placement, impl.Replicate)]
    if not replicated:
        return
    for step, rec in enumerate(recorders):
        reduced = len(rec.of("all_reduce"))
        ctx.true(f"{label} step {step} Replicate() grads all-reduced", reduced > 0, reduced, "> 0")
    for name in replicated:
        local = impl.local(named_params(model)[name])
        whole = tuple(local.shape) == shapes[name]  # else its shape check failed already
        same = whole and not differs_across_ranks(local)
        ctx.true(f"{label} {name} Replicate(): bitwise equal on all ranks after training", same)


@case(
    "L1-07",
    "test_custom_shard_placement_fn",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("shard_placement_fn",),
)
def custom_shard_placement_fn(ctx: CaseContext) -> None:
    """shard_placement_fn decides each param's layout: Shard(1) holds full_shape[1] // world_size
    columns (uneven columns are L0-03's), None the default Shard(0), and (a part of its own, for
    implementations without it) Replicate() the whole tensor, grads all-reduced, bitwise equal on
    all ranks. Loss, grad norm, grads and params within 1e-5 of the single-device fp32 reference:
    one unsharded copy run on the global batch (all ranks' batches concatenated) on every rank."""
    _placed(ctx, "Shard(1)", _weights_by_columns)
    ctx.run_part("Replicate()", ("placement_replicate",), lambda: _placed(ctx, "Replicate()", _first_biases_whole))
