"""Extra L0 cases L0-FSDP2-*, beyond the plan: FSDP2's controls of when params are gathered and how a model
runs -- an int ``reshard_after_forward``, ``register_fsdp_forward_method``, ``set_unshard_in_backward``.
Each trains a small model against DDP for two steps or more (the int reshard on 4 ranks).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own alias

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.checks import raised, refused_with
from tests.kit.judging.layout import local_numels_after_forward, padded_shard_numel, shard_shape
from tests.kit.judging.recorder import CollectiveRecorder
from tests.kit.judging.reference import ddp_of
from tests.kit.judging.surface import impl
from tests.kit.workloads.models import DIMS, MLP, rank_tokens
from tests.kit.workloads.training import (
    BackwardRecorder,
    differs_across_ranks,
    distinct_batches,
    raises_nothing,
    shard_nested,
    square_mean,
    train_against,
)

STEPS = 2


# -- reshard_after_forward as an int -------------------------------------------------------------
def _sharded_with(ctx: CaseContext, reshard: int) -> tuple[MLP, list[dict[str, int]]]:
    """An MLP sharded (nested) with ``reshard_after_forward=reshard``, and the local numels of its params
    after each forward (filled as it runs)."""
    model = MLP(DIMS)
    shard_nested(model, model.layers, mesh=ctx.mesh, reshard_after_forward=reshard)
    return model, local_numels_after_forward(model)


def _check_kept_after_forward(ctx: CaseContext, label: str, seen: dict[str, int], share: int) -> None:
    """After forward each param holds ``1/share`` of its elements (1: the whole param)."""
    for name, param in MLP(DIMS).named_parameters():
        ctx.equal(f"{label}: {name} local numel after forward = 1/{share}", seen.get(name), param.numel() // share)


def _check_backward_gathers(ctx: CaseContext, label: str, recorder: CollectiveRecorder, group: int) -> None:
    """The backward re-gathers every param over groups of ``group`` ranks, each rank giving 1/group."""
    gathers = recorder.of("all_gather")
    sizes = sorted({call.group_size for call in gathers})
    total = sum(p.numel() for p in MLP(DIMS).parameters())
    ctx.true(f"{label}: backward all-gathers run", bool(gathers), len(gathers), ">= 1")
    ctx.equal(f"{label}: backward all-gather group sizes", str(sizes), str([group]))
    ctx.equal(f"{label}: elements this rank gives in backward", sum(c.numel for c in gathers), total // group)


def _int_one_and_world(ctx: CaseContext, batch: torch.Tensor) -> None:
    """1 keeps whole params after forward with no all-gather in backward (False); the shard dim's size
    keeps 1/world and gathers over all its ranks (True): one forward and backward each."""
    world = ctx.world_size
    for reshard, share, gathers in ((1, 1, False), (world, world, True)):
        label = f"reshard_after_forward={reshard} (int, as {gathers})"
        model, seen = _sharded_with(ctx, reshard)
        step = BackwardRecorder(square_mean)
        step(model, batch)
        _check_kept_after_forward(ctx, label, seen[0], share)
        if gathers:
            _check_backward_gathers(ctx, label, step.steps[0], world)
        else:
            ctx.equal(f"{label}: no all-gather in backward", len(step.steps[0].of("all_gather")), 0)


def _bool_replaces_int(ctx: CaseContext, batch: torch.Tensor, k: int) -> None:
    """set_reshard_after_forward(True) on a model sharded with an int: the bool replaces the smaller
    mesh, so forward keeps 1/world and backward gathers over all the shard dim's ranks."""
    label = f"reshard_after_forward={k}, then set_reshard_after_forward(True)"
    model, seen = _sharded_with(ctx, k)
    model.set_reshard_after_forward(True)
    step = BackwardRecorder(square_mean)
    step(model, batch)
    _check_kept_after_forward(ctx, label, seen[0], ctx.world_size)
    _check_backward_gathers(ctx, label, step.steps[0], ctx.world_size)


