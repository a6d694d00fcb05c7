"""hyper_parallel: HyperParallel's ``fully_shard`` API implemented on PyTorch (DTensor, c10d)."""

from hyper_parallel.core.fully_shard.api import (
    HSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from hyper_parallel.core.fully_shard.errors import FullyShardMisuse
from hyper_parallel.core.fully_shard.utils import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

__all__ = [
    "fully_shard",
    "HSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "FullyShardMisuse",
]
