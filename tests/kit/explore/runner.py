"""The driver side of L4: run one configuration on the cluster, explore the space with Hypothesis
(draw, run, shrink any failure to a minimal configuration, save it), replay a saved one, and count
what was drawn.

Two Hypothesis settings profiles: ``ci`` (a fixed seed, no example database: the same examples on
every machine and every run) and ``deep`` (an example database under ``runs/l4/db``, so a failure
found once is tried first the next time). A failure's minimal configuration is saved as JSON under
``runs/l4/<id>.json``; ``replay(cluster, "<id>" or a path)`` runs it again, from pytest
(``--replay``), the sweep and the L4 notebook alike.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import Flaky

from tests.kit.explore.oracle import run_example
from tests.kit.explore.pairs import pairs_text
from tests.kit.explore.pipeline import SAVED, Pipeline
from tests.kit.explore.space import Config
from tests.kit.judging.checks import Check
from tests.kit.judging.divergence import needs_fresh_engines, wanted  # noqa: F401 - the explorer's too
from tests.kit.runtime.cluster import RankCluster, RankFailure

REGRESSIONS = Path(__file__).resolve().parent / "regressions"
TIMEOUT_S = 60.0  # one configuration on up to 8 ranks; a hang fails with every rank's stack

settings.register_profile(
    "ci",
    deadline=None,
    database=None,
    derandomize=False,  # the seed decides: @seed(S) makes the draws the same everywhere
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
    print_blob=False,
)
settings.register_profile(
    "deep",
    deadline=None,
    database=DirectoryBasedExampleDatabase(str(SAVED / "db")),
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
)


@dataclass
class ExampleResult:
    """One configuration's run: passed, or its first failures in a paragraph."""

    config: Config
    passed: bool
    failure: str = ""
    checks: int = 0
    seconds: float = 0.0
    signature: str = ""  # how it failed, without the numbers and names of this configuration
    signatures: frozenset[str] = frozenset()  # every failed check's, generic (a layout stop checks all first)

    @property
    def id(self) -> str:
        return config_id(self.config)


def config_id(config: Config) -> str:
    """A short name of a configuration (its JSON's hash)."""
    return hashlib.sha1(config.to_json().encode()).hexdigest()[:10]


def run_config(
    cluster: RankCluster, config: Config, timeout: float = TIMEOUT_S, isolate: bool = False
) -> ExampleResult:
    """Run ``config`` on the cluster's first ``config.world`` engines and judge every rank's checks;
    ``isolate``: on fresh engines (an implementation whose process-global state does not survive
    the kit's fresh process group per run, as upstream's cache of groups)."""
    started = time.monotonic()
    if isolate:
        cluster.renew()
    try:
        results = cluster.run(run_example, config.world, config.to_json(), timeout=timeout)
    except RankFailure as failure:
        raised = _raised(failure)
        seconds = time.monotonic() - started
        return ExampleResult(config, False, str(failure)[:4000], 0, seconds, raised, frozenset({raised}))
    checks = [Check(**c) for result in results for c in result["checks"]]
    failed = [c for c in checks if not c.passed]
    text = "; ".join(
        f"rank {c.rank}: {c.name}: {c.measured} vs {c.reference} (error {c.error}, tol {c.tol})" for c in failed[:4]
    )
    if len(failed) > 4:
        text += f"; and {len(failed) - 4} more failed checks"
    signature = generic(failed[0].name) if failed else ""
    every = frozenset(generic(c.name) for c in failed)
    return ExampleResult(config, not failed, text, len(checks), time.monotonic() - started, signature, every)


def generic(text: str) -> str:
    """A failure's text without what belongs to one configuration: numbers become ``#`` and dotted
    param or module paths ``<path>``, so one defect met in two configurations reads the same."""
    text = re.sub(r"\b[A-Za-z_]\w*(?:\.\w+)+", "<path>", text)
    return re.sub(r"\d+(?:\.\d+)?", "#", text)


def _raised(failure: RankFailure) -> str:
    """The signature of a run that raised: the first rank's exception, generic; or how it ended."""
    if failure.raised:
        name, message = next(iter(sorted(failure.raised.items())))[1]
        return generic(f"raised {name}: {message}")
    return "timed out" if failure.timed_out else "an engine died" if failure.dead else generic(failure.summary)


