"""Adapter of the toy engine (``toy_fsdp.py``) to the kit's implementation surface: its own mesh
type and its own sharded-tensor convention (plain tensors tagged with a layout), translated.

Load it with the spec ``file:tests/fakes/own_types/adapter.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.kit.judging.surface import Implementation, Spec, import_package


class _Shard:
    """The toy's only placement: dim-0 chunks."""

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Shard) and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(("toy-shard", self.dim))

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


class _Replicate:
    """Never produced by the toy; there for the surface's completeness."""


class OwnTypes(Implementation):
    """The toy engine: 1-D meshes of its own, dim-0 shards as tagged plain tensors."""

    name = "own-types"
    features = frozenset({"fully_shard", "mesh_none"})
    Shard = _Shard
    Replicate = _Replicate

    def __init__(self, spec: Spec) -> None:
        toy = import_package("toy_fsdp", str(Path(spec.path).parent))
        super().__init__(spec, toy)
        self.toy = toy
        self.fully_shard = toy.fully_shard
        self.HSDPModule = toy.HSDPModule
        self.MixedPrecisionPolicy = toy.MixedPrecisionPolicy
        self.OffloadPolicy = toy.OffloadPolicy
        self.CPUOffloadPolicy = toy.CPUOffloadPolicy

    def init_mesh(self, device_type: str, shape: tuple[int, ...], dim_names: tuple[str, ...]) -> Any:
        if len(shape) != 1:
            raise NotImplementedError(f"{len(shape)}-D meshes")
        return self.toy.Mesh(shape[0], dim_names[0])

    def submesh(self, mesh: Any, *dim_names: str) -> Any:
        if dim_names != (mesh.name,):
            raise NotImplementedError("sub-meshes")
        return mesh

    def process_group(self, mesh: Any, dim_name: str) -> Any:
        return mesh.group

    def mesh_dim_names(self, mesh: Any) -> tuple[str, ...]:
        return (mesh.name,)

    def mesh_shape(self, mesh: Any) -> tuple[int, ...]:
        return (mesh.size,)

    def local_rank(self, mesh: Any, dim_name: str) -> int:
        import torch.distributed as dist

        return dist.get_rank(mesh.group)

    def is_sharded(self, tensor: Any) -> bool:
        return self.toy.layout_of(tensor) is not None

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        layout = self.toy.layout_of(tensor)
        return tensor if layout is None else self.toy.gather(tensor, layout)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def placements(self, tensor: torch.Tensor) -> tuple:
        return (_Shard(0),) if self.is_sharded(tensor) else ()

    def mesh_of(self, tensor: torch.Tensor) -> Any:
        layout = self.toy.layout_of(tensor)
        return None if layout is None else layout.mesh


def load(spec: Spec) -> OwnTypes:
    """The toy engine next to this adapter."""
    return OwnTypes(spec)
