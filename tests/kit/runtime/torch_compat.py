"""The kit's uses of torch names that are private or differ between releases, each behind one
function with the fallback a release without the name takes, found from what is installed (never a
version table), so the kit runs on torch 2.6 to the newest. ``tests/kit_tests/test_torch_compat.py``
drives every fallback, whatever the installed release takes.

Which release takes which path (measured by ``make test-torch-matrix``, docs/testing.md):

- DTensor's sharding caches: torch 2.13+ has a C++ cache (``torch._C._clear_DTensor_sharding_propagator_cache``)
  and a Python LRU cache with ``cache_clear``; torch 2.6-2.9 only the Python one, a thread-local
  ``LocalLRUCache`` whose ``.cache`` is the LRU of the calling thread (the engine's main thread,
  where every run computes).
- Which meshes were cut from which: torch 2.6 to 2.9 keep it in ``device_mesh._mesh_resources`` (2.6 so
  that an equal mesh of a later run counts as a sub-mesh: ``forget_sub_meshes`` clears it between
  runs); 2.13 keeps it on the mesh itself.
- Functional collectives name their group by a string: ``distributed_c10d._resolve_process_group``.
- ``ReduceOp.AVG``: gloo before torch 2.8 lacks it; the kit's own averages then SUM and divide.
- Meshes unflattened from a 1-D world mesh (``DeviceMesh._unflatten``: torch 2.13 has it, 2.9.1
  not; torchtitan's meshes): their root is the world mesh, which names none of their dims. Without
  it, the same dims come from one named mesh. A sub-mesh's root: ``DeviceMesh._get_root_mesh`` (2.13),
  ``device_mesh._mesh_resources.get_root_mesh`` (2.6 to 2.9).
- ``torch.distributed.pipelining``: on gloo torch 2.9's first p2p of a schedule mismatches its
  sizes (gloo aborts) and torch 2.6 and 2.7's schedules leave p2p works unwaited (1F1B hangs);
  torch 2.6's schedules do not divide the grads by the microbatches. The PP case adapts all three,
  alike for every implementation.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist


def forget_dtensor_specs() -> list[str]:
    """Clear DTensor's sharding caches; return which were cleared. They key specs by value, so an
    equal mesh of an earlier run comes back from them with its process groups named as that run's
    world numbered them (found by a TP test on a 3-D mesh after one on a 2-D mesh: "Could not
    resolve the process group registered under the name 3"). A release whose cache the kit finds
    no way to clear is warned about: run it with fresh engines per case (``--isolate``)."""
    cleared = []
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
        cleared.append("native")
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    if _clear_lru(getattr(propagator, "propagate_op_sharding", None)):
        cleared.append("python")
    else:
        warnings.warn(
            f"torch {torch.__version__}: the kit found no way to clear DTensor's sharding cache; "
            "a run on a mesh equal to an earlier run's may see that run's process groups (use --isolate)",
            RuntimeWarning,
            stacklevel=2,
        )
    return cleared


def forget_sub_meshes() -> list[str]:
    """Forget which meshes were cut from which; return the registries cleared. torch 2.6 to 2.9 keep
    that in ``device_mesh._mesh_resources``, keyed by a mesh's value; on 2.6 a mesh equal to a sub-mesh of an
    earlier run counts as that sub-mesh and cannot be sliced ("Cannot create a submesh from a
    submesh"). Newer releases keep a mesh's root on the mesh itself: nothing to forget there."""
    from torch.distributed import device_mesh

    resources = getattr(device_mesh, "_mesh_resources", None)
    cleared = []
    for name in ("child_to_root_mapping", "root_to_flatten_mapping", "flatten_name_to_root_dims"):
        registry = getattr(resources, name, None)
        if isinstance(registry, dict):
            registry.clear()
            cleared.append(name)
    return cleared


def _clear_lru(cache: Any) -> bool:
    """Clear an ``functools.lru_cache`` (torch 2.13+) or a thread-local wrapper holding one in
    ``.cache`` (torch 2.6-2.9's ``LocalLRUCache``, this thread's LRU); False if it is neither."""
    for candidate in (cache, getattr(cache, "cache", None)):
        clear = getattr(candidate, "cache_clear", None)
        if callable(clear):
            clear()
            return True
    return False


def resolve_process_group(name: str) -> dist.ProcessGroup:
    """The process group a functional collective names by ``name``."""
    from torch.distributed import distributed_c10d

    resolve = getattr(distributed_c10d, "_resolve_process_group", None)
    if resolve is None:
        resolve = torch._C._distributed_c10d._resolve_process_group
    return resolve(name)


def dispatch_with_inplace_view(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``func`` with ADInplaceOrView back in the dispatch set (a TorchDispatchMode excludes it),
    so an in-place collective bumps the version counters autograd checks. Without torch's guard
    the op runs as the mode leaves it, with a warning: a saved tensor refilled would go unseen."""
    guard = getattr(torch._C, "_ForceDispatchKeyGuard", None)
    if guard is None:
        warnings.warn(f"torch {torch.__version__} lacks _ForceDispatchKeyGuard", RuntimeWarning, stacklevel=2)
        return func(*args, **kwargs)
    included = torch._C._dispatch_tls_local_include_set()
    excluded = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.ADInplaceOrView)
    with guard(included, excluded):
        return func(*args, **kwargs)


def is_plain_dispatch(kind: type) -> bool:
    """Whether a tensor subclass leaves ``__torch_dispatch__`` as torch's disabled default."""
    disabled = getattr(torch._C, "_disabled_torch_dispatch_impl", None)
    return kind.__torch_dispatch__ is disabled if disabled is not None else "__torch_dispatch__" not in vars(kind)


@functools.cache
def gloo_averages() -> bool:
    """Whether the installed torch's gloo has ``ReduceOp.AVG``: asked of a one-rank gloo group of
    this process alone (no other rank, no recorded collective), once per process."""
    try:
        probe = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.AVG
        probe.allreduce([torch.zeros(1)], options).wait()
    except RuntimeError as exc:
        if "AVG" in str(exc):
            return False
        raise
    return True


def averages(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group``'s backend (default: the world's) reduces with ``ReduceOp.AVG``."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend:
        return gloo_averages()
    return "hccl" not in backend


def all_reduce_mean(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Average ``tensor`` over ``group`` in place: ``ReduceOp.AVG`` where the backend has it (the
    same result as before on every release that has it), else SUM and a division."""
    if averages(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
        return
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    tensor.div_(dist.get_world_size(group))


def root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was cut from (itself when it is no other's sub-mesh): ``DeviceMesh._get_root_mesh``
    where the release has it (2.13 does, 2.9.1 not), else ``device_mesh._mesh_resources.get_root_mesh``."""
    getter = getattr(mesh, "_get_root_mesh", None)
    return getter() if getter is not None else root_by_mesh_resources(mesh)


def root_by_mesh_resources(mesh: Any) -> Any:
    """``root_mesh`` on a release without ``DeviceMesh._get_root_mesh`` (torch 2.6 to 2.9)."""
    from torch.distributed import device_mesh

    return device_mesh._mesh_resources.get_root_mesh(mesh)


def unflattened_mesh(device_type: str, dims: dict[str, int]) -> Any:
    """A mesh of ``dims`` unflattened from a 1-D mesh over the world, as torchtitan makes its meshes
    (a release without ``DeviceMesh._unflatten``: ``dims`` as one named mesh, its only way)."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes, names = tuple(dims.values()), tuple(dims)
    world = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("world",))
    unflatten = getattr(world, "_unflatten", None)
    if unflatten is None:
        return init_device_mesh(device_type, sizes, mesh_dim_names=names)
    return unflatten(0, sizes, names)


# -- torch.distributed.pipelining on gloo ------------------------------------------------------
def init_p2p_in_float32(ops: list[dist.P2POp]) -> list[dist.P2POp]:
    """A schedule's first p2p with each neighbour (``PipelineStage._get_init_p2p_neighbors_ops``),
    every tensor in float32 as torch 2.13 sends it: torch 2.9 sends the stage index as int64 into
    its peer's 4-byte float32 buffer, which gloo answers by aborting both processes."""
    for op in ops:
        op.tensor = op.tensor.to(torch.float32).reshape(-1)
    return ops


class _EveryWork:
    """The works of one batch of p2p ops, waited for together."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _batch_waiting_every_work(p2p_ops: list[dist.P2POp], desc: str | None = None) -> _EveryWork | None:
    return _EveryWork(dist.batch_isend_irecv(p2p_ops)) if p2p_ops else None


@contextlib.contextmanager
def every_p2p_waited() -> Iterator[None]:
    """Inside: a pipeline schedule waits for every p2p op it batches. torch 2.6 and 2.7's schedules
    wait for the last work of a batch only (``batch_isend_irecv(ops).pop()``); on gloo each op is a
    work of its own, so Schedule1F1B hangs there (seen with a plain two-stage Linear). A release
    whose schedules have ``_wait_batch_p2p`` (2.9 on: they wait for all) is left as it is."""
    schedules = importlib.import_module("torch.distributed.pipelining.schedules")
    if hasattr(schedules, "_wait_batch_p2p"):
        yield
        return
    with mock.patch.object(schedules, "_batch_p2p", _batch_waiting_every_work):
        yield


def scale_grads_as_newer_schedules(schedule: Any, module: Any, microbatches: int) -> None:
    """After a schedule's step: a stage's grads divided by the microbatches, as torch 2.7 on does
    (``scale_grads=True``, for mean losses, ``PipelineStage.scale_grads``). torch 2.6's schedules
    have no such step and leave the sum over the microbatches; a schedule with ``scale_grads``
    has divided already."""
    if hasattr(schedule, "scale_grads"):
        return
    for param in module.parameters():
        if param.grad is not None:
            param.grad.div_(microbatches)
