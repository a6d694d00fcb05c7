"""Engine control tests: collectives issued, HSDPModule methods, argument checks."""

from __future__ import annotations

import pytest

from tests.engine import _ranks_controls as ranks

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("comm_fusion", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["fsdp", "hsdp"])
def test_collective_counts(cluster, mesh_shape, comm_fusion):
    world = 1
    for size in mesh_shape:
        world *= size
    cluster.run(ranks.collective_counts, world, mesh_shape=mesh_shape, comm_fusion=comm_fusion)


@pytest.mark.parametrize(
    "body",
    [
        ranks.unshard_reshard_lifecycle,
        ranks.reshard_controls_match_ddp,
        ranks.reduce_op_sum_is_world_times_avg,
        ranks.deferred_last_backward,
        ranks.prefetch_follows_lists,
        ranks.zero_grad_clears_everything,
        ranks.recurse_false_touches_own_group_only,
        ranks.ignored_params_untouched,
        ranks.bad_input_is_refused_before_any_change,
        ranks.recovers_after_failed_iterations,
    ],
    ids=lambda f: f.__name__,
)
def test_control_2_ranks(cluster, body):
    cluster.run(body, 2)


def test_requires_all_reduce_hsdp(cluster):
    cluster.run(ranks.requires_all_reduce_hsdp, 4)


def test_reduce_op_sum_4_ranks(cluster):
    cluster.run(ranks.reduce_op_sum_is_world_times_avg, 4)
