"""Rank bodies of the engine's tensor-parallel test: TP on one mesh dim, fully_shard without comm
fusion on the other."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.kit.judging.checks import StrictChecks
from tests.kit.judging.recorder import CollectiveRecorder
from tests.kit.judging.reference import ddp_of
from tests.kit.judging.surface import impl
from tests.kit.runtime.torch_compat import unflattened_mesh
from tests.kit.workloads.models import FeedForwardStack, rank_batches
from tests.kit.workloads.training import differs_across_ranks, shard_nested, square_mean, train_against


def tp_unfused_matches_ddp() -> None:
    """tp 2 x dp 2: Colwise/Rowwise blocks inside fully_shard(comm_fusion=False) over dp reduce-
    scatter one param at a time and train 3 SGD steps like DDP over the 4 ranks."""
    checks = StrictChecks("TP + FSDP fp32", dp=2, tp=2)
    mesh = checks.mesh
    model = FeedForwardStack()
    ddp = ddp_of(model)
    for block in model.blocks:
        parallelize_module(block, impl.submesh(mesh, "tp"), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    shard_nested(model, model.blocks, mesh=impl.submesh(mesh, "dp"), comm_fusion=False)
    for name, param in model.blocks.named_parameters():
        names = impl.mesh_dim_names(impl.mesh_of(param)) if impl.is_sharded(param) else None
        checks.equal(f"blocks.{name} on the (dp, tp) mesh", str(names), str(("dp", "tp")))
    # both tp ranks of a dp group need the same batch; DDP's average over 4 ranks then equals
    # the average over the 2 dp batches
    batches = rank_batches(impl.local_rank(mesh, "dp"), (4, 8), steps=3)
    checks.require("dp groups' batches differ", differs_across_ranks(batches[0]))

    # SGD, not Adam: TP sums partial matmuls in another order than DDP; Adam would turn that
    # rounding on a near-zero grad into an lr-sized step difference (see L0-TP)
    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-1, momentum=0.9)

    recorders: list[CollectiveRecorder] = []
    train_against(checks, model, ddp, batches, square_mean, checks.tol, make_optimizer=sgd, recorders=recorders)
    params = len(list(model.parameters()))
    for step, rec in enumerate(recorders):
        checks.equal(f"step {step} reduce-scatters (one per param)", len(rec.of("reduce_scatter")), params)


def _tp_on_a_slice_matches_ddp(dims: dict[str, int], dp_dims: tuple[str, ...], unflattened: bool = False) -> None:
    """Colwise/Rowwise blocks on the ``tp`` slice of a mesh, fully_shard over the ``dp_dims`` slice
    (one dim: FSDP, two: HSDP): each param a DTensor on the dp dims and ``tp`` together, and 3 SGD
    steps train like DDP over the 4 ranks. ``unflattened``: the mesh unflattened from the world's."""
    checks = StrictChecks("TP + FSDP fp32", **dims)
    mesh = unflattened_mesh(checks.mesh.device_type, dims) if unflattened else checks.mesh
    model = FeedForwardStack()
    ddp = ddp_of(model)
    for block in model.blocks:
        parallelize_module(block, impl.submesh(mesh, "tp"), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    shard_nested(model, model.blocks, mesh=impl.submesh(mesh, *dp_dims))
    for name, param in model.blocks.named_parameters():
        names = impl.mesh_dim_names(impl.mesh_of(param)) if impl.is_sharded(param) else None
        checks.equal(f"blocks.{name} on the {(*dp_dims, 'tp')} mesh", str(names), str((*dp_dims, "tp")))
    # the two tp ranks of a data-parallel coordinate need the same batch (dp_dims[0] has size 2)
    batches = rank_batches(impl.local_rank(mesh, dp_dims[0]), (4, 8), steps=3)
    checks.require("data-parallel batches differ", differs_across_ranks(batches[0]))

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-1, momentum=0.9)

    train_against(checks, model, ddp, batches, square_mean, checks.tol, make_optimizer=sgd)


def tp_on_a_3d_mesh_matches_ddp() -> None:
    """TP from a slice of a bigger mesh: FSDP over ``dp`` of (pp 1, dp 2, tp 2) (FSDP2's
    ``test_2d_mlp_with_nd_mesh``), then HSDP over (replicate 2, shard 1) beside tp 2 (its 3-D one)."""
    _tp_on_a_slice_matches_ddp({"pp": 1, "dp": 2, "tp": 2}, ("dp",))
    _tp_on_a_slice_matches_ddp({"dp_replicate": 2, "dp_shard": 1, "tp": 2}, ("dp_replicate", "dp_shard"))


def tp_on_an_unflattened_mesh_matches_ddp() -> None:
    """TP and FSDP on dims unflattened from a 1-D world mesh, as torchtitan makes them (their root,
    the world mesh, names neither dim): FSDP over ``dp`` beside ``tp``, then HSDP beside ``tp``."""
    _tp_on_a_slice_matches_ddp({"dp": 2, "tp": 2}, ("dp",), unflattened=True)
    _tp_on_a_slice_matches_ddp({"dp_replicate": 2, "dp_shard": 1, "tp": 2}, ("dp_replicate", "dp_shard"), True)


def tp_on_a_3d_mesh_without_concatenate_matches_ddp() -> None:
    """A release without ``DeviceMesh._concatenate``: the engine joins the dp and TP dims by name
    from the mesh they were sliced from, and trains as on a release with it."""
    with mock.patch.object(DeviceMesh, "_concatenate", None, create=True):  # torch 2.9 has none
        tp_on_a_3d_mesh_matches_ddp()
