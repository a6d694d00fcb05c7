"""Driver side of the case contract: run a case on the cluster and judge every rank's checks.

A case passes only if it ran to the end on every rank and every check on every rank passed.
The verdict renders as a text table (pytest failure messages, logs) and as HTML (notebooks).
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from typing import Any

from tests.kit.case import REGISTRY, Case, Check, run_on_rank
from tests.kit.cluster import RankCluster, RankFailure


@dataclass
class Verdict:
    """Every rank's checks of one case run, or the failure that stopped it."""

    case: Case
    checks: list[Check] = field(default_factory=list)
    series: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    failure: str | None = None  # traceback / stacks when the run itself failed
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.failure is None and bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

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
        state = "PASS" if self.passed else "FAIL"
        bad = len(self.failed_checks)
        detail = f"{len(self.checks)} checks, {bad} failed" if self.failure is None else "run failed"
        where = f"[{self.case.world_size} ranks, {self.case.config}]"
        return f"{self.case.id} {self.case.name} {where}: {state} ({detail}, {self.seconds:.1f} s)"

    def report(self) -> str:
        """Summary, the failing rows (or all rows), and the run failure if any."""
        parts = [self.summary()]
        if self.checks:
            parts.append(self.table(only_failed=not self.passed and bool(self.failed_checks)))
        if self.failure:
            parts.append(self.failure)
        return "\n".join(parts)

    def html(self) -> str:
        """An HTML table for notebooks: failing rows first, red."""
        rows = sorted(self.checks, key=lambda c: c.passed)
        cells = "".join(
            "<tr style='background:{}'>{}</tr>".format(
                "#fde2e2" if not c.passed else "#ffffff",
                "".join(f"<td>{html.escape(v)}</td>" for v in _row(c)),
            )
            for c in rows
        )
        head = "".join(f"<th>{h}</th>" for h in ("check", "rank", "measured", "reference", "error", "tol", "verdict"))
        failure = f"<pre>{html.escape(self.failure)}</pre>" if self.failure else ""
        return f"<h4>{html.escape(self.summary())}</h4><table><tr>{head}</tr>{cells}</table>{failure}"

    def assert_passed(self) -> None:
        if not self.passed:
            raise AssertionError(self.report())


def _fmt(value: float | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3e}" if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e4) else f"{value:.6g}"
    return str(value)


def _row(check: Check) -> tuple[str, ...]:
    return (
        check.name,
        str(check.rank),
        _fmt(check.measured),
        _fmt(check.reference),
        _fmt(check.error),
        _fmt(check.tol),
        "pass" if check.passed else "FAIL",
    )


def run_case(cluster: RankCluster, case_id: str, timeout: float | None = None, backend: str | None = None) -> Verdict:
    """Run one registered case on the cluster's first ``world_size`` engines and judge it.

    ``timeout`` / ``backend`` override the case's own (None: keep them; backend None = auto)."""
    spec = REGISTRY[case_id]
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
        verdict.failure = str(failure)
    else:
        for result in results:
            verdict.checks.extend(Check(**c) for c in result["checks"])
        verdict.series = results[0]["series"]
    verdict.checks.sort(key=lambda c: (c.name, c.rank))
    verdict.seconds = time.monotonic() - started
    return verdict
