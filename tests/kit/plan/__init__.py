"""The plan's assertions, case by case, and the checks that judge each (plan fidelity).

Every row of the plan's L1-L3 tables lists core assertions (the plan, ``v1.1``: "核心断言" and the
"L3 assertion specs"). Each becomes an ``Assertion`` here: what the plan asks (in English), the
checks that judge it (a regular expression searched in the check names a case records), the
baseline they compare with, and where the kit reads the plan differently, with the triage. A
case's other layouts (``L3-01-FSDP``, ``L3-02-HSDP``, ...) are judged by their base case's rows.
The rows are data, one module per level (``l1``, ``l2``, ``l3``); ``assertions`` holds what an
assertion is and the baselines they share. This package may import ``tests.kit.judging`` only.

``judge(verdict)`` turns a verdict into one row per assertion (the head of every case page, and the
table in docs/plan_fidelity.md, generated from here by ``python docs/catalogue.py``);
``tests/kit_tests/test_plan_fidelity.py`` checks that every assertion is judged by at least one check in
a real run, so a renamed or dropped check cannot leave a plan assertion silently unchecked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.kit.plan.assertions import CHECKS, CLEAN, TIMEOUT, Assertion, Judged
from tests.kit.plan.l1 import L1
from tests.kit.plan.l2 import L2
from tests.kit.plan.l3 import L3

if TYPE_CHECKING:
    from tests.kit.judging.checks import Check
    from tests.kit.judging.verdict import Verdict

__all__ = ["CHECKS", "CLEAN", "PLAN", "TIMEOUT", "Assertion", "Judged", "assertions_of", "base_id", "judge"]

PLAN: dict[str, tuple[Assertion, ...]] = {**L1, **L2, **L3}


def base_id(case_id: str) -> str:
    """The plan row a case judges: ``L3-01-FSDP`` -> ``L3-01`` (its other layout)."""
    return "-".join(case_id.split("-")[:2])


def assertions_of(case_id: str) -> tuple[Assertion, ...]:
    """The plan's assertions of a case (none for the kit's own L0 cases)."""
    return PLAN.get(base_id(case_id), ())


def judge(verdict: Verdict) -> list[Judged]:
    """One row per plan assertion of the verdict's case."""
    return [_judge_one(assertion, verdict) for assertion in assertions_of(verdict.case.id)]


def _judge_one(assertion: Assertion, verdict: Verdict) -> Judged:
    if assertion.judged_by == TIMEOUT:
        done = verdict.failure_kind != "TIMEOUT" and verdict.failure_kind != "DIED"
        detail = f"{verdict.seconds:.1f} s of {verdict.case.timeout:g} s"
        return Judged(assertion, "pass" if done and verdict.status != "UNSUPPORTED" else "FAIL", detail=detail)
    if assertion.judged_by == CLEAN:
        clean = verdict.failure is None
        return Judged(assertion, "pass" if clean else "FAIL", detail="raised nothing" if clean else "the run failed")
    matched = [c for c in verdict.checks if assertion.matches(c)]
    if not matched:
        noted = assertion.device and any(note.startswith("device part: not run") for note in verdict.notes)
        return Judged(assertion, "not run" if noted else "no check")
    failed = [c for c in matched if not c.passed]
    scored = [c for c in matched if c.error is not None]
    top = max(scored, key=_margin) if scored else None
    names = sorted({c.name for c in (failed or matched)})
    first = (failed or matched)[0]
    seen = f"{_number(first.measured)} vs {_number(first.reference)}" if len(names) == 1 and not scored else ""
    return Judged(
        assertion,
        "FAIL" if failed else "pass",
        checks=len(matched),
        failed=len(failed),
        worst_error=top.error if top else None,
        tol=top.tol if top else None,
        names=names[:3],
        kinds={c.kind for c in matched},
        seen=seen,
    )


def _number(value: float | str) -> str:
    if isinstance(value, float):
        return f"{int(value):,}" if value.is_integer() else f"{value:.4g}"
    return str(value)


def _margin(check: Check) -> float:
    """How close a check came to its tolerance (exact checks: only when they missed)."""
    if check.tol:
        return check.error / check.tol
    return float("inf") if check.error else 0.0
