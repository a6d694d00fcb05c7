"""Records the collectives a rank issues, whatever implementation issues them.

It wraps the public ``torch.distributed`` collectives for the duration of a ``with`` block,
so any engine that calls them from Python (ours, torch FSDP2) is observed: op, dtype, element
count, group size. DDP's reducer communicates from C++ and is not seen. Functions that are
deprecated aliases of another (e.g. ``all_gather_into_tensor`` -> ``all_gather_single``) are
recorded once, at the outermost call.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

# public name -> the op kind recorded
_WRAPPED = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "broadcast": "broadcast",
}


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as this rank issued it."""

    op: str
    dtype: torch.dtype | None
    numel: int
    group_size: int


class CollectiveRecorder:
    """The calls seen inside ``record()``, in issue order."""

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []

    def of(self, op: str) -> list[CollectiveCall]:
        return [c for c in self.calls if c.op == op]

    def counts(self) -> Counter:
        return Counter(c.op for c in self.calls)


_depth = threading.local()


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def _input_tensor(op: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    # gather/scatter ops take (output, input, ...): the input is what this rank contributes
    if op in ("all_gather", "reduce_scatter", "all_to_all") and len(args) >= 2:
        second = args[1]
        if isinstance(second, torch.Tensor):
            return second
        if isinstance(second, (list, tuple)) and second and isinstance(second[0], torch.Tensor):
            return second[0]
    return _first_tensor(args, kwargs)


def _wrap(name: str, op: str, original, recorder: CollectiveRecorder):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def recorded(*args, **kwargs):
        depth = getattr(_depth, "value", 0)
        if depth == 0:
            tensor = _input_tensor(op, args, kwargs)
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            recorder.calls.append(
                CollectiveCall(
                    op=op,
                    dtype=None if tensor is None else tensor.dtype,
                    numel=0 if tensor is None else tensor.numel(),
                    group_size=dist.get_world_size(group),
                )
            )
        _depth.value = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            _depth.value = depth

    return recorded


@contextmanager
def record_collectives() -> Iterator[CollectiveRecorder]:
    """Record every collective this process issues inside the block."""
    recorder = CollectiveRecorder()
    originals = {n: getattr(dist, n) for n in _WRAPPED if hasattr(dist, n)}
    try:
        for name, original in originals.items():
            setattr(dist, name, _wrap(name, _WRAPPED[name], original, recorder))
        yield recorder
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
