"""Rank bodies of the engine's state-dict tests: full state dicts through torch's
``get_model_state_dict`` / ``set_model_state_dict``, a state dict taken while the params are
unsharded, a sharded state dict assigned into a meta-built model, and the L0-DCP case's body on an HSDP mesh."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import distribute_tensor

from tests.kit.judging.checks import StrictChecks
from tests.kit.judging.layout import local_numel
from tests.kit.judging.reference import ddp_of, full
from tests.kit.judging.surface import impl
from tests.kit.workloads.models import MLP, rank_batch, rank_batches
from tests.kit.workloads.training import named_params, shard_nested, square_mean, train_against
from tests.torch.fully_shard._test_fully_shard import dcp_round_trip

DIMS = (7, 13, 5, 3)


def full_state_dict_round_trip() -> None:
    """After 2 steps equal to DDP: get_model_state_dict(full_state_dict=True) holds plain tensors
    equal to DDP's weights; set_model_state_dict loads them into a fresh sharded model bitwise,
    keeping it sharded; with the params left unsharded by a forward, state_dict() still holds
    sharded tensors of the same values."""
    checks = StrictChecks("FSDP 1D fp32")
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=checks.mesh)
    train_against(checks, model, ddp, rank_batches(checks.rank, (4, DIMS[0])), square_mean, checks.tol)

    options = StateDictOptions(full_state_dict=True)
    full_sd = get_model_state_dict(model, options=options)
    ref_sd = ddp.module.state_dict()
    checks.equal("full state dict keys", str(sorted(full_sd)), str(sorted(ref_sd)))
    for name, ref in ref_sd.items():
        checks.true(f"full state dict {name} a plain tensor", not impl.is_sharded(full_sd[name]))
        checks.close(f"full state dict {name} vs DDP", full_sd[name], ref, checks.tol.grad)

    fresh = MLP(DIMS, seed=11)
    shard_nested(fresh, fresh.layers, mesh=checks.mesh)
    saved = named_params(model)
    checks.require(
        "the fresh model differs before loading",
        any(not torch.equal(full(p), full(saved[n])) for n, p in named_params(fresh).items()),
    )
    set_model_state_dict(fresh, full_sd, options=options)
    for name, param in named_params(fresh).items():
        checks.true(f"loaded {name} sharded", impl.is_sharded(param), type(param).__name__)
        checks.equal(f"loaded {name} == saved", param, saved[name])

    model.set_reshard_after_forward(False)
    model(rank_batch(9, checks.rank, (4, DIMS[0])))
    checks.require(
        "the forward left every param unsharded", all(local_numel(p) == p.numel() for p in model.parameters())
    )
    unsharded = named_params(model)
    for name, value in model.state_dict().items():
        checks.true(f"state dict while unsharded: {name} sharded", impl.is_sharded(value), type(value).__name__)
        checks.equal(f"state dict while unsharded: {name} value", value, unsharded[name])


def assigned_after_meta_init() -> None:
    """Built on the meta device, sharded, then given a sharded state dict (made from the full one with
    ``distribute_tensor``) by ``load_state_dict(assign=True)``, torchtune's load: ``state_dict()`` before
    the first forward holds the loaded tensors (the engine had kept the meta ones until a forward), an
    optimizer built then trains them = DDP, and that early state dict holds the trained values after."""
    checks = StrictChecks("FSDP 1D fp32")
    plain = MLP(DIMS)
    with torch.device("meta"):
        model = MLP(DIMS)
    shard_nested(model, model.layers, mesh=checks.mesh)
    loaded = {
        name: distribute_tensor(plain.state_dict()[name], meta.device_mesh, meta.placements)
        for name, meta in model.state_dict().items()
    }
    model.load_state_dict(loaded, assign=True)
    early = model.state_dict()
    for name, value in early.items():
        checks.true(f"state_dict() after the load: {name} not meta", not impl.local(value).is_meta)
        checks.equal(f"state_dict() after the load: {name} = the loaded tensor", value, loaded[name])
    train_against(checks, model, ddp_of(plain), rank_batches(checks.rank, (4, DIMS[0])), square_mean, checks.tol)
    trained = named_params(model)
    for name, value in early.items():
        checks.equal(f"the state dict taken before training: {name} = the trained param", value, trained[name])


def hsdp_dcp_round_trip() -> None:
    """The L0-DCP case's body (torch.distributed.checkpoint save, load into a fresh sharded model,
    bitwise params and Adam state, next step identical and = DDP) on a (replicate 2, shard 2) mesh."""
    dcp_round_trip(StrictChecks("HSDP 2D fp32", replicate=2, shard=2))
