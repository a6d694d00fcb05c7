"""Writes a mutation run's evidence: ``matrix.json`` and a self-contained ``index.html``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

CASES_TARGET = 0.95  # the bar for the plan cases alone
_CELL = {"failed": "F", "error": "E", "timeout": "T", "skipped": "s", "passed": ""}
_SUITE_TITLE = {"cases": "plan cases", "engine": "engine tests", "cases_and_engine": "cases + engine tests"}
_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.meta { color: #555; }
.scores { display: flex; gap: 1em; flex-wrap: wrap; }
.score { border: 1px solid #ccc; border-radius: 6px; padding: .5em 1em; }
.score b { font-size: 1.3em; }
.warn { background: #fff3cd; padding: .4em .8em; border-radius: 4px; }
table { border-collapse: collapse; margin: .5em 0; }
th, td { border: 1px solid #ddd; padding: 2px 6px; vertical-align: top; }
th { background: #f4f4f4; }
table.matrix td { text-align: center; min-width: 1.4em; }
table.matrix th.v { writing-mode: vertical-rl; transform: rotate(180deg); font-weight: normal; white-space: nowrap; }
td.kill { background: #2e7d32; color: #fff; font-weight: bold; }
td.timeout { background: #6a1b9a; color: #fff; font-weight: bold; }
td.notrun { color: #aaa; }
.KILLED { background: #c8e6c9; } .SURVIVED { background: #ffcdd2; font-weight: bold; }
.EQUIVALENT { background: #eeeeee; } .INVALID { background: #ffe0b2; } .NOT-RUN { color: #999; }
code { font-size: 12px; }
"""


def write_json(path: Path, matrix: Mapping[str, Any]) -> None:
    """Write matrix.json atomically (a partial report is always a whole file)."""
    _write_atomic(path, json.dumps(matrix, indent=1, sort_keys=False))


def write_html(path: Path, matrix: Mapping[str, Any]) -> None:
    """Write index.html, built from the matrix alone."""
    _write_atomic(path, render_html(matrix))


