"""Every assertion of the plan's L1-L3 rows is judged by at least one check of a real run of its
case (``tests/kit/plan/``): a check renamed or dropped cannot leave a plan assertion unchecked
while the case still passes. A device-only assertion may be not run, and only with the case's note
saying so. In ``make test`` the runs are the notebooks' (``tests.kit.judging.verdict_store``); the L3
cases whose notebook is left to ``make test-slow`` are judged there too (``slow``), but the two
``make test`` runs itself, once: the run here is shared with their case tests."""

from __future__ import annotations

import pytest

from tests.kit.front.pytest_cases import L3_IN_MAKE_TEST
from tests.kit.judging.case import Case, Check, load_plan_cases
from tests.kit.judging.verdict import Verdict, judge_case
from tests.kit.judging.verdict_store import share, shared
from tests.kit.plan import PLAN, Assertion, base_id, judge

PLANNED = sorted(c.id for c in load_plan_cases().values() if c.level in ("L1", "L2", "L3"))


def _tiered(case_id: str) -> object:
    """An L3 case's run is ``slow`` where ``make test`` leaves that case to ``make test-slow``."""
    slow = case_id.startswith("L3") and case_id not in L3_IN_MAKE_TEST
    return pytest.param(case_id, marks=pytest.mark.slow) if slow else case_id


def test_every_case_of_the_plan_has_its_assertions_and_only_those():
    assert sorted({base_id(case_id) for case_id in PLANNED}) == sorted(PLAN)


@pytest.mark.parametrize("case_id", [_tiered(case_id) for case_id in PLANNED])
def test_every_plan_assertion_is_judged_by_a_check(case_id, request):
    verdict = shared(case_id, "")
    if verdict is None:
        verdict = judge_case(request.getfixturevalue("cluster"), case_id)
        share(verdict, "")  # the case's own test judges this run instead of running it again
    rows = judge(verdict)
    unjudged = [row.assertion.says for row in rows if row.status == "no check"]
    assert not unjudged, f"{case_id}: plan assertions no check judges: {unjudged}"
    for row in rows:
        if row.status == "not run":
            assert row.assertion.device, row
            assert any(note.startswith("device part: not run") for note in verdict.notes), verdict.notes
    failed = [row.assertion.says for row in rows if row.status == "FAIL"]
    assert not failed and verdict.passed, verdict.report()


def _check(name: str, passed: bool = True, error: float | None = 0.0) -> Check:
    return Check(name, 0, 1.0, 1.0, 1e-5, passed, error, None, "close")


def test_an_assertion_loses_its_verdict_when_its_checks_go_or_fail():
    case = Case("L3-05", "test_x", 2, {"dp": 2}, "FSDP 1D fp32", body=lambda ctx: None)
    by_name = {a.says: a for a in PLAN["L3-05"]}
    chunk_sum = by_name["sum(per_chunk_losses) == total_loss (atol=1e-6)"]
    assert isinstance(chunk_sum, Assertion)
    named = "step 0 sum of chunk losses == total loss (the CE of the whole logits at once)"
    rows = {r.assertion.says: r for r in judge(Verdict(case, checks=[_check(named)]))}
    assert rows[chunk_sum.says].status == "pass" and rows[chunk_sum.says].checks == 1
    assert rows["total loss atol=1e-5"].status == "no check"  # no loss check recorded
    rows = {r.assertion.says: r for r in judge(Verdict(case, checks=[_check(named, passed=False, error=0.3)]))}
    assert rows[chunk_sum.says].status == "FAIL" and rows[chunk_sum.says].worst_error == 0.3
    renamed = [_check("step 0 sum of the chunks")]
    assert {r.assertion.says: r for r in judge(Verdict(case, checks=renamed))}[chunk_sum.says].status == "no check"
