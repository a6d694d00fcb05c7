"""Extra L0 cases L0-FSDP2-*, beyond the plan: how FSDP2 users build and convert a sharded model -- deferred
init on the meta device (``to_empty``, then a DCP load or ``reset_parameters``) and ``module.to(dtype)``
after ``fully_shard``. Each trains a small MLP against DDP for two steps, on 2 ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.checks import device_type
from tests.kit.judging.reference import ddp_of, named_params
from tests.kit.judging.surface import impl
from tests.kit.runtime.devices import compute_device
from tests.kit.workloads.models import DIMS, MLP
from tests.kit.workloads.training import (
    differs_across_ranks,
    distinct_batches,
    raises_nothing,
    shard_nested,
    shared_tmpdir,
    square_mean,
    train_against,
)


# -- deferred init -------------------------------------------------------------------------------
def _deferred_mlp(mesh: Any) -> MLP:
    """The MLP built on the meta device, sharded (nested), then materialised empty on this rank's device."""
    with torch.device("meta"):
        model = MLP(DIMS)
    shard_nested(model, model.layers, mesh=mesh)
    model.to_empty(device=compute_device())
    return model


def _check_materialised(ctx: CaseContext, label: str, model: nn.Module) -> None:
    """Every param is sharded and held on this rank's device, none left on the meta device."""
    device = compute_device().type
    for name, param in model.named_parameters():
        local = impl.local(param)
        ctx.true(f"{label}: {name} is sharded", impl.is_sharded(param), type(param).__name__, "sharded")
        on_device = not param.is_meta and not local.is_meta and local.device.type == device
        ctx.true(f"{label}: {name} materialised on {device}", on_device, str(local.device), device)


def _poison(model: nn.Module) -> None:
    """NaN into every param, so a load that leaves one untouched cannot pass by the memory's luck."""
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))


def _check_values(ctx: CaseContext, label: str, model: nn.Module, expected: nn.Module) -> None:
    """Every param's whole value equals ``expected``'s, bitwise (a load copies)."""
    ours = named_params(model)
    for name, param in named_params(expected).items():
        ctx.equal(f"{label}: {name} = the reference's", ours[name], param)


def _full_load(ctx: CaseContext) -> None:
    """Rank 0's full state dict broadcast into the deferred model, which then trains like DDP."""
    template = MLP(DIMS)
    ddp = ddp_of(template)
    model = _deferred_mlp(ctx.mesh)
    _check_materialised(ctx, "after to_empty", model)
    _poison(model)
    full = template.state_dict() if ctx.rank == 0 else {}  # the other ranks receive rank 0's
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    _check_materialised(ctx, "full load", model)
    _check_values(ctx, "full load", model, template)
    train_against(ctx, model, ddp, distinct_batches(ctx), square_mean, ctx.tol, label="full load")


def _sharded_load(ctx: CaseContext) -> None:
    """A DCP checkpoint of a normally built sharded model loaded into the deferred one; trains like DDP."""
    source = MLP(DIMS, seed=5)
    ddp = ddp_of(source)
    shard_nested(source, source.layers, mesh=ctx.mesh)
    model = _deferred_mlp(ctx.mesh)
    _poison(model)
    with shared_tmpdir() as path:
        dcp.save(get_model_state_dict(source), checkpoint_id=path)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)
    _check_materialised(ctx, "sharded load", model)
    _check_values(ctx, "sharded load", model, ddp.module)
    train_against(ctx, model, ddp, distinct_batches(ctx), square_mean, ctx.tol, label="sharded load")


@case(
    "L0-FSDP2-deferred_init",
    "test_fsdp2_deferred_init",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("deferred_init",),
)
def deferred_init(ctx: CaseContext) -> None:
    """An MLP built on the meta device, sharded, to_empty'd: every param sharded on this rank's device;
    rank 0's full state dict (set_model_state_dict, broadcast_from_rank0) and a DCP checkpoint of a
    sharded model load bitwise, and each trains like DDP."""
    _full_load(ctx)
    ctx.run_part("sharded load (dcp.save of a sharded model, dcp.load)", ("dcp",), lambda: _sharded_load(ctx))


# -- reset_parameters ----------------------------------------------------------------------------
def _init_bound(module: nn.Linear) -> float:
    """nn.Linear's init draws weight and bias from U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return 1 / math.sqrt(module.in_features)


# torch.distributed.tensor._random.is_rng_supported_mesh: DTensor's random ops keep one stream over
# the shards only on accelerators; on the CPU each rank draws its shard from its own generator
CPU_DRAWS = (
    "the ranks' shards differ: not judged on the CPU, where torch's DTensor random ops draw each shard "
    "from the rank's own generator (one seed: the same values on every rank)"
)


def _check_random_init(ctx: CaseContext, model: MLP) -> None:
    """Each param: finite, not all zero, within nn.Linear's bound, its shards not copies of each other."""
    for i, layer in enumerate(model.layers):
        for kind, param in (("weight", layer.weight), ("bias", layer.bias)):
            name, whole = f"layers.{i}.{kind}", impl.full(param).detach()
            ctx.true(f"{name}: sharded", impl.is_sharded(param), type(param).__name__, "sharded")
            ctx.true(f"{name}: finite", bool(torch.isfinite(whole).all()))
            ctx.true(f"{name}: not all zero", bool(whole.abs().max() > 0), float(whole.abs().max()), "> 0")
            ctx.at_most(f"{name}: |value| <= 1/sqrt(fan_in)", whole.abs().max(), _init_bound(layer))
            if device_type() != "cpu":
                shard = impl.local(param).detach()
                ctx.true(f"{name}: the ranks' shards differ (not one draw each)", differs_across_ranks(shard))
    if device_type() == "cpu":
        ctx.notes.append(CPU_DRAWS)


