"""The one import point through which cases and tests reach the ``fully_shard`` API.

Everything the kit exercises comes from here, so the same kit can validate another
implementation of the API: put an upstream HyperParallel checkout first on ``sys.path``
(its package is also called ``hyper_parallel``), and this module picks it up.
"""

from hyper_parallel import (
    CPUOffloadPolicy,
    HSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

__all__ = ["fully_shard", "HSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]
