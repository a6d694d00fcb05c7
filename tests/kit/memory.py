"""Per-rank memory probe: the allocator's peak on CUDA; on CPU, the peak bytes autograd holds
for backward (what activation checkpointing and resharding are meant to reduce)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class MemoryPeak:
    """Filled in when the ``peak_memory`` block ends."""

    bytes: int = 0
    what: str = ""


class _SavedTensorBytes:
    """Counts distinct storages saved for backward while they are alive; keeps the peak."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._holders: dict[int, int] = {}  # storage address -> live saved tensors using it

    def pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if self._holders.get(key, 0) == 0:
            self.current += size
            self.peak = max(self.peak, self.current)
        self._holders[key] = self._holders.get(key, 0) + 1
        handle = _Handle(tensor)
        weakref.finalize(handle, self._release, key, size)
        return handle

    @staticmethod
    def unpack(handle: _Handle) -> torch.Tensor:
        return handle.tensor

    def _release(self, key: int, size: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.current -= size


class _Handle:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@contextmanager
def peak_memory(device: torch.device | str = "cpu") -> Iterator[MemoryPeak]:
    """Measure this rank's peak inside the block (CUDA: allocator peak; CPU: saved-for-backward)."""
    device = torch.device(device)
    result = MemoryPeak()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result.bytes = torch.cuda.max_memory_allocated(device) - base
        result.what = "CUDA allocator peak above the start"
        return
    counter = _SavedTensorBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        yield result
    result.bytes = counter.peak
    result.what = "peak bytes saved for backward"