@case(
    "L0-FSDP2-reshard_int",
    "test_fsdp2_reshard_int",
    world_size=4,
    mesh={"dp": 4},
    config="FSDP 1D fp32",
    needs=("reshard_int",),
)
def reshard_int(ctx: CaseContext) -> None:
    """reshard_after_forward=2 on 4 ranks: after forward each param keeps a 1/2 share, backward gathers
    over groups of 2 ranks, training equals DDP; 1 acts as False, 4 as True; set_reshard_after_forward(True)
    replaces the int; 3 (no divisor) is a ValueError."""
    k = 2
    ddp = ddp_of(MLP(DIMS))
    model, seen = _sharded_with(ctx, k)
    step, batches = BackwardRecorder(square_mean), distinct_batches(ctx)
    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, model_step=step)
    for i in range(STEPS):
        _check_kept_after_forward(ctx, f"step {i}", seen[i], k)
        _check_backward_gathers(ctx, f"step {i}", step.steps[i], k)
    _int_one_and_world(ctx, batches[0])
    _bool_replaces_int(ctx, batches[0], k)
    refused_with(
        ctx,
        "reshard_after_forward=3 (not a divisor of 4)",
        lambda: impl.fully_shard(MLP(DIMS), mesh=ctx.mesh, reshard_after_forward=3),
        ValueError,
    )


# -- register_fsdp_forward_method ----------------------------------------------------------------
class GeneratingMLP(MLP):
    """An MLP with a second entry point: ``generate`` computes like forward, on its own params directly
    (functional linears, no child module's call), so only the root's forward hooks can unshard them."""

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = F.linear(x, layer.weight, layer.bias)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def _generate_step(model: Any, batch: torch.Tensor) -> torch.Tensor:
    """The model's step through ``generate`` instead of forward."""
    loss = model.generate(batch).square().mean()
    loss.backward()
    return loss


def _generating_ddp() -> Any:
    """DDP over a GeneratingMLP whose forward is its generate: DDP's own forward runs the same method."""
    module = GeneratingMLP(DIMS)
    module.forward = module.generate
    return ddp_of(module)


def _check_no_op_unsharded(ctx: CaseContext) -> None:
    """On a module never given to fully_shard the registration changes nothing."""
    plain = GeneratingMLP(DIMS)
    error = raised(lambda: impl.register_fsdp_forward_method(plain, "generate"))
    ctx.true("unsharded module: registration raises nothing", error is None, repr(error)[:160], "None")
    unchanged = "generate" not in vars(plain) and plain.generate.__func__ is GeneratingMLP.generate
    ctx.true("unsharded module: generate unchanged", unchanged)


@case(
    "L0-FSDP2-forward_method",
    "test_fsdp2_forward_method",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("forward_method",),
)
def forward_method(ctx: CaseContext) -> None:
    """register_fsdp_forward_method(model, "generate") on a sharded model: training through generate
    equals DDP running generate; on an unsharded module it is a no-op; a missing method is a ValueError."""
    model = GeneratingMLP(DIMS)
    ddp = _generating_ddp()
    impl.fully_shard(model, mesh=ctx.mesh)
    impl.register_fsdp_forward_method(model, "generate")
    train_against(ctx, model, ddp, distinct_batches(ctx), square_mean, ctx.tol, model_step=_generate_step)
    _check_no_op_unsharded(ctx)
    missing = lambda: impl.register_fsdp_forward_method(model, "no_such_method")  # noqa: E731
    refused_with(ctx, "a method the module lacks", missing, ValueError)


# -- set_unshard_in_backward ---------------------------------------------------------------------
VOCAB = 12  # embedding rows: 6 per rank; its shard (6 x 8 = 48 elements) differs from every layer's


class EmbeddingMLP(nn.Module):
    """Token embedding, then the MLP: the embedding's weight is not needed by its own backward."""

    def __init__(self, seed: int = 9) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIMS[0])
        self.mlp = MLP(DIMS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(tokens))


def _gathered(recorder: CollectiveRecorder, numel: int) -> int:
    """All-gathers of ``numel`` elements from this rank (one group's, told apart by its shard size)."""
    return sum(1 for call in recorder.of("all_gather") if call.numel == numel)


