"""Engine checkpoint tests: DCP save/load and full/sharded state dicts of a sharded model."""

from __future__ import annotations

import pytest

from tests.engine import _ranks_checkpoint as ranks

pytestmark = pytest.mark.engine


def test_dcp_round_trip_fsdp(cluster):
    cluster.run(ranks.dcp_round_trip, 2)


def test_dcp_round_trip_hsdp(cluster):
    cluster.run(ranks.dcp_round_trip, 4, mesh_shape=(2, 2))


def test_full_state_dict_round_trip(cluster):
    cluster.run(ranks.full_state_dict_round_trip, 2)
