"""Plan cases of the plan's ``test_fully_shard_precision.py``, level L0: comm fusion on and off (L0-06), list
input (L0-07), the mixed-precision defaults and fp16 (L0-10)."""

from __future__ import annotations

import torch

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.recorder import CollectiveRecorder
from tests.kit.judging.reference import ddp_of
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import tolerance
from tests.kit.workloads.models import DIMS, MLP, rank_batches
from tests.kit.workloads.precision import train_under_policy
from tests.kit.workloads.training import (
    shard_nested,
    square_mean,
    train_against,
)


@case(
    "L0-06",
    "test_comm_fusion_on_off",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("comm_fusion",),
)
def comm_fusion_on_off(ctx: CaseContext) -> None:
    """comm_fusion=True issues one all-gather / reduce-scatter per group, False one per param; both
    train like DDP."""
    mesh = ctx.mesh
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    totals = {}
    for fused in (True, False):
        label = f"comm_fusion={fused}"
        model = MLP(DIMS)
        ddp = ddp_of(model)
        shard_nested(model, model.layers, mesh=mesh, comm_fusion=fused)
        # one group per layer, the root holds none; children reshard after forward, so each
        # group is gathered in forward and again in backward
        per_step = len(model.layers) if fused else len(list(model.parameters()))
        recorders: list[CollectiveRecorder] = []

        train_against(ctx, model, ddp, batches, square_mean, ctx.tol, label=label, recorders=recorders)
        for step, rec in enumerate(recorders):
            ctx.equal(f"{label} step {step} all-gathers", len(rec.of("all_gather")), 2 * per_step)
            ctx.equal(f"{label} step {step} reduce-scatters", len(rec.of("reduce_scatter")), per_step)
            ctx.equal(f"{label} step {step} all-reduces", len(rec.of("all_reduce")), 0)
        totals[fused] = sum(len(rec.calls) for rec in recorders)
    ctx.true("fused issues fewer collectives than unfused", totals[True] < totals[False], totals[True], totals[False])


@case(
    "L0-07",
    "test_fully_shard_list_input_precision",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("list_input",),
)
def list_input_precision(ctx: CaseContext) -> None:
    """Two layers sharded by one list call, as independent groups under a sharded root, train like DDP."""
    mesh = ctx.mesh
    model = MLP(DIMS)
    ddp = ddp_of(model)
    listed = [model.layers[0], model.layers[1]]
    groups = impl.fully_shard(listed, mesh=mesh)
    ctx.require(
        "the list call returns its modules, each an HSDPModule",
        isinstance(groups, list)
        and len(groups) == len(listed)
        and all(g is m and isinstance(g, impl.HSDPModule) for g, m in zip(groups, listed, strict=False)),
        f"{type(groups).__name__}",
    )
    impl.fully_shard(model, mesh=mesh)

    train_against(ctx, model, ddp, rank_batches(ctx.rank, (4, DIMS[0])), square_mean, ctx.tol)


@case(
    "L0-10",
    "test_mp_defaults_and_fp16",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp16",
    needs=("mixed_precision",),
)
def mp_defaults_and_fp16(ctx: CaseContext) -> None:
    """The default MixedPrecisionPolicy computes and communicates in fp32; fp16/fp32/fp32 computes and
    gathers in fp16 and reduces in fp32 into fp32 grads; both match a same-dtype reference."""
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    configs = (
        ("default", impl.MixedPrecisionPolicy(), tolerance("FSDP 1D fp32")),
        ("fp16/fp32/fp32", impl.MixedPrecisionPolicy(torch.float16, torch.float32, torch.float32), ctx.tol),
    )
    for label, policy, tol in configs:
        train_under_policy(ctx, label, policy, tol, batches)


# -- L1 ----------------------------------------------------------------------------------------
