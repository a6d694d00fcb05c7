"""A fake implementation: this repository's engine beside a module-level cache of process groups,
as an implementation that sets up its communicators once per process would have. The cached
groups die with the case that made them (unregistered when its process group is destroyed), so
every later case of the process fails where it looks its rank up in them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

__path__.append(str(Path(__file__).resolve().parents[4] / "hyper_parallel"))  # noqa: F821 - the package's path

from hyper_parallel.core.fully_shard.api import HSDPModule  # noqa: E402
from hyper_parallel.core.fully_shard.api import fully_shard as _fully_shard  # noqa: E402
from hyper_parallel.core.fully_shard.utils import (  # noqa: E402
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

__all__ = ["fully_shard", "HSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]

_GROUPS: dict[tuple, Any] = {}  # mesh shape and names -> the first process group of that kind seen


def fully_shard(module: Any, *, mesh: Any = None, **kwargs: Any) -> Any:
    """The engine's fully_shard, after looking this rank up in the cached group of the mesh's kind."""
    if mesh is not None and mesh.ndim == 1:
        group = _GROUPS.setdefault((tuple(mesh.shape), mesh.mesh_dim_names), mesh.get_group())
        dist.get_rank(group)  # raises once that group is gone
    return _fully_shard(module, mesh=mesh, **kwargs)
