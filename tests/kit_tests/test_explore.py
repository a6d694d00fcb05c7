"""L4, the generalization explorer (``tests.kit.explore``): the space draws only what an
implementation declares, configurations survive JSON, shrinking reaches a small configuration,
and the committed regressions (minimal configurations L4 once found failing) pass on our engine.
The fixed, derandomised CI budget itself is the L4 notebook, which nbval runs in ``make test``.

``pytest tests/kit_tests/test_explore.py --replay ID_OR_PATH`` replays saved configurations as well.
"""

from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kit.explore import report as l4
from tests.kit.explore.draws import configs
from tests.kit.explore.runner import REGRESSIONS, explore, load, run_config
from tests.kit.explore.space import Config
from tests.kit.judging.surface import FEATURES
from tests.kit.sweep.l4 import l4_line, l4_section

ALL = frozenset(FEATURES)
REGRESSION_FILES = sorted(REGRESSIONS.glob("*.json"))


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(st.data())
def test_only_declared_features_are_drawn_and_configurations_survive_json(data):
    declared = frozenset(data.draw(st.sets(st.sampled_from(sorted(ALL - {"fully_shard"})))) | {"fully_shard"})
    config = data.draw(configs(declared, max_world=8))
    assert config.features() <= declared, sorted(config.features() - declared)
    assert Config.from_json(config.to_json()) == config
    assert 1 <= config.world <= 8 and (config.mesh == [config.world] or config.mesh[0] * config.mesh[1] == config.world)


@settings(max_examples=100, deadline=None, database=None, derandomize=True)
@given(configs(ALL, max_world=4))
def test_the_grammar_builds_every_configuration_and_it_trains_unsharded(config):
    from tests.kit.explore.grammar import batch, build, loss_of

    model = build(config)
    args, kwargs = batch(config, 0, 0, 0)
    loss = loss_of(model(*args, **kwargs))
    loss.backward()
    assert model.gain.grad is not None  # the root's own param always has a path to the loss


class _FakeCluster:
    """Stands in for the cluster: a configuration 'fails' when it has more than one step and a
    sharded child, to show that shrinking reaches the smallest such configuration."""

    n_engines = 4
    implementation = ""

    def run(self, fn, world, config_json, *traced, timeout):
        if traced:  # the diagnosis's run of the minimal configuration: it traces nothing here
            return [{"result": answer, "rows": []} for answer in self.run(fn, world, config_json, timeout=timeout)]
        config = Config.from_json(config_json)
        bad = len(config.steps) > 1 and len(config.groups) > 1
        check = {
            "name": "made-up property",
            "rank": 0,
            "measured": 1.0,
            "reference": 0.0,
            "tol": None,
            "passed": not bad,
            "error": None,
            "extra": None,
            "kind": "true",
        }
        return [{"checks": [check], "series": {}, "figures": {}, "notes": []}] * world


class _TwoDefectsCluster(_FakeCluster):
    """Fails two ways: more than one step with a sharded child; and, apart, a world of 3."""

    def run(self, fn, world, config_json, timeout):
        config = Config.from_json(config_json)
        first = len(config.steps) > 1 and len(config.groups) > 1
        second = config.world == 3
        check = _FakeCluster.run(self, fn, world, config_json, timeout=timeout)[0]["checks"][0]
        checks = []
        if first:
            checks.append({**check, "name": f"step {len(config.steps) - 1}: grads of body.0.weight", "passed": False})
        if second:
            checks.append({**check, "name": "world of three ranks", "passed": False})
        if not checks:
            checks.append({**check, "passed": True})
        return [{"checks": checks, "series": {}, "figures": {}, "notes": []}] * world


class _PassingCluster(_FakeCluster):
    """Every configuration passes."""

    def run(self, fn, world, config_json, timeout):
        check = _FakeCluster.run(self, fn, world, config_json, timeout=timeout)[0]["checks"][0]
        return [{"checks": [{**check, "passed": True}], "series": {}, "figures": {}, "notes": []}] * world


