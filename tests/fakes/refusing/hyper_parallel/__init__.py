"""A fake implementation: this repository's engine, refusing three HyperParallel extras with
``NotImplementedError`` (replicated params, unfused collectives, list input)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__path__.append(str(Path(__file__).resolve().parents[4] / "hyper_parallel"))  # noqa: F821 - the package's path

from hyper_parallel.core.fully_shard.api import HSDPModule  # noqa: E402
from hyper_parallel.core.fully_shard.api import fully_shard as _fully_shard  # noqa: E402
from hyper_parallel.core.fully_shard.utils import (  # noqa: E402
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

__all__ = ["fully_shard", "HSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]


def fully_shard(module: Any, *, replicate_params: Any = None, comm_fusion: bool = True, **kwargs: Any) -> Any:
    """The engine's fully_shard without replicated params, unfused collectives or list input."""
    if replicate_params:
        raise NotImplementedError("replicate_params")
    if not comm_fusion:
        raise NotImplementedError("comm_fusion=False")
    if isinstance(module, (list, tuple)):
        raise NotImplementedError("list input")
    return _fully_shard(module, **kwargs)
