"""The kill matrix: per mutant and suite, which tests killed it; verdicts and scores (pure data).

A test kills a mutant when it failed, errored or was running when its run timed out. A run
that timed out or crashed without naming a test still kills (the column ``(timeout)`` /
``(crashed)``). Scores count the mutants not declared equivalent whose runs were judged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .catalogue import Mutant

SUITES = ("cases", "engine")
KILLING = frozenset({"failed", "error", "timeout"})
# a run's status: "ok" (pytest ran to its end), "timeout", "crashed" (pytest could not run the
# tests), "invalid" (the mutated tree did not import), "interrupted" (Ctrl-C)
JUDGED = frozenset({"ok", "timeout", "crashed"})
_SEVERITY = {"passed": 0, "skipped": 1, "failed": 2, "error": 2, "timeout": 3}


def worse(a: str | None, b: str) -> str:
    """The more severe of two outcomes of one test (a failing teardown spoils a passed call)."""
    if a is None:
        return b
    return b if _SEVERITY.get(b, 0) > _SEVERITY.get(a, 0) else a


@dataclass
class SuiteRun:
    """One pytest run of one suite on one tree (a mutant or the baseline)."""

    suite: str
    status: str
    seconds: float = 0.0
    outcomes: dict[str, str] = field(default_factory=dict)  # column -> passed/failed/error/skipped/timeout
    exit_code: int | None = None
    log: str = ""
    note: str = ""

    @property
    def judged(self) -> bool:
        """The run says something about the mutant (not invalid, not interrupted)."""
        return self.status in JUDGED

    def killers(self) -> list[str]:
        """The columns that killed the mutant, or the run's status when no test is named."""
        found = [col for col, outcome in self.outcomes.items() if outcome in KILLING]
        if not found and self.status in ("timeout", "crashed"):
            found = [f"({self.status})"]
        return found

    @property
    def killed(self) -> bool:
        return self.judged and bool(self.killers())

    def failing(self) -> list[str]:
        """Tests that did not pass (for the baseline, which must have none)."""
        return self.killers() if self.status in JUDGED else [f"({self.status})"]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SuiteRun:
        return cls(**dict(data))


Results = dict[str, dict[str, SuiteRun]]  # mutant id -> suite -> run


def verdict(mutant: Mutant, runs: Mapping[str, SuiteRun]) -> str:
    """KILLED, SURVIVED, EQUIVALENT, INVALID or NOT RUN, over the suites that ran."""
    if any(r.status == "invalid" for r in runs.values()):
        return "INVALID"
    judged = [r for r in runs.values() if r.judged]
    if not judged:
        return "NOT RUN"
    if any(r.killed for r in judged):
        return "KILLED"
    return "EQUIVALENT" if mutant.equivalent else "SURVIVED"


def score(mutants: Iterable[Mutant], results: Results, suites: Sequence[str]) -> dict[str, Any]:
    """Fraction of the non-equivalent mutants, judged by every one of ``suites``, that they kill."""
    pool = [
        m
        for m in mutants
        if not m.equivalent and all(s in results.get(m.id, {}) and results[m.id][s].judged for s in suites)
    ]
    killed = [m.id for m in pool if any(results[m.id][s].killed for s in suites)]
    return {
        "suites": list(suites),
        "killed": len(killed),
        "judged": len(pool),
        "fraction": len(killed) / len(pool) if pool else None,
        "survivors": [m.id for m in pool if m.id not in killed],
    }


def contradicted_equivalents(mutants: Iterable[Mutant], results: Results) -> list[str]:
    """Mutants declared equivalent that a test killed anyway (the claim, or that test, is wrong)."""
    return [m.id for m in mutants if m.equivalent and any(r.killed for r in results.get(m.id, {}).values())]


def column_key(column: str) -> tuple:
    """Plan case ids in plan order (L0-01 .. L0-10, then L0-TP ...), other columns after, by name."""
    numbered = re.fullmatch(r"(L\d)-(\d+)", column)
    if numbered:
        return (0, numbered.group(1), 0, int(numbered.group(2)), "")
    named = re.fullmatch(r"(L\d)-(.+)", column)
    if named:
        return (0, named.group(1), 1, 0, named.group(2))
    return (1, "", 0, 0, column)


def columns(suite: str, baseline: Mapping[str, SuiteRun], results: Results) -> list[str]:
    """The suite's columns: the baseline's tests, plus any other test a mutant's run reported."""
    seen = set(baseline[suite].outcomes) if suite in baseline else set()
    for runs in results.values():
        if suite in runs:
            seen.update(runs[suite].outcomes)
    return sorted(seen, key=column_key)


def mutant_row(mutant: Mutant, runs: Mapping[str, SuiteRun]) -> dict[str, Any]:
    """One mutant's entry of matrix.json: the catalogue fields, its runs and its verdict."""
    return {
        **asdict(mutant),
        "verdict": verdict(mutant, runs),
        "killed_by": {suite: run.killers() for suite, run in runs.items() if run.judged},
        "runs": {suite: run.to_json() for suite, run in runs.items()},
    }


def build(
    meta: Mapping[str, Any],
    mutants: Sequence[Mutant],
    baseline: Mapping[str, SuiteRun],
    results: Results,
    suites: Sequence[str],
) -> dict[str, Any]:
    """Everything matrix.json holds (and index.html shows)."""
    scores: dict[str, Any] = {}
    if "cases" in suites:
        scores["cases"] = score(mutants, results, ("cases",))
    if "engine" in suites:
        scores["engine"] = score(mutants, results, ("engine",))
    if "cases" in suites and "engine" in suites:
        scores["cases_and_engine"] = score(mutants, results, ("cases", "engine"))
    if "l4" in suites:
        scores["l4"] = score(mutants, results, ("l4",))
    return {
        "meta": dict(meta),
        "suites": list(suites),
        "columns": {suite: columns(suite, baseline, results) for suite in suites},
        "baseline": {suite: run.to_json() for suite, run in baseline.items()},
        "mutants": [mutant_row(m, results.get(m.id, {})) for m in mutants],
        "scores": scores,
        "contradicted_equivalents": contradicted_equivalents(mutants, results),
    }
