"""Shared pytest fixtures and options: one warm RankCluster for the whole session, running the
implementation under test (``--implementation``; default: this repository's engine)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.kit.cluster import RankCluster
from tests.kit.levels import LEVELS
from tests.kit.surface import IMPLEMENTATION_ENV, parse_spec


def pytest_addoption(parser: pytest.Parser) -> None:
    """--implementation SPEC (see tests.kit.surface) and --isolate (fresh engines per case)."""
    group = parser.getgroup("hyper-parallel-kit")
    group.addoption(
        "--implementation",
        default=os.environ.get(IMPLEMENTATION_ENV, ""),
        help="implementation under test: PATH (a hyper_parallel checkout), torch, native:PATH, upstream:PATH, "
        "file:ADAPTER.py (default: this repository's engine). Only the plan cases run against another one.",
    )
    group.addoption("--isolate", action="store_true", help="fresh engines for every plan case")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a malformed implementation spec before anything starts."""
    try:
        parse_spec(config.getoption("--implementation"))
    except ValueError as exc:
        raise pytest.UsageError(f"--implementation: {exc}") from None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Against another implementation only the plan cases run (the engine and kit tests are about ours)."""
    if not config.getoption("--implementation"):
        return
    keep = [item for item in items if any(item.get_closest_marker(level) for level in LEVELS)]
    dropped = [item for item in items if item not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[RankCluster]:
    """Warm cluster of torch ranks shared by the session (engine i = rank i).

    HPKIT_ENGINES: number of engines to start (default 4).
    HPKIT_CLUSTER_ID / HPKIT_PROFILE: join that running ipyparallel cluster instead of
    starting one (joining happens when HPKIT_CLUSTER_ID is set, even to "").
    """
    implementation = request.config.getoption("--implementation") or None
    profile = os.environ.get("HPKIT_PROFILE") or None
    if "HPKIT_CLUSTER_ID" in os.environ:
        rc = RankCluster.join(os.environ["HPKIT_CLUSTER_ID"], profile=profile, implementation=implementation)
    else:
        engines = int(os.environ.get("HPKIT_ENGINES", "4"))
        rc = RankCluster.start(engines, profile=profile, implementation=implementation)
    try:
        yield rc
    finally:
        rc.stop()
