"""Plan cases L0-ARGS-*: argument validation, one case per API entry point (``fully_shard``, the
policies, each ``HSDPModule`` method). Every bad argument is refused with ``TypeError`` or
``ValueError`` naming it, before anything changes: the model keeps its classes, its params (the
same objects, the same values) and its hooks; afterwards it still trains like DDP.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.checks import raised
from tests.kit.judging.reference import ddp_of
from tests.kit.judging.surface import impl
from tests.kit.workloads.models import DIMS, MLP, rank_batches
from tests.kit.workloads.training import named_params, shard_nested, square_mean, train_against

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


@dataclass(frozen=True)
class Refusal:
    """A bad call: what is wrong, the call (given the model and the case context), and the argument
    its error must name."""

    what: str
    call: Callable[[nn.Module, CaseContext], Any]
    argument: str
    setup: Callable[[nn.Module], None] | None = None  # run before the snapshot
    method: str | None = None  # an HSDPModule method whose parameter ``position`` is the argument
    position: int = 0


def _names_of(refusal: Refusal, model: nn.Module) -> set[str]:
    """The names the error may give the argument: the plan's, and the implementation's own name for
    that parameter of the method (an implementation may call ``requires_gradient_sync`` otherwise)."""
    names = {refusal.argument}
    if refusal.method is not None:
        with contextlib.suppress(TypeError, ValueError, AttributeError, IndexError):
            names.add(list(inspect.signature(getattr(model, refusal.method)).parameters)[refusal.position])
    return names


def _snapshot(model: nn.Module) -> dict[str, Any]:
    """What a refused call must leave as it was: each module's class, attribute names and hook
    counts, each param's identity and value (this rank's part)."""
    return {
        "classes": {name: type(m).__qualname__ for name, m in model.named_modules()},
        "attributes": {name: sorted(vars(m)) for name, m in model.named_modules()},
        "hooks": {name: [len(getattr(m, d, {})) for d in _HOOK_DICTS] for name, m in model.named_modules()},
        "params": {name: (id(p), impl.local(p).detach().clone()) for name, p in named_params(model).items()},
    }


def _refused_untouched(ctx: CaseContext, refusal: Refusal, model: nn.Module) -> None:
    """The call raises TypeError/ValueError naming its argument, and the model is as it was."""
    if refusal.setup is not None:
        refusal.setup(model)
    before = _snapshot(model)
    error = raised(lambda: refusal.call(model, ctx))
    where = refusal.what
    ctx.true(
        f"{where}: refused with TypeError or ValueError",
        isinstance(error, (TypeError, ValueError)),
        repr(error)[:160],
        "TypeError or ValueError",
    )
    names = _names_of(refusal, model)
    named = any(name in str(error) for name in names)
    ctx.true(f"{where}: the error names {refusal.argument!r}", named, str(error)[:160], " or ".join(sorted(names)))
    after = _snapshot(model)
    ctx.equal(f"{where}: module classes unchanged", str(after["classes"]), str(before["classes"]))
    ctx.equal(f"{where}: module attributes unchanged", str(after["attributes"]), str(before["attributes"]))
    ctx.equal(f"{where}: hooks unchanged", str(after["hooks"]), str(before["hooks"]))
    ctx.equal(f"{where}: params are the same objects", str(sorted(after["params"])), str(sorted(before["params"])))
    for name, (identity, value) in before["params"].items():
        now = after["params"].get(name)
        same = now is not None and now[0] == identity and torch.equal(now[1], value)
        ctx.true(f"{where}: param {name} the same object, same value", same)


def _trains_like_ddp(ctx: CaseContext, model: nn.Module, ddp: nn.Module) -> None:
    """After the refusals, two Adam steps still equal DDP."""
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, label="afterwards")


def _mesh3d(ctx: CaseContext) -> Any:
    return ctx.mesh_of(a=1, b=1, c=ctx.world_size)


def _add_shared_pair(model: nn.Module) -> None:
    """Two modules sharing a param, in the model (so the snapshot sees them)."""
    pair = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    pair[1].weight = pair[0].weight
    model.add_module("pair", pair)


def _shard_shared_pair(model: nn.Module, ctx: CaseContext) -> Any:
    """The two modules sharing a param, listed (shard their common parent instead)."""
    return impl.fully_shard([model.pair[0], model.pair[1]], mesh=ctx.mesh)


FULLY_SHARD = [
    Refusal("a non-module", lambda m, c: impl.fully_shard("layer", mesh=c.mesh), "module"),
    Refusal("an empty list", lambda m, c: impl.fully_shard([], mesh=c.mesh), "module"),
    Refusal("a module listed twice", lambda m, c: impl.fully_shard([m.layers[1]] * 2, mesh=c.mesh), "module"),
    Refusal("a module sharded already", lambda m, c: impl.fully_shard(m.layers[0], mesh=c.mesh), "already"),
    Refusal("mesh of the wrong type", lambda m, c: impl.fully_shard(m, mesh="cpu"), "mesh"),
    Refusal("a 3-D mesh", lambda m, c: impl.fully_shard(m, mesh=_mesh3d(c)), "mesh"),
    Refusal(  # an int must divide the shard dim's 2 ranks (2 itself means True: FSDP2's reading)
        "reshard_after_forward=3", lambda m, c: impl.fully_shard(m, mesh=c.mesh, reshard_after_forward=3), "reshard"
    ),
    Refusal(
        "shard_placement_fn not callable",
        lambda m, c: impl.fully_shard(m, mesh=c.mesh, shard_placement_fn=3),
        "shard_placement_fn",
    ),
    Refusal(
        "shard_placement_fn returning Shard(5)",
        lambda m, c: impl.fully_shard(m, mesh=c.mesh, shard_placement_fn=lambda p: impl.Shard(5)),
        "shard_placement_fn",
    ),
    Refusal(
        "shard_placement_fn returning a string",
        lambda m, c: impl.fully_shard(m, mesh=c.mesh, shard_placement_fn=lambda p: "x"),
        "shard_placement_fn",
    ),
    Refusal(
        "mp_policy of the wrong type", lambda m, c: impl.fully_shard(m, mesh=c.mesh, mp_policy="bf16"), "mp_policy"
    ),
    Refusal(
        "offload_policy of the wrong type",
        lambda m, c: impl.fully_shard(m, mesh=c.mesh, offload_policy=1),
        "offload_policy",
    ),
    Refusal(
        "ignored_params not in the module",
        lambda m, c: impl.fully_shard(m, mesh=c.mesh, ignored_params=[nn.Parameter(torch.ones(1))]),
        "ignored_params",
    ),
    Refusal(
        "replicate_params not iterable",
        lambda m, c: impl.fully_shard(m, mesh=c.mesh, replicate_params=5),
        "replicate_params",
    ),
    Refusal(
        "a param both ignored and replicated",
        lambda m, c: impl.fully_shard(
            m, mesh=c.mesh, ignored_params=[m.layers[2].bias], replicate_params=[m.layers[2].bias]
        ),
        "ignored_params",
    ),
    Refusal("comm_fusion='yes'", lambda m, c: impl.fully_shard(m, mesh=c.mesh, comm_fusion="yes"), "comm_fusion"),
    Refusal("a device of another type", lambda m, c: impl.fully_shard(m, mesh=c.mesh, device="meta"), "device"),
    Refusal("two listed modules sharing a param", _shard_shared_pair, "share", setup=_add_shared_pair),
]

MIXED_PRECISION_POLICY = [
    Refusal("param_dtype='bf16'", lambda m, c: impl.MixedPrecisionPolicy(param_dtype="bf16"), "param_dtype"),
    Refusal(
        "reduce_dtype=torch.int32", lambda m, c: impl.MixedPrecisionPolicy(reduce_dtype=torch.int32), "reduce_dtype"
    ),
    Refusal("output_dtype=5", lambda m, c: impl.MixedPrecisionPolicy(output_dtype=5), "output_dtype"),
    Refusal(
        "cast_forward_inputs='no'",
        lambda m, c: impl.MixedPrecisionPolicy(cast_forward_inputs="no"),
        "cast_forward_inputs",
    ),
    Refusal(
        "apply_grad_on_fp32_main_grad=1",
        lambda m, c: impl.MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=1),
        "apply_grad_on_fp32_main_grad",
    ),
]

CPU_OFFLOAD_POLICY = [
    Refusal("pin_memory='yes'", lambda m, c: impl.CPUOffloadPolicy(pin_memory="yes"), "pin_memory"),
]


def _flag(method: str, argument: str, *, recurse: bool = True) -> list[Refusal]:
    """A boolean setter refusing a non-bool flag and (where it takes one) a non-bool ``recurse``."""
    refusals = [Refusal(f"{method}('yes')", lambda m, c: getattr(m, method)("yes"), argument, method=method)]
    if recurse:
        refusals.append(
            Refusal(f"{method}(True, recurse='no')", lambda m, c: getattr(m, method)(True, recurse="no"), "recurse")
        )
    return refusals


def _not_sharded() -> nn.Module:
    return nn.Linear(2, 2)


def _prefetch_refusals(method: str) -> list[Refusal]:
    """A prefetch setter refusing a string and a module that ``fully_shard`` never saw."""
    return [
        Refusal("a string", lambda m, c: getattr(m, method)("layers"), "modules"),
        Refusal("a module not given to fully_shard", lambda m, c: getattr(m, method)([_not_sharded()]), "modules"),
    ]


METHODS: dict[str, tuple[tuple[str, ...], list[Refusal]]] = {
    "set_requires_gradient_sync": (("gradient_sync",), _flag("set_requires_gradient_sync", "requires_gradient_sync")),
    "set_requires_all_reduce": (("all_reduce_control",), _flag("set_requires_all_reduce", "requires_all_reduce")),
    "set_reshard_after_forward": (("reshard_controls",), _flag("set_reshard_after_forward", "reshard_after_forward")),
    "set_reshard_after_backward": (
        ("reshard_controls",),
        _flag("set_reshard_after_backward", "reshard_after_backward"),
    ),
    "set_reduce_op_type": (
        ("reduce_op_type",),
        [
            Refusal(
                "set_reduce_op_type('max')",
                lambda m, c: m.set_reduce_op_type("max"),
                "reduce_op_type",
                method="set_reduce_op_type",
            ),
            Refusal(
                "set_reduce_op_type(5)",
                lambda m, c: m.set_reduce_op_type(5),
                "reduce_op_type",
                method="set_reduce_op_type",
            ),
        ],
    ),
    "set_is_last_backward": (("last_backward",), _flag("set_is_last_backward", "is_last_backward", recurse=False)),
    "set_modules_to_forward_prefetch": (("prefetch",), _prefetch_refusals("set_modules_to_forward_prefetch")),
    "set_modules_to_backward_prefetch": (("prefetch",), _prefetch_refusals("set_modules_to_backward_prefetch")),
    "unshard": (
        ("unshard_reshard",),
        [Refusal("unshard(async_op='y')", lambda m, c: m.unshard(async_op="y"), "async_op")],
    ),
    "zero_grad": (
        ("zero_grad",),
        [Refusal("zero_grad(set_to_none='x')", lambda m, c: m.zero_grad("x"), "set_to_none")],
    ),
}


def _fully_shard_refusals(ctx: CaseContext) -> None:
    """Refusals on a model whose first layer is sharded already; then the rest sharded, trained."""
    model = MLP(DIMS)
    ddp = ddp_of(model)
    impl.fully_shard(model.layers[0], mesh=ctx.mesh)
    for refusal in FULLY_SHARD:
        _refused_untouched(ctx, refusal, model)
    if hasattr(model, "pair"):
        del model.pair  # the shared-param probe, refused: not part of the model to train
    shard_nested(model, model.layers[1:], mesh=ctx.mesh)
    _trains_like_ddp(ctx, model, ddp)


def _policy_refusals(refusals: list[Refusal]) -> Callable[[CaseContext], None]:
    def body(ctx: CaseContext) -> None:
        model = MLP(DIMS)
        ddp = ddp_of(model)
        for refusal in refusals:
            _refused_untouched(ctx, refusal, model)
        shard_nested(model, model.layers, mesh=ctx.mesh)
        _trains_like_ddp(ctx, model, ddp)

    return body


def _method_refusals(refusals: list[Refusal]) -> Callable[[CaseContext], None]:
    def body(ctx: CaseContext) -> None:
        model = MLP(DIMS)
        ddp = ddp_of(model)
        shard_nested(model, model.layers, mesh=ctx.mesh)
        for refusal in refusals:
            _refused_untouched(ctx, refusal, model)
        _trains_like_ddp(ctx, model, ddp)

    return body


def _register(entry: str, needs: tuple[str, ...], body: Callable[[CaseContext], None]) -> None:
    body.__doc__ = f"Bad arguments of {entry}: refused, named, before any change; training afterwards = DDP."
    body.__qualname__ = f"args_{entry}"
    case(
        f"L0-ARGS-{entry}",
        f"test_args_{entry}",
        world_size=2,
        mesh={"dp": 2},
        config="FSDP 1D fp32",
        needs=("argument_checks", *needs),
    )(body)


_register("fully_shard", ("replicate_params", "ignored_params", "comm_fusion", "list_input"), _fully_shard_refusals)
_register("MixedPrecisionPolicy", ("mixed_precision", "main_grad"), _policy_refusals(MIXED_PRECISION_POLICY))
_register("CPUOffloadPolicy", ("cpu_offload",), _policy_refusals(CPU_OFFLOAD_POLICY))
for _entry, (_needs, _refusals) in METHODS.items():
    _register(_entry, _needs, _method_refusals(_refusals))
