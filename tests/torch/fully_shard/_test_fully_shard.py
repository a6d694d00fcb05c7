"""Plan cases of ``_test_fully_shard.py``: the L0 coverage the plan takes as existing."""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.kit.case import CaseContext, case
from tests.kit.checks import device_type
from tests.kit.layout import local_numels_after_forward, padded_shard_numel, shard_shape
from tests.kit.models import MLP, FeedForwardStack, rank_batch, rank_batches
from tests.kit.recorder import CollectiveRecorder
from tests.kit.reference import ddp_of, full
from tests.kit.surface import impl
from tests.kit.tolerances import tolerance
from tests.kit.training import (
    differs_across_ranks,
    named_params,
    record_params,
    shard_nested,
    square_mean,
    train_against,
)

DIMS = (7, 13, 5, 3)
# 13 rows over 2 ranks: 7 + 6; the last layer has 1 row, fewer than the ranks: rank 1 holds none
UNEVEN_DIMS = (7, 13, 5, 1)


@case(
    "L0-01",
    "test_fully_shard_none_mesh",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32", needs=("mesh_none",),
)
def none_mesh(ctx: CaseContext) -> None:
    """mesh=None builds a 1-D mesh over the world; 2 steps equal DDP."""
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers)
    weight = model.layers[0].weight
    shape = impl.mesh_shape(impl.mesh_of(weight)) if impl.is_sharded(weight) else ()
    ctx.true("default mesh is 1-D", len(shape) == 1, len(shape), 1)
    ctx.equal("default mesh spans the world", math.prod(shape), dist.get_world_size())
    train_against(ctx, model, ddp, rank_batches(ctx.rank, (4, DIMS[0])), square_mean, ctx.tol)


@case(
    "L0-02",
    "test_fully_shard_explicit_mesh_nested",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32", needs=("reshard_after_forward",),
)
def explicit_mesh_nested(ctx: CaseContext) -> None:
    """With an explicit 1-D mesh and nested groups, reshard_after_forward=True/False at construction
    leaves shards / full params after forward, and both train like DDP."""
    mesh = ctx.mesh
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    for reshard in (True, False):
        label = f"reshard_after_forward={reshard}"
        model = MLP(DIMS)
        ddp = ddp_of(model)
        full_numel = {name: p.numel() for name, p in model.named_parameters()}
        shard_numel = {
            n: math.prod(shard_shape(p.shape, ctx.world_size, ctx.rank)) for n, p in model.named_parameters()
        }
        ctx.require(
            f"{label}: every param splits over the ranks", all(shard_numel[n] < full_numel[n] for n in full_numel)
        )
        # layers 0 and 1 get groups of their own; the root's group holds layer 2
        shard_nested(model, model.layers[:2], mesh=mesh, reshard_after_forward=reshard)
        elsewhere = sum(impl.mesh_of(p) != mesh for p in model.parameters())
        ctx.equal(f"{label}: params not on the given mesh", elsewhere, 0)
        after_forward = local_numels_after_forward(model)

        train_against(ctx, model, ddp, batches, square_mean, ctx.tol, label=label)
        want = shard_numel if reshard else full_numel
        for step, seen in enumerate(after_forward):
            for name, numel in seen.items():
                ctx.equal(f"{label} step {step} after forward: local numel {name}", numel, want[name])


@case(
    "L0-03",
    "test_fully_shard_uneven_shapes",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32", needs=("uneven",),
)
def uneven_shapes(ctx: CaseContext) -> None:
    """Odd dims and fewer rows than ranks: shards follow torch.chunk, every rank sends shards padded
    to equal size, and training equals DDP."""
    world = ctx.world_size
    model = MLP(UNEVEN_DIMS)
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    ctx.require("some param's rows do not divide by the ranks", any(s[0] % world for s in full_shapes.values()))
    ctx.require("some param has fewer rows than ranks", any(s[0] < world for s in full_shapes.values()))
    padded = sorted(padded_shard_numel(layer, world) for layer in model.layers)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=ctx.mesh)

    for name, param in model.named_parameters():
        ctx.equal(
            f"local shard shape {name}",
            str(tuple(impl.local(param).shape)),
            str(shard_shape(full_shapes[name], world, ctx.rank)),
        )
    recorders: list[CollectiveRecorder] = []
    train_against(
        ctx, model, ddp, rank_batches(ctx.rank, (4, UNEVEN_DIMS[0])), square_mean, ctx.tol, recorders=recorders
    )
    for step, rec in enumerate(recorders):
        sent = sorted({c.numel for c in rec.of("all_gather")})
        ctx.equal(f"step {step} all-gather sizes: shards padded to ceil(rows / ranks)", str(sent), str(padded))
        scattered = sorted({c.numel for c in rec.of("reduce_scatter")})
        ctx.equal(
            f"step {step} reduce-scatter sizes: ranks x padded shard", str(scattered), str([world * n for n in padded])
        )


