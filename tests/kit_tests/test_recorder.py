"""The collective recorder sees every implementation's collectives (positional or keyword
arguments, any group) and changes nothing they do (autograd's version counters included)."""

from __future__ import annotations

from tests.kit_tests import _ranks_recorder as ranks


def test_recording_leaves_version_counters_as_they_are(cluster):
    for result in cluster.run(ranks.versions_with_and_without_recording, 2):
        assert result["recorded"] == result["plain"] and result["plain"][0] > 0, result


def test_positional_keyword_and_subgroup_calls_are_recorded_alike(cluster):
    world = 4
    for rank, calls in enumerate(cluster.run(ranks.calls_seen, world)):
        in_pair = [("all_reduce", "torch.bfloat16", 7, 2, 2 * (2 - 1) / 2 * 7 * 2)] if rank < 2 else []
        assert calls == [
            ("all_gather", "torch.float32", 3, world, (world - 1) * 3 * 4),
            ("all_gather", "torch.float32", 3, world, (world - 1) * 3 * 4),
            ("reduce_scatter", "torch.float32", 5 * world, world, (world - 1) / world * 5 * world * 4),
            *in_pair,  # ranks outside the subgroup issue nothing
            ("all_to_all", "torch.float32", 2 * world, world, (world - 1) / world * 2 * world * 4),
        ], (rank, calls)