@dataclass
class Exploration:
    """What an exploration ran and found."""

    examples: int = 0  # configurations run (shrinking included)
    drawn: int = 0  # configurations drawn by the generation phase
    seconds: float = 0.0
    coverage: Counter = field(default_factory=Counter)  # (option, value) -> configurations drawn
    minimal: ExampleResult | None = None  # the smallest failing configuration, after shrinking
    saved: Path | None = None
    failures_seen: int = 0
    budget_spent: bool = False
    covering: int = 0  # configurations of the covering phase run (before the draws)
    pairs: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (covered, possible)
    diagnosis: Any = None  # the minimal failing configuration's first divergence (explore.diagnosis)

    @property
    def passed(self) -> bool:
        return self.minimal is None

    def head(self) -> str:
        """What ran, how fast (the summary's first words)."""
        rate = 60 * (self.drawn + self.covering) / self.seconds if self.seconds else 0.0
        cover = f"{self.covering} covering + " if self.covering else ""
        head = f"L4: {cover}{self.drawn} configurations drawn, {self.examples} run, {self.seconds:.0f} s"
        head += f" ({rate:.0f} a minute)"
        return head + (", time budget spent" if self.budget_spent else "")

    def pairs_line(self) -> str:
        """Pairwise coverage of what ran (covering phase and draws): covered / possible."""
        return pairs_text(self.pairs) if self.pairs else "pairs: not measured (no covering phase)"

    def summary(self) -> str:
        head = self.head()
        if self.passed:
            return head + ": no failure"
        size = self.minimal.config.size()
        where = f"; diagnosis: {self.diagnosis.line()}" if self.diagnosis is not None else ""
        return (
            f"{head}: FAIL, shrunk to {size['groups']} group(s), {size['steps']} step(s), world {size['world']} "
            f"({self.minimal.id}, saved {self.saved}): {self.minimal.failure[:600]}{where}"
        )

    def diagnose(self, cluster: RankCluster) -> None:
        """Diagnose the minimal failing configuration (once shrunk), unless ``HPKIT_DIAGNOSE=0``."""
        if self.minimal is not None:
            self.diagnosis = diagnose_failing(cluster, self.minimal)


def diagnose_failing(cluster: RankCluster, result: ExampleResult, name: str = "") -> Any:
    """A failing configuration's diagnosis (``explore.diagnosis``), named ``name`` (a replay's, as the
    user wrote it) or its id; None with ``HPKIT_DIAGNOSE=0``."""
    from tests.kit.explore.diagnosis import diagnose_config

    if not wanted():
        return None
    diagnosis = diagnose_config(cluster, result.config, name or result.id)
    if diagnosis.status == "PASS":  # what failed is checked only untraced (a storage the tracer's records hold)
        diagnosis.status = "FAIL"
        first = re.sub(r"^rank \d+: ", "", result.failure.split("; rank ")[0].split(" (error ")[0])
        diagnosis.first_failing_check = f"{first} (checked only where nothing is traced)"
    return diagnosis


def explore(
    cluster: RankCluster,
    features: frozenset[str],
    *,
    budget_s: float = 0.0,
    profile: str = "ci",
    isolate: bool = False,
    shrink_budget_s: float = 300.0,
    **options: Any,
) -> Exploration:
    """Draw configurations of ``features`` (``options``: ``Pipeline.on``'s, ``examples`` of them
    from ``seed`` ...), run each, shrink the first failure to a minimal one and save it. The covering
    phase runs first; a failure there is shrunk by the draws of ``seed`` failing the same way.
    ``budget_s`` > 0 stops drawing new configurations once that many seconds have gone (the examples
    left pass unrun); ``profile``: Hypothesis's settings profile; ``isolate``: fresh engines per run."""
    found = Exploration()
    stages = Pipeline.on(cluster.n_engines, found, features, **options)
    examples, seed, save_dir = stages.examples, stages.seed, stages.save_dir
    failing: list[ExampleResult] = []
    failed = _cover_first(cluster, stages, isolate)
    if failed is not None:  # shrunk by the draws of ``seed`` failing the same way (cached: no rerun)
        found.minimal, found.failures_seen = failed, 1
        cache = {failed.id: failed}
        run = cached_runner(cluster, isolate, cache)
        found.minimal = shrink_one(run, stages.draw, failed.signature, examples, seed, shrink_budget_s) or failed
        found.examples += len(cache) - 1
        found.saved = save(found.minimal, save_dir)
        stages.finish()
        found.diagnose(cluster)
        return found

    first_failure = [0.0]  # when the first drawn failure was seen: the shrink's budget counts from it

    @settings(settings.get_profile(profile), max_examples=examples)
    @hypothesis_seed(seed)
    @given(stages.draw)
    def every_configuration_keeps_its_promise(config: Config) -> None:
        shrinking = bool(failing)
        if not shrinking and budget_s and time.monotonic() - stages.started > budget_s:
            found.budget_spent = True
            return
        if shrinking and time.monotonic() - first_failure[0] > shrink_budget_s:
            return  # shrunk long enough: the smallest failing so far stands
        result = run_config(cluster, config, isolate=isolate)
        found.examples += 1
        stages.record(result, shrinking)
        if not result.passed:
            if not failing:
                first_failure[0] = time.monotonic()
            failing.append(result)
            raise AssertionError(result.failure)

    try:
        every_configuration_keeps_its_promise()
    except (AssertionError, Flaky):  # Flaky: the minimal one failed otherwise when run again
        found.minimal = failing[-1]  # Hypothesis runs the minimal failing example last
        found.failures_seen = len(failing)
        found.saved = save(found.minimal, save_dir)
    stages.finish()
    found.diagnose(cluster)
    return found