@case(
    "L0-FSDP2-unshard_in_backward",
    "test_fsdp2_unshard_in_backward",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("unshard_in_backward",),
)
def unshard_in_backward(ctx: CaseContext) -> None:
    """An embedding sharded as its own group: by default it is all-gathered again in backward; after
    set_unshard_in_backward(False) it is not (the other groups still are), and training equals DDP."""
    model = EmbeddingMLP()
    ddp = ddp_of(model)
    impl.fully_shard(model.embed, mesh=ctx.mesh)
    shard_nested(model, model.mlp.layers, mesh=ctx.mesh)
    embed_numel = padded_shard_numel(model.embed, ctx.world_size)
    batches = [rank_tokens(step, ctx.rank, (6,), VOCAB) for step in range(3)]
    ctx.require("the ranks' tokens differ", differs_across_ranks(batches[0]))
    step = BackwardRecorder(square_mean)

    def before_step(i: int) -> None:
        model.embed.set_unshard_in_backward(i == 0)  # step 0: the default, the control

    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, model_step=step, before_step=before_step)
    ctx.require("by default the embedding is all-gathered in backward", _gathered(step.steps[0], embed_numel) == 1)
    layers = [padded_shard_numel(layer, ctx.world_size) for layer in model.mlp.layers]
    for i in (1, 2):
        ctx.equal(f"step {i}: embedding all-gathers in backward", _gathered(step.steps[i], embed_numel), 0)
        others = [_gathered(step.steps[i], numel) for numel in layers]
        ctx.true(f"step {i}: the other groups are all-gathered in backward", all(others), str(others), "each >= 1")


# -- reset_iter_state, container slicing, share_comm_ctx ----------------------------------------
class FailingMLP(MLP):
    """The kit's MLP whose forward raises after its first layer while ``fail`` is set (an aborted
    iteration: the root's group is left gathered)."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            self.layers[0](x)
            raise RuntimeError("the forward failed on purpose")
        return super().forward(x)


def _reset_iter_state(ctx: CaseContext) -> None:
    """After a forward raised, reset_iter_state() on the root reshards every group (the root's own was
    gathered), refuses a non-root (RuntimeError), and the model then trains like DDP."""
    model = FailingMLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers[:1], mesh=ctx.mesh)  # the root's own group holds the other layers
    batches = distinct_batches(ctx)
    model.fail = True
    ctx.require("the forward failed", isinstance(raised(lambda: square_mean(model, batches[0])), RuntimeError))
    model.fail = False
    refused_with(ctx, "reset_iter_state() of a non-root module", model.layers[0].reset_iter_state, RuntimeError)
    model.reset_iter_state()
    resharded = True
    for name, param in model.named_parameters():
        shard = math.prod(shard_shape(param.shape, ctx.world_size, ctx.rank))
        ctx.equal(f"after reset_iter_state: {name} local numel (its shard)", impl.local(param).numel(), shard)
        resharded = resharded and impl.local(param).numel() == shard
    # an optimizer built on gathered params would step tensors the next reshard frees
    ctx.require("every param resharded before the optimizer is built", resharded)
    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, label="after reset_iter_state")


def _slicing(ctx: CaseContext) -> None:
    """A slice of a sharded nn.Sequential is a plain nn.Sequential: it was not given to fully_shard."""
    model = nn.Sequential(*MLP(DIMS).layers)
    impl.fully_shard(model, mesh=ctx.mesh)
    part = model[:1]
    ctx.equal("the sliced container's class", type(part).__name__, "Sequential")
    ctx.true("the slice is not a sharded module", not isinstance(part, impl.HSDPModule), type(part).__mro__[1].__name__)


def _share_comm_ctx(ctx: CaseContext) -> None:
    """share_comm_ctx of two sharded roots runs; of a module not given to fully_shard, a ValueError."""
    roots = [MLP(DIMS), MLP(DIMS, seed=2)]
    for root in roots:
        impl.fully_shard(root, mesh=ctx.mesh)
    raises_nothing(ctx, "share_comm_ctx of two sharded roots", lambda: impl.share_comm_ctx(roots))
    refused_with(ctx, "share_comm_ctx of a plain module", lambda: impl.share_comm_ctx([MLP(DIMS)]), ValueError)


@case(
    "L0-FSDP2-module_api",
    "test_fsdp2_module_api",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
)
def module_api(ctx: CaseContext) -> None:
    """The rest of FSDP2's module API, each part needing its own feature: reset_iter_state() after a
    failed forward reshards and training then equals DDP; slicing a sharded Sequential builds a plain
    one; share_comm_ctx accepts sharded roots and refuses others."""
    ctx.run_part("reset_iter_state", ("reset_iter_state",), lambda: _reset_iter_state(ctx))
    ctx.run_part("slicing a sharded container", ("module_slicing",), lambda: _slicing(ctx))
    ctx.run_part("share_comm_ctx", ("share_comm_ctx",), lambda: _share_comm_ctx(ctx))
