"""Engine training tests: every fully_shard option trained 3 Adam steps against torch DDP.

Rank bodies live in ``_ranks_training.py``; each runs on the warm cluster's engines.
"""

from __future__ import annotations

import pytest

from tests.engine import _ranks_training as ranks

pytestmark = pytest.mark.engine

OPTIONS = {
    "nested": dict(),
    "flat": dict(nested=False),
    "unfused": dict(comm_fusion=False),
    "reshard_after_forward_true": dict(reshard_after_forward=True),
    "reshard_after_forward_false": dict(reshard_after_forward=False),
    "shard_dim1": dict(placement="dim1"),
    "shard_dim1_unfused": dict(placement="dim1", comm_fusion=False),
    "placement_replicate": dict(placement="replicate_bias"),
    "replicate_params": dict(replicate_first_bias=True),
    "mesh_none": dict(use_default_mesh=True),
    "fewer_rows_than_ranks": dict(dims=(3, 1, 2)),
}

OPTIONS_4 = {
    "hsdp": dict(mesh_shape=(2, 2)),
    "hsdp_unfused_dim1": dict(mesh_shape=(2, 2), comm_fusion=False, placement="dim1"),
    "hsdp_replicate_params": dict(mesh_shape=(2, 2), replicate_first_bias=True),
    "fsdp_4_ranks": dict(mesh_shape=(4,)),
    "fsdp_4_ranks_empty_shards": dict(mesh_shape=(4,), dims=(3, 2, 3)),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_fully_shard_matches_ddp_2_ranks(cluster, options):
    cluster.run(ranks.fsdp_matches_ddp, 2, **options)


@pytest.mark.parametrize("options", OPTIONS_4.values(), ids=OPTIONS_4.keys())
def test_fully_shard_matches_ddp_4_ranks(cluster, options):
    cluster.run(ranks.fsdp_matches_ddp, 4, **options)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_activation_checkpointing_matches_ddp(cluster, use_reentrant):
    cluster.run(ranks.checkpointed_matches_ddp, 2, use_reentrant=use_reentrant)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_several_forwards_per_backward(cluster, reshard_after_forward):
    cluster.run(ranks.multi_forward_matches_ddp, 2, reshard_after_forward=reshard_after_forward)


def test_module_unused_in_a_step(cluster):
    cluster.run(ranks.unused_module_matches_ddp, 2)


def test_tied_weights_in_one_group(cluster):
    cluster.run(ranks.tied_weights_match_ddp, 2)


def test_list_input(cluster):
    cluster.run(ranks.list_input_matches_ddp, 2)


def test_gradient_accumulation_without_sync(cluster):
    cluster.run(ranks.gradient_accumulation_matches_ddp, 2)
