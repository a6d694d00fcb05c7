"""The exception ``fully_shard`` raises where torch FSDP2 raises an ``AssertionError``.

HyperParallel's argument checks raise ``ValueError`` naming the argument; torch FSDP2 2.13 raises
``AssertionError`` for some of the same misuses (a module sharded twice, a deep copy, a 2-D mesh
without dim names, a shard dim out of range). One class that is both lets code written against
either API catch it.
"""

from __future__ import annotations

__all__ = ["FullyShardMisuse"]


class FullyShardMisuse(ValueError, AssertionError):
    """A misuse refused before any change: a ``ValueError`` that is also FSDP2's ``AssertionError``."""
