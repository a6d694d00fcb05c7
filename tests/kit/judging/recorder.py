"""Records the collectives a rank issues, whatever implementation issues them and however.

A ``TorchDispatchMode`` watches the c10d ops at the dispatcher for the duration of a ``with``
block: every ``torch.distributed`` call (positional or keyword arguments, any alias), every
``ProcessGroup`` method called from Python or C++, and the functional collectives end there.
Recorded per call: op kind, dtype, the element count this rank contributes, group size, and the
bytes it puts on the wire under the ring algorithm. Ops issued from inside another tensor
subclass's dispatch (e.g. a DTensor redistribution) are not seen.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.kit.runtime.torch_compat import dispatch_with_inplace_view, resolve_process_group


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as this rank issued it."""

    op: str  # all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, send, recv
    dtype: torch.dtype | None
    numel: int  # elements this rank contributes (the input of a gather / scatter)
    group_size: int
    group: str = ""  # the process group's name: two groups over the same ranks are told apart

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends under the ring algorithm (all-gather and reduce-scatter: (W-1) x
        shard; all-reduce: 2 (W-1)/W x buffer; all-to-all: (W-1)/W x input; others: the buffer)."""
        size = self.numel * (self.dtype.itemsize if self.dtype is not None else 0)
        w = self.group_size
        if self.op == "all_gather":
            return (w - 1) * size
        if self.op in ("reduce_scatter", "all_to_all"):
            return (w - 1) / w * size
        if self.op == "all_reduce":
            return 2 * (w - 1) / w * size
        return float(size)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op argument (a tensor, or nested lists of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _group_of(args: tuple) -> tuple[int, str]:
    """Size and name of the process group among an op's arguments (the boxed ProcessGroup script object)."""
    for value in args:
        if isinstance(value, torch.ScriptObject) and "ProcessGroup" in str(value._type()):
            group = dist.ProcessGroup.unbox(value)
            return group.size(), group.group_name
    return 1, ""


# c10d op name -> (recorded kind, index of the argument holding what this rank contributes)
_OPS: dict[str, tuple[str, int]] = {
    "_allgather_base_": ("all_gather", 1),
    "allgather_": ("all_gather", 1),
    "allgather_coalesced_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
}


# functional collectives (``_c10d_functional``): kind; the input is their first argument
_FUNCTIONAL: dict[str, str] = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def _functional_group_of(args: tuple) -> tuple[int, str]:
    """Size and name of the group a functional collective names (its last string argument)."""
    names = [a for a in args if isinstance(a, str)]
    try:
        return (resolve_process_group(names[-1]).size(), names[-1]) if names else (1, "")
    except (RuntimeError, ValueError, KeyError):
        return 1, ""


def _contribution(name: str, index: int, args: tuple) -> list[torch.Tensor]:
    """What this rank puts in: for list-of-lists inputs (reduce_scatter_) the first rank's list."""
    value = args[index] if len(args) > index else None
    if name == "reduce_scatter_" and isinstance(value, (list, tuple)) and value:
        value = value[0]
    return _tensors(value)


class CollectiveRecorder:
    """The calls seen inside ``record_collectives()``, in issue order."""

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        self._lock = threading.Lock()

    def of(self, op: str) -> list[CollectiveCall]:
        return [c for c in self.calls if c.op == op]

    def counts(self) -> Counter:
        return Counter(c.op for c in self.calls)

    def wire_bytes(self) -> float:
        """Bytes this rank sent in all recorded calls (ring algorithm)."""
        return sum(c.wire_bytes for c in self.calls)

    def note(self, namespace: str, name: str, args: tuple) -> None:
        """Record one c10d op by its name and arguments (ignored unless it is a collective)."""
        if namespace == "c10d":
            if name not in _OPS:
                return
            kind, index = _OPS[name]
            tensors, (group_size, group) = _contribution(name, index, args), _group_of(args)
        else:
            if name not in _FUNCTIONAL:
                return
            kind, tensors, (group_size, group) = _FUNCTIONAL[name], _tensors(args[0]), _functional_group_of(args)
        call = CollectiveCall(
            op=kind,
            dtype=tensors[0].dtype if tensors else None,
            numel=sum(t.numel() for t in tensors),
            group_size=group_size,
            group=group,
        )
        with self._lock:
            self.calls.append(call)


class _C10dSpy(TorchDispatchMode):
    """Passes every op through; tells the recorder about the c10d ones.

    A collective writes into its output in place, and autograd learns of that through the version
    counter, which the ADInplaceOrView kernel bumps. Redispatched from a mode, a c10d op would run
    with that key excluded, so the write would go unseen: a collective refilling a buffer autograd
    saved would no longer fail its saved-tensor check, and the recorder would hide a real bug. The
    op therefore runs with ADInplaceOrView back in the dispatch set, as it would without the mode.
    """

    def __init__(self, notify: Callable[[str, str, tuple], None]) -> None:
        super().__init__()
        self._notify = notify

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace not in ("c10d", "_c10d_functional", "c10d_functional"):
            return func(*args, **(kwargs or {}))
        self._notify(func.namespace, func._opname, tuple(args))
        return dispatch_with_inplace_view(func, args, kwargs or {})


@contextmanager
def record_collectives() -> Iterator[CollectiveRecorder]:
    """Record every collective this process issues inside the block."""
    recorder = CollectiveRecorder()
    with _C10dSpy(recorder.note):
        yield recorder
