"""Session-wide pytest set-up for the tests and the notebooks nbval runs (``make test``): the options
(``--implementation``, ``--isolate``), one warm RankCluster for the whole session running the
implementation under test, and what lets one execution of a case serve nbval and pytest alike:

- the level notebooks join one cluster of the session (``HPKIT_JOIN_CLUSTER``, read by
  ``tests.kit.front.notebook.connect``) instead of starting four of their own; its engines compute with
  other CPU arithmetic than the recording's (``OTHER_ARITHMETIC``), so nbval proves the recorded
  text holds where the last digits differ;
- their verdicts go to the session's verdict store (``HPKIT_VERDICT_STORE``), where the pytest
  case of the same id finds and judges them (``tests.kit.judging.verdict_store``), so ``pytest notebooks
  tests`` runs every plan case once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.kit.front.notebook import JOIN_ENV
from tests.kit.judging.levels import LEVELS
from tests.kit.judging.surface import IMPLEMENTATION_ENV, parse_spec
from tests.kit.judging.verdict_store import STORE_ENV
from tests.kit.runtime.cluster import RankCluster

_SESSION: dict[str, RankCluster] = {}
# The notebooks' cluster computes with other CPU arithmetic than the recording's (ATen's scalar
# kernels instead of the CPU's AVX2 / AVX-512 ones: sums and norms add in another order, which moves
# the last digits of L3-01's and L3-02's losses): the recorded text nbval compares must hold anyway.
# A second torch thread per rank was tried too: it moved no loss of those cases and cost 1.5x.
OTHER_ARITHMETIC = {"ATEN_CPU_CAPABILITY": "default"}


def pytest_addoption(parser: pytest.Parser) -> None:
    """--implementation SPEC (see tests.kit.judging.surface), --isolate (fresh engines per case), --replay (L4)."""
    group = parser.getgroup("hyper-parallel-kit")
    group.addoption(
        "--implementation",
        default=os.environ.get(IMPLEMENTATION_ENV, ""),
        help="implementation under test, a SPEC (docs/judging.md#specs; default: this repository's engine). "
        "Only the plan cases run against another one.",
    )
    group.addoption("--isolate", action="store_true", help="fresh engines for every plan case")
    group.addoption(
        "--replay",
        action="append",
        default=[],
        metavar="ID_OR_PATH",
        help="an L4 configuration to replay (tests/kit_tests/test_explore.py): its id under runs/l4/ or a .json path",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a malformed implementation spec before anything starts; open the session's verdict
    store (before any notebook kernel starts, so the kernels inherit it)."""
    try:
        parse_spec(config.getoption("--implementation"))
    except ValueError as exc:
        raise pytest.UsageError(f"--implementation: {exc}") from None
    if not os.environ.get(STORE_ENV):
        store = tempfile.mkdtemp(prefix="hpkit-verdicts-")
        os.environ[STORE_ENV] = store
        config.add_cleanup(lambda: (os.environ.pop(STORE_ENV, None), shutil.rmtree(store, ignore_errors=True)))


def session_cluster(config: pytest.Config, kind: str = "tests") -> RankCluster:
    """The session's warm cluster of ``kind``, started on first use (engine i = rank i): "tests" for
    the tests, "notebooks" for the notebooks nbval runs (four engines, ``OTHER_ARITHMETIC``).

    HPKIT_ENGINES: number of engines the tests' cluster starts (default 4).
    HPKIT_CLUSTER_ID / HPKIT_PROFILE: the tests join that running ipyparallel cluster instead of
    starting one (joining happens when HPKIT_CLUSTER_ID is set, even to "").
    """
    if kind not in _SESSION:
        implementation = config.getoption("--implementation") or None
        profile = os.environ.get("HPKIT_PROFILE") or None
        if kind == "notebooks":
            rc = RankCluster.start(4, profile=profile, engine_env=OTHER_ARITHMETIC)
        elif "HPKIT_CLUSTER_ID" in os.environ:
            rc = RankCluster.join(os.environ["HPKIT_CLUSTER_ID"], profile=profile, implementation=implementation)
        else:
            engines = int(os.environ.get("HPKIT_ENGINES", "4"))
            rc = RankCluster.start(engines, profile=profile, implementation=implementation)
        _SESSION[kind] = rc
        config.add_cleanup(rc.stop)
    return _SESSION[kind]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a notebook's kernel starts (nbval starts it with the notebook's first cell): point it
    at the notebooks' cluster, when the session judges our engine (the notebooks' default). Any
    other test runs without it, so a kernel a test starts itself starts a cluster of its own."""
    if type(item).__name__ != "IPyNbCell":
        os.environ.pop(JOIN_ENV, None)
        return
    if item.config.getoption("--implementation") or JOIN_ENV in os.environ:
        return
    rc = session_cluster(item.config, "notebooks")
    os.environ[JOIN_ENV] = f"{rc.cluster.profile}:{rc.cluster.cluster_id}"


# Notebooks whose cells are marked ``slow`` (make test-slow): L3 trains its networks at the plan's sizes.
SLOW_NOTEBOOKS = ("L3_networks.ipynb",)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow notebooks' cells are marked ``slow``; against another implementation only the plan
    cases run (the engine and kit tests are about ours)."""
    for item in items:
        if type(item).__name__ == "IPyNbCell" and item.path.name in SLOW_NOTEBOOKS:
            item.add_marker(pytest.mark.slow)
    if not config.getoption("--implementation"):
        return
    keep = [item for item in items if any(item.get_closest_marker(level) for level in LEVELS)]
    dropped = [item for item in items if item not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[RankCluster]:
    """Warm cluster of torch ranks shared by the session's tests (``session_cluster``)."""
    yield session_cluster(request.config)


@pytest.fixture(scope="session")
def notebooks_cluster(request: pytest.FixtureRequest) -> Iterator[RankCluster]:
    """The cluster the level notebooks run on (``OTHER_ARITHMETIC``; ``session_cluster``)."""
    yield session_cluster(request.config, "notebooks")
