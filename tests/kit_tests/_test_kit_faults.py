"""The kit's own cases (level KIT): a passing one, and deliberately wrong, hanging, crashing and
dying ones, to prove that verdicts fail loudly and in bounded time. Never part of a sweep."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.reference import ddp_of
from tests.kit.workloads.models import MLP, TiedEmbeddingNet, rank_batch, rank_tokens
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


def _mlp_against_ddp(ctx: CaseContext, plant: object) -> None:
    """L0-01's training with a bug ``plant(model, step)`` planted after each backward (the grads) or
    before training (``plant(model, None)``: a forward hook), for the diagnosis to find."""
    model = MLP((7, 13, 5, 3))
    ddp = ddp_of(model)
    shard_nested(model, model.layers)
    plant(model, None)
    batches = [rank_batch(step, ctx.rank, (4, 7)) for step in range(2)]
    train_against(
        ctx, model, ddp, batches, lambda m, x: m(x).square().mean(), ctx.tol, after_backward=lambda s: plant(model, s)
    )


@case("KIT-DIVERGE-FORWARD", "kit_forward_divergence", world_size=2, mesh={"dp": 2}, config="FSDP 1D fp32")
def forward_divergence(ctx: CaseContext) -> None:
    """L0-01's training with rank 1's second layer computing 1e-3 too much: the diagnosis must name
    step 0, forward, layers.1, rank 1 alone."""

    def plant(model: torch.nn.Module, step: int | None) -> None:
        if step is None and ctx.rank == 1:
            model.layers[1].register_forward_hook(lambda module, args, out: out * (1 + 1e-3))

    _mlp_against_ddp(ctx, plant)


@case("KIT-DIVERGE-GRAD", "kit_grad_divergence", world_size=2, mesh={"dp": 2}, config="FSDP 1D fp32")
def grad_divergence(ctx: CaseContext) -> None:
    """L0-01's training with the first layer's reduced weight grad 1e-3 too large on rank 0's shard:
    the diagnosis must name step 0, reduction, layers.0 weight.grad (every rank: the full grad)."""

    def plant(model: torch.nn.Module, step: int | None) -> None:
        if step is not None and ctx.rank == 0:
            with torch.no_grad():
                model.layers[0].weight.grad.mul_(1 + 1e-3)

    _mlp_against_ddp(ctx, plant)


class _RaisesInBackward(torch.autograd.Function):
    """Identity in forward; its backward raises, as an implementation's backward would."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("deliberate crash in layers.1's backward")


class _SleepsInBackward(_RaisesInBackward):
    """Identity in forward; its backward sleeps (a rank stuck where its peers wait for it)."""

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(3600)
        return grad


@case("KIT-CRASH-FORWARD", "kit_forward_crash", world_size=2, mesh={"dp": 2}, config="FSDP 1D fp32", timeout=60)
def forward_crash(ctx: CaseContext) -> None:
    """L0-01's training, layers.1's forward raising at step 1 on both ranks (a pre-hook, as an
    implementation's own would): the diagnosis must name step 1, forward, layers.1, ranks 0,1."""

    def plant(model: torch.nn.Module, step: int | None) -> None:
        def raise_at_step_1(module: torch.nn.Module, args: object) -> None:
            if step_seen[0] == 1:
                raise RuntimeError("deliberate crash entering layers.1")

        if step is None:
            model.layers[1].register_forward_pre_hook(raise_at_step_1)
        else:
            step_seen[0] = step + 1

    step_seen = [0]
    _mlp_against_ddp(ctx, plant)


@case("KIT-CRASH-BACKWARD", "kit_backward_crash", world_size=2, mesh={"dp": 2}, config="FSDP 1D fp32", timeout=60)
def backward_crash(ctx: CaseContext) -> None:
    """L0-01's training, layers.1's backward raising at step 0 on both ranks (its input's grad node,
    which runs after its output grad): the diagnosis must name step 0, backward, layers.1."""

    def plant(model: torch.nn.Module, step: int | None) -> None:
        if step is None:
            model.layers[1].register_forward_pre_hook(lambda module, args: (_RaisesInBackward.apply(args[0]),))

    _mlp_against_ddp(ctx, plant)


@case("KIT-UNTIED", "kit_untied_weight", world_size=2, mesh={"dp": 2}, config="FSDP 1D fp32", timeout=60)
def untied(ctx: CaseContext) -> None:
    """A tied embedding whose tie the model under test lost (its output weight a copy of its own), its
    baseline still tied: the diagnosis must name the structure, 'out.weight' on the model's side alone."""
    model = TiedEmbeddingNet()
    ddp = ddp_of(model)
    model.out.weight = torch.nn.Parameter(model.embed.weight.detach().clone())
    shard_nested(model, [model.mid])
    batches = [rank_tokens(step, ctx.rank, (3, 5), vocab=11) for step in range(2)]
    loss = torch.nn.functional.cross_entropy
    train_against(ctx, model, ddp, batches, lambda m, t: loss(m(t).flatten(0, 1), t.flatten()), ctx.tol)


@case("KIT-HANG-BACKWARD", "kit_backward_hang", world_size=2, mesh={"dp": 2}, config="FSDP 1D fp32", timeout=8)
def backward_hang(ctx: CaseContext) -> None:
    """L0-01's training, rank 1 stuck in layers.1's backward at step 0 while rank 0 waits in a collective
    for it: the diagnosis must name where each rank's traced run was, rank 1 in layers.1's backward."""

    def plant(model: torch.nn.Module, step: int | None) -> None:
        if step is None and ctx.rank == 1:
            model.layers[1].register_forward_pre_hook(lambda module, args: (_SleepsInBackward.apply(args[0]),))

    _mlp_against_ddp(ctx, plant)


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
