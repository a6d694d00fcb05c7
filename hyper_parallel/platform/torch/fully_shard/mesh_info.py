"""A group's mesh, described once: its shard dimension and (for HSDP) replicate dimension, the
compute device this rank uses on it, whether its backend averages, and the post-forward meshes an
int ``reshard_after_forward`` keeps params on."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate

from ..compat import backend_averages, joined_mesh
from ..device import current_device, default_device_type


@dataclass(frozen=True)
class PostForwardMesh:
    """Where ``reshard_after_forward=k`` keeps params after forward: the mesh's ranks in rows of k
    consecutive ranks (dim 1 shards within a row), and this rank's row as a process group."""

    mesh: DeviceMesh
    group: ProcessGroup
    size: int


_POST_FORWARD_ATTR = "_hsdp_post_forward_meshes"


@dataclass(frozen=True)
class MeshInfo:
    """A 1-D mesh shards over its only dim; a 2-D mesh replicates over dim 0, shards over dim 1."""

    mesh: DeviceMesh
    device: torch.device  # the compute device this rank uses on the mesh
    shard_group: ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: ProcessGroup | None
    replicate_size: int
    # the groups' backend reduces with ReduceOp.AVG (gloo before torch 2.8 and HCCL do not: SUM, then
    # a division); asked once, when the group's mesh is split, never per reduction
    averages: bool = True

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_group is not None

    def placements(self, inner: Placement) -> tuple[Placement, ...]:
        """DTensor placements on the mesh for a param placed as ``inner`` on the shard dim."""
        return (Replicate(), inner) if self.is_hsdp else (inner,)

    def post_forward(self, size: int) -> PostForwardMesh:
        """The post-forward mesh of ``size`` ranks per row over this mesh. Made once per mesh and size
        (making one is a collective of the mesh's ranks) and kept on the mesh object itself, so it
        lives and dies with the process groups it was made from."""
        per_mesh = self.mesh.__dict__.setdefault(_POST_FORWARD_ATTR, {})
        if size not in per_mesh:
            rows = self.mesh.mesh.reshape(-1, size)
            mesh = DeviceMesh(self.mesh.device_type, rows)
            per_mesh[size] = PostForwardMesh(mesh, mesh.get_group(1), size)
        return per_mesh[size]


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole world on the default device type (the accelerator when present)."""
    if not torch.distributed.is_initialized():
        raise RuntimeError("fully_shard(mesh=None) needs torch.distributed to be initialized")
    return init_device_mesh(default_device_type(), (torch.distributed.get_world_size(),))


def mesh_info_of(mesh: DeviceMesh) -> MeshInfo:
    """Split a validated 1-D or 2-D mesh into its shard and replicate process groups."""
    averages = backend_averages(mesh.get_group(0), mesh.device_type)
    device = current_device(mesh.device_type)
    if mesh.ndim == 1:
        return MeshInfo(mesh, device, mesh.get_group(0), mesh.size(0), mesh.get_local_rank(0), None, 1, averages)
    return MeshInfo(
        mesh,
        device,
        shard_group=mesh.get_group(1),
        shard_size=mesh.size(1),
        shard_rank=mesh.get_local_rank(1),
        replicate_group=mesh.get_group(0),
        replicate_size=mesh.size(0),
        averages=averages and backend_averages(mesh.get_group(1), mesh.device_type),
    )


def with_tensor_parallel(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of a param sharded over ``dp_mesh`` whose TP-local tensor is ``tp_mesh``'s: their dims,
    dp's first (FSDP2's 2-D or, under HSDP, 3-D layout), however the two were cut from one mesh."""
    return joined_mesh([dp_mesh, tp_mesh])