@pytest.mark.slow
def test_keep_going_lists_each_distinct_failure_shrunk_once(tmp_path):
    from tests.kit.explore.survey import explore_all

    survey = explore_all(_TwoDefectsCluster(), ALL, examples=120, seed=1, max_world=4, save_dir=tmp_path, cover=False)
    assert survey.exploration.drawn == 120  # every configuration drawn and run, past the failures
    signatures = sorted(d.signature for d in survey.defects)
    assert signatures == ["step #: grads of <path>", "world of three ranks"], signatures
    smallest = {d.signature: d.minimal.config.size() for d in survey.defects}
    assert smallest["world of three ranks"]["groups"] == 1 and smallest["world of three ranks"]["steps"] == 1
    assert smallest["step #: grads of <path>"]["steps"] == 2 and smallest["step #: grads of <path>"]["world"] == 1
    assert all(d.saved is not None and d.saved.exists() for d in survey.defects)
    assert all(d.count >= 1 for d in survey.defects) and "2 distinct failure(s)" in survey.summary()


def test_a_failure_is_shrunk_to_a_minimal_configuration_and_saved(tmp_path):
    # the covering phase meets the failure first; the draws of the seed failing the same way shrink it
    found = explore(_FakeCluster(), ALL, examples=200, seed=5, max_world=4, save_dir=tmp_path)
    assert found.covering >= 1 and found.failures_seen == 1
    assert not found.passed and found.saved is not None and found.saved.exists()
    size = found.minimal.config.size()
    assert size["steps"] == 2 and size["groups"] == 2 and size["world"] == 1, size
    assert size["leaves"] == 1 and size["micro-batches"] == 2, size
    saved = json.loads(found.saved.read_text())
    assert Config.from_json(saved["config"]) == found.minimal.config
    assert load(found.saved) == found.minimal.config
    # once shrunk it is diagnosed: here, where nothing is traced, it names the failing check
    line = found.diagnosis.line()
    assert "failed before any traced tensor" in line and "diagnosis: L4" in found.summary(), line


def test_the_covering_phase_holds_every_pair_of_features_its_pool_holds(tmp_path, monkeypatch):
    """The covering configurations hold every pair of features the pool shows possible, fewer of
    them than random draws need for that, the same ones on every machine (drawn again or cached)."""
    from tests.kit.explore import pairs

    monkeypatch.setattr(pairs, "POOL", 80)
    monkeypatch.setattr(pairs, "EXTRA_POOLS", 0)  # pairs of features here; interplays in the next test
    monkeypatch.setattr(pairs, "CACHE", tmp_path)
    first = pairs.covering(ALL, 4)
    possible = len(first.feature_pairs)
    assert first.measure(first.configs)["feature pairs"] == (possible, possible)
    drawn = pairs._pool(ALL, 4, 1, (), pairs.COVER_SEED)[: len(first.configs)]
    assert first.measure(drawn)["feature pairs"][0] < possible, "as many random draws hold them all"
    assert pairs.covering(ALL, 4).configs == first.configs  # from the cache
    for cached in tmp_path.iterdir():
        cached.unlink()
    assert pairs.covering(ALL, 4).configs == first.configs  # drawn again


def test_the_shipped_covering_is_the_current_spaces():
    """A default run reads its covering from ``tests/kit/explore/cover/`` (committed) instead of drawing
    pools on every fresh clone: the file there must be the one of today's space, and the only one."""
    from tests.kit.explore import pairs

    shipped = sorted(path.name for path in pairs.SHIPPED.glob("*.json"))
    expected = f"{pairs.shipped_key(ALL, 4)}.json"
    fix = "python -m tests.kit.explore --ship-cover"
    assert shipped == [expected], f"shipped {shipped}, the space's is {expected}: {fix}"


