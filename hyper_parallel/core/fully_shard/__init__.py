"""``fully_shard`` API and policies."""

from .api import HSDPModule, UnshardHandle, fully_shard
from .utils import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "fully_shard",
    "HSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
]
