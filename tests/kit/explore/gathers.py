"""L4's account of the all-gathers a configuration needs: which sharded modules ("units": a
``fully_shard`` call's index and one of its module paths) hold their params unsharded at each
moment, and so how many elements the coming forward, or the backward just run, must all-gather
(each module it needs, once) and may (a recompute, a prefetch, a module whose state a state dict
may have changed). ``oracle.Example`` keeps one ``GatherLedger`` per configuration and moves it
as the schedule runs; the sizes are fixed when the model is sharded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

Unit = tuple[int, str]


@dataclass
class GatherLedger:
    """Per unit, the elements this rank contributes to gathering it (``sizes``: each shard padded
    to ceil(rows / ranks) rows, nothing where it shards over one rank) and the all-gathers that
    takes (``calls``: one, or one per param under ``comm_fusion=False``); which units are unsharded
    now, and which may or may not be."""

    sizes: dict[Unit, int]
    calls: dict[Unit, int]
    unsharded: set[Unit] = field(default_factory=set)
    unknown: set[Unit] = field(default_factory=set)

    def forward(self) -> tuple[int, int]:
        """(least, most) elements the coming forward all-gathers: every unit not unsharded, once."""
        least = most = 0
        for unit, size in self.sizes.items():
            size = 0 if unit in self.unsharded else size
            least += 0 if unit in self.unknown else size
            most += size
        return least, most

    def forward_calls(self) -> int:
        """The all-gathers the coming forward issues, where no unit's state is unknown."""
        return sum(calls for unit, calls in self.calls.items() if unit not in self.unsharded)

    def backward(self, reached: set[int], recompute: bool) -> tuple[int, int]:
        """(least, most) elements the backward just run had to all-gather, the units as forward left
        them: every unit it reached that is sharded, once; at most once more each under activation
        checkpointing (``recompute``); a unit it did not reach at most once (a prefetch ahead of a
        need that never came)."""
        least = most = 0
        for unit, size in self.sizes.items():
            if unit in self.unsharded:
                continue
            hit = unit[0] in reached
            least += size if hit and unit not in self.unknown else 0
            most += size * (2 if hit and recompute else 1)
        return least, most

    def mark(self, units: Iterable[Unit], unsharded: bool) -> None:
        for unit in units:
            self.unknown.discard(unit)
            (self.unsharded.add if unsharded else self.unsharded.discard)(unit)

    def after_forward(self, resharded: list[bool]) -> None:
        """Each call's units as its effective reshard_after_forward left them."""
        self.mark([u for u in self.sizes if resharded[u[0]]], False)
        self.mark([u for u in self.sizes if not resharded[u[0]]], True)

    def after_backward(self, reached: set[int], resharded: list[bool]) -> None:
        """Reached units as reshard_after_backward says. One backward never reached may be left
        either way: unsharded by a prefetch and kept (torch FSDP2), or resharded (ours)."""
        for unit in self.sizes:
            if unit[0] in reached:
                self.mark([unit], not resharded[unit[0]])
            else:
                self.unsharded.discard(unit)
                self.unknown.add(unit)

    def maybe_resharded(self) -> None:
        """A state dict was taken: an implementation may reshard for it."""
        self.unknown |= self.unsharded
        self.unsharded.clear()

    def all_resharded(self) -> None:
        self.unsharded.clear()
        self.unknown.clear()