def test_an_interplay_the_features_allow_counts_where_no_pool_holds_it(tmp_path, monkeypatch):
    """The interplays' "possible" comes from the declared features, not from what a pool happens to
    hold: one no configuration can carry stays possible and uncovered after the extra pools."""
    from tests.kit.explore import pairs

    monkeypatch.setattr(pairs, "POOL", 40)
    monkeypatch.setattr(pairs, "EXTRA_POOLS", 1)
    monkeypatch.setattr(pairs, "CACHE", tmp_path)
    monkeypatch.setitem(pairs.INTERPLAY_NEEDS, "never drawn", (frozenset({"recurse_false"}), 1))
    found = pairs.covering(ALL, 4)
    covered, possible = found.measure(found.configs)["interplays"]
    assert "never drawn" in found.interplays and possible == len(pairs.possible_interplays(ALL, 4))
    assert covered < possible


def test_an_exploration_says_which_pairs_it_reached(tmp_path, monkeypatch):
    from tests.kit.explore import pairs

    monkeypatch.setattr(pairs, "POOL", 40)
    monkeypatch.setattr(pairs, "CACHE", tmp_path / "cover")
    found = explore(_PassingCluster(), ALL, examples=5, seed=1, max_world=4, save_dir=tmp_path)
    assert found.passed and found.covering > 0 and found.drawn == 5
    covered, possible = found.pairs["feature pairs"]
    assert covered == possible > 0, found.pairs
    assert f"feature pairs {covered}/{possible}" in found.pairs_line()
    assert f"{found.covering} covering + 5 configurations drawn" in found.summary()


def _replayed(request) -> list[Path | str]:
    return [*REGRESSION_FILES, *(request.config.getoption("--replay") or [])]


def test_regressions_and_replays_pass(request, cluster):
    """Each committed regression (a configuration L4 found failing, now fixed) and each --replay."""
    targets = _replayed(request)
    assert REGRESSION_FILES, "no committed L4 regression under tests/kit/explore/regressions/"
    failed = []
    for target in targets:
        result = run_config(cluster, load(target))
        if not result.passed:
            failed.append(f"{target}: {result.failure}")
    assert not failed, "\n".join(failed)


def _replays_named_by(known_defects: dict) -> list[str]:
    """The replay ids an adapter's known defects name (ten hex digits each)."""
    return sorted({found for text in known_defects.values() for found in re.findall(r"\b[0-9a-f]{10}\b", text)})


def test_fsdp2s_known_defects_still_fail_on_it_and_are_regressions_ours_passes(tmp_path):
    """Each replay torch FSDP2's known defects name is a committed regression (ours passes it:
    ``test_regressions_and_replays_pass``) and still fails on FSDP2: were torch to fix one, this says
    so, and its combination can be drawn for FSDP2 again."""
    from tests.kit.judging.adapters.fsdp2 import KNOWN_DEFECTS
    from tests.kit.runtime.cluster import RankCluster

    replays = _replays_named_by(KNOWN_DEFECTS)
    assert len(replays) >= len(KNOWN_DEFECTS), KNOWN_DEFECTS
    configs_ = {name: load(name) for name in replays}
    assert all((REGRESSIONS / f"{name}.json").exists() for name in replays), replays
    with RankCluster.start(max(c.world for c in configs_.values()), implementation="torch") as fsdp2:
        passed = [name for name, config in configs_.items() if run_config(fsdp2, config).passed]
        raising = l4.run(fsdp2, 0, 0, 2, replay=LATE_WEIGHT_CRASH)
    assert not passed, f"torch FSDP2 passes its known defects' replays {passed}: drop them from KNOWN_DEFECTS"
    _says_where_it_raised(raising, tmp_path)


LATE_WEIGHT_CRASH = "30e947c334"  # FSDP2 raises on the late-registered module's weight, in backward


