"""How one param's shard dim is cut over the ranks of its shard group: the rows each rank holds.

A param sharded on dim ``d`` over ``W`` ranks is cut like ``torch.chunk`` (DTensor's ``Shard(d)``):
every rank's piece has ``c = ceil(n / W)`` rows except the last ones, which may be shorter or empty.
To communicate, every piece is padded to ``c`` rows so all ranks send equal-sized buffers; the
padding never reaches a param or a grad. The all-gather and the reduction read the same layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowLayout:
    """The rows of one param's shard dim cut over ``world`` ranks like ``torch.chunk``: ``rows[r]``
    rows on rank ``r``, each padded to ``chunk`` rows (``padded_shape``) to communicate."""

    dim: int
    world: int
    chunk: int
    rows: tuple[int, ...]
    padded_shape: torch.Size

    @classmethod
    def cut(cls, full_shape: torch.Size, dim: int, world: int) -> RowLayout:
        """``full_shape``'s dim ``dim`` cut over ``world`` ranks (a 0-dim shape: one row, whole)."""
        if not full_shape:
            return cls(0, 1, 1, (1,), full_shape)
        total = full_shape[dim]
        chunk = math.ceil(total / world) if total else 0
        rows = tuple(max(0, min(total, (rank + 1) * chunk) - rank * chunk) for rank in range(world))
        padded = list(full_shape)
        padded[dim] = chunk
        return cls(dim, world, chunk, rows, torch.Size(padded))

    @property
    def padded_numel(self) -> int:
        return math.prod(self.padded_shape)

    @property
    def has_padding(self) -> bool:
        return self.chunk * self.world != sum(self.rows)

    @property
    def rank_major(self) -> bool:
        """Dim-0 cuts without padding: the full tensor is the shards back to back, in rank order, so
        it is all-gathered straight into the unsharded param and reduce-scattered as it is."""
        return self.dim == 0 and not self.has_padding

    def narrow(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s rows of the full tensor."""
        start = min(rank * self.chunk, full.shape[self.dim])  # empty chunks at the end
        return full.narrow(self.dim, start, self.rows[rank])


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a DTensor's global stride)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))
