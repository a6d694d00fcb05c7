"""L4's lifetime invariants (a mixin of ``oracle.Example``), judged by measured storage and counts,
not by a symptom elsewhere:

- no storage a param held before ``fully_shard``, nor one a local shard held before, is kept once
  the shard lives elsewhere (a pre-shard copy kept by the engine or its policy objects, an old shard
  beside a flat buffer: upstream's #434, #231, PR #825);
- no storage the model's forward or backward created is alive once every module is sharded again,
  but the grads (a flat gather or reduce buffer kept past its use: #231);
- the hooks registered on the model's modules and params are as many at the end of every step from
  the second on as at the end of the first (hooks registered per step and never removed: #660);
- the objects the implementation holds on the host (reachable from the model and from its own
  modules' globals, by type: ``host_objects``) no more at the end of a later step than of the first;
- every grad is a plain leaf tensor of its param's dtype that aliases no param's data (#692, #629);
- forward and backward write no shard, bit for bit (a compute copy written back over the master: #212).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.kit.explore.host_objects import grown, held_objects
from tests.kit.explore.storages import alive_bytes
from tests.kit.judging.surface import impl
from tests.kit.judging.trace import Untraced

# the hook dicts torch keeps per module (forward, backward, state-dict and load hooks alike)
_MODULE_HOOKS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_PARAM_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def registered_hooks(model: nn.Module) -> int:
    """Hooks registered now on ``model``'s modules and params (each param once, tied or not)."""
    count = sum(len(getattr(module, name, None) or {}) for module in model.modules() for name in _MODULE_HOOKS)
    params = {id(p): p for p in model.parameters()}
    return count + sum(len(getattr(p, name, None) or {}) for p in params.values() for name in _PARAM_HOOKS)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class KeptStorages:
    """Weak references to every storage the params held before sharding and each local shard held
    since; ``kept`` is what of them is still alive apart from the current local shards."""

    def __init__(self) -> None:
        self.watched: dict[int, tuple[str, StorageWeakRef]] = {}

    def watch(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for path, tensor in named:
            if tensor.is_meta:
                continue  # nothing allocated to keep
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue  # a wrapper tensor with no storage of its own
            ref = StorageWeakRef(storage)
            self.watched.setdefault(ref.cdata, (path, ref))

    def kept(self, current: Iterable[torch.Tensor]) -> dict[str, int]:
        """Bytes per param path of watched storages still alive that no current local shard uses."""
        own = {_storage_key(t) for t in current if not t.is_meta}
        kept = self._alive_apart_from(own)
        # a storage only a reference cycle holds is garbage, not kept, and an async collective's work
        # lets its tensors go on the backend's thread a moment after completing: collect, and look
        # again a few times over about a tenth of a second before calling anything kept
        for _ in range(5):
            if not kept:
                break
            gc.collect()
            time.sleep(0.02)
            kept = self._alive_apart_from(own)
        return kept

    def _alive_apart_from(self, own: set[int]) -> dict[str, int]:
        kept: dict[str, int] = {}
        for key, (path, ref) in list(self.watched.items()):
            if ref.expired():
                del self.watched[key]
            elif key not in own and (held := alive_bytes(ref)):
                kept[path] = kept.get(path, 0) + held
        return kept


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's local tensor, any other as it is."""
    return impl.local(tensor) if impl.is_sharded(tensor) else tensor


class _SeeCreated(TorchDispatchMode):
    """Watches (weakly) the storage of every tensor an op returns (of a sharded tensor, its local one)."""

    def __init__(self, watched: KeptStorages) -> None:
        super().__init__()
        self.watched = watched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # a tensor subclass runs its own dispatch inside (unseen): what it returns is watched by its local tensors
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view or alias (detach, view, ...) of a storage made elsewhere, maybe before the step
        self.watched.watch(("", _plain(t)) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@contextmanager
def created_into(watched: KeptStorages) -> Iterator[None]:
    """Inside the block, every storage an op returns is watched by ``watched``."""
    with _SeeCreated(watched):
        yield


class Lifetimes:
    """Storage kept beyond the shards, hooks piling up per step, and what a grad is."""

    def _watch_before_sharding(self) -> None:
        self.kept_storages = KeptStorages()
        self.created = KeptStorages()  # what this step's forwards and backwards created
        self.shards_before: dict[str, torch.Tensor] = {}  # the local shards as a step's forwards start
        self.kept_storages.watch(self.model.named_parameters())
        self.hook_counts: dict[str, int] = {}  # this step's counts (``_check_hooks_flat``)
        self.hooks_in_first_step: dict[str, int] | None = None
        self.held_at_first_end: tuple[str, Any] | None = None  # (where, counts): ``_check_held_objects``

    def _local_shards(self) -> list[tuple[str, torch.Tensor]]:
        return [(path, impl.local(p)) for path, p in self.model.named_parameters()]

    def _check_kept_storages(self, where: str) -> None:
        """Nothing a param held before sharding, or a shard held before, is alive beside its shard now."""
        shards = self._local_shards()
        kept = self.kept_storages.kept(t for _, t in shards)
        self.ctx.equal(
            f"{where}: bytes of storage kept beyond the shards (held before sharding, or by an earlier shard)",
            str(sorted(kept.items())),
            "[]",
        )
        self.kept_storages.watch(shards)

    def _note_unsharded_hooks(self, unit: tuple[int, str], params: list[nn.Parameter]) -> None:
        """``unit``'s params as its forward starts, unsharded: the hooks on them (the most this step)."""
        key = f"call {unit[0]} {unit[1] or 'root'}: hooks on its params while unsharded"
        count = sum(len(getattr(p, name, None) or {}) for p in params for name in _PARAM_HOOKS)
        self.hook_counts[key] = max(count, self.hook_counts.get(key, 0))

    def _all_sharded(self) -> bool:
        """Whether the ledger knows every module sharded now (the registered params are the shards)."""
        return all(self.gathers.is_sharded(unit) for unit in self._units())

    def _check_lifetimes(self, where: str) -> None:
        """After a step's backwards, where every module is sharded: no shard written, nothing kept
        beside the shards, nothing forward or backward created alive but the grads (not while the
        diagnosis traces, whose records hold them, nor while per-replica parts are kept: an
        implementation keeps its own too)."""
        if self._all_sharded():
            self._check_shards_untouched(where)
            self._check_kept_storages(f"{where} after backward")
            if not self.reference.keeps_replica_parts and isinstance(self.trace, Untraced):
                self._check_created_freed(f"{where} after backward")
        self.created = KeptStorages()

    def _creating(self) -> Any:
        """The model's forward or backward, every storage it creates watched."""
        return created_into(self.created)

    def _check_created_freed(self, where: str) -> None:
        """Once every module is sharded after backward: of the storages this step's forwards and
        backwards created, none is alive but the grads' and the params'."""
        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        mains = [m for p in params if (m := getattr(p, "main_grad", None)) is not None]
        held = [impl.local(t) for t in (*params, *grads, *mains)]
        kept = sum(self.created.kept(held).values())
        self.ctx.equal(f"{where}: bytes still held of what forward and backward created (but grads)", kept, 0)
        self.created = KeptStorages()

    def _note_shards(self, when: bool) -> None:
        """Each param's local shard as a step's forwards start (a copy), ``when`` the registered params
        are the shards (else nothing to compare this step)."""
        shards = self._local_shards() if when else []
        self.shards_before = {path: local.detach().clone() for path, local in shards if not local.is_meta}

    def _check_shards_untouched(self, where: str) -> None:
        """Forward and backward leave every shard as they found it, bit for bit (only the optimizer
        writes them): a compute copy written back at reshard rounds a bf16-cast master (#212)."""
        for path, local in self._local_shards():
            before = self.shards_before.get(path)
            if before is not None:
                label = f"{where}: {path}'s shard as before the forwards (forward and backward write no shard)"
                self.ctx.equal(label, local.detach(), before)
        self.shards_before = {}

    def _check_hooks_flat(self, where: str, pending: bool = False) -> None:
        """The hooks registered at the end of this step on the modules and params, and on each call's
        params while it was unsharded: from the second step on, as many as in the first. So too the
        objects the implementation holds on the host (``host_objects``), from the first step's end where
        it holds nothing for later on (or the end of the last step that made a param trainable again: its
        per-param state may be built then, once): not with an unshard issued for the next step (``pending``:
        its handle is held until then), nor with per-replica parts of grads kept for a later all-reduce."""
        self.hook_counts["modules and params at the step's end: hooks registered"] = registered_hooks(self.model)
        counts, self.hook_counts = self.hook_counts, {}
        self._check_held_objects(where, pending or self.reference.keeps_replica_parts)
        if self.hooks_in_first_step is None:
            self.hooks_in_first_step = counts
            return
        for key in sorted(counts.keys() & self.hooks_in_first_step.keys()):
            self.ctx.equal(f"{where}: {key} (as in step 0)", counts[key], self.hooks_in_first_step[key])

    def _check_held_objects(self, where: str, holding: bool) -> None:
        if holding:
            return
        held = held_objects(self.model, impl.host_packages)
        if self.held_at_first_end is None:
            self.held_at_first_end = (where, held)
            return
        first, before = self.held_at_first_end
        more = grown(before, held)
        self.ctx.equal(f"{where}: objects the implementation holds on the host beyond {first}'s", str(more), "[]")

    def _check_grad_kind(self, where: str, path: str, param: nn.Parameter, grad: torch.Tensor, dtype: Any) -> None:
        """A grad is a plain leaf of the promised grad dtype (its param's, or the ``grad_dtype`` the user
        set), aliasing no param's data."""
        local = impl.local(grad)
        plain = grad.grad_fn is None and not grad.requires_grad
        self.ctx.true(
            f"{where} grad {path}: a leaf tensor of the param's grad dtype",
            plain and grad.dtype == dtype,
            f"{grad.dtype}, grad_fn {type(grad.grad_fn).__name__}",
            str(dtype),
        )
        params = {_storage_key(impl.local(p)) for p in self.model.parameters() if not impl.local(p).is_meta}
        self.ctx.true(f"{where} grad {path}: aliases no param's data", _storage_key(local) not in params)
