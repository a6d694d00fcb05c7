"""Extra L0 cases L0-FSDP2-*, from torch's own FSDP2 tests (issue 30): what a root is and what it owns.
Two roots in one process iterate independently; a root's first forward takes a param the user
registered again after ``fully_shard``; a root forward may take no inputs; what FSDP2 refuses to do to
a sharded module (deep-copy it, shard it again, shard a container with no forward, a param shared by
two separate calls at the first forward) is refused with FSDP2's exception types. Each trains against DDP for two steps.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.checks import device_type, refused_with
from tests.kit.judging.recorder import CollectiveRecorder, record_collectives
from tests.kit.judging.reference import ddp_of
from tests.kit.judging.surface import impl
from tests.kit.workloads.models import DIMS, MLP
from tests.kit.workloads.training import distinct_batches, shard_nested, square_mean, train_against


# -- two roots, interleaved ----------------------------------------------------------------------
class Pair(nn.Module):
    """A model and a second one beside it (a teacher, or a copy made before sharding): each is its
    own root once sharded; the pair itself is never given to fully_shard."""

    def __init__(self) -> None:
        super().__init__()
        self.first = MLP(DIMS, seed=1)
        self.second = MLP(DIMS, seed=3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first(x), self.second(x)


def _pair_loss(model: Any, x: torch.Tensor) -> torch.Tensor:
    """The reference's loss: both models' square means (one backward reaches both)."""
    first, second = model(x)
    return first.float().square().mean() + second.float().square().mean()


class Interleaved:
    """A ``model_step``: forward of the first root, forward of the second, then the second's backward
    before the first's, the collectives of each backward recorded apart."""

    def __init__(self) -> None:
        self.backwards: list[dict[str, CollectiveRecorder]] = []

    def __call__(self, pair: Pair, x: torch.Tensor) -> torch.Tensor:
        first = square_mean(pair.first, x)
        second = square_mean(pair.second, x)
        recorded = {}
        for name, loss in (("second", second), ("first", first)):
            with record_collectives() as recorder:
                loss.backward()
            recorded[name] = recorder
        self.backwards.append(recorded)
        return (first + second).detach()


@case(
    "L0-FSDP2-two_roots",
    "test_fsdp2_two_roots",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
)
def two_roots(ctx: CaseContext) -> None:
    """Two sharded roots in one process (a model and a teacher beside it), run interleaved: forward of
    one, forward of the other, backward of the second, then of the first. Both train as DDP of the pair,
    and each backward all-gathers its own root's params once and nothing of the other root's (FSDP2
    keeps a root's iteration, its backward order and prefetch, per root)."""
    pair = Pair()
    ddp = ddp_of(pair)
    for root in (pair.first, pair.second):
        shard_nested(root, root.layers, mesh=ctx.mesh, reshard_after_forward=True)
    step = Interleaved()
    train_against(ctx, pair, ddp, distinct_batches(ctx), _pair_loss, ctx.tol, model_step=step)
    per_root = sum(p.numel() for p in MLP(DIMS).parameters()) // ctx.world_size
    for i, recorded in enumerate(step.backwards):
        for name, recorder in recorded.items():
            given = sum(call.numel for call in recorder.of("all_gather"))
            ctx.equal(f"step {i}: elements this rank gives in the {name} root's backward", given, per_root)


# -- a root's first forward --------------------------------------------------------------------------
class Scaled(nn.Module):
    """An MLP whose output is multiplied by a param of the root's own group."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(DIMS)
        self.scale = nn.Parameter(torch.ones(DIMS[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) * self.scale


def _registered_again(ctx: CaseContext) -> None:
    """After fully_shard and before the first forward, ``scale`` is registered again as a param computed
    from the sharded params (as FSDP2's test does after a deferred init): the root's first forward
    shards it in the old one's place, so training equals DDP of a model holding that value."""
    model, reference = Scaled(), Scaled()
    with torch.no_grad():
        reference.scale.copy_(reference.mlp.layers[-1].bias.abs() + 0.5)
    ddp = ddp_of(reference)
    shard_nested(model, model.mlp.layers, mesh=ctx.mesh)
    with torch.no_grad():
        model.scale = nn.Parameter(model.mlp.layers[-1].bias.detach().abs() + 0.5)
    train_against(ctx, model, ddp, distinct_batches(ctx), square_mean, ctx.tol, label="scale registered again")
    ctx.true("scale is sharded after training", impl.is_sharded(model.scale), type(model.scale).__name__, "sharded")


def _plain_registered_again(ctx: CaseContext) -> None:
    """A plain full-shape param registered in a sharded param's place before the first forward (which
    FSDP2 refuses: its lazy init reads a DTensor's local tensor): the root's first forward (here one
    under ``no_grad``, then ``reshard()``) cuts it to this rank's shard and registers that DTensor
    instead (torch swaps no plain tensor with a DTensor), so an optimizer built after it trains it like
    DDP of a model holding that value."""
    model, reference = Scaled(), Scaled()
    value = torch.linspace(0.5, 1.5, DIMS[-1])
    with torch.no_grad():
        reference.scale.copy_(value)
    ddp = ddp_of(reference)
    shard_nested(model, model.mlp.layers, mesh=ctx.mesh)
    model.scale = nn.Parameter(value.clone())
    with torch.no_grad():
        model(distinct_batches(ctx)[0])
    model.reshard()  # the root keeps its params gathered after forward: an optimizer must see the shards
    ctx.true("the plain scale is sharded by a first forward", impl.is_sharded(model.scale), type(model.scale).__name__)
    train_against(ctx, model, ddp, distinct_batches(ctx), square_mean, ctx.tol, label="plain scale registered again")
    ctx.true("the plain scale is sharded after training", impl.is_sharded(model.scale), type(model.scale).__name__)


class Masked(nn.Module):
    """A linear whose output a mask scales, called with an activation that needs grad and a mask that
    needs none: it notes what the mask needed as its forward saw it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.lin = nn.Linear(DIMS[0], DIMS[0])
        self.seen: list[bool] = []

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.seen.append(mask.requires_grad)
        return self.lin(h) * mask


class Gated(nn.Module):
    """A first linear, then ``Masked`` on its output and a data mask (the activation needs grad, the
    mask not): a call's inputs of both kinds at once."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.pre = nn.Linear(DIMS[0], DIMS[0])
        self.masked = Masked()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x > 0).to(x.dtype)
        return self.masked(self.pre(x), mask)


