"""Rank bodies of the engine's control tests: recurse=False on gradient sync, recovery after a
failed iteration, and the refusal of bad arguments before any change."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.kit.checks import StrictChecks
from tests.kit.models import MLP, rank_batch, rank_batches
from tests.kit.recorder import CollectiveRecorder
from tests.kit.reference import ddp_of
from tests.kit.surface import impl
from tests.kit.training import (
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


# -- argument refusals (until the plan's L0-ARGS takes them over) ---------------------------
_HOOKS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _snapshot(model: nn.Module) -> dict[str, Any]:
    """What a refused call must leave as it was: every module's class, attributes and hook counts,
    every param's identity and value."""
    return {
        "modules": [(type(m), sorted(vars(m)), [len(getattr(m, h, {})) for h in _HOOKS]) for m in model.modules()],
        "params": [(n, p, p.detach().clone()) for n, p in model.named_parameters()],
    }


def _untouched(checks: StrictChecks, what: str, model: nn.Module, before: dict[str, Any]) -> None:
    after = _snapshot(model)
    checks.true(f"{what}: modules (class, attributes, hooks) unchanged", after["modules"] == before["modules"])
    same = [
        n
        for (n, p, v), (m, q, w) in zip(before["params"], after["params"], strict=True)
        if p is q and torch.equal(v, w)
    ]
    checks.equal(f"{what}: params unchanged (identity, value)", len(same), len(before["params"]))
    checks.true(f"{what}: nothing sharded", not any(impl.is_sharded(p) for p in model.parameters()))


def _refused(checks: StrictChecks, what: str, call: Callable[[], Any], exc: type[Exception], names: str) -> None:
    """``call`` raises ``exc`` whose message names ``names``."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the check reports what was raised
        checks.equal(f"{what}: raises", type(err).__name__, exc.__name__)
        checks.true(f"{what}: the message names {names!r}", names in str(err), str(err)[:200])
        return
    checks.true(f"{what}: refused", False, "accepted", exc.__name__)


def _shared_list(model: MLP, mesh: Any) -> None:
    shared = nn.Sequential(model.layers[0], model.layers[1])
    impl.fully_shard([shared, nn.Sequential(model.layers[1])], mesh=mesh)


def bad_input_is_refused_before_any_change() -> None:
    """Every argument of fully_shard, MixedPrecisionPolicy and the HSDPModule setters is checked,
    with TypeError/ValueError naming it, before anything changes."""
    checks = StrictChecks(dp=2)
    mesh, mesh3d = checks.mesh, checks.mesh_of(a=1, b=1, c=2)
    fully_shard, policy = impl.fully_shard, impl.MixedPrecisionPolicy
    stray = nn.Parameter(torch.ones(1))
    refusals: list[tuple[str, Callable[[MLP], Any], type[Exception], str]] = [
        ("non-module", lambda m: fully_shard("layer", mesh=mesh), TypeError, "module"),
        ("empty list", lambda m: fully_shard([], mesh=mesh), ValueError, "module"),
        ("mesh type", lambda m: fully_shard(m, mesh="cpu"), TypeError, "mesh"),
        ("3-D mesh", lambda m: fully_shard(m, mesh=mesh3d), ValueError, "mesh"),
        (
            "int reshard",
            lambda m: fully_shard(m, mesh=mesh, reshard_after_forward=2),
            TypeError,
            "reshard_after_forward",
        ),
        ("placement fn", lambda m: fully_shard(m, mesh=mesh, shard_placement_fn=3), TypeError, "shard_placement_fn"),
        (
            "placement dim",
            lambda m: fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: impl.Shard(5)),
            ValueError,
            "shard_placement_fn",
        ),
        (
            "placement kind",
            lambda m: fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: "x"),
            ValueError,
            "shard_placement_fn",
        ),
        ("mp type", lambda m: fully_shard(m, mesh=mesh, mp_policy="bf16"), TypeError, "mp_policy"),
        ("mp field", lambda m: policy(param_dtype="bf16"), TypeError, "param_dtype"),
        ("mp int dtype", lambda m: policy(reduce_dtype=torch.int32), ValueError, "reduce_dtype"),
        ("offload type", lambda m: fully_shard(m, mesh=mesh, offload_policy=1), TypeError, "offload_policy"),
        ("ignored stray", lambda m: fully_shard(m, mesh=mesh, ignored_params=[stray]), ValueError, "ignored_params"),
        ("replicate type", lambda m: fully_shard(m, mesh=mesh, replicate_params=5), TypeError, "replicate_params"),
        (
            "ignored and replicated",
            lambda m: fully_shard(m, mesh=mesh, ignored_params=[m.layers[0].bias], replicate_params=[m.layers[0].bias]),
            ValueError,
            "ignored_params",
        ),
        ("comm_fusion", lambda m: fully_shard(m, mesh=mesh, comm_fusion="yes"), TypeError, "comm_fusion"),
        ("device", lambda m: fully_shard(m, mesh=mesh, device="meta"), ValueError, "device"),
        ("shared in list", lambda m: _shared_list(m, mesh), ValueError, "share"),
    ]
    for what, call, exc, names in refusals:
        model = MLP(DIMS)
        before = _snapshot(model)
        _refused(checks, what, lambda call=call, model=model: call(model), exc, names)
        _untouched(checks, what, model, before)

    model = fully_shard(MLP(DIMS), mesh=mesh)
    setters: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
        ("twice", lambda: fully_shard(model, mesh=mesh), ValueError, "already"),
        ("reduce op", lambda: model.set_reduce_op_type("max"), ValueError, "reduce_op_type"),
        ("sync flag", lambda: model.set_requires_gradient_sync(1), TypeError, "requires_gradient_sync"),
        ("recurse", lambda: model.set_reshard_after_forward(True, recurse="no"), TypeError, "recurse"),
        ("prefetch", lambda: model.set_modules_to_forward_prefetch([nn.Linear(1, 1)]), TypeError, "modules"),
        ("async flag", lambda: model.unshard(async_op="y"), TypeError, "async_op"),
        ("last backward", lambda: model.set_is_last_backward(None), TypeError, "is_last_backward"),
    ]
    for what, call, exc, names in setters:
        _refused(checks, what, call, exc, names)
