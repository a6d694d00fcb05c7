"""Rank bodies of the engine's checkpoint tests: torch.distributed.checkpoint round trips."""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from tests.kit.api import fully_shard
from tests.kit.models import MLP, rank_batch
from tests.kit.reference import assert_close, ddp_of, full
from tests.kit.tolerances import tolerance
from tests.kit.training import case_mesh


def _sharded_mlp(mesh) -> MLP:
    model = MLP((7, 13, 5, 3))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model, opt, step: int) -> torch.Tensor:
    loss = model(rank_batch(step, dist.get_rank(), (4, 7))).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _shared_tmpdir() -> str:
    path = [tempfile.mkdtemp(prefix="hp_dcp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _assert_bitwise(what: str, a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            _assert_bitwise(f"{what}.{key}", a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise(f"{what}[{i}]", x, y)
    elif isinstance(a, torch.Tensor):
        assert isinstance(a, DTensor) == isinstance(b, DTensor), f"{what}: DTensor-ness differs"
        assert torch.equal(full(a), full(b)), f"{what}: tensors differ after load"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def dcp_round_trip(mesh_shape: tuple[int, ...] = (2,)) -> None:
    """Save model + Adam state with DCP, load into a freshly sharded model: bitwise equal,
    and the next step is bitwise equal too."""
    mesh = case_mesh(mesh_shape)
    model = _sharded_mlp(mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        _step(model, opt, step)
    path = _shared_tmpdir()
    try:
        model_sd, opt_sd = get_state_dict(model, opt)
        assert all(isinstance(v, DTensor) for v in model_sd.values()), "sharded state dict holds non-DTensors"
        dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path)

        fresh = _sharded_mlp(mesh)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
        _step(fresh, fresh_opt, 99)  # a different state, to be overwritten by the load
        fresh_sd, fresh_opt_sd = get_state_dict(fresh, fresh_opt)
        state = {"model": fresh_sd, "optim": fresh_opt_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _assert_bitwise("model", get_state_dict(fresh, fresh_opt)[0], get_state_dict(model, opt)[0])
        _assert_bitwise("optim", get_state_dict(fresh, fresh_opt)[1], get_state_dict(model, opt)[1])
        loss, fresh_loss = _step(model, opt, 2), _step(fresh, fresh_opt, 2)
        assert torch.equal(loss, fresh_loss), f"next step loss {loss} != {fresh_loss} after load"
        _assert_bitwise("model after next step", dict(fresh.state_dict()), dict(model.state_dict()))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


def full_state_dict_round_trip() -> None:
    """get_model_state_dict(full) equals DDP's weights; set_model_state_dict(full) loads them
    into a fresh sharded model; a state dict taken mid-iteration is still sharded."""
    mesh = case_mesh((2,))
    model = _sharded_mlp(mesh)
    ddp = ddp_of(MLP((7, 13, 5, 3)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    for step in range(2):
        _step(model, opt, step)
        _step(ddp, ref_opt, step)
    options = StateDictOptions(full_state_dict=True)
    full_sd = get_model_state_dict(model, options=options)
    tol = tolerance("FSDP 1D fp32").grad
    for name, ref in ddp.module.state_dict().items():
        assert not isinstance(full_sd[name], DTensor), f"{name}: full state dict holds a DTensor"
        assert_close(f"full state dict {name}", full_sd[name], ref, tol)
    fresh = _sharded_mlp(mesh)
    set_model_state_dict(fresh, full_sd, options=options)
    for (name, a), b in zip(fresh.named_parameters(), model.parameters(), strict=True):
        assert isinstance(a, DTensor), f"{name} not sharded after set_model_state_dict"
        assert torch.equal(full(a), full(b)), f"{name} differs after full load"
    model.set_reshard_after_forward(False)
    model(rank_batch(0, dist.get_rank(), (4, 7)))  # leaves the params unsharded
    assert all(isinstance(v, DTensor) for v in model.state_dict().values()), "state dict of an unsharded model"
