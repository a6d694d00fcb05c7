"""What differs between the torch releases and the backends the engine runs on, found from what is
installed (never from a version table): each private or young torch name the engine needs is
reached here, with the fallback a release without it takes, so the rest of the engine reads the
same on torch 2.6 and on the newest.

- ``root_mesh``: the mesh a sub-mesh was cut from (``DeviceMesh._get_root_mesh`` on new releases,
  ``device_mesh._mesh_resources.get_root_mesh`` on older ones).
- ``joined_mesh``: one mesh of several meshes' dims, all cut from one mesh (FSDP's dp dims beside
  TP's): ``DeviceMesh._concatenate`` where it exists (as torch FSDP2 joins them: meshes sliced from
  one named mesh or unflattened from the world's, as torchtitan makes them), else the named dims of
  the mesh both were sliced from.
- ``backend_averages``: whether a process group's backend reduces with ``ReduceOp.AVG`` (gloo gained
  it in torch 2.8; HCCL has none): a group whose backend lacks it reduces with SUM and divides.
- ``accelerator_index``: the current accelerator's index (``torch.accelerator.current_device_index``
  from torch 2.7, ``current_device_idx`` in 2.6).
"""

from __future__ import annotations

import functools
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed import device_mesh as device_mesh_module
from torch.distributed.device_mesh import DeviceMesh

# Backends that refuse ReduceOp.AVG whatever the release: torch_npu's ProcessGroupHCCL maps only SUM,
# PRODUCT, MIN and MAX to HCCL and raises "Cannot use ReduceOp.AVG with HCCL" (its unsupportedOp table
# in torch_npu/csrc/distributed/ProcessGroupHCCL.cpp), nor does it map PREMUL_SUM.
SUM_ONLY_BACKENDS = frozenset({"hccl"})


class TorchReleaseLacks(RuntimeError):
    """A feature the installed torch cannot give: named with the release, never a wrong result."""

    def __init__(self, feature: str, missing: str) -> None:
        super().__init__(f"{feature} needs {missing}, which torch {torch.__version__} lacks")


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was cut from (``mesh`` itself when it is not a sub-mesh)."""
    getter = getattr(mesh, "_get_root_mesh", None)
    if getter is not None:
        return getter()
    resources = getattr(device_mesh_module, "_mesh_resources", None)
    if resources is not None and hasattr(resources, "get_root_mesh"):
        return resources.get_root_mesh(mesh)
    raise TorchReleaseLacks(
        "a sub-mesh's parent mesh (tensor parallel beside fully_shard)",
        "DeviceMesh._get_root_mesh or device_mesh._mesh_resources.get_root_mesh",
    )


def joined_mesh(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are ``meshes``' named dims in order. ``ValueError`` (why) where they are not
    distinct dims of one mesh; a release without ``DeviceMesh._concatenate`` also asks that they be
    named dims of the mesh they were sliced from, in that mesh's order."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        try:
            return concatenate(list(meshes))
        except RuntimeError as error:  # other root meshes, or overlapping dims
            raise ValueError(f"they must be distinct dims of one mesh ({error})") from error
    root = root_mesh(meshes[0])
    names = tuple(name for mesh in meshes for name in mesh.mesh_dim_names)
    if root.mesh_dim_names is None or not set(names) <= set(root.mesh_dim_names) or len(set(names)) != len(names):
        raise ValueError(f"they must be distinct dims of one mesh, got dims {names} of a mesh {root.mesh_dim_names}")
    if root[meshes[-1].mesh_dim_names] != meshes[-1]:
        raise ValueError(f"they must be dims of one mesh, {meshes[-1]} is not {root.mesh_dim_names}'s")
    order = [root.mesh_dim_names.index(name) for name in names]
    if order != sorted(order):
        raise ValueError(f"dims {names} must follow their mesh's order {root.mesh_dim_names} (this torch)")
    return root if root.mesh_dim_names == names else root[names]


def accelerator_index() -> int:
    """The index of the accelerator this process computes on."""
    accelerator = torch.accelerator
    getter = getattr(accelerator, "current_device_index", None) or getattr(accelerator, "current_device_idx", None)
    if getter is None:
        raise TorchReleaseLacks("the current accelerator", "torch.accelerator.current_device_index")
    return getter()


def backend_of(group: ProcessGroup, device_type: str) -> str:
    """The backend a group uses for tensors of ``device_type`` ("gloo", "hccl", ...): a group may
    name one per device type ("cpu:gloo,npu:hccl")."""
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    per_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    return per_device.get(device_type, next(iter(per_device.values())))


def backend_averages(group: ProcessGroup, device_type: str) -> bool:
    """Whether ``group``'s backend reduces with ``ReduceOp.AVG`` for tensors of ``device_type``."""
    backend = backend_of(group, device_type)
    if backend in SUM_ONLY_BACKENDS:
        return False
    if backend == "gloo":
        return gloo_averages()
    return True


