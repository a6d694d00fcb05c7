"""The peer-suite page and JSON: test x implementation, each verdict, each failure sorted."""

from __future__ import annotations

import html
import json
from collections import Counter
from pathlib import Path
from typing import Any

from .by_design import KIND as BY_DESIGN

CONTROL = "torch"  # torch FSDP2 itself: what its own tests are judged against
NOT_OWED = ("private", BY_DESIGN)  # failures an implementation does not owe even where torch passes


def is_owed(record: dict, control_passed: bool) -> bool:
    """A failure of an implementation where torch FSDP2 passed, neither private nor a listed difference."""
    failed = record.get("outcome") in ("failed", "timeout")
    return control_passed and failed and record.get("kind", "behaviour") not in NOT_OWED


def verdict_rows(results: dict[str, dict[str, dict]]) -> list[dict[str, Any]]:
    """One row per test: its file and, per implementation, its record (outcome, kind, error)."""
    tests: dict[str, dict[str, Any]] = {}
    for name, files in results.items():
        for file, outcomes in files.items():
            for nodeid, record in outcomes.items():
                row = tests.setdefault(nodeid, {"nodeid": nodeid, "file": file, "verdicts": {}})
                row["verdicts"][name] = record
    return sorted(tests.values(), key=lambda row: row["nodeid"])


def summary(rows: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, Counter]]:
    """file -> implementation -> counts: passed, skipped, failed by kind, and the failures owed (``is_owed``)."""
    table: dict[str, dict[str, Counter]] = {}
    for row in rows:
        control_passed = row["verdicts"].get(CONTROL, {}).get("outcome") == "passed"
        for name in names:
            record = row["verdicts"].get(name)
            counts = table.setdefault(row["file"], {}).setdefault(name, Counter())
            if record is None:
                counts["missing"] += 1
                continue
            outcome = record["outcome"]
            counts[outcome] += 1
            if outcome in ("failed", "timeout") and name != CONTROL:
                counts[record.get("kind", "behaviour")] += 1
                counts["owed"] += is_owed(record, control_passed)
    return table


def _brief(record: dict) -> dict:
    return {key: value for key, value in record.items() if key != "longrepr"}


def write_json(path: Path, rows: list[dict[str, Any]], names: list[str], provenance: dict[str, Any]) -> None:
    table = summary(rows, names)
    data = {
        "provenance": provenance,
        "implementations": names,
        "summary": {file: {name: dict(counts) for name, counts in per.items()} for file, per in table.items()},
        "tests": [{**row, "verdicts": {n: _brief(r) for n, r in row["verdicts"].items()}} for row in rows],
    }
    path.write_text(json.dumps(data, indent=1))


_CSS = """body{font-family:sans-serif;margin:1.5em;max-width:1400px}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;vertical-align:top}th{background:#f3f3f3}
.passed{background:#d9f2d9}.failed,.timeout{background:#f9d0d0}.skipped{color:#777}
.private,.by-design{background:#eee;color:#555}.message{background:#fde9c8}
.owed td:first-child{border-left:4px solid #c00}
pre{white-space:pre-wrap;font-size:12px;max-height:20em;overflow:auto}
td code{word-break:break-all}details{margin:.2em 0}"""


def _cell(record: dict | None) -> str:
    if record is None:
        return "<td>-</td>"
    outcome = record["outcome"]
    kind = record.get("kind", "")
    css = kind.replace(" ", "-") if kind in ("private", "message", BY_DESIGN) else outcome
    label = outcome.upper() + (f" ({kind})" if kind else "")
    body = html.escape(label)
    if record.get("design"):
        body += f"<br>{html.escape(record['design'])}"
    if record.get("error_type"):
        body += f"<br><code>{html.escape(record['error_type'])}: {html.escape(record.get('message', '')[:200])}</code>"
    if record.get("internals"):
        body += "<br>reads " + ", ".join(f"<code>{html.escape(n)}</code>" for n in record["internals"])
    if record.get("longrepr"):
        body += f"<details><summary>traceback</summary><pre>{html.escape(record['longrepr'][-6000:])}</pre></details>"
    return f'<td class="{css}">{body}</td>'


def write_page(path: Path, rows: list[dict[str, Any]], names: list[str], provenance: dict[str, Any]) -> None:
    table = summary(rows, names)
    out = [
        f"<!doctype html><meta charset=utf-8><title>FSDP2's tests as a judge</title><style>{_CSS}</style>",
        "<h1>torch's FSDP2 tests, run against each implementation</h1>",
        "<p>" + " · ".join(f"{html.escape(k)}: <code>{html.escape(str(v))}</code>" for k, v in provenance.items()),
        "</p><p><b>owed</b>: tests torch FSDP2 passes that the implementation fails, not counting "
        "<b>private</b> ones (they read FSDP2's internals) and those that <b>differ by design</b> (a "
        "difference the test plan mandates, failing the listed way). <b>message</b>: the same exception "
        "type, other text.</p><h2>Summary</h2><table><tr><th>file</th>",
    ]
    out += [f"<th>{html.escape(n)}</th>" for n in names] + ["</tr>"]
    for file, per in sorted(table.items()):
        out.append(f"<tr><td>{html.escape(file)}</td>")
        for name in names:
            c = per.get(name, Counter())
            text = f"{c['passed']} passed, {c['skipped']} skipped"
            if c["failed"] or c["timeout"]:
                text += f", {c['failed'] + c['timeout']} failed"
                if name != CONTROL:
                    text += (
                        f" (owed {c['owed']}; by design {c[BY_DESIGN]}, private {c['private']}, "
                        f"message {c['message']}, behaviour {c['behaviour']})"
                    )
            out.append(f"<td>{text}</td>")
        out.append("</tr>")
    out.append("</table><h2>Every test that did not skip everywhere</h2><table><tr><th>test</th>")
    out += [f"<th>{html.escape(n)}</th>" for n in names] + ["</tr>"]
    for row in rows:
        verdicts = row["verdicts"]
        if all(r.get("outcome") == "skipped" for r in verdicts.values()):
            continue
        control_passed = verdicts.get(CONTROL, {}).get("outcome") == "passed"
        owed = any(is_owed(r, control_passed) for n, r in verdicts.items() if n != CONTROL)
        out.append(f'<tr class="{"owed" if owed else ""}"><td><code>{html.escape(row["nodeid"])}</code></td>')
        out += [_cell(verdicts.get(n)) for n in names] + ["</tr>"]
    out.append("</table>")
    path.write_text("\n".join(out))
