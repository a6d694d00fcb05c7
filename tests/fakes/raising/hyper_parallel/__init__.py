"""A fake implementation whose ``fully_shard`` raises: every case that shards must end in ERROR."""

from __future__ import annotations

from typing import Any


class HSDPModule:
    """Never produced."""


class MixedPrecisionPolicy:
    """Accepts anything; never used."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs


class OffloadPolicy:
    """Never used."""


class CPUOffloadPolicy(OffloadPolicy):
    """Never used."""

    def __init__(self, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory


def fully_shard(module: Any, **kwargs: Any) -> Any:
    """Broken on purpose."""
    raise RuntimeError("fake implementation: fully_shard is broken")
