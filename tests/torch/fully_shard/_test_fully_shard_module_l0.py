"""Plan cases of the plan's ``test_fully_shard_module.py``, level L0: gradient sync (L0-08), prefetch and
set_is_last_backward (L0-09)."""

from __future__ import annotations

import torch
from torch import nn

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.layout import (
    padded_shard_numel,
)
from tests.kit.judging.recorder import CollectiveRecorder, record_collectives
from tests.kit.judging.reference import ddp_of
from tests.kit.workloads.models import DIMS, MLP, rank_batches
from tests.kit.workloads.training import (
    differs_across_ranks,
    shard_nested,
    square_mean,
    train_accumulating_against,
    train_against,
)

MICRO_BATCHES = 2


def _micro_batches(rank: int, steps: int = 2) -> list[list]:
    """Per optimizer step, ``MICRO_BATCHES`` batches that differ per rank, step and micro-batch."""
    return [rank_batches(rank, (4, DIMS[0]), MICRO_BATCHES, first=10 * step) for step in range(steps)]


@case(
    "L0-08",
    "test_set_requires_gradient_sync",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("gradient_sync",),
)
def requires_gradient_sync(ctx: CaseContext) -> None:
    """set_requires_gradient_sync(False) issues no reduction and accumulates locally; the next
    syncing backward reduce-scatters every group, and the result equals DDP with no_sync."""
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    step_batches = _micro_batches(ctx.rank)
    # equal rank data would hide a sync that reduced only the last micro-batch
    ctx.require("ranks' micro-batches differ", differs_across_ranks(step_batches[0][0]))

    def communication(step: int, micro: int, rec: CollectiveRecorder) -> None:
        syncing = micro == MICRO_BATCHES - 1
        where = f"step {step} micro {micro} sync {'on' if syncing else 'off'}"
        if syncing:
            issued = len(rec.of("reduce_scatter"))
            ctx.true(f"{where}: reduce-scatters issued", issued > 0, issued, "> 0")
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


def _layer_of_gather(model: MLP, world: int) -> dict[int, int]:
    """All-gather element count -> the layer it gathers, whether an implementation gathers a layer
    in one collective (its params' padded shards back to back) or one per param."""
    owners: dict[int, set[int]] = {}
    for i, layer in enumerate(model.layers):
        per_param = [padded_shard_numel([p], world) for p in layer.parameters()]
        for numel in [padded_shard_numel(layer, world), *per_param]:
            owners.setdefault(numel, set()).add(i)
    # a size two layers share would be ambiguous: -1
    return {numel: min(layers) if len(layers) == 1 else -1 for numel, layers in owners.items()}


def _gathered_layers(rec: CollectiveRecorder, layer_of: dict[int, int]) -> list[int | None]:
    """The layers gathered, in issue order (consecutive gathers of one layer counted once)."""
    order: list[int | None] = []
    for call in rec.of("all_gather"):
        layer = layer_of.get(call.numel)
        if not order or order[-1] != layer:
            order.append(layer)
    return order


def _train_recording_gathers(
    ctx: CaseContext, mesh, label: str, lists: bool
) -> tuple[dict[int, int], list[tuple[CollectiveRecorder, CollectiveRecorder]]]:
    """Train the 3-layer MLP like DDP, each layer its own group resharded after forward, with the
    prefetch lists (forward 0, 2, 1; backward 2, 0, 1) or without; each step's forward and backward
    collectives, and the gather sizes' layers."""
    model = MLP(DIMS)
    ddp = ddp_of(model)
    layer_of = _layer_of_gather(model, ctx.world_size)
    # resharded after forward (explicitly: the default's meaning is no business of this case), so
    # backward gathers every layer again
    first, middle, last = shard_nested(model, model.layers, mesh=mesh, reshard_after_forward=True).layers
    if lists:  # natural orders: forward 0, 1, 2 and backward 2, 1, 0
        first.set_modules_to_forward_prefetch([last, middle])
        last.set_modules_to_backward_prefetch([first, middle])
    phases: list[tuple[CollectiveRecorder, CollectiveRecorder]] = []

    def forward_then_backward(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with record_collectives() as forward:
            loss = square_mean(module, batch)
        with record_collectives() as backward:
            loss.backward()
        phases.append((forward, backward))
        return loss

    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, label=label, model_step=forward_then_backward)
    return layer_of, phases