def _says_where_it_raised(done: l4.L4Run, tmp_path: Path) -> None:
    """A failing replay is diagnosed where L4's users meet it: the run, its results JSON, the sweep's
    line and index section, and the notebook's failure cell (its picture marks the crash)."""
    crash = done.diagnosis.crash if done.diagnosis is not None else None
    assert crash is not None and (crash["module"], crash["tensor"]) == ("late", "weight"), done.diagnosis
    assert crash["phase"] == "backward" and crash["ranks"] == [0, 1], crash
    l4.write_results(done, str(tmp_path / "l4.json"))
    line = json.loads((tmp_path / "l4.json").read_text())["diagnosis"]
    assert line.startswith(f"L4 {LATE_WEIGHT_CRASH}: raised at step "), line
    row = {"implementation": "torch", "status": "FAIL", "summary": "s", "seconds": 1.0, "page": "p", "notebook": None}
    row["diagnosis"] = line
    assert line in l4_line(row) and html.escape(line) in l4_section([row])
    from tests.kit.front.diagnose import picture

    assert picture(done.diagnosis).axes[0].get_title().endswith("raised at " + crash["step"] + ", backward")


def test_the_explorer_finds_nothing_within_its_budget(cluster, tmp_path):
    """Another seed than the notebook's, on a budget of ``HPKIT_L4_EXAMPLES`` configurations
    (default 8: a smoke run of random draws beside the notebook's, which has the covering phase;
    given a budget, as the mutation harness gives it, the covering phase first too; ``HPKIT_L4_SHRINK_S``
    bounds the shrink of a failure, default 300 s)."""
    from tests.kit.explore.runner import features_of, known_defects_of

    budget = os.environ.get("HPKIT_L4_EXAMPLES")
    examples = int(budget or "8")
    avoid = tuple(known_defects_of(cluster))
    found = explore(
        cluster,
        features_of(cluster),
        examples=examples,
        seed=1,
        max_world=4,
        save_dir=tmp_path,
        avoid=avoid,
        cover=budget is not None,
        shrink_budget_s=float(os.environ.get("HPKIT_L4_SHRINK_S", "300")),
    )
    assert found.passed, found.summary() + "\n" + found.minimal.config.to_json()


@pytest.mark.parametrize(
    "bad",
    [
        {"--examples": "0"},
        {"--max-world": "9"},
        {"--replay": "nonexistent-id"},
        {"--without": "hsdp,warp_drive"},
        {"--min-world": "5"},
    ],
)
def test_the_command_refuses_bad_arguments_in_one_line(bad, capsys):
    from tests.kit.explore.__main__ import main

    argv = [part for item in bad.items() for part in item]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert str(stop.value).startswith(next(iter(bad))), stop.value


def test_both_drivers_check_their_world_sizes_alike():
    """``explore`` and ``explore_all`` set up through one pipeline: a ``min_world`` above the
    ``max_world`` asked for is refused by both, before anything runs."""
    from tests.kit.explore.survey import explore_all

    for driver in (explore, explore_all):
        with pytest.raises(ValueError, match="min_world must be in 1..max_world"):
            driver(_PassingCluster(), ALL, examples=1, max_world=2, min_world=3, cover=False)


def test_a_failure_only_checked_untraced_is_still_named_by_the_diagnosis(monkeypatch):
    """Where the traced run passes (the lifetime checks stand down while the tracer's records hold
    tensors), the diagnosis of a failing configuration still names what failed untraced."""
    from tests.kit.explore import diagnosis as l4_diagnosis
    from tests.kit.explore.runner import ExampleResult, diagnose_failing
    from tests.kit.judging.divergence import Diagnosis

    monkeypatch.setattr(l4_diagnosis, "diagnose_config", lambda *a, **k: Diagnosis("L4 x", "", status="PASS"))
    failure = "rank 0: step 0 after backward: bytes still held: 16.0 vs 0.0 (error None, tol None); rank 1: ..."
    result = ExampleResult(load(REGRESSION_FILES[0]), passed=False, failure=failure)
    diagnosis = diagnose_failing(None, result, "x")
    assert diagnosis.line().endswith(
        "fails outside them, first at step 0 after backward: bytes still held: 16.0 vs 0.0 "
        "(checked only where nothing is traced)"
    ), diagnosis.line()
