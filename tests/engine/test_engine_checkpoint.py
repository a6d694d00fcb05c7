"""Engine state-dict tests the plan's L0-DCP does not cover. Rank bodies live in ``_ranks_checkpoint.py``."""

from __future__ import annotations

import pytest

from tests.engine import _ranks_checkpoint as ranks

pytestmark = pytest.mark.engine


def test_full_state_dict_round_trip(cluster):
    """Full state dict via get/set_model_state_dict, state_dict() while unsharded; no plan case covers it."""
    cluster.run(ranks.full_state_dict_round_trip, 2)


def test_a_sharded_state_dict_assigned_after_meta_init(cluster):
    """load_state_dict(assign=True) after meta init (torchtune's load; L4's find, replays 995e331665 and
    bdf792b928): state_dict() holds the loaded tensors before the first forward, training = DDP."""
    cluster.run(ranks.assigned_after_meta_init, 2)


def test_dcp_round_trip_hsdp(cluster):
    """L0-DCP's body on a 2x2 HSDP mesh; no plan case covers DCP on HSDP (L0-DCP is 1-D)."""
    cluster.run(ranks.hsdp_dcp_round_trip, 4)
