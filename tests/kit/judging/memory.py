"""Per-rank memory probe of a block, two measures on any device:

- ``peak``: the peak bytes of live tensors. An accelerator: its allocator's peak (``tests.kit.runtime.devices``). CPU: a
  dispatcher-level tracker (a ``TorchDispatchMode``) of the storages of ``holding`` (modules: params,
  grads, buffers; optimizers: their state), counted from the start, and of every storage the block's
  ops create or touch, counted from then on; each at its current size while it is alive, so
  ``UntypedStorage.resize_`` (how FSDP frees and re-allocates unsharded params) counts too.
- ``saved_bytes``: the peak bytes of the distinct storages autograd holds for backward, at their
  current size (a param storage freed by resharding after forward counts 0 until re-gathered).

``bytes`` is the measure the plan's cases compare (L2-04, "peak memory"): the allocator's peak above
the start on an accelerator, the peak of live storages (``peak``) on CPU; both count the recomputation, the
unsharded params and the grads, not only what autograd saves. Both drop under activation
checkpointing, and so does ``saved_bytes``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.kit.judging.surface import impl
from tests.kit.runtime.devices import allocator_peak, allocator_start, has_allocator
from tests.kit.runtime.torch_compat import is_plain_dispatch


@dataclass
class MemoryPeak:
    """Filled in when the ``peak_memory`` block ends."""

    bytes: int = 0  # the plan's measure: the accelerator's allocator peak above the start; CPU: live storages
    what: str = ""
    peak: int = 0  # peak bytes of live tensors (see the module docstring)
    saved_bytes: int = 0  # peak bytes held for backward


def _storage(tensor: Any) -> torch.UntypedStorage | None:
    """The storage behind a tensor (a sharded tensor's local shard, read through the implementation
    surface), or None (no storage, fake or meta)."""
    if not isinstance(tensor, torch.Tensor):
        return None
    if impl.is_sharded(tensor):
        tensor = impl.local(tensor)
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return None if storage.device.type == "meta" else storage


class _StorageBytes:
    """Bytes of the storages seen (live and held for backward), kept up to date; keeps the peaks."""

    def __init__(self) -> None:
        self.live = 0  # bytes of the storages seen, now
        self.peak = 0
        self.saved = 0  # bytes of the storages held for backward now
        self.saved_peak = 0
        self._size: dict[int, int] = {}  # storage key -> its counted bytes
        self._refs: dict[int, weakref.ref] = {}  # storage key -> weakref whose callback uncounts it
        self._saved: dict[int, int] = {}  # storage key -> live saved tensors using it

    def see(self, storage: torch.UntypedStorage, nbytes: int | None = None) -> int:
        """Count a storage (at ``nbytes``, default its size) from now on, unless counted; returns its key."""
        key = storage._cdata
        if key not in self._size:
            self._size[key] = storage.nbytes() if nbytes is None else nbytes
            self._refs[key] = weakref.ref(storage, functools.partial(self._gone, key))
            self.live += self._size[key]
            self.peak = max(self.peak, self.live)
        return key

    def resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """A storage changed size (from ``before`` bytes)."""
        key = self.see(storage, before)
        delta = storage.nbytes() - self._size[key]
        self._size[key] += delta
        self.live += delta
        self.peak = max(self.peak, self.live)
        if key in self._saved:
            self.saved += delta
            self.saved_peak = max(self.saved_peak, self.saved)

    def _gone(self, key: int, _ref: weakref.ref) -> None:
        """A counted storage was freed."""
        self._unsave(key, everyone=True)
        self.live -= self._size.pop(key, 0)
        self._refs.pop(key, None)

    def pack(self, tensor: torch.Tensor) -> object:
        """Saved-tensor pack hook: count the storage as held for backward while the handle lives."""
        storage = _storage(tensor)
        if storage is None:
            return tensor
        key = self.see(storage)
        self._saved[key] = self._saved.get(key, 0) + 1
        if self._saved[key] == 1:
            self.saved += self._size[key]
            self.saved_peak = max(self.saved_peak, self.saved)
        handle = _Handle(tensor)
        weakref.finalize(handle, self._unsave, key)
        return handle

    @staticmethod
    def unpack(handle: object) -> torch.Tensor:
        """Saved-tensor unpack hook."""
        return handle.tensor if isinstance(handle, _Handle) else handle

    def _unsave(self, key: int, everyone: bool = False) -> None:
        """One saved tensor on the storage was released (``everyone``: the storage itself was freed)."""
        if key not in self._saved:
            return
        self._saved[key] = 0 if everyone else self._saved[key] - 1
        if self._saved[key] == 0:
            del self._saved[key]
            self.saved -= self._size.get(key, 0)

    def close(self) -> None:
        """Stop counting (drop the weakrefs, so their callbacks never fire)."""
        self._refs.clear()
        self._saved.clear()


class _Handle:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _LiveStorages(TorchDispatchMode):
    """Counts the storage of every tensor an op takes or returns (ops on tensor subclasses, such as a
    sharded tensor: the local ops they run)."""

    def __init__(self, counter: _StorageBytes) -> None:
        super().__init__()
        self._counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not all(is_plain_dispatch(kind) for kind in types):
            return NotImplemented  # a subclass with a dispatch of its own runs; its local ops come back here
        kwargs = kwargs or {}
        for value in tree_leaves((args, kwargs)):
            storage = _storage(value)
            if storage is not None:
                self._counter.see(storage)
        out = func(*args, **kwargs)
        for value in tree_leaves(out):
            storage = _storage(value)
            if storage is not None:
                self._counter.see(storage)
        return out


@contextmanager
def _counting_resizes(counter: _StorageBytes) -> Iterator[None]:
    """Route ``UntypedStorage.resize_`` (not a dispatcher op) through the counter inside the block."""
    original: Callable[..., Any] = torch.UntypedStorage.resize_

    @functools.wraps(original)
    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        before = storage.nbytes()
        result = original(storage, size)
        counter.resized(storage, before)
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


def _held_tensors(holding: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors of modules (params, their grads, buffers), optimizers (state) and tensors."""
    for item in holding:
        if isinstance(item, torch.nn.Module):
            yield from item.buffers()
            for param in item.parameters():
                yield param
                if param.grad is not None:
                    yield param.grad
        elif isinstance(item, torch.optim.Optimizer):
            yield from (v for state in item.state.values() for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(item, torch.Tensor):
            yield item


@contextmanager
def peak_memory(device: torch.device | str = "cpu", holding: Iterable[Any] = ()) -> Iterator[MemoryPeak]:
    """Measure this rank's peaks inside the block (see the module docstring; ``holding``: the CPU tracker
    counts the tensors of these modules, optimizers and tensors from the start)."""
    device = torch.device(device)
    result = MemoryPeak()
    counter = _StorageBytes()
    for tensor in _held_tensors(holding):
        storage = _storage(tensor)
        if storage is not None:
            counter.see(storage)
    accelerator = has_allocator(device)
    if accelerator:
        base = allocator_start(device)
    tracker = _LiveStorages(counter) if not accelerator else None
    try:
        with _counting_resizes(counter), torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            if tracker is None:
                yield result
            else:
                with tracker:
                    yield result
    finally:
        counter.close()
    result.saved_bytes = counter.saved_peak
    if accelerator:
        result.peak = allocator_peak(device)
        result.bytes = result.peak - base
        result.what = f"{device.type} allocator peak above the start"
    else:
        result.peak = counter.peak
        result.bytes = counter.peak
        result.what = "peak bytes of live storages"