@functools.cache
def gloo_averages() -> bool:
    """Whether the installed torch's gloo averages with ``ReduceOp.AVG``, in both collectives the
    engine reduces with: asked of a two-rank gloo group of this process alone (two threads; no
    other process takes part, nothing is recorded), once per process, by the values it returns.
    torch 2.6 and 2.7 refuse AVG in all-reduce, and their reduce-scatter sums under AVG without a
    word (so FSDP2 there gets grads times the world size): both read as False. A probe that cannot
    finish also reads as False: SUM and a division are right on every backend."""
    store, answers, groups = dist.HashStore(), [False, False], [None, None]
    ranks = [threading.Thread(target=_probe_rank, args=(store, rank, answers, groups), daemon=True) for rank in (0, 1)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=_PROBE_TIMEOUT.total_seconds())
    # both groups live until both ranks are done: a group destroyed while its peer still connects
    # aborts the process (seen on torch 2.6)
    groups.clear()
    return all(answers)


_PROBE_TIMEOUT = timedelta(seconds=30)


def _probe_rank(store: dist.Store, rank: int, answers: list[bool], groups: list) -> None:
    """One rank of the probe: the mean of 1 and 3 through all-reduce and reduce-scatter with AVG."""
    mine = 1.0 + 2 * rank
    try:
        group = groups[rank] = dist.ProcessGroupGloo(store, rank, 2, _PROBE_TIMEOUT)
        summed = torch.tensor([mine])
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.AVG
        group.allreduce([summed], options).wait()
        scattered = torch.empty(1)
        scatter_options = dist.ReduceScatterOptions()
        scatter_options.reduceOp = dist.ReduceOp.AVG
        group._reduce_scatter_base(scattered, torch.tensor([mine, mine]), scatter_options).wait()
    except (RuntimeError, AttributeError):
        return  # "Cannot use ReduceOp.AVG with Gloo", or a backend without the call: SUM and divide
    answers[rank] = summed.item() == 2.0 and scattered.item() == 2.0


SavedTensorsHooks = tuple  # (pack, unpack), as torch keeps them


def saved_tensors_hooks_on_top() -> tuple[bool, SavedTensorsHooks | None]:
    """(whether the engine can stack saved-tensor hooks of its own over the user's, the pair on top now).

    The engine's hooks (``saved_params.py``) must hand every tensor they are not about to the pair they
    cover (``save_on_cpu``, activation checkpointing), so they need to read it: torch 2.8 and later
    expose it (``_top_saved_tensors_default_hooks``); 2.6 and 2.7 do not, and there the engine pushes
    none (as before: a backward that reaches a resharded param by a path the engine does not hook
    fails as it does on FSDP2). Hooks disabled by torch (``disable_saved_tensors_hooks``) likewise."""
    autograd = torch._C._autograd
    top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    enabled = getattr(autograd, "_saved_tensors_hooks_is_enabled", None)
    if top is None or enabled is None or not enabled():
        return False, None
    return True, top(False)
