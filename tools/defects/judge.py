"""Judge one upstream tree with the kit: its plan cases (fresh engines per case, as conformance
runs a foreign implementation) and L4 in keep-going mode (every distinct failure, each shrunk once),
then compare a defect's tree with the same tree without the defect."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.kit.judging.case import Case

BAD = {"FAIL", "ERROR", "TIMEOUT", "DIED"}


@dataclass
class TreeRun:
    """What the kit said of one tree."""

    tree: str
    cases: dict[str, dict[str, Any]] = field(default_factory=dict)  # case id -> verdict summary
    l4: list[dict[str, Any]] = field(default_factory=list)  # distinct failures: signature, count, smallest
    l4_drawn: int = 0
    l4_checks: dict[str, int] = field(default_factory=dict)  # every failed check's signature -> configurations
    seconds: float = 0.0

    def l4_signatures(self) -> set[str]:
        return {row["signature"] for row in self.l4}

    def l4_failed_checks(self) -> set[str]:
        """Every check L4 saw fail, first or not (a defect may fail a check behind another's)."""
        return set(self.l4_checks) | self.l4_signatures()


def judge_tree(
    tree: Path,
    cases: list[Case],
    l4_examples: int,
    seed: int,
    engines: int = 4,
    progress: Callable[[str], None] = print,
    shrink: bool = False,
) -> TreeRun:
    """The plan cases and an L4 survey of the upstream tree at ``tree`` (each distinct failure
    shrunk once where ``shrink``: upstream's head; elsewhere only the signatures are compared)."""
    from tests.kit.explore.runner import features_of, known_defects_of
    from tests.kit.explore.survey import explore_all
    from tests.kit.runtime.cluster import RankCluster

    started = time.monotonic()
    spec = f"upstream:{tree}"
    run = TreeRun(str(tree))

    run.cases = judge_cases(spec, cases, engines, progress)
    if l4_examples:
        with RankCluster.start(engines, implementation=spec, startup_timeout=180) as cluster:
            survey = explore_all(
                cluster,
                features_of(cluster),
                examples=l4_examples,
                seed=seed,
                max_world=engines,
                isolate=True,
                avoid=tuple(known_defects_of(cluster)),
                shrink=shrink,
                shrink_budget_s=90.0,
                save_dir=tree.parent / "l4",
            )
        run.l4_drawn = survey.exploration.drawn
        run.l4_checks = dict(survey.failed_checks)
        for defect in survey.defects:
            shown = defect.minimal or defect.first
            row = {"signature": defect.signature, "count": defect.count, "smallest": shown.id}
            run.l4.append({**row, "size": shown.config.size(), "failure": shown.failure[:600]})
            progress(f"  L4 {defect.signature} ({defect.count}x, smallest {shown.id})")
    run.seconds = time.monotonic() - started
    return run


def judge_cases(spec: str, cases: list[Case], engines: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Each case on fresh engines: its verdict summary with the names of its failed and passed
    checks (a case failing on both trees may still fail more checks with the defect)."""
    from tests.kit.front.notebook import summarize
    from tests.kit.judging.verdict import judge_case
    from tests.kit.runtime.cluster import RankCluster

    rows: dict[str, Any] = {}
    with RankCluster.start(engines, implementation=spec) as cluster:
        for case in cases:
            verdict = judge_case(cluster, case.id, isolate=True)
            row = summarize(verdict)
            row["failed"] = sorted({c.name for c in verdict.failed_checks})
            row["passed_names"] = sorted({c.name for c in verdict.checks if c.passed})
            rows[case.id] = row
            progress(f"  {verdict.status:<11} {case.id:<8} {verdict.first_failure[:90]}")
    return rows


@dataclass
class Finding:
    """One defect judged: the checks that fail with it and pass without it."""

    defect: dict[str, Any]
    defect_tree: str = ""
    fixed_tree: str = ""
    cases: list[dict[str, Any]] = field(default_factory=list)  # cases failing only with the defect
    l4: list[dict[str, Any]] = field(default_factory=list)  # L4 signatures seen only with the defect
    error: str = ""  # why the defect could not be built or run
    seconds: float = 0.0

    @property
    def found(self) -> bool:
        return bool(self.cases or self.l4)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "found": self.found}


def compare(defect: dict[str, Any], with_defect: TreeRun, without: TreeRun) -> Finding:
    """Found where a case fails (or errs, hangs, dies, or is refused while running) with the defect
    and passes without it, or
    fails on both but with checks that pass without it; or L4 sees a check fail with the defect
    (first or behind another failing check) that it never sees fail without it."""
    finding = Finding(defect, with_defect.tree, without.tree, seconds=with_defect.seconds)
    for case_id, row in with_defect.cases.items():
        clean = without.cases.get(case_id, {})
        if row["status"] == "UNSUPPORTED" and clean and clean.get("status") != "UNSUPPORTED":
            # refused with the defect (a feature the tree without it runs): taken away by the defect
            why = f"refused with the defect ({row['first_failure']}), runs without it ({clean.get('status')})"
            finding.cases.append({"id": case_id, "status": row["status"], "first_failure": why})
            continue
        if row["status"] not in BAD:
            continue
        if clean.get("status") == "PASS":
            finding.cases.append({"id": case_id, "status": row["status"], "first_failure": row["first_failure"]})
            continue
        only_here = sorted(set(row.get("failed", ())) & set(clean.get("passed_names", ())))
        if only_here:
            first = f"{only_here[0]} (passes without the defect; the case fails on both)"
            finding.cases.append({"id": case_id, "status": row["status"], "first_failure": first})
    seen_without = without.l4_failed_checks()
    finding.l4 = [row for row in with_defect.l4 if row["signature"] not in seen_without]
    behind = sorted(set(with_defect.l4_checks) - seen_without - {row["signature"] for row in finding.l4})
    finding.l4 += [{"signature": name, "count": with_defect.l4_checks[name], "behind": True} for name in behind]
    return finding