@case(
    "L0-04",
    "test_fully_shard_cpu_offload",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32", needs=("cpu_offload",),
)
def cpu_offload(ctx: CaseContext) -> None:
    """CPUOffloadPolicy keeps sharded params, grads and optimizer state on the CPU (pinned only where
    an accelerator exists) and trains like DDP. On a CPU-only host the compute device is the CPU too."""
    mesh = ctx.mesh
    policy = impl.CPUOffloadPolicy()
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=mesh, offload_policy=policy)
    pinned = policy.pin_memory and device_type() != "cpu"

    for name, param in model.named_parameters():
        ctx.equal(f"shard device {name}", impl.local(param).device.type, "cpu")
        ctx.equal(f"shard pinned {name}", impl.local(param).is_pinned(), pinned)

    def grads_on_cpu(step: int) -> None:
        for name, param in model.named_parameters():
            ctx.equal(f"step {step} grad device {name}", impl.local(param.grad).device.type, "cpu")

    opt, _ = train_against(
        ctx, model, ddp, rank_batches(ctx.rank, (4, DIMS[0])), square_mean, ctx.tol, after_backward=grads_on_cpu
    )
    devices = {v.device.type for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)}
    ctx.equal("optimizer state devices", str(sorted(devices)), str(["cpu"]))


def _same_as_rank0(ctx: CaseContext, name: str, tensor: torch.Tensor) -> None:
    """Record whether this rank's ``tensor`` is bitwise equal to rank 0's."""
    local = tensor.detach().clone().contiguous()
    rank0 = local.clone()
    dist.broadcast(rank0, src=0)
    ctx.equal(name, local, rank0)


@case(
    "L0-05",
    "test_fully_shard_replicate_params",
    world_size=4,
    mesh={"replicate": 2, "shard": 2},
    config="FSDP 1D fp32", needs=("replicate_params", "hsdp"),
)
def replicate_params(ctx: CaseContext) -> None:
    """replicate_params keeps the chosen params whole and bitwise equal on every rank, on a 1-D and
    a 2-D mesh, while the others shard; both train like DDP."""
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    ctx.require("ranks' batches differ (unsynced grads would differ)", differs_across_ranks(batches[0]))
    for mesh, config in ((ctx.mesh_of(dp=4), "FSDP 1D fp32"), (ctx.mesh, "HSDP 2D fp32")):
        shape = impl.mesh_shape(mesh)
        label = f"mesh {shape}"
        model = MLP(DIMS)
        ddp = ddp_of(model)
        replicated = {"layers.0.bias", "layers.1.weight"}
        params = dict(model.named_parameters())
        full_shapes = {name: tuple(p.shape) for name, p in params.items()}
        impl.fully_shard(model, mesh=mesh, replicate_params=[params[n] for n in sorted(replicated)])

        for name, param in model.named_parameters():
            placements = impl.placements(param)
            if name in replicated:
                ctx.true(
                    f"{label} {name} placements all Replicate",
                    all(isinstance(p, impl.Replicate) for p in placements),
                    str(placements),
                )
                ctx.equal(
                    f"{label} {name} local shape is whole", str(tuple(impl.local(param).shape)), str(full_shapes[name])
                )
            else:
                ctx.true(f"{label} {name} sharded", isinstance(placements[-1], impl.Shard), str(placements))
        train_against(ctx, model, ddp, batches, square_mean, tolerance(config), label=label)
        for name, param in model.named_parameters():
            if name in replicated:
                _same_as_rank0(ctx, f"{label} after training: {name} bitwise equal to rank 0", impl.local(param))


