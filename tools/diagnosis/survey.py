"""Diagnose every L1-L3 precision case on one warm cluster: what the diagnosis says of each, and the
largest error / threshold an honest run reaches (the margin under ``DIAGNOSIS.k``)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from tests.kit.judging.case import Case
from tests.kit.judging.divergence import Diagnosis, diagnose
from tests.kit.runtime.cluster import RankCluster


def worst_ratio(diagnosis: Diagnosis) -> float | None:
    """The largest error / threshold of any traced tensor on any rank (None: nothing compared)."""
    ratios = [t.ratio(r) for t in diagnosis.tensors for r in t.errors]
    ratios = [r for r in ratios if r is not None]
    return max(ratios) if ratios else None


def survey_row(diagnosis: Diagnosis) -> dict[str, Any]:
    worst = worst_ratio(diagnosis)
    return {
        "case": diagnosis.case,
        "status": diagnosis.status,
        "exit": diagnosis.exit_status,
        "line": diagnosis.line(),
        "worst_ratio": worst if worst is None or math.isfinite(worst) else "inf",
        "tensors": len(diagnosis.tensors),
        "seconds": round(diagnosis.seconds, 1),
    }


def survey(
    cluster: RankCluster, cases: list[Case], out: Path | None = None, failing_only: bool = False
) -> list[dict[str, Any]]:
    """Diagnose each case in turn, printing one line each; the rows (written to ``out`` as JSON).
    ``failing_only``: a passing case is run once, not diagnosed."""
    rows = []
    for spec in cases:
        started = time.monotonic()
        row = survey_row(diagnose(cluster, spec.id, failing_only=failing_only))
        row["wall"] = round(time.monotonic() - started, 1)
        rows.append(row)
        print(f"{row['exit']} {row['status']:<11} worst {row['worst_ratio']!s:<24} {row['line']}", flush=True)
        if out is not None:
            out.write_text(json.dumps(rows, indent=1))
    return rows
