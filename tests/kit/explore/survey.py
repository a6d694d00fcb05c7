"""L4's keep-going mode (``--keep-going``): explore past failures and list each distinct one (its
first failing check as the signature), every failed check counted, each distinct failure shrunk
once, so one run lists an implementation's defects instead of stopping at the first."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import Phase, given, settings
from hypothesis import seed as hypothesis_seed

from tests.kit.explore.pipeline import Pipeline
from tests.kit.explore.runner import ExampleResult, Exploration, cached_runner, save, shrink_one
from tests.kit.explore.space import Config
from tests.kit.runtime.cluster import RankCluster


@dataclass
class DistinctFailure:
    """One distinct way an implementation failed in a keep-going exploration."""

    signature: str
    first: ExampleResult  # the first drawn configuration failing this way
    count: int = 1  # drawn configurations failing this way
    minimal: ExampleResult | None = None  # after shrinking (None: not shrunk)
    saved: Path | None = None


@dataclass
class Survey:
    """What a keep-going exploration ran and found: every distinct failure, each shrunk once."""

    exploration: Exploration
    defects: list[DistinctFailure] = field(default_factory=list)
    failed_checks: Counter = field(default_factory=Counter)  # every failed check's signature -> configurations

    @property
    def passed(self) -> bool:
        return not self.defects

    def summary(self) -> str:
        lines = [f"{self.exploration.head()}: {len(self.defects)} distinct failure(s)"]
        for number, defect in enumerate(self.defects, 1):
            shown = defect.minimal or defect.first
            size = shown.config.size()
            lines.append(
                f"  {number}. {defect.signature} — {defect.count} configuration(s); smallest: {shown.id} "
                f"({size['groups']} group(s), {size['steps']} step(s), world {size['world']})"
            )
        return "\n".join(lines)


def explore_all(
    cluster: RankCluster,
    features: frozenset[str],
    *,
    isolate: bool = False,
    shrink: bool = True,
    shrink_budget_s: float = 300.0,
    **options: Any,
) -> Survey:
    """Keep exploring past failures: draw and run all the configurations (``options``:
    ``Pipeline.on``'s), group the failing ones by signature (``generic`` first failing check, or what
    was raised), then shrink the first of each signature once (``shrink_budget_s`` each). The
    shrinking replays the same seed with a cache of every run, so reaching a signature's first
    configuration again costs no run."""
    cache: dict[str, ExampleResult] = {}
    run = cached_runner(cluster, isolate, cache)
    survey = Survey(Exploration())
    stages = Pipeline.on(cluster.n_engines, survey.exploration, features, **options)
    examples, seed, save_dir = stages.examples, stages.seed, stages.save_dir
    by_signature: dict[str, DistinctFailure] = {}

    def record(result: ExampleResult, covering: bool = False) -> None:
        stages.record(result, covering=covering)
        if not result.passed:
            survey.failed_checks.update(result.signatures)
            if result.signature in by_signature:
                by_signature[result.signature].count += 1
            else:
                by_signature[result.signature] = DistinctFailure(result.signature, result)

    for config in stages.plan.configs if stages.plan is not None else ():
        record(run(config), covering=True)

    @settings(settings.get_profile("ci"), max_examples=examples, phases=(Phase.explicit, Phase.generate))
    @hypothesis_seed(seed)
    @given(stages.draw)
    def every_configuration(config: Config) -> None:
        record(run(config))

    every_configuration()
    survey.defects = list(by_signature.values())
    if shrink:
        for defect in survey.defects:
            defect.minimal = shrink_one(run, stages.draw, defect.signature, examples, seed, shrink_budget_s)
            defect.saved = save(defect.minimal, save_dir) if defect.minimal is not None else None
    survey.exploration.examples = len(cache)
    stages.finish()
    return survey
