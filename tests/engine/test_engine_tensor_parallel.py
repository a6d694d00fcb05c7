"""Engine test: tensor parallel (torch's parallelize_module) on one mesh dim, fully_shard on the other."""

from __future__ import annotations

import pytest

from tests.engine import _ranks_tensor_parallel as ranks

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("comm_fusion", [True, False], ids=["fused", "unfused"])
def test_tp_and_fully_shard_match_ddp(cluster, comm_fusion):
    cluster.run(ranks.tp_fsdp_matches_ddp, 4, comm_fusion=comm_fusion)
