"""Driver side of the case contract: run a case on the cluster and judge every rank's checks.

Verdicts: PASS (every plan check on every rank passed), FAIL (a check failed, or a
precondition), UNSUPPORTED (the implementation lacks or refused a plan feature the case needs;
named), ERROR (the case raised), TIMEOUT (a rank hung: stacks attached), DIED (a rank's process
ended). Checks tagged extra (beyond the plan and the API) are judged apart: ``extras_passed``.
The verdict renders as a text table (pytest failure messages, logs) and as HTML (notebooks).
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from typing import Any

from tests.kit.judging.case import Case, Check, ImplementationRefused, case_by_id, run_on_rank
from tests.kit.judging.divergence import NOT_RUN, Diagnosis, diagnose, wanted
from tests.kit.runtime.cluster import RankCluster, RankFailure

STATUSES = ("PASS", "FAIL", "UNSUPPORTED", "ERROR", "TIMEOUT", "DIED")


@dataclass
class Verdict:
    """Every rank's checks of one case run, or the failure that stopped it."""

    case: Case
    checks: list[Check] = field(default_factory=list)
    series: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    figures: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # every rank's bars, merged
    failure: str | None = None  # traceback / stacks when the run itself failed
    failure_kind: str | None = None  # ERROR, TIMEOUT, DIED or UNSUPPORTED when the run failed
    unsupported: list[str] = field(default_factory=list)  # features lacking or refused
    origin: dict[str, Any] = field(default_factory=dict)  # what the ranks imported (surface origin)
    seconds: float = 0.0
    leak: str | None = None  # set when the case failed warm but passes alone on fresh engines
    notes: list[str] = field(default_factory=list)  # parts of the case that did not run, and why
    diagnosis: Diagnosis | None = None  # a FAIL's first divergence (tests.kit.judging.divergence)

    @property
    def plan_checks(self) -> list[Check]:
        return [c for c in self.checks if c.extra is None]

    @property
    def extra_checks(self) -> list[Check]:
        return [c for c in self.checks if c.extra is not None]

    @property
    def status(self) -> str:
        """PASS, FAIL, UNSUPPORTED, ERROR, TIMEOUT or DIED (the plan's verdict; extras apart)."""
        if self.unsupported or self.nothing_but_skipped_parts:
            return "UNSUPPORTED"
        if self.failure_kind:
            return self.failure_kind
        plan = self.plan_checks
        return "PASS" if plan and all(c.passed for c in plan) else "FAIL"

    @property
    def nothing_but_skipped_parts(self) -> bool:
        """Every part was skipped or refused: only preconditions ran, nothing was judged."""
        judged = [c for c in self.plan_checks if not c.name.startswith("precondition: ")]
        return bool(self.notes) and not judged and self.failure_kind is None

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    @property
    def extras_passed(self) -> bool:
        return all(c.passed for c in self.extra_checks)

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    @property
    def first_failure(self) -> str:
        """One line: the first failing plan check, the unsupported feature, or the run's failure."""
        if self.leak:
            return self.leak
        if self.unsupported:
            return "unsupported: " + ", ".join(self.unsupported)
        if self.nothing_but_skipped_parts:
            return "unsupported: every part (" + "; ".join(self.notes) + ")"
        if self.failure:
            return self.failure.splitlines()[0][:300]
        failed = [c for c in self.plan_checks if not c.passed]
        if failed:
            c = failed[0]
            return f"{c.name} (rank {c.rank}): {_fmt(c.measured)} vs {_fmt(c.reference)}, error {_fmt(c.error)}"
        return ""

    # -- rendering -------------------------------------------------------------------------
    def table(self, only_failed: bool = False) -> str:
        """A fixed-width table of the checks (one row per check and rank)."""
        rows = self.failed_checks if only_failed else self.checks
        header = ("check", "rank", "measured", "reference", "error", "tol", "verdict")
        lines = [header] + [_row(c) for c in rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines]
        text.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(text)

    def summary(self) -> str:
        if self.unsupported:
            detail = "unsupported: " + ", ".join(self.unsupported)
        elif self.failure is not None:
            detail = "run failed"
        else:
            detail = f"{len(self.plan_checks)} checks, {sum(not c.passed for c in self.plan_checks)} failed"
            if self.extra_checks:
                bad = sum(not c.passed for c in self.extra_checks)
                detail += f"; extras {len(self.extra_checks) - bad}/{len(self.extra_checks)}"
            if self.notes:
                detail += f"; {len(self.notes)} part(s) not run"
        where = f"[{self.case.world_size} ranks, {self.case.config}]"
        return f"{self.case.id} {self.case.name} {where}: {self.status} ({detail}, {self.seconds:.1f} s)"

    def report(self) -> str:
        """Summary, the failing rows (or all rows), and the run failure if any."""
        parts = [self.summary()]
        if self.diagnosis is not None:
            parts.append(f"diagnosis: {self.diagnosis.line()}")
        if self.leak:
            parts.append(self.leak)
        parts.extend(f"note: {note}" for note in self.notes)
        if self.checks:
            parts.append(self.table(only_failed=bool(self.failed_checks)))
        if self.failure:
            parts.append(self.failure)
        return "\n".join(parts)

    def html_rows(self, checks: list[Check]) -> str:
        """An HTML table of these checks: failing rows first, red."""
        rows = sorted(checks, key=lambda c: c.passed)
        cells = "".join(
            "<tr style='background:{}'>{}</tr>".format(
                "#fde2e2" if not c.passed else "#ffffff",
                "".join(f"<td>{html.escape(v)}</td>" for v in _row(c)),
            )
            for c in rows
        )
        head = "".join(f"<th>{h}</th>" for h in ("check", "rank", "measured", "reference", "error", "tol", "verdict"))
        return f"<table><tr>{head}</tr>{cells}</table>"

    def html(self) -> str:
        """An HTML table of every check for notebooks: failing rows first, red."""
        failure = f"<pre>{html.escape(self.failure)}</pre>" if self.failure else ""
        return f"<h4>{html.escape(self.summary())}</h4>{self.html_rows(self.checks)}{failure}"

    def assert_passed(self, extras: bool = True) -> None:
        """Raise with the report unless the plan checks (and, by default, the extras) passed."""
        if not self.passed or (extras and not self.extras_passed):
            raise AssertionError(self.report())


