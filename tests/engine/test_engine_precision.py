"""Engine mixed-precision tests: the policy combinations no plan case trains (the MP rows of the plan, docs/cases.md
are L0-10, L1-10..L1-13). Rank bodies live in ``_ranks_precision.py``."""

from __future__ import annotations

import pytest

from tests.engine import _ranks_precision as ranks

pytestmark = pytest.mark.engine


def test_mixed_precision_unfused(cluster):
    """bf16/fp32 with comm_fusion=False: per-param gathers and reductions = reference; no plan case covers it."""
    cluster.run(ranks.mixed_precision_matches_reference, 2, mesh={"dp": 2}, comm_fusion=False)


def test_mixed_precision_hsdp(cluster):
    """bf16/fp32 on a 2x2 HSDP mesh, the replicas' all-reduce in fp32, = reference; no plan case covers it."""
    cluster.run(ranks.mixed_precision_matches_reference, 4, mesh={"replicate": 2, "shard": 2})


def test_mixed_precision_accumulation_unreduced(cluster):
    """bf16/fp32, no main grad: unreduced grads accumulate, then reduce = reference; no plan case covers it."""
    cluster.run(ranks.mixed_precision_accumulation, 2)


def test_ignored_params_never_cast(cluster):
    """An ignored param stays plain fp32 under a bf16 policy; no plan case covers it (L1-06 has no policy)."""
    cluster.run(ranks.ignored_params_never_cast, 2)


def test_a_first_grad_held_back_stays_in_the_compute_dtype(cluster):
    """bf16/fp32: a first unreduced grad is not cast before its reduction copies it; a second is added in fp32."""
    cluster.run(ranks.first_grad_kept_in_compute_dtype, 2)
