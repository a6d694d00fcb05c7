"""Rank functions for tests/kit_tests/test_torch_compat.py."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist

from tests.kit.runtime import torch_compat


def mean_with_and_without_avg() -> dict[str, list[float]]:
    """This rank's vector averaged over the world with AVG (where gloo has it) and as if it had not."""
    rank, world = dist.get_rank(), dist.get_world_size()
    values = torch.arange(4, dtype=torch.float32) * (rank + 1)
    results = {"expected": (torch.arange(4, dtype=torch.float32) * (world + 1) / 2).tolist()}
    for name, averages in (("avg", torch_compat.averages()), ("sum_only", False)):
        tensor = values.clone()
        with mock.patch.object(torch_compat, "averages", lambda group=None, answer=averages: answer):
            torch_compat.all_reduce_mean(tensor)
        results[name] = tensor.tolist()
    return results


def unflattened_meshes() -> dict[str, list]:
    """The mesh ``unflattened_mesh`` gives for (a 2, b 2) on this torch and on one without
    ``DeviceMesh._unflatten``: its dim names, shape, this rank's coordinates and its root's names; and
    the root of its dim ``a``, found as this torch finds it and as a release without
    ``DeviceMesh._get_root_mesh`` does."""
    from torch.distributed.device_mesh import DeviceMesh

    def described(mesh) -> list:
        root = torch_compat.root_mesh(mesh)
        coordinate = list(mesh.get_coordinate())
        return [list(mesh.mesh_dim_names), list(mesh.shape), coordinate, list(root.mesh_dim_names or ())]

    dims = {"a": 2, "b": 2}
    results = {"installed": described(torch_compat.unflattened_mesh("cpu", dims))}
    with mock.patch.object(DeviceMesh, "_unflatten", None, create=True):
        results["without"] = described(torch_compat.unflattened_mesh("cpu", dims))
    results["has_unflatten"] = [getattr(DeviceMesh, "_unflatten", None) is not None]
    installed = torch_compat.unflattened_mesh("cpu", dims)
    results["root_of_a"] = list(torch_compat.root_mesh(installed["a"]).mesh_dim_names)
    results["root_of_a_without_the_method"] = list(torch_compat.root_by_mesh_resources(installed["a"]).mesh_dim_names)
    results["rank"] = [dist.get_rank()]
    return results


def sliced(dims: dict[str, int], name: str | tuple[str, ...]) -> list[str]:
    """Dim ``name`` sliced from a fresh mesh of ``dims``: its dim names."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    return list(mesh[name].mesh_dim_names)
