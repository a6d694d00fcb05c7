"""The kit's own cases (level KIT): a passing one, and deliberately wrong, hanging, crashing and
dying ones, to prove that verdicts fail loudly and in bounded time. Never part of a sweep."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.reference import ddp_of
from tests.kit.workloads.models import MLP, rank_batch
from tests.kit.workloads.training import shard_nested, train_against


@case("KIT-OK", "kit_passing_case", world_size=2, mesh={"dp": 2}, config="FSDP 1D fp32")
def passing(ctx: CaseContext) -> None:
    """An all-reduce equals the sum of ranks on every rank."""
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    ctx.close("all-reduce sum", total, torch.tensor([3.0]), ctx.tol.loss)


@case("KIT-WRONG-REF", "kit_wrong_reference", world_size=2, mesh={"dp": 2}, config="FSDP 1D fp32")
def wrong_reference(ctx: CaseContext) -> None:
    """L0-01's training, against a DDP reference whose last bias is off by 1e-3: must fail."""
    model = MLP((7, 13, 5, 3))
    ddp = ddp_of(model)
    with torch.no_grad():
        ddp.module.layers[2].bias.add_(1e-3)
    shard_nested(model, model.layers)
    batches = [rank_batch(step, ctx.rank, (4, 7)) for step in range(2)]
    train_against(ctx, model, ddp, batches, lambda m, x: m(x).square().mean(), ctx.tol)


def _stuck_in_a_collective() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(3600)


@case("KIT-HANG", "kit_hanging_case", world_size=2, mesh={"dp": 2}, config="FSDP 1D fp32", timeout=5)
def hanging(ctx: CaseContext) -> None:
    """Rank 0 waits in an all-reduce that rank 1 never joins."""
    _stuck_in_a_collective()


@case("KIT-CRASH", "kit_crashing_case", world_size=2, mesh={"dp": 2}, config="FSDP 1D fp32", timeout=30)
def crashing(ctx: CaseContext) -> None:
    """Rank 1 raises while rank 0 waits for it."""
    if ctx.rank == 1:
        raise ValueError("deliberate crash on rank 1")
    dist.barrier()


@case("KIT-DIE", "kit_dying_case", world_size=2, mesh={"dp": 2}, config="FSDP 1D fp32", timeout=30)
def dying(ctx: CaseContext) -> None:
    """Rank 1's process exits outright while rank 0 waits for it."""
    if ctx.rank == 1:
        os._exit(3)
    dist.barrier()
