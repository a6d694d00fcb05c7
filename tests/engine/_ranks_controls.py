"""Rank bodies of the engine's control tests: recurse=False on gradient sync, recovery after a
failed iteration, and the refusal of bad arguments before any change."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.kit.judging.checks import StrictChecks
from tests.kit.judging.recorder import CollectiveRecorder, record_collectives
from tests.kit.judging.reference import ddp_of
from tests.kit.judging.surface import impl
from tests.kit.workloads.models import MLP, rank_batch, rank_batches
from tests.kit.workloads.training import (
    grad_norm,
    named_params,
    record_grads,
    record_params,
    shard_nested,
    square_mean,
    step_optimizers,
    train_accumulating_against,
)

DIMS = (7, 13, 5, 3)
LR = 1e-2
ROOT_OWN = ("layers.2.weight", "layers.2.bias")  # the root's group, with layers 0 and 1 sharded on their own


def gradient_sync_recurse_false() -> None:
    """root.set_requires_gradient_sync(False, recurse=False): only the root's own group holds its
    grads back (no grads yet), the children still reduce-scatter each micro-batch; after the
    syncing micro-batch every grad equals DDP's accumulated no_sync grads, over 2 steps."""
    checks = StrictChecks("FSDP 1D fp32")
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers[:2], mesh=checks.mesh)
    children = [n for n in named_params(model) if n not in ROOT_OWN]

    def after_micro(step: int, micro: int, rec: CollectiveRecorder) -> None:
        where = f"step {step} micro {micro}"
        if micro == 0:  # held back by the root's own group only
            checks.equal(f"{where} reduce-scatters (the children's)", len(rec.of("reduce_scatter")), 2)
            params = named_params(model)
            for name in ROOT_OWN:
                checks.true(f"{where} root's {name} has no grad yet", params[name].grad is None)
            for name in children:
                checks.true(f"{where} child's {name} has its reduced grad", params[name].grad is not None)
        else:
            checks.equal(f"{where} reduce-scatters (every group)", len(rec.of("reduce_scatter")), 3)

    train_accumulating_against(
        checks,
        model,
        ddp,
        [rank_batches(checks.rank, (4, DIMS[0]), 2, first=10 * step) for step in range(2)],
        square_mean,
        checks.tol,
        accumulate=lambda holding: model.set_requires_gradient_sync(not holding, recurse=False),
        after_micro=after_micro,
    )


def gradient_sync_sets_the_all_reduce() -> None:
    """HSDP (2 replicas of 1 shard): set_requires_gradient_sync(True) after set_requires_all_reduce(False)
    all-reduces again (FSDP2's documented rule: on HSDP it sets both); set_requires_all_reduce(False)
    after it turns the all-reduce alone off. Each backward's all-reduces counted, the grads as DDP's or
    as each replica's own."""
    checks = StrictChecks("HSDP 2D fp32", replicate=2, shard=1)
    model = MLP(DIMS)
    ddp = ddp_of(model)
    impl.fully_shard(model, mesh=checks.mesh)
    batch = rank_batch(0, checks.rank, (4, DIMS[0]))
    for order, all_reduced in (("all-reduce off, then sync on", True), ("sync on, then all-reduce off", False)):
        model.zero_grad(set_to_none=True)
        ddp.zero_grad(set_to_none=True)
        if all_reduced:
            model.set_requires_all_reduce(False)
            model.set_requires_gradient_sync(True)
        else:
            model.set_requires_gradient_sync(True)
            model.set_requires_all_reduce(False)
        with record_collectives() as rec:
            square_mean(model, batch).backward()
        checks.equal(f"{order}: all-reduces issued", len(rec.of("all_reduce")) > 0, all_reduced)
        if all_reduced:  # the sum over both replicas, as DDP's
            square_mean(ddp, batch).backward()
            record_grads(checks, order, model, ddp, checks.tol.grad)
    model.set_requires_all_reduce(True)


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("deliberate failure in backward")


def _raised(action: Callable[[], Any]) -> str:
    """What ``action`` raised (its text), or '' when it raised nothing."""
    try:
        action()
    except RuntimeError as exc:
        return str(exc) or type(exc).__name__
    return ""


def _train_on(checks: StrictChecks, model: nn.Module, params: dict, ddp: nn.Module, opts: tuple, batches: list) -> None:
    """``train_against``'s checks per step, on the params and optimizers taken before the failures
    (``train_against`` takes the params registered when it starts: a failed forward leaves its
    group's unsharded params registered until the next forward ends)."""
    tol = checks.tol
    for step, batch in enumerate(batches):
        ref_loss = square_mean(ddp, batch)
        ref_loss.backward()
        loss = square_mean(model, batch)
        loss.backward()
        checks.close(f"step {step} loss", loss, ref_loss, tol.loss)
        checks.close(f"step {step} grad norm", grad_norm(params), grad_norm(ddp), tol.grad)
        record_grads(checks, f"step {step}", params, ddp, tol.grad)
        step_optimizers(opts)
        record_params(checks, f"step {step}", params, ddp, tol.grad)


def recovers_after_a_failed_iteration(failing: str) -> None:
    """A ``failing`` "forward" (raising in the first layer) or "backward" (raising between layers,
    after the later layers' backward ran) leaves the engine usable: after zero_grad, 3 steps with
    the optimizers built before equal DDP, and the sharded params are registered again."""
    checks = StrictChecks("FSDP 1D fp32")
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=checks.mesh)
    params = named_params(model)
    opts = torch.optim.Adam(model.parameters(), lr=LR), torch.optim.Adam(ddp.parameters(), lr=LR)
    x = rank_batch(0, checks.rank, (4, DIMS[0]))
    if failing == "backward":
        hook = model.layers[0].register_forward_hook(lambda m, a, out: _FailingBackward.apply(out))
        failure = _raised(lambda: model(x).sum().backward())
        hook.remove()
        checks.require("the backward failed as planned", "deliberate" in failure, failure)
    else:
        failure = _raised(lambda: model(x[:, :3]))  # the wrong width: the first layer raises
        checks.require("the forward failed", bool(failure), failure)
    model.zero_grad()
    _train_on(checks, model, params, ddp, opts, rank_batches(checks.rank, (4, DIMS[0]), 3, first=1))
    registered = named_params(model)
    for name, param in params.items():
        checks.true(f"{name}: the sharded param is registered again", registered[name] is param)


def unshard_across_the_optimizer_step(waited: bool) -> None:
    """A nested call's ``unshard(async_op=True)`` issued before each optimizer step, its handle
    waited after the step or never (the next forward meets the all-gather in flight): every step's
    loss and grads equal DDP's, so that forward computed with the stepped params, not the old ones."""
    checks = StrictChecks("FSDP 1D fp32")
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=checks.mesh)
    opts = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step, batch in enumerate(rank_batches(checks.rank, (4, DIMS[0]), 3, first=1)):
        ref_loss = square_mean(ddp, batch)
        ref_loss.backward()
        loss = square_mean(model, batch)
        loss.backward()
        checks.close(f"step {step} loss", loss, ref_loss, checks.tol.loss)
        record_grads(checks, f"step {step}", named_params(model), ddp, checks.tol.grad)
        handle = model.layers[1].unshard(async_op=True)
        step_optimizers(opts)
        if waited and handle is not None:
            handle.wait()
