"""What the mechanics read of the policies ``fully_shard`` takes: the fields, not the classes.

The policy classes are the API's (``hyper_parallel.core.fully_shard.utils``); the mechanics name only
what they read of them, so imports run one way, from the API down to the platform.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Precision(Protocol):
    """A ``MixedPrecisionPolicy``'s fields: the dtypes of compute, reduction and outputs."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    cast_forward_inputs: bool
    apply_grad_on_fp32_main_grad: bool


class CPUOffload(Protocol):
    """A ``CPUOffloadPolicy``'s field: whether the CPU shards are pinned."""

    pin_memory: bool