def _full_copy(model: MLP) -> MLP:
    """A plain MLP holding the sharded model's whole values."""
    copy_ = MLP(DIMS)
    ours = named_params(model)
    with torch.no_grad():
        for name, param in copy_.named_parameters():
            param.copy_(impl.full(ours[name]))
    return copy_


@case(
    "L0-FSDP2-reset_parameters",
    "test_fsdp2_reset_parameters",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("deferred_init", "reset_parameters"),
)
def reset_parameters(ctx: CaseContext) -> None:
    """reset_parameters() of each Linear of a meta-built, sharded, to_empty'd MLP runs on the sharded
    params: finite, not zero, within nn.Linear's bound, a different draw on each shard (judged on an
    accelerator only: on the CPU torch's DTensor draws every shard from the same seed); then it trains
    like DDP started from its whole values. Where HSDP is declared, the same on a one-shard-rank mesh
    with AdamW."""
    model = _deferred_mlp(ctx.mesh)
    _poison(model)
    before = [id(p) for p in model.parameters()]
    reset = raises_nothing(
        ctx, "reset_parameters() of every Linear", lambda: [m.reset_parameters() for m in model.layers]
    )
    if reset is None:
        return
    # an optimizer built before the reset still steps the registered params (upstream's #322 rebound them)
    kept = [id(p) for p in model.parameters()] == before
    ctx.true("reset_parameters() keeps every param object (an optimizer built before holds them)", kept)
    _check_random_init(ctx, model)
    ddp = ddp_of(_full_copy(model))
    train_against(ctx, model, ddp, distinct_batches(ctx), square_mean, ctx.tol)
    ctx.run_part("one shard rank (replicate 2 x shard 1)", ("hsdp",), lambda: _one_shard_rank(ctx))


def _one_shard_rank(ctx: CaseContext) -> None:
    """The same on a mesh whose shard dim has one rank (upstream's ``dp_shard == 1`` path, #428: each
    rank's shard is the whole param), trained with AdamW: materialised off the meta device, reset, and
    training like DDP started from its values."""
    model = _deferred_mlp(ctx.mesh_of(replicate=ctx.world_size, shard=1))
    _check_materialised(ctx, "one shard rank, after to_empty", model)
    reset = raises_nothing(
        ctx, "one shard rank: reset_parameters() of every Linear", lambda: [m.reset_parameters() for m in model.layers]
    )
    if reset is None:
        return
    ddp = ddp_of(_full_copy(model))
    train_against(
        ctx, model, ddp, distinct_batches(ctx), square_mean, ctx.tol, make_optimizer=_adamw, label="one shard rank"
    )


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """torch's AdamW as it comes (its foreach implementation where the params allow)."""
    return torch.optim.AdamW(params, lr=1e-2)


# -- module.to(dtype) ----------------------------------------------------------------------------
def _square_mean_as_is(model: Any, x: Any) -> torch.Tensor:
    """Mean of the squared output in the output's own dtype (float64 stays float64)."""
    return model(x).square().mean()


def _check_dtype(ctx: CaseContext, label: str, tensors: Iterable[tuple[str, torch.Tensor | None]]) -> None:
    """Each tensor is sharded and float64, as is what this rank holds of it."""
    for name, tensor in tensors:
        if tensor is None:
            ctx.true(f"{label}: {name} present", False, "None", "a tensor")
            continue
        dtypes = f"{tensor.dtype} / local {impl.local(tensor).dtype}"
        ctx.true(f"{label}: {name} sharded", impl.is_sharded(tensor), type(tensor).__name__, "sharded")
        ctx.equal(f"{label}: {name} dtype", dtypes, "torch.float64 / local torch.float64")


def _double_method(ctx: CaseContext) -> None:
    """``.double()`` of another sharded MLP: float64 sharded params holding the same values."""
    model = MLP(DIMS)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    model.double()
    _check_dtype(ctx, ".double()", model.named_parameters())
    _check_values(ctx, ".double()", model, MLP(DIMS).double())


@case(
    "L0-FSDP2-to_dtype",
    "test_fsdp2_to_dtype",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("to_dtype",),
)
def to_dtype(ctx: CaseContext) -> None:
    """model.to(torch.float64) after sharding: params and grads sharded float64, training in float64 equals
    a float64 DDP; .double() the same."""
    ddp = ddp_of(MLP(DIMS).double())
    model = MLP(DIMS)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    model.to(torch.float64)
    _check_dtype(ctx, "after .to(float64)", model.named_parameters())

    def grads_double(step: int) -> None:
        _check_dtype(ctx, f"step {step} grads", ((n, p.grad) for n, p in model.named_parameters()))

    batches = [batch.double() for batch in distinct_batches(ctx)]
    train_against(ctx, model, ddp, batches, _square_mean_as_is, ctx.tol, after_backward=grads_double)
    _double_method(ctx)
