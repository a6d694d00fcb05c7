"""Engine tensor-parallel test: the TP + FSDP row L0-TP does not train. Rank bodies in ``_ranks_tensor_parallel.py``."""

from __future__ import annotations

import pytest

from tests.engine import _ranks_tensor_parallel as ranks

pytestmark = pytest.mark.engine


def test_tp_with_unfused_fully_shard(cluster):
    """TP + fully_shard(comm_fusion=False) on a (dp, tp) mesh = DDP; no plan case covers it (L0-TP is fused)."""
    cluster.run(ranks.tp_unfused_matches_ddp, 4)


def test_tp_on_a_slice_of_a_3d_mesh(cluster):
    """TP on the tp slice of a 3-D mesh beside FSDP on a 1-D dp slice, and beside HSDP on a 2-D one, = DDP."""
    cluster.run(ranks.tp_on_a_3d_mesh_matches_ddp, 4)


def test_tp_on_a_mesh_unflattened_from_the_worlds(cluster):
    """TP and FSDP (then HSDP) on dims unflattened from a 1-D world mesh (torchtitan's meshes) = DDP."""
    cluster.run(ranks.tp_on_an_unflattened_mesh_matches_ddp, 4)


def test_tp_on_a_slice_of_a_3d_mesh_where_torch_cannot_concatenate_meshes(cluster):
    """The engine's fallback for releases without ``DeviceMesh._concatenate`` (dims joined by name) = DDP."""
    cluster.run(ranks.tp_on_a_3d_mesh_without_concatenate_matches_ddp, 4)