def _prefetch_lists_order_gathers(ctx: CaseContext, mesh) -> None:
    layer_of, phases = _train_recording_gathers(ctx, mesh, "prefetch", lists=True)
    ctx.require("every layer's gathers have sizes of their own", -1 not in layer_of.values(), str(layer_of))
    for step, (forward, backward) in enumerate(phases):
        where = f"prefetch step {step}"
        ctx.equal(f"{where} forward all-gather order", str(_gathered_layers(forward, layer_of)), "[0, 2, 1]")
        ctx.equal(f"{where} backward all-gather order", str(_gathered_layers(backward, layer_of)), "[2, 0, 1]")


def _default_order_gathers_each_layer_once(ctx: CaseContext, mesh) -> None:
    """Without prefetch lists, backward gathers each layer once, last layer first, and ahead of
    need: an implicit prefetch that picks a finished layer gathers nothing early (or twice)."""
    layer_of, phases = _train_recording_gathers(ctx, mesh, "no lists", lists=False)
    with ctx.extra("beyond the plan's lists: the default backward order gathers no layer twice, ahead of need"):
        for step, (_, backward) in enumerate(phases):
            order = str(_gathered_layers(backward, layer_of))
            ctx.equal(f"no lists step {step} backward all-gather order", order, "[2, 1, 0]")
            events = _backward_events(backward, layer_of, ctx.world_size)
            for layer in (1, 0):
                gathered, reduced = events.index(f"AG{layer}"), events.index(f"RS{layer + 1}")
                ctx.true(
                    f"no lists step {step}: layer {layer} gathered before layer {layer + 1}'s grads are reduced",
                    gathered < reduced,
                    " ".join(events),
                )


def _backward_events(rec: CollectiveRecorder, layer_of: dict[int, int], world: int) -> list[str]:
    """Gathers and reduce-scatters in issue order, as ``AG<layer>`` / ``RS<layer>`` (once per layer)."""
    events: list[str] = []
    for call in rec.calls:
        if call.op == "all_gather":
            event = f"AG{layer_of.get(call.numel)}"
        elif call.op == "reduce_scatter":
            event = f"RS{layer_of.get(call.numel // world)}"
        else:
            continue
        if event not in events:
            events.append(event)
    return events


def _not_last_backward_defers_reductions(ctx: CaseContext, mesh) -> None:
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=mesh)

    def deferred(step: int, micro: int, rec: CollectiveRecorder) -> None:
        if micro == MICRO_BATCHES - 1:
            return
        where = f"deferred step {step} micro {micro}"
        issued = len(rec.of("reduce_scatter"))
        ctx.true(f"{where}: reductions issued (sync is on)", issued > 0, issued, "> 0")
        with ctx.extra("our engine leaves the reductions of a non-last backward in flight"):
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
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("prefetch", "last_backward", "reshard_after_forward"),
)
def prefetch_and_last_backward(ctx: CaseContext) -> None:
    """Forward/backward prefetch lists decide the order of all-gathers (without lists, backward
    gathers each layer once, last first: extra); set_is_last_backward(False) issues the reductions
    but defers applying them; all train like DDP."""
    mesh = ctx.mesh
    _prefetch_lists_order_gathers(ctx, mesh)
    _default_order_gathers_each_layer_once(ctx, mesh)
    _not_last_backward_defers_reductions(ctx, mesh)


# -- L1: HSDPModule interface, one control at a time ----------------------------------------
