"""L4's account of the all-gathers a configuration needs: which sharded modules ("units": a
``fully_shard`` call's index and one of its module paths) hold their params unsharded at each
moment, and so how many elements the coming forward, or the backward just run, must all-gather
(each module it needs, once) and may (a recompute, a prefetch, a module whose state a state dict
may have changed). ``oracle.Example`` keeps one ``GatherLedger`` per configuration and moves it
as the schedule runs; the sizes are fixed when the model is sharded.

A unit is in one of four states: sharded (a gather of ``sizes[unit]`` elements brings it back),
unsharded (nothing to gather), kept in rows of ``k`` ranks after forward by an int
``reshard_after_forward`` (a gather within the row, ``rows[unit]`` = (least, most) elements: the
row's share of the unpadded param, or of the shard group's padded one), or unknown (any of those;
``unknown[unit]`` is the most a gather of it may take). A loose unit is unknown for good: a module
called more than once in a forward (``loose[unit]``: the most one forward, or one backward, may gather
of it; a list call's modules may be one group, gathered together: torch FSDP2's list).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Unit = tuple[int, str]
Bounds = tuple[int, int]


@dataclass
class GatherLedger:
    """Per unit, the elements this rank contributes to gathering it (``sizes``: each shard padded
    to ceil(rows / ranks) rows, nothing where it shards over one rank) and the all-gathers that
    takes (``calls``: one, or one per param under ``comm_fusion=False``); the state of each unit
    (module docstring); ``skip_backward``: the units ``set_unshard_in_backward(False)`` keeps
    sharded through backward."""

    sizes: dict[Unit, int]
    calls: dict[Unit, int]
    unsharded: set[Unit] = field(default_factory=set)
    rows: dict[Unit, Bounds] = field(default_factory=dict)
    skip_backward: set[Unit] = field(default_factory=set)
    unknown: dict[Unit, int] = field(default_factory=dict)
    loose: dict[Unit, int] = field(default_factory=dict)

    def _gather(self, unit: Unit) -> Bounds:
        """(least, most) elements bringing ``unit`` back from its state now."""
        if unit in self.loose:
            return 0, self.loose[unit]
        if unit in self.unsharded:
            return 0, 0
        if unit in self.rows:
            return self.rows[unit]
        if unit in self.unknown:
            return 0, self.unknown[unit]
        return self.sizes[unit], self.sizes[unit]

    def gather(self, unit: Unit) -> Bounds:
        """(least, most) elements bringing ``unit`` back now."""
        return self._gather(unit)

    def is_sharded(self, unit: Unit) -> bool:
        """Whether ``unit`` is known to be sharded now (not unsharded, not in rows, not unknown, not loose)."""
        return all(unit not in states for states in (self.unsharded, self.rows, self.unknown, self.loose))

    def forward(self) -> Bounds:
        """(least, most) elements the coming forward all-gathers: every unit not unsharded, once."""
        least = most = 0
        for unit in self.sizes:
            low, high = self._gather(unit)
            least, most = least + low, most + high
        return least, most

    def forward_calls(self) -> int:
        """The all-gathers the coming forward issues, where no unit's state is unknown."""
        return sum(calls for unit, calls in self.calls.items() if unit not in self.unsharded)

    def backward(self, reached: set[int], regathers: int, idle: frozenset[Unit] = frozenset()) -> Bounds:
        """(least, most) elements the backward just run had to all-gather, the units as forward left
        them: every unit it reached and needs that is not unsharded, once; a unit it did not reach at most once (a
        prefetch ahead of a need that never came). ``idle``: units of reached calls that ran no
        forward (a list call's module, each a group of its own): not reached. Each at most ``regathers``
        times more: a recompute under activation checkpointing that reshards gathers again what it runs,
        reached or not (a frozen module's forward is recomputed too)."""
        least = most = 0
        for unit in self.sizes:
            if unit in self.skip_backward:
                continue
            low, high = self._gather(unit)
            hit = unit[0] in reached and unit not in idle
            least += low if hit else 0
            most += high * (1 + regathers)  # a recompute runs a forward whether or not backward needs the unit
        return least, most

    def mark(self, units: Iterable[Unit], unsharded: bool) -> None:
        for unit in units:
            self.unknown.pop(unit, None)
            self.rows.pop(unit, None)
            (self.unsharded.add if unsharded else self.unsharded.discard)(unit)

    def after_forward(self, settings: list[bool | int], rows: Callable[[Unit, int], Bounds]) -> None:
        """Each call's units as its effective reshard_after_forward left them: True sharded, False
        unsharded, an int ``k`` in rows of ``k`` (``rows(unit, k)`` the gather bringing them back)."""
        for unit in self.sizes:
            setting = settings[unit[0]]
            if type(setting) is int:
                self.mark([unit], False)
                self.rows[unit] = rows(unit, setting)
            else:
                self.mark([unit], not setting)

    def after_backward(self, reached: set[int], resharded: list[bool], idle: frozenset[Unit] = frozenset()) -> None:
        """Reached units as reshard_after_backward says (a unit backward does not gather keeps what
        forward left unless resharded). One backward never reached (or ``idle``, as in ``backward``)
        may be left either way: unsharded by a prefetch and kept (torch FSDP2), or resharded (ours)."""
        for unit in self.sizes:
            if unit in idle:
                self._forget(unit)
            elif unit[0] in reached and unit in self.skip_backward and not resharded[unit[0]]:
                if unit in self.rows:
                    self.unknown[unit] = self.rows.pop(unit)[1]
            elif unit[0] in reached:
                self.mark([unit], not resharded[unit[0]])
            else:
                self._forget(unit)

    def _forget(self, unit: Unit) -> None:
        most = max(self.sizes[unit], self.rows[unit][1] if unit in self.rows else 0)
        self.unsharded.discard(unit)
        self.rows.pop(unit, None)
        self.unknown[unit] = max(most, self.unknown.get(unit, 0))

    def forget(self, units: Iterable[Unit]) -> None:
        """These units may be in any state (gathered again or not): at most one gather each."""
        for unit in units:
            self._forget(unit)

    def maybe_resharded(self) -> None:
        """A state dict was taken: an implementation may reshard for it."""
        for unit in list(self.unsharded) + list(self.rows):
            self._forget(unit)

    def all_resharded(self) -> None:
        self.unsharded.clear()
        self.rows.clear()
        self.unknown.clear()