def _fmt(value: float | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3e}" if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e4) else f"{value:.6g}"
    return str(value)


def _row(check: Check) -> tuple[str, ...]:
    name = check.name if check.extra is None else f"[extra] {check.name}"
    return (
        name,
        str(check.rank),
        _fmt(check.measured),
        _fmt(check.reference),
        _fmt(check.error),
        _fmt(check.tol),
        "pass" if check.passed else "FAIL",
    )


def _judge_failure(verdict: Verdict, failure: RankFailure) -> None:
    """Tell a refusal from an error, a hang and a death."""
    verdict.failure = str(failure)
    refused = [evalue for ename, evalue in failure.raised.values() if ename == ImplementationRefused.__name__]
    if failure.dead:
        verdict.failure_kind = "DIED"
    elif refused:
        verdict.failure_kind = "UNSUPPORTED"
        verdict.unsupported = sorted(set(refused))
    elif failure.timed_out:
        verdict.failure_kind = "TIMEOUT"
    else:
        verdict.failure_kind = "ERROR"


def _merged_figures(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Every rank's bars in one figure each (a label two ranks draw: the lower rank's)."""
    merged: dict[str, dict[str, dict[str, float]]] = {}
    for result in results:
        for figure, groups in result.get("figures", {}).items():
            into = merged.setdefault(figure, {})
            for label, values in groups.items():
                into.setdefault(label, values)
    return merged


def run_case(cluster: RankCluster, case_id: str, timeout: float | None = None, backend: str | None = None) -> Verdict:
    """Run one registered case on the cluster's first ``world_size`` engines and judge it.

    ``timeout`` / ``backend`` override the case's own (None: keep them; backend None = auto)."""
    spec = case_by_id(case_id)
    verdict = Verdict(spec)
    started = time.monotonic()
    try:
        results: list[dict[str, Any]] = cluster.run(
            run_on_rank,
            spec.world_size,
            spec.id,
            spec.module,
            timeout=timeout or spec.timeout,
            backend=backend or spec.backend,
        )
    except RankFailure as failure:
        _judge_failure(verdict, failure)
    else:
        for result in results:
            verdict.checks.extend(Check(**c) for c in result["checks"])
        verdict.series = results[0]["series"]
        verdict.figures = _merged_figures(results)
        verdict.unsupported = results[0]["unsupported"]
        verdict.origin = results[0]["origin"]
        verdict.notes = results[0].get("notes", [])
    verdict.checks.sort(key=lambda c: (c.name, c.rank))
    verdict.seconds = time.monotonic() - started
    return verdict


def judge_case(
    cluster: RankCluster,
    case_id: str,
    *,
    isolate: bool = False,
    timeout: float | None = None,
    backend: str | None = None,
) -> Verdict:
    """Run a case on fresh engines (``isolate``) or on the warm ones; a case that fails warm is run
    again alone on fresh engines, and if it passes there the verdict says that state leaks between
    cases (it stays failed: an implementation must survive several cases per process).

    A FAIL, ERROR or TIMEOUT is then diagnosed (``tests.kit.judging.divergence``: more runs of the case, traced),
    unless ``HPKIT_DIAGNOSE=0``; its verdict leads with the first divergence."""
    if isolate:
        cluster.renew()
        return _diagnosed(cluster, run_case(cluster, case_id, timeout, backend), timeout)
    verdict = run_case(cluster, case_id, timeout, backend)
    if verdict.status in ("FAIL", "ERROR", "TIMEOUT") and cluster.cluster is not None:
        cluster.renew()
        alone = run_case(cluster, case_id, timeout, backend)
        if alone.passed:
            verdict.leak = (
                f"state leaks between cases: {case_id} {verdict.status} after other cases on warm engines, "
                f"PASS alone on fresh engines ({alone.seconds:.1f} s)"
            )
    return _diagnosed(cluster, verdict, timeout)


def _diagnosed(cluster: RankCluster, verdict: Verdict, timeout: float | None) -> Verdict:
    """The verdict with its diagnosis, where it failed its checks, raised or hung (not a leak: alone it
    passes); a hang's traced run hangs again, bounded alike, and names where each rank was."""
    if verdict.status in ("FAIL", "ERROR", "TIMEOUT") and not verdict.leak and wanted():
        diagnosis = diagnose(cluster, verdict.case.id, timeout)
        if diagnosis.exit_status != NOT_RUN:  # a case with nothing traced keeps its plain verdict
            verdict.diagnosis = diagnosis
    return verdict
