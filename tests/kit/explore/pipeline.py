"""The stages every L4 exploration goes through, once: draw -> cover -> run -> shrink -> save.

``explore`` (``runner.py``) stops at the first failure and lets Hypothesis shrink it; ``explore_all``
(``survey.py``, keep-going) runs every configuration and shrinks each distinct failure once. Both
set up through ``Pipeline``: its arguments checked the same way, the same strategy and covering
configurations, every run recorded the same way (what ran, how often, which options it used).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.kit.explore.draws import configs
from tests.kit.explore.pairs import Covering
from tests.kit.explore.pairs import covering as covering_of
from tests.kit.explore.space import Config

SAVED = Path(__file__).resolve().parents[3] / "runs" / "l4"  # failing configurations, saved by id


@dataclass
class Pipeline:
    """One exploration's set-up and bookkeeping. ``run(config)`` runs a configuration (the driver's
    choice: cached or not); ``record`` counts what ran into ``exploration``."""

    features: frozenset[str]
    examples: int
    seed: int
    max_world: int
    min_world: int
    avoid: tuple[frozenset[str], ...]
    cover: bool
    save_dir: Path
    exploration: Any  # runner.Exploration (imported there: runner imports this module)
    on_example: Callable[[Any, bool], None] | None = None
    ran: list[Config] = field(default_factory=list)  # every configuration run outside shrinking
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.draw = configs(self.features, self.max_world, self.min_world, self.avoid)  # the strategy
        # the covering configurations run before the draws (None: no covering phase)
        self.plan: Covering | None = (
            covering_of(self.features, self.max_world, self.min_world, self.avoid) if self.cover else None
        )

    @classmethod
    def on(
        cls,
        n_engines: int,
        exploration: Any,
        features: frozenset[str],
        examples: int = 50,
        seed: int = 0,
        max_world: int = 4,
        min_world: int = 1,
        avoid: tuple[frozenset[str], ...] = (),
        cover: bool = True,
        save_dir: Path = SAVED,
        on_example: Callable[[Any, bool], None] | None = None,
    ) -> Pipeline:
        """The pipeline of an exploration on a cluster of ``n_engines``: ``examples`` configurations of
        ``features`` drawn from ``seed``, on ``min_world`` to ``max_world`` ranks (checked, then held to
        what the cluster has), never the feature combinations of ``avoid`` together (an
        implementation's known defects), after the covering phase (``cover``); failures saved under
        ``save_dir``; ``on_example(result, shrinking)`` told of every run (progress)."""
        if not 1 <= min_world <= max_world:
            raise ValueError(f"min_world must be in 1..max_world ({max_world}), got {min_world}")
        max_world = min(max_world, n_engines)
        min_world = min(min_world, max_world)
        return cls(features, examples, seed, max_world, min_world, avoid, cover, save_dir, exploration, on_example)

    def record(self, result: Any, shrinking: bool = False, covering: bool = False) -> None:
        """Tell ``on_example`` of a run; outside shrinking, count it and the options it used."""
        if self.on_example is not None:
            self.on_example(result, shrinking)
        if shrinking:
            return
        if covering:
            self.exploration.covering += 1
        else:
            self.exploration.drawn += 1
        self.ran.append(result.config)
        self.exploration.coverage.update(result.config.coverage().items())

    def finish(self) -> None:
        """What the run covered (pairs against the covering phase's) and how long it took."""
        self.exploration.pairs = self.plan.measure(self.ran) if self.plan is not None else {}
        self.exploration.seconds = time.monotonic() - self.started
