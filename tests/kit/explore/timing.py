"""The invariants L4 reads through module hooks while a configuration runs (a mixin of
``oracle.Example``): prefetch timing (as each sharded module's forward, and backward, starts,
before its own hooks: what has been all-gathered so far), the order of backward prefetch lists, and
the storage a module's params used while unsharded, freed once it is sharded again; and the
prefetch lists set from the model's order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from tests.kit.explore.gathers import Unit
from tests.kit.explore.grammar import first_tensor
from tests.kit.judging.recorder import CollectiveRecorder
from tests.kit.judging.surface import impl


class Timing:
    """Prefetch timing, backward list order and freed storage, seen through module hooks."""

    forward_without_backward = False  # a forward with grad ran that no backward followed (see below)

    def _set_prefetch(self) -> None:
        """Each sharded module prefetches the one whose forward starts next, and in backward the one
        whose backward comes next (the reverse of the order forwards finish in): the lists a user
        writes for the model's order, so a prefetch never fetches a module that is done. A module called
        twice a forward (a loose unit of the ledger) neither prefetches nor is prefetched."""
        modules = {
            (index, path): hsdp
            for index, calls in enumerate(self.hsdp_modules)
            for path, hsdp in zip(self.config.groups[index].paths, calls, strict=True)
        }
        starts, finishes = self._unit_orders()
        twice = self._called_twice()
        starts, finishes = ([u for u in order if u not in twice] for order in (starts, finishes))
        for order, setter in (
            (starts, "set_modules_to_forward_prefetch"),
            (finishes[::-1], "set_modules_to_backward_prefetch"),
        ):
            for place, unit in enumerate(order[:-1]):
                following = order[place + 1 : place + 1 + self.config.prefetch_depth]
                getattr(modules[unit], setter)([modules[f] for f in following])
                lists = self.forward_prefetch if setter == "set_modules_to_forward_prefetch" else self.backward_prefetch
                lists[unit] = following

    def _unit_orders(self) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        """The units in the order their forwards start (pre-order of the module tree, which this
        grammar runs in registration order) and the order they finish (post-order)."""
        unit_of = {path: (index, path) for index, path in self._units()}
        starts: list[tuple[int, str]] = []
        finishes: list[tuple[int, str]] = []

        def walk(module: nn.Module, path: str) -> None:
            if path in unit_of:
                starts.append(unit_of[path])
            for name, child in module.named_children():
                walk(child, f"{path}.{name}" if path else name)
            if path in unit_of:
                finishes.append(unit_of[path])

        walk(self.model, "")
        return starts, finishes

    def _seen_start(self, index: int, module_path: str) -> Callable[..., None]:
        """A pre-forward hook of one module of call ``index``, run before the implementation's."""

        def start(module: nn.Module, args: tuple) -> None:
            if self._recording_forward and (index, module_path) not in self.started:
                self._check_started((index, module_path))

        return start

    def _check_started(self, unit: Unit) -> None:
        """Prefetch timing: when a module's forward starts (before its own unshard), the forward has
        all-gathered every module started before it and every module their forward lists prefetch
        (so a prefetched module's gather is issued before it starts), and nothing beyond them."""
        rec = self._forward_rec
        if rec is not None:
            due = set(self.started) | {t for u in self.started for t in self.forward_prefetch.get(u, [])}
            least = sum(self.gathers.gather(u)[0] for u in due)
            most = sum(self.gathers.gather(u)[1] for u in due)
            gathered = sum(c.numel for c in rec.calls if c.op == "all_gather" and c.group_size > 1)
            label = (
                f"{self._where} forward, as call {unit[0]}'s module starts: elements all-gathered so far "
                "(the modules started before it and those their lists prefetch)"
            )
            self.ctx.true(label, least <= gathered <= most, str(gathered), f"{least}..{most}")
        self.started.append(unit)

    def _seen_unsharded(self, index: int, module_path: str) -> Callable[..., None]:
        """A pre-forward hook of one module of call ``index``, run after the implementation's: the
        storages of its sharded params, unsharded now, watched until they are freed."""

        def unsharded(module: nn.Module, args: tuple) -> None:
            params = dict(self.model.named_parameters())
            own = self._own_numels(index, module_path)
            sharded = [impl.local(params[path]) for path in own if self.plans[path].kind == "sharded"]
            self.storages.note((index, module_path), sharded)
            self._note_unsharded_hooks((index, module_path), [params[path] for path in own])
            self._check_stepped((index, module_path))  # the first forward after an unshard across the step

        return unsharded

    def _check_storage_freed(self, where: str) -> None:
        """Each module the ledger says is sharded again holds none of the storage its params used
        while unsharded: resharding frees it (FSDP2 resizes it to nothing)."""
        params = dict(self.model.named_parameters())
        for unit in self._units():
            if not self.gathers.is_sharded(unit) or unit not in self.storages.watched:
                continue
            shards = [impl.local(params[path]) for path in self._own_numels(*unit)]
            label = f"{where}, call {unit[0]} sharded: bytes still held of its unsharded params' storage"
            self.ctx.equal(label, self.storages.held(unit, shards), 0)

    def _times_backward(self) -> bool:
        """Whether backward prefetch timing is judged (``Config.times_backward``)."""
        return self.config.times_backward()

    def _seen_backward_start(self, index: int, module_path: str) -> Callable[..., None]:
        """A backward pre-hook of one module of call ``index``: the elements all-gathered in this
        backward when its backward starts, before the implementation's own pre-backward."""

        def start(module: nn.Module, grad_output: Any) -> None:
            rec = self._backward_rec
            if rec is not None:
                gathered = sum(c.numel for c in rec.calls if c.op == "all_gather" and c.group_size > 1)
                self.backward_starts.append(((index, module_path), gathered))

        return start

    def _backward_targets(self, unit: Unit) -> list[Unit]:
        """The modules ``unit``'s backward prefetches: its backward list where lists are set, else
        the module managing params whose forward finished just before its own (FSDP2's implicit
        prefetch: a call managing no params has no param group, so takes no part)."""
        if self.config.prefetch:
            return self.backward_prefetch.get(unit, [])
        order = [u for u in self.finished if any(self.plans[p].kind != "ignored" for p in self._own_numels(*u))]
        place = order.index(unit) if unit in order else 0
        return order[place - 1 : place] if place > 0 else []

    def _check_backward_starts(self, where: str) -> None:
        """Backward prefetch timing: when a module's backward starts (before its own hooks), this
        backward has all-gathered the modules whose backward started before it and those they
        prefetch (so a prefetched module's gather is issued before it starts), nothing beyond them;
        a prefetched module backward never reaches may or may not have been gathered. Not judged for
        the first backward after a forward with grad that had none (the frozen first forward of
        ``patterns``): the implicit order is ambiguous then (ours skips it; FSDP2 follows a stale one)."""
        if self.forward_without_backward and not self.config.prefetch:
            self.forward_without_backward = False
            return
        self.forward_without_backward = False
        units = [unit for unit, _ in self.backward_starts]
        reached = sorted(u for u in self._units() if u[0] in self.reached)
        if sorted(set(units)) != reached or len(set(units)) < len(units):
            return  # a module whose start torch could not see (no tensor output): its prefetch unknown
        for place, (unit, gathered) in enumerate(self.backward_starts):
            before = units[:place]
            due = set(before) | {t for u in before for t in self._backward_targets(u)}
            least = sum(self.gathers.gather(u)[0] for u in due if u[0] in self.reached)
            most = sum(self.gathers.gather(u)[1] for u in due)
            label = (
                f"{where} backward, as call {unit[0]}'s module starts: elements all-gathered so far "
                "(the modules whose backward started before it and those they prefetch)"
            )
            self.ctx.true(label, least <= gathered <= most, str(gathered), f"{least}..{most}")

    def _seen_after_forward(self, index: int, module_path: str) -> Callable[..., None]:
        """A forward hook of one module of call ``index``: its own params' numels once its forward
        is done (a list call's modules each finish their forward at their own time)."""

        def seen(module: nn.Module, args: tuple, output: Any) -> None:
            self._note_forward(index, module_path, output)

        return seen

    def _note_forward(self, index: int, module_path: str, output: Any) -> None:
        """A module of call ``index`` finished its forward: its params' numels now, and a hook that
        notes when backward reaches it."""
        if self._recording_forward and (index, module_path) not in self.after_forward:
            self.after_forward[(index, module_path)] = self._own_numels(index, module_path)
            self.finished.append((index, module_path))
            out = first_tensor(output)
            if out.requires_grad:  # backward reaches the module only through its output's grad
                out.register_hook(lambda grad: self.reached.add(index))

    def _ordered_pairs(self) -> list[tuple[Unit, Unit]]:
        """The pairs (first, second) of one backward prefetch list whose all-gathers the coming
        backward must issue in that order, where the recorder tells them apart: both sharded now
        (one whole gather each, fused), sizes no other module shares, no recompute in between."""
        if self.recompute or self.config.prefetch_depth < 2:
            return []
        sizes = self.gathers.sizes
        pairs = []
        listed = [
            pair for targets in self.backward_prefetch.values() for pair in zip(targets, targets[1:], strict=False)
        ]
        for first, second in listed:
            whole = all(
                self.gathers.gather(u) == (sizes[u], sizes[u]) and sizes[u] > 0 and self.gathers.calls[u] == 1
                for u in (first, second)
            )
            unique = all(sum(size == sizes[u] for size in sizes.values()) == 1 for u in (first, second))
            if whole and unique:
                pairs.append((first, second))
        return pairs

    def _check_backward_order(self, where: str, rec: CollectiveRecorder, pairs: list[tuple[Unit, Unit]]) -> None:
        """Backward prefetch lists issue their all-gathers in the lists' order (a module gathered on
        demand comes after those prefetched ahead of it, so the order holds without a prefetch too)."""
        gathered = [c.numel for c in rec.calls if c.op == "all_gather" and c.group_size > 1]
        sizes = self.gathers.sizes
        for first, second in pairs:
            if sizes[first] in gathered and sizes[second] in gathered:
                label = (
                    f"{where} backward: call {first[0]}'s module all-gathered before call {second[0]}'s (list order)"
                )
                self.ctx.true(label, gathered.index(sizes[first]) < gathered.index(sizes[second]))
