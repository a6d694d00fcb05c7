"""Engine control tests no plan case covers: recurse=False on gradient sync, recovery after a failed
iteration, an unshard across the optimizer step (argument refusals are the L0-ARGS cases). Rank bodies
live in ``_ranks_controls.py``."""

from __future__ import annotations

import pytest

from tests.engine import _ranks_controls as ranks

pytestmark = pytest.mark.engine


def test_gradient_sync_recurse_false(cluster):
    """Gradient sync off, recurse=False: only the root's group holds; no plan case covers it (L1-02: all-reduce)."""
    cluster.run(ranks.gradient_sync_recurse_false, 2)


def test_gradient_sync_sets_the_all_reduce_as_fsdp2s(cluster):
    """On HSDP, set_requires_gradient_sync(True) turns the all-reduce back on (FSDP2's rule);
    set_requires_all_reduce(False) after it turns it off alone."""
    cluster.run(ranks.gradient_sync_sets_the_all_reduce, 2)


@pytest.mark.parametrize("failing", ["forward", "backward"])
def test_recovers_after_a_failed_iteration(cluster, failing):
    """After a forward or a backward that raised, training still equals DDP; no plan case covers it."""
    cluster.run(ranks.recovers_after_a_failed_iteration, 2, failing=failing)


@pytest.mark.parametrize("waited", [True, False], ids=["waited after the step", "in flight at the next forward"])
def test_unshard_across_the_optimizer_step(cluster, waited):
    """A gather issued before the optimizer step: the next forward uses the stepped params, whether
    its handle was waited after the step or the forward meets it in flight (L1-01 checks the first)."""
    cluster.run(ranks.unshard_across_the_optimizer_step, 2, waited=waited)
