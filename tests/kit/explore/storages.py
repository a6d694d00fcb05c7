"""L4's probe of freed storage: weak references to the storages a sharded module's params use
while it is unsharded, so that once the gather ledger says the module is sharded again the kit can
ask whether resharding freed them (resized to nothing, or collected).

Weak references change nothing they watch: no dispatch mode, no saved-tensor hooks, no strong
reference that would keep a storage an implementation dropped. A storage that is still the
storage of a param's local shard (a shard group of one rank may compute on its shard) is the
sharded param itself, never counted.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tests.kit.explore.gathers import Unit


def alive_bytes(ref: StorageWeakRef) -> int:
    """Bytes the watched storage holds now: 0 once collected or resized to nothing."""
    if ref.expired():
        return 0
    # torch's own way back from a weak storage reference (torch.multiprocessing uses it too)
    storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
    return 0 if storage is None else storage.nbytes()


class UnshardedStorages:
    """Per unit, the storages its params used while unsharded (each once, by storage identity)."""

    def __init__(self) -> None:
        self.watched: dict[Unit, dict[int, StorageWeakRef]] = {}

    def note(self, unit: Unit, tensors: Iterable[torch.Tensor]) -> None:
        """``unit`` is unsharded now and its params are ``tensors``: watch their storages."""
        refs = self.watched.setdefault(unit, {})
        for tensor in tensors:
            ref = StorageWeakRef(tensor.untyped_storage())
            refs.setdefault(ref.cdata, ref)

    def held(self, unit: Unit, shards: Iterable[torch.Tensor]) -> int:
        """Bytes still held by the storages ``unit`` used while unsharded, apart from its local
        ``shards``' own; the collected ones are dropped from the watch."""
        own = {shard.untyped_storage()._cdata for shard in shards}
        refs = self.watched.get(unit, {})
        for key in [key for key, ref in refs.items() if ref.expired()]:
            del refs[key]
        return sum(alive_bytes(ref) for key, ref in refs.items() if key not in own)
