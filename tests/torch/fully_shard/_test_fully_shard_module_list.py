"""Plan cases of the plan's ``test_fully_shard_module.py``, level L1: ``fully_shard([layer0, layer1])``, each
listed module its own independently controlled group (L1-09)."""


from __future__ import annotations

import torch
from torch import nn

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.layout import (
    numels,
)
from tests.kit.judging.recorder import record_collectives
from tests.kit.judging.reference import ddp_of, full
from tests.kit.judging.surface import impl
from tests.kit.workloads.models import DIMS, MLP, rank_batch, rank_batches
from tests.kit.workloads.training import (
    named_params,
    record_grads,
    record_numels,
    reshard_all,
    square_mean,
    train_against,
)


@case(
    "L1-09",
    "test_fully_shard_list_input",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("list_input", "reshard_controls", "gradient_sync", "unshard_reshard"),
)
def fully_shard_list_input(ctx: CaseContext) -> None:
    """fully_shard([layer0, layer1]) returns a list of the two modules, each an HSDPModule with its
    own group. Controlling one (reshard flags, gradient sync, unshard/reshard, a step using it
    alone) leaves the other's params and grads as they would be; the whole model trains like DDP
    with finite grads."""
    world, rank, tol = ctx.world_size, ctx.rank, ctx.tol
    mesh = ctx.mesh
    model = MLP(DIMS)
    ddp = ddp_of(model)
    full_numel, shard_numel = numels(model, world, rank)
    listed = [model.layers[0], model.layers[1]]
    returned = impl.fully_shard(listed, mesh=mesh)
    ctx.true("returns a list", isinstance(returned, list), type(returned).__name__, "list")
    ctx.require("one element per listed module", isinstance(returned, list) and len(returned) == len(listed))
    for i, (element, module) in enumerate(zip(returned, listed, strict=True)):
        ctx.true(f"element {i} is an HSDPModule", isinstance(element, impl.HSDPModule), type(element).__name__)
        ctx.true(f"element {i} is listed module {i}", element is module)
    impl.fully_shard(model, mesh=mesh)  # the root's group holds layer 2
    own = {i: (f"layers.{i}.weight", f"layers.{i}.bias") for i in range(len(listed))}

    def grads_finite(label: str) -> None:
        for name, param in named_params(model).items():
            finite = param.grad is not None and bool(torch.isfinite(full(param.grad)).all())
            ctx.true(f"{label} grad {name} finite", finite)

    batches = rank_batches(rank, (4, DIMS[0]))
    train_against(ctx, model, ddp, batches, square_mean, tol, after_backward=lambda step: grads_finite(f"step {step}"))

    for mine, other in ((0, 1), (1, 0)):
        controlled, label = returned[mine], f"controlling layers.{mine}:"

        def layout(where: str, unsharded: bool, mine: int = mine, other: int = other) -> None:
            want = {n: full_numel[n] if unsharded and n in own[mine] else shard_numel[n] for n in full_numel}
            record_numels(ctx, where, model, want, own[mine] + own[other])

        # reshard flags: only the controlled group stays unsharded after forward and backward
        batch = rank_batch(20 + mine, rank, (4, DIMS[0]))
        controlled.set_reshard_after_forward(False)
        controlled.set_reshard_after_backward(False)
        out = model(batch)
        layout(f"{label} reshard flags off, after forward", unsharded=True)
        out.float().square().mean().backward()
        layout(f"{label} reshard flags off, after backward", unsharded=True)
        controlled.set_reshard_after_forward(True)
        controlled.set_reshard_after_backward(True)
        reshard_all(model)
        square_mean(ddp, batch).backward()
        record_grads(ctx, f"{label} reshard flags off", model, ddp, tol.grad)
        model.zero_grad()
        ddp.zero_grad()

        # gradient sync off for the controlled group: the others still reduce, like DDP
        batch = rank_batch(30 + mine, rank, (4, DIMS[0]))
        controlled.set_requires_gradient_sync(False)
        with record_collectives() as rec:
            square_mean(model, batch).backward()
        controlled.set_requires_gradient_sync(True)
        square_mean(ddp, batch).backward()
        others_reduced = len(rec.of("reduce_scatter"))
        ctx.true(f"{label} sync off: the other groups reduce-scatter", others_reduced > 0, others_reduced, "> 0")
        params = named_params(model)
        for name in own[mine]:
            ctx.true(f"{label} sync off: {name} has no grad yet", params[name].grad is None)
        others = [n for n in full_numel if n not in own[mine]]
        record_grads(ctx, f"{label} sync off, the others'", model, ddp, tol.grad, others)
        model.zero_grad()
        ddp.zero_grad()

        # unshard / reshard of the controlled group only
        controlled.unshard()
        layout(f"{label} unshard()", unsharded=True)
        controlled.reshard()
        layout(f"{label} reshard()", unsharded=False)

        # a step using the controlled layer alone: its grads equal DDP's of a copy, no other grads
        layer = listed[mine]
        twin = nn.Linear(layer.in_features, layer.out_features)
        with torch.no_grad():
            twin.weight.copy_(full(layer.weight))
            twin.bias.copy_(full(layer.bias))
        alone = ddp_of(twin)
        batch = rank_batch(40 + mine, rank, (4, layer.in_features))
        loss = square_mean(layer, batch)
        loss.backward()
        ref_loss = square_mean(alone, batch)
        ref_loss.backward()
        ctx.close(f"{label} used alone: loss", loss, ref_loss, tol.loss)
        record_grads(ctx, f"{label} used alone", layer, alone, tol.grad)
        params = named_params(model)
        for name in others:
            ctx.true(f"{label} used alone: {name} has no grad", params[name].grad is None)
        layout(f"{label} used alone, after backward", unsharded=False)
        model.zero_grad()

    train_against(
        ctx,
        model,
        ddp,
        rank_batches(rank, (4, DIMS[0]), first=50),
        square_mean,
        tol,
        label="after the controls",
        after_backward=lambda step: grads_finite(f"after the controls step {step}"),
    )
