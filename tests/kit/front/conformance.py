"""Conformance: every plan case against each implementation, in one table.

    python -m tests.kit.front.conformance --implementation ours= --implementation fsdp2=torch \\
        [--implementation upstream=upstream:/src/hyper-parallel] [--levels L0,L1] [--cases L1-03,...]

One cluster per implementation runs its cases; an implementation other than ours gets fresh
engines for every case (``--isolate auto``), so process-global state of one case cannot decide
the next. Output: ``runs/<timestamp>/conformance.json`` and ``conformance.html``: cases x
implementations, each cell the plan verdict, the extras beside it, and the first failing check
(or the feature an UNSUPPORTED case lacks). The exit status is 0 when the run completed, whatever
the verdicts: conformance describes implementations, it does not gate them.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tests.kit.front.notebook import select, summarize
from tests.kit.judging.case import Case
from tests.kit.judging.levels import LEVELS
from tests.kit.judging.surface import parse_implementations
from tests.kit.judging.verdict import judge_case
from tests.kit.runtime.cluster import RankCluster

ROOT = Path(__file__).resolve().parents[3]
VERDICT_COLOURS = {
    "PASS": "#dafbe1",
    "FAIL": "#ffd8d3",
    "UNSUPPORTED": "#eeeeee",
    "ERROR": "#ffd8d3",
    "TIMEOUT": "#fff1c2",
    "DIED": "#fff1c2",
}


def run_implementation(
    name: str, spec: str, cases: list[Case], isolate: bool, engines: int, progress: Any = None
) -> dict[str, dict[str, Any]]:
    """Every case on one cluster running ``spec``: case id -> verdict summary."""
    rows: dict[str, dict[str, Any]] = {}
    with RankCluster.start(engines, implementation=spec or None) as cluster:
        for spec_case in cases:
            verdict = judge_case(cluster, spec_case.id, isolate=isolate)
            rows[spec_case.id] = summarize(verdict)
            if progress is not None:
                progress(name, verdict)
    return rows


def write_report(
    implementations: dict[str, str], cases: list[Case], results: dict[str, dict[str, dict[str, Any]]], out: Path
) -> Path:
    """conformance.json and conformance.html in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "implementations": implementations,
        "cases": [{"id": c.id, "name": c.name, "level": c.level, "needs": list(c.needs)} for c in cases],
        "results": results,
    }
    (out / "conformance.json").write_text(json.dumps(payload, indent=1, default=str))
    page = out / "conformance.html"
    page.write_text(_html(implementations, cases, results))
    return page


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "<td>-</td>"
    status = row["status"]
    extras = ""
    if row.get("extras"):
        extras = " · extras " + ("pass" if row["extras_passed"] else "<b>fail</b>")
    detail = html.escape(row.get("first_failure") or "")
    origin = row.get("origin") or {}
    where = html.escape(f"{origin.get('file', '')} @ {str(origin.get('commit') or '')[:10]}")
    return (
        f"<td style='background:{VERDICT_COLOURS.get(status, '#fff')}' title='{where}'><b>{status}</b>{extras}"
        f"<div class='d'>{detail}</div></td>"
    )


def _html(implementations: dict[str, str], cases: list[Case], results: dict[str, dict[str, dict[str, Any]]]) -> str:
    names = list(implementations)
    head = "".join(
        f"<th>{html.escape(n)}<div class='d'>{html.escape(implementations[n] or 'ours')}</div></th>" for n in names
    )
    counts = {
        n: {s: sum(1 for r in results.get(n, {}).values() if r["status"] == s) for s in VERDICT_COLOURS} for n in names
    }
    totals = "".join("<td>" + ", ".join(f"{s} {k}" for s, k in counts[n].items() if k) + "</td>" for n in names)
    rows = "".join(
        f"<tr><td><b>{c.id}</b> {html.escape(c.name)}<div class='d'>needs {', '.join(c.needs)}</div></td>"
        + "".join(_cell(results.get(n, {}).get(c.id)) for n in names)
        + "</tr>"
        for c in cases
    )
    return f"""<!doctype html><html><head><meta charset='utf-8'><title>conformance</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px;text-align:left;vertical-align:top}}
.d{{color:#555;font-size:11px;max-width:420px}}</style></head><body>
<h1>Conformance: {len(cases)} plan cases x {len(names)} implementations</h1>
<p>{time.strftime("%Y-%m-%d %H:%M:%S")}. Each cell: the plan verdict (PASS, FAIL, UNSUPPORTED, ERROR, TIMEOUT,
DIED), the extra checks beside it, and the first failing check or the feature the implementation lacks.
Hover a cell for the file and commit the ranks imported.</p>
<table><tr><th>case</th>{head}</tr><tr><td>totals</td>{totals}</tr>{rows}</table></body></html>"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every plan case against each implementation.")
    parser.add_argument(
        "--implementation",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="repeatable; SPEC: docs/judging.md#specs ('' is ours)",
    )
    parser.add_argument("--levels", default=",".join(LEVELS), help="comma-separated levels")
    parser.add_argument("--cases", default="", help="only these case ids (comma-separated)")
    parser.add_argument("--isolate", choices=("auto", "always", "never"), default="auto")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "runs"))
    args = parser.parse_args(argv)
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    implementations = parse_implementations(args.implementation or ["ours="])
    cases = select([level.strip() for level in args.levels.split(",") if level.strip()], args.cases)
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")

    def progress(name: str, verdict: Any) -> None:
        print(f"{name:>10}  {verdict.status:<11} {verdict.case.id:<8} {verdict.first_failure[:100]}", flush=True)

    results: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        for name, spec in implementations.items():
            isolate = args.isolate == "always" or (args.isolate == "auto" and bool(spec))
            results[name] = run_implementation(name, spec, cases, isolate, args.engines, progress)
    except KeyboardInterrupt:
        print("interrupted: writing what finished")
        write_report(implementations, cases, results, out)
        return 130
    page = write_report(implementations, cases, results, out)
    print(f"conformance: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