def write_report(out: Path, matrix: Mapping[str, Any]) -> None:
    """Both files of a run's report into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "matrix.json", matrix)
    write_html(out / "index.html", matrix)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def format_score(entry: Mapping[str, Any] | None) -> str:
    """``"32/38 = 84.2%"`` (or ``"-"`` when nothing was judged)."""
    if not entry or entry.get("fraction") is None:
        return "-"
    return f"{entry['killed']}/{entry['judged']} = {100 * entry['fraction']:.1f}%"


def render_html(matrix: Mapping[str, Any]) -> str:
    """The whole page: scores, one line per mutant, one kill matrix per suite."""
    meta = matrix.get("meta", {})
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>engine mutants {escape(str(meta.get('started', '')))}</title><style>{_CSS}</style></head><body>",
        "<h1>Engine mutants: kill matrix</h1>",
        _meta_html(meta, matrix),
        _scores_html(matrix.get("scores", {})),
        _baseline_html(matrix.get("baseline", {}), meta),
        _warnings_html(matrix),
        "<h2>Mutants</h2>",
        _mutants_html(matrix.get("mutants", []), matrix.get("suites", [])),
    ]
    for suite in matrix.get("suites", []):
        cols = matrix.get("columns", {}).get(suite, [])
        parts.append(f"<h2>Kill matrix: {escape(_SUITE_TITLE.get(suite, suite))}</h2>")
        parts.append(_matrix_html(matrix.get("mutants", []), suite, cols))
    parts.append(
        "<p class='meta'>Cells: <b>F</b> failed, <b>E</b> error, <b>T</b> running when the run timed out "
        "(all three kill), s skipped, blank passed, &middot; not run.</p></body></html>"
    )
    return "\n".join(parts)


def _meta_html(meta: Mapping[str, Any], matrix: Mapping[str, Any]) -> str:
    bits = [
        f"started {meta.get('started', '?')}",
        f"suites: {', '.join(matrix.get('suites', [])) or '-'}",
        f"{len(matrix.get('mutants', []))} mutant(s)",
        f"timeout per run {meta.get('timeout_per_run', '?')} s",
    ]
    if meta.get("cases_filter"):
        bits.append(f"cases: {meta['cases_filter']}")
    if meta.get("engine_filter"):
        bits.append(f"engine tests: -k {meta['engine_filter']}")
    if meta.get("state"):
        bits.append(f"state: {meta['state']}")
    return f"<p class='meta'>{escape(' · '.join(bits))}</p>"


def _scores_html(scores: Mapping[str, Any]) -> str:
    boxes = []
    for key, entry in scores.items():
        target = f" (target &ge; {100 * CASES_TARGET:.0f}%)" if key == "cases" else ""
        if key == "cases_and_engine":
            target = " (target: all)"
        survivors = ", ".join(entry.get("survivors", [])) or "none"
        boxes.append(
            f"<div class='score'>{escape(_SUITE_TITLE.get(key, key))}{target}<br>"
            f"<b>{escape(format_score(entry))}</b><br><small>survivors: {escape(survivors)}</small></div>"
        )
    return f"<div class='scores'>{''.join(boxes)}</div>" if boxes else ""


def _baseline_html(baseline: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    if not baseline:
        why = "skipped (--no-baseline)" if meta.get("no_baseline") else "not run"
        return f"<p>Baseline (unmutated tree): {why}.</p>"
    bits = []
    for suite, run in baseline.items():
        failing = [c for c, o in run.get("outcomes", {}).items() if o in ("failed", "error", "timeout")]
        state = "passed" if run.get("status") == "ok" and not failing else f"FAILED {', '.join(failing)}"
        bits.append(f"{suite}: {state} ({len(run.get('outcomes', {}))} tests, {run.get('seconds', 0):.0f} s)")
    return f"<p>Baseline (unmutated tree): {escape('; '.join(bits))}.</p>"


def _warnings_html(matrix: Mapping[str, Any]) -> str:
    contradicted = matrix.get("contradicted_equivalents", [])
    if not contradicted:
        return ""
    return (
        f"<p class='warn'>Declared equivalent but killed: {escape(', '.join(contradicted))} "
        "(the equivalence claim, or the killing test, is wrong).</p>"
    )


def _verdict_text(row: Mapping[str, Any]) -> str:
    verdict = row.get("verdict", "")
    if verdict == "EQUIVALENT":
        return f"EQUIVALENT: {row.get('equivalent', '')}"
    if verdict == "KILLED" and row.get("equivalent"):
        return "KILLED (declared equivalent)"
    if verdict == "INVALID":
        notes = [r.get("note", "") for r in row.get("runs", {}).values() if r.get("note")]
        return f"INVALID: {notes[0] if notes else ''}"
    return verdict


def _killed_cell(row: Mapping[str, Any], suite: str) -> str:
    run = row.get("runs", {}).get(suite)
    if run is None:
        return "<td class='notrun'>&middot;</td>"
    killers = row.get("killed_by", {}).get(suite)
    if killers is None:
        return f"<td class='notrun'>{escape(run.get('status', ''))}</td>"
    log = run.get("log", "")
    count = f"<a href='{escape(log)}'>{len(killers)}</a>" if log else str(len(killers))
    return f"<td title='{escape(', '.join(killers))}'>{count}</td>"


def _mutants_html(rows: Sequence[Mapping[str, Any]], suites: Sequence[str]) -> str:
    head = "".join(f"<th>killed by {escape(_SUITE_TITLE.get(s, s))}</th>" for s in suites)
    lines = [f"<table class='mutants'><tr><th>id</th><th>file</th><th>feature</th><th>bug</th>{head}<th>s</th>"]
    lines[0] += "<th>verdict</th></tr>"
    for row in rows:
        seconds = sum(r.get("seconds", 0.0) for r in row.get("runs", {}).values())
        verdict = row.get("verdict", "")
        lines.append(
            f"<tr id='m{escape(row['id'])}'><td>{escape(row['id'])}</td>"
            f"<td title='{escape(row['file'])}'><code>{escape(Path(row['file']).name)}</code></td>"
            f"<td>{escape(row['feature'])}</td><td>{escape(row['description'])}</td>"
            + "".join(_killed_cell(row, s) for s in suites)
            + f"<td>{seconds:.0f}</td><td class='{escape(verdict.replace(' ', '-'))}'>"
            f"{escape(_verdict_text(row))}</td></tr>"
        )
    lines.append("</table>")
    return "\n".join(lines)


def _matrix_cell(row: Mapping[str, Any], suite: str, column: str) -> str:
    run = row.get("runs", {}).get(suite)
    if run is None or run.get("status") not in ("ok", "timeout", "crashed"):
        return "<td class='notrun'>&middot;</td>"
    outcome = run.get("outcomes", {}).get(column)
    if outcome is None:
        return "<td class='notrun'>&middot;</td>"
    css = {"failed": "kill", "error": "kill", "timeout": "timeout"}.get(outcome, "")
    return f"<td class='{css}' title='{escape(outcome)}'>{_CELL.get(outcome, '?')}</td>"


def _matrix_html(rows: Sequence[Mapping[str, Any]], suite: str, cols: Sequence[str]) -> str:
    if not cols:
        return "<p>No tests recorded.</p>"
    head = "".join(f"<th class='v' title='{escape(c)}'>{escape(c)}</th>" for c in cols)
    lines = [f"<table class='matrix'><tr><th>mutant</th>{head}<th>verdict</th></tr>"]
    for row in rows:
        verdict = row.get("verdict", "")
        cells = "".join(_matrix_cell(row, suite, c) for c in cols)
        lines.append(
            f"<tr><th><a href='#m{escape(row['id'])}'>{escape(row['id'])}</a></th>{cells}"
            f"<td class='{escape(verdict.replace(' ', '-'))}'>{escape(verdict)}</td></tr>"
        )
    lines.append("</table>")
    return "\n".join(lines)