def _cover_first(cluster: RankCluster, stages: Pipeline, isolate: bool) -> ExampleResult | None:
    """Run the covering configurations until one fails: that one (unshrunk), or None."""
    for config in stages.plan.configs if stages.plan is not None else ():
        result = run_config(cluster, config, isolate=isolate)
        stages.exploration.examples += 1
        stages.record(result, covering=True)
        if not result.passed:
            return result
    return None


def cached_runner(
    cluster: RankCluster, isolate: bool, cache: dict[str, ExampleResult]
) -> Callable[[Config], ExampleResult]:
    """``run_config`` remembering every result by configuration id (a shrink replays draws)."""

    def run(config: Config) -> ExampleResult:
        key = config_id(config)
        if key not in cache:
            cache[key] = run_config(cluster, config, isolate=isolate)
        return cache[key]

    return run


def shrink_one(
    run: Callable[[Config], ExampleResult], draw: Any, signature: str, examples: int, seed: int, budget_s: float
) -> ExampleResult | None:
    """The smallest configuration failing with ``signature``: the same seed again, where only that
    signature counts as failing; after ``budget_s`` no new configuration is run (the best so far
    stands)."""
    started = time.monotonic()
    failing: list[ExampleResult] = []

    @settings(settings.get_profile("ci"), max_examples=examples)
    @hypothesis_seed(seed)
    @given(draw)
    def fails_this_way(config: Config) -> None:
        if failing and time.monotonic() - started > budget_s:
            if config_id(config) != failing[-1].id:
                return  # the budget is spent: nothing new fails, so the shrinker stops soon
        result = run(config)
        if not result.passed and result.signature == signature:
            failing.append(result)
            raise AssertionError(signature)

    try:
        fails_this_way()
    except (AssertionError, Flaky):
        return failing[-1]
    return None


def save(result: ExampleResult, folder: Path = SAVED) -> Path:
    """Write a failing configuration as JSON: ``<folder>/<id>.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{result.id}.json"
    data = {
        "id": result.id,
        "size": result.config.size(),
        "failure": result.failure,
        "config": json.loads(result.config.to_json()),
    }
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return path


def load(what: str | Path) -> Config:
    """A saved configuration: a path, or an id under ``runs/l4/`` or the committed regressions."""
    path = Path(what)
    if not path.suffix:
        candidates = [SAVED / f"{what}.json", REGRESSIONS / f"{what}.json"]
        path = next((p for p in candidates if p.exists()), candidates[0])
    if not path.exists():
        raise FileNotFoundError(f"no saved L4 configuration {what!r} (looked at {path})")
    data = json.loads(path.read_text())
    return Config.from_json(data["config"] if "config" in data else data)


def replay(cluster: RankCluster, what: str | Path) -> ExampleResult:
    """Run a saved configuration again."""
    return run_config(cluster, load(what))


def coverage_rows(coverage: Counter) -> list[tuple[str, str, int]]:
    """(option, value, configurations) sorted by option, most drawn first."""
    return sorted(((option, value, n) for (option, value), n in coverage.items()), key=lambda r: (r[0], -r[2], r[1]))


def features_of(cluster: RankCluster) -> frozenset[str]:
    """The features the implementation on the cluster's engines declares (asked of rank 0)."""
    return frozenset(cluster.view(0).apply_sync(_declared))


def _declared() -> list[str]:
    from tests.kit.judging.surface import impl

    return sorted(impl.features)


def known_defects_of(cluster: RankCluster) -> dict[frozenset[str], str]:
    """The implementation's known defects (its adapter's ``known_defects``): each a combination of
    features that fails together, and why; L4 leaves them out unless asked to draw them."""
    return {frozenset(names): why for names, why in cluster.view(0).apply_sync(_known_defects)}


def _known_defects() -> list[tuple[list[str], str]]:
    from tests.kit.judging.surface import impl

    return [(sorted(names), why) for names, why in impl.known_defects.items()]


def describe(config: Config) -> dict[str, Any]:
    """A configuration as plain data, for notebooks and logs."""
    return json.loads(config.to_json())