@case(
    "L0-TP",
    "test_fully_shard_tensor_parallel",
    world_size=4,
    mesh={"dp": 2, "tp": 2},
    config="TP + FSDP fp32", needs=("tensor_parallel",),
)
def tensor_parallel(ctx: CaseContext) -> None:
    """Tensor parallel (Colwise/Rowwise) on the tp dim and fully_shard on the dp dim of a (dp, tp)
    mesh train like DDP over all ranks."""
    model = FeedForwardStack()
    ddp = ddp_of(model)
    for block in model.blocks:
        parallelize_module(block, ctx.submesh("tp"), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    shard_nested(model, model.blocks, mesh=ctx.submesh("dp"))
    for name, param in model.blocks.named_parameters():
        names = impl.mesh_dim_names(impl.mesh_of(param)) if impl.is_sharded(param) else None
        ctx.equal(f"blocks.{name} on the (dp, tp) mesh", str(names), str(("dp", "tp")))
    # TP needs the same input on both tp ranks; the dp groups see different ones, so DDP's average
    # over 4 ranks equals the average over the 2 dp batches
    batches = rank_batches(impl.local_rank(ctx.mesh, "dp"), (4, 8))
    ctx.require("dp groups' batches differ", differs_across_ranks(batches[0]))

    # SGD, not Adam: TP sums partial matmuls in another order than DDP, so grads differ by rounding;
    # Adam divides by each grad's own magnitude and would blow that up on near-zero grads.
    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-1, momentum=0.9)

    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, make_optimizer=sgd)


def _shared_tmpdir() -> str:
    """A fresh directory made by rank 0, its path known to every rank."""
    path = [tempfile.mkdtemp(prefix="hpkit_dcp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf of a nested state dict, in a stable order."""
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from _leaves(tree[key], f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}[{i}]")
    else:
        yield prefix, tree


def _record_bitwise(ctx: CaseContext, label: str, ours: dict, reference: dict) -> None:
    """One bitwise check per leaf of the reference state dict; missing or extra entries fail."""
    ours_leaves, ref_leaves = dict(_leaves(ours)), dict(_leaves(reference))
    ctx.equal(f"{label}: entries not in the saved state", str(sorted(set(ours_leaves) - set(ref_leaves))), "[]")
    for path, value in ref_leaves.items():
        if path not in ours_leaves:
            ctx.true(f"{label} {path} present", False, "missing", "saved")
        else:
            ctx.equal(f"{label} {path}", ours_leaves[path], value)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    loss = square_mean(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@case(
    "L0-DCP",
    "test_fully_shard_dcp_round_trip",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32", needs=("dcp",),
)
def dcp_round_trip(ctx: CaseContext) -> None:
    """A torch.distributed.checkpoint of a sharded model and its Adam state loads bitwise into a
    fresh sharded model, which then trains on exactly like the original (and like DDP)."""
    mesh = ctx.mesh
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=mesh)
    opt, ref_opt = train_against(ctx, model, ddp, rank_batches(ctx.rank, (4, DIMS[0])), square_mean, ctx.tol)
    saved_model, saved_optim = get_state_dict(model, opt)
    ctx.true("saved state dict holds sharded tensors", all(impl.is_sharded(v) for v in saved_model.values()))

    fresh = MLP(DIMS, seed=11)
    shard_nested(fresh, fresh.layers, mesh=mesh)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    _train_step(fresh, fresh_opt, rank_batch(99, ctx.rank, (4, DIMS[0])))  # optimizer state the load must replace
    ctx.require(
        "fresh model differs from the saved one before loading",
        any(not torch.equal(full(a), full(b)) for a, b in zip(fresh.parameters(), model.parameters(), strict=True)),
    )
    path = _shared_tmpdir()
    try:
        dcp.save({"model": saved_model, "optim": saved_optim}, checkpoint_id=path)
        fresh_model_sd, fresh_optim_sd = get_state_dict(fresh, fresh_opt)
        state = {"model": fresh_model_sd, "optim": fresh_optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    finally:
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    loaded_model, loaded_optim = get_state_dict(fresh, fresh_opt)
    _record_bitwise(ctx, "loaded params", loaded_model, saved_model)
    _record_bitwise(ctx, "loaded optimizer state", loaded_optim, saved_optim)
    batch = rank_batch(2, ctx.rank, (4, DIMS[0]))
    original, resumed, reference = (
        _train_step(m, o, batch) for m, o in ((model, opt), (fresh, fresh_opt), (ddp, ref_opt))
    )
    ctx.equal("next step loss: resumed == original", resumed, original)
    ctx.close("next step loss: resumed vs DDP", resumed, reference, ctx.tol.loss)
    originals = named_params(model)
    for name, param in named_params(fresh).items():
        ctx.equal(f"next step param {name}: resumed == original", param, originals[name])
    record_params(ctx, "next step resumed vs DDP", fresh, ddp, ctx.tol.grad)
