"""Engine training tests: what no plan case trains (layouts and option rows, model shapes, AC),
each against its baseline through the kit's checks. Rank bodies live in ``_ranks_training.py``."""

from __future__ import annotations

import pytest

from tests.engine import _ranks_training as ranks

pytestmark = pytest.mark.engine

# option rows no plan case trains (the others: L0-01..L0-06, L1-02, L1-07, L1-08)
OPTIONS = {
    "flat_root_only": (2, dict(mesh={"dp": 2}, nested=False)),
    "shard_dim1_unfused": (2, dict(mesh={"dp": 2}, dim1=True, comm_fusion=False)),
    "hsdp_unfused_dim1": (4, dict(mesh={"replicate": 2, "shard": 2}, dim1=True, comm_fusion=False)),
    # (2, 3) and (3, 2) weights over 4 ranks: ranks 2 and 3 hold nothing of some params
    "fsdp_4_ranks_empty_shards": (4, dict(mesh={"dp": 4}, dims=(3, 2, 3))),
}


@pytest.mark.parametrize("world, options", OPTIONS.values(), ids=OPTIONS.keys())
def test_option_rows_match_ddp(cluster, world, options):
    """Layout, collectives and training = DDP of the OPTIONS rows; no plan case covers these rows."""
    cluster.run(ranks.options_match_ddp, world, **options)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_several_forwards_per_backward(cluster, reshard_after_forward):
    """Several forwards of one model per backward = DDP; no plan case covers it."""
    cluster.run(ranks.several_forwards_match_ddp, 2, reshard_after_forward=reshard_after_forward)


def test_module_unused_in_a_step(cluster):
    """A module unused in a step: no grad, training = DDP(find_unused_parameters); no plan case covers it."""
    cluster.run(ranks.unused_module_matches_ddp, 2)


def test_tied_weights_in_one_group(cluster):
    """Weights tied inside one group stay tied, training = DDP; no plan case covers it yet (L3-01/02 will)."""
    cluster.run(ranks.tied_weights_match_ddp, 2)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_activation_checkpointing(cluster, use_reentrant, bf16):
    """AC re-running sharded forwards in backward = no-AC baseline; no plan case covers it (L2-03/04 will: fp32)."""
    cluster.run(ranks.checkpointed_matches_reference, 2, use_reentrant=use_reentrant, bf16=bf16)


@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "by keyword"])
def test_each_group_reshards_when_its_backward_is_done(cluster, by_keyword):
    """Post-backward fires per module during backward (not only at its end), whether the module's input
    comes positionally or by keyword; no plan case looks inside a backward."""
    cluster.run(ranks.each_group_reshards_when_its_backward_is_done, 2, by_keyword=by_keyword)
