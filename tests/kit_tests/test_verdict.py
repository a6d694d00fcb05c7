"""The case contract end to end: verdicts pass, fail with a readable table, and survive hangs,
crashes and dead ranks in bounded time, after which the next case runs on the same cluster."""

from __future__ import annotations

import time

import pytest

import tests.kit_tests._test_kit_faults  # noqa: F401 - registers the KIT cases
from tests.kit.judging.verdict import run_case


def _assert_next_case_runs(cluster) -> None:
    verdict = run_case(cluster, "KIT-OK")
    assert verdict.passed, verdict.report()


def test_passing_case_has_every_ranks_checks(cluster):
    verdict = run_case(cluster, "KIT-OK")
    assert verdict.passed, verdict.report()
    assert sorted(c.rank for c in verdict.checks) == [0, 1]
    assert "pass" in verdict.table() and "all-reduce sum" in verdict.table()


def test_warm_run_overhead_is_well_under_a_second(cluster):
    run_case(cluster, "KIT-OK")
    started = time.monotonic()
    verdict = run_case(cluster, "KIT-OK")
    overhead = time.monotonic() - started
    print(f"warm 2-rank case, whole kit round trip: {overhead * 1000:.0f} ms")
    assert verdict.passed and overhead < 1.0, f"warm case took {overhead:.3f} s"


def test_wrong_reference_fails_with_a_readable_table(cluster):
    verdict = run_case(cluster, "KIT-WRONG-REF")
    assert not verdict.passed
    failed = {c.name for c in verdict.failed_checks}
    # the perturbed bias fails element-wise; checks of untouched params still pass
    assert "step 0 grad layers.2.bias" in failed or "step 0 loss" in failed, failed
    assert any(c.passed for c in verdict.checks), "every check failed: the perturbation is not local"
    with pytest.raises(AssertionError) as raised:
        verdict.assert_passed()
    message = str(raised.value)
    assert "FAIL" in message and "tol" in message and "KIT-WRONG-REF" in message
    print(message)


@pytest.mark.parametrize(
    "case_id, needle, bound_s",
    [
        ("KIT-HANG", "_stuck_in_a_collective", 20),
        ("KIT-CRASH", "deliberate crash on rank 1", 15),
        ("KIT-DIE", "died", 15),
    ],
)
def test_faulty_case_fails_in_bounded_time_and_the_next_runs(cluster, case_id, needle, bound_s):
    started = time.monotonic()
    verdict = run_case(cluster, case_id)
    elapsed = time.monotonic() - started
    assert not verdict.passed and verdict.failure, verdict.report()
    assert needle in verdict.failure, verdict.failure
    assert elapsed < bound_s, f"{case_id} took {elapsed:.1f} s"
    if case_id == "KIT-HANG":
        assert "rank 0" in verdict.failure and "rank 1" in verdict.failure, "stacks of every rank"
    _assert_next_case_runs(cluster)