def _inputs_needing_no_grad(ctx: CaseContext) -> None:
    """A sharded call's input that needs no grad reaches its forward as it was passed (the hook that
    starts the call's post-backward wraps only the inputs that need grad: upstream's #323 flipped the
    others), and training equals DDP."""
    model, reference = Gated(), Gated()
    ddp = ddp_of(reference)
    shard_nested(model, [model.masked], mesh=ctx.mesh)
    train_against(ctx, model, ddp, distinct_batches(ctx), square_mean, ctx.tol, label="a mask needing no grad")
    ctx.equal("the mask needs no grad inside the sharded call's forward", str(model.masked.seen), str([False, False]))


class WeightsOnly(nn.Module):
    """A root whose forward takes no inputs (FSDP2's ``test_root_no_forward_inputs``): it computes from its
    own param and a per-rank buffer, so the ranks' grads differ and their mean is what DDP reduces."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.weight = nn.Parameter(torch.randn(DIMS[0], DIMS[0]))
        self.register_buffer("rows", torch.randn(2, DIMS[0]) + rank)

    def forward(self) -> torch.Tensor:
        return self.rows @ self.weight @ self.weight


def _no_forward_inputs(ctx: CaseContext) -> None:
    model = WeightsOnly(ctx.rank)
    ddp = ddp_of(model, broadcast_buffers=False)  # each rank keeps its own rows
    impl.fully_shard(model, mesh=ctx.mesh)
    batches = [None, None]  # what the loss passes: nothing

    def loss(module: Any, _: Any) -> torch.Tensor:
        return module().float().square().mean()

    train_against(ctx, model, ddp, batches, loss, ctx.tol, label="no forward inputs")


class Tied(nn.Module):
    """Two linears sharing one weight (a tied embedding and output head, in small)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(DIMS[0], DIMS[0], bias=False)
        self.second = nn.Linear(DIMS[0], DIMS[0], bias=False)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _tied_in_two_calls(ctx: CaseContext) -> None:
    """Each of two modules sharing a weight sharded by a call of its own, then their parent: the root's
    first forward refuses it (two groups would train two untied copies), as FSDP2's lazy init does."""
    tied = Tied()
    for module in (tied.first, tied.second, tied):
        impl.fully_shard(module, mesh=ctx.mesh)
    x = torch.randn(2, DIMS[0], device=device_type())
    refused_with(ctx, "first forward of a param sharded by two fully_shard calls", lambda: tied(x), ValueError)


def _refusals(ctx: CaseContext) -> None:
    """What FSDP2 refuses for a sharded module, with FSDP2's exception types (HyperParallel's may be a
    subclass of both: a ValueError that is also the AssertionError)."""
    model = MLP(DIMS)
    impl.fully_shard(model, mesh=ctx.mesh)
    refused_with(ctx, "copy.deepcopy of a sharded module", lambda: copy.deepcopy(model), AssertionError)
    refused_with(ctx, "fully_shard applied again", lambda: impl.fully_shard(model, mesh=ctx.mesh), AssertionError)
    container = nn.ModuleList([nn.Linear(4, 4)])
    refused_with(ctx, "fully_shard of a ModuleList (no forward)", lambda: impl.fully_shard(container), ValueError)
    _tied_in_two_calls(ctx)


@case(
    "L0-FSDP2-first_forward",
    "test_fsdp2_first_forward",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
)
def first_forward(ctx: CaseContext) -> None:
    """A root's first forward: it shards a param the user registered again after fully_shard (a plain
    full-shape one too, where declared), it may take no inputs, a call's input that needs no grad is
    passed to it as it is, and it refuses a param that two separate fully_shard calls shard; a sharded module is
    neither deep-copied nor sharded again (FSDP2's refusals)."""
    _registered_again(ctx)
    ctx.run_part("a plain tensor registered again", ("reregister_plain",), lambda: _plain_registered_again(ctx))
    _no_forward_inputs(ctx)
    _inputs_needing_no_grad(ctx)
    _refusals(ctx)
