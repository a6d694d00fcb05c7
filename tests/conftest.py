"""Shared pytest fixtures: one warm RankCluster for the whole session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.kit.cluster import RankCluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[RankCluster]:
    """Warm cluster of torch ranks shared by the session (engine i = rank i).

    HPKIT_ENGINES: number of engines to start (default 4).
    HPKIT_CLUSTER_ID / HPKIT_PROFILE: join that running ipyparallel cluster instead of
    starting one (joining happens when HPKIT_CLUSTER_ID is set, even to "").
    """
    profile = os.environ.get("HPKIT_PROFILE") or None
    if "HPKIT_CLUSTER_ID" in os.environ:
        rc = RankCluster.join(os.environ["HPKIT_CLUSTER_ID"], profile=profile)
    else:
        rc = RankCluster.start(int(os.environ.get("HPKIT_ENGINES", "4")), profile=profile)
    try:
        yield rc
    finally:
        rc.stop()
