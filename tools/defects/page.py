"""The defects page: each defect of upstream's history against the kit (its plan cases, L4), the
count found, and L4's survey of upstream's head (its distinct failures, each shrunk once)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

_STYLE = (
    "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;font-size:13px}"
    ".found{background:#dafbe1}.missed{background:#ffd8d3}.error{background:#eeeeee}"
)


def _cell_cases(finding: dict[str, Any]) -> str:
    rows = [
        f"<b>{html.escape(c['id'])}</b> {c['status']}: {html.escape(c['first_failure'][:160])}"
        for c in finding["cases"]
    ]
    return "<br>".join(rows) or "none"


def _cell_l4(finding: dict[str, Any]) -> str:
    rows = [
        f"{html.escape(r['signature'])} ({r['count']}x, behind another failing check)"
        if r.get("behind")
        else f"{html.escape(r['signature'])} ({r['count']}x; smallest <code>{r['smallest']}</code>, "
        f"world {r['size']['world']}, {r['size']['groups']} group(s))"
        for r in finding["l4"]
    ]
    return "<br>".join(rows) or "none"


def _built(defect: dict[str, Any]) -> str:
    """How the defect's trees were made, with any later fix applied to both."""
    text = f"{defect['build']}: {', '.join(defect['paths'])}"
    for later, paths in defect.get("also", ()):
        text += f"; both trees with {later}'s {', '.join(paths)}"
    return html.escape(text)


def _head_survey(data: dict[str, Any]) -> str:
    head = data["upstream_head"][:10]
    runs = [run for key, run in data["trees"].items() if Path(key.split("|")[0]).name == head]
    if not runs:
        return "<p>Upstream's head was not surveyed in this run.</p>"
    run = runs[0]
    items = "".join(
        f"<li>{html.escape(r['signature'])}: {r['count']} configuration(s); smallest <code>{r['smallest']}</code> "
        f"(world {r['size']['world']}, {r['size']['groups']} group(s), {r['size']['steps']} step(s))</li>"
        for r in run["l4"]
    )
    failing = [cid for cid, row in run["cases"].items() if row["status"] != "PASS"]
    return (
        f"<p>L4 on upstream's head ({head}), {run['l4_drawn']} configurations, keep going: "
        f"{len(run['l4'])} distinct failure(s).</p><ol>{items}</ol>"
        f"<p>Plan cases not passing on the head: {html.escape(', '.join(failing) or 'none')}.</p>"
    )


def write_page(out: Path, data: dict[str, Any]) -> Path:
    """``out/index.html`` from the run's data."""
    findings = data["findings"]
    found = sum(f["found"] for f in findings)
    rows = []
    for f in findings:
        d = f["defect"]
        verdict = "error" if f["error"] else "found" if f["found"] else "missed"
        label = {"found": "FOUND", "missed": "not found", "error": "not built"}[verdict]
        why = html.escape(f["error"]) if f["error"] else ""
        if verdict != "found" and d.get("beyond"):
            why += f"<br><i>why the kit cannot: {html.escape(d['beyond'])}</i>"
        rows.append(
            f"<tr class='{verdict}'><td>{d['id']}</td><td><code>{d['fix']}</code> {html.escape(d['subject'])}</td>"
            f"<td>{html.escape(d['what'])}</td><td>{_built(d)}</td>"
            f"<td>{label} {why}</td><td>{_cell_cases(f)}</td><td>{_cell_l4(f)}</td></tr>"
        )
    explained = sum(not f["found"] and bool(f["defect"].get("beyond")) for f in findings)
    body = (
        f"<h1>Upstream's defects against the kit</h1><p>Found {found} of {len(findings)}, "
        f"{explained} more beyond what the kit can judge (each says why) "
        f"(upstream head {data['upstream_head'][:10]}; {data['seconds']:.0f} s). A defect is found where a "
        "check fails with it and passes on the same tree without it.</p>"
        "<table><tr><th>id</th><th>fix</th><th>the defect</th><th>built as</th><th>verdict</th>"
        f"<th>plan cases failing only with it</th><th>L4 failures only with it</th></tr>{''.join(rows)}</table>"
        f"<h2>L4 on upstream's head</h2>{_head_survey(data)}"
    )
    page = out / "index.html"
    page.write_text(f"<!doctype html><meta charset='utf-8'><title>defects</title><style>{_STYLE}</style>{body}")
    return page
