"""The matrix as data and as a page: cases x releases x implementations, each cell the verdict.

A failure whose innermost frame lies in torch's own package (not the kit, not the implementation's
adapter) is shown as torch's: what that release's torch itself cannot do (gloo without
``ReduceOp.AVG`` before torch 2.8, for FSDP2's averaging), not a defect of what the kit judges."""

from __future__ import annotations

import html
import json
import re
import time
from pathlib import Path
from typing import Any

from tests.kit.front.conformance import VERDICT_COLOURS

# a frame of a plain traceback (File "x.py", line 3) or of IPython's (File /x.py:3, in f)
_FRAME = re.compile(r'File "([^"]+)", line (\d+)|File (/[^\s:]+\.py):(\d+)')
_RAISED = re.compile(r"raised (\w+): (.*)")  # the kit's line heading a rank's failure
_EXCEPTION = re.compile(r"\s*\w+(Error|Exception)\b")
_COLOURS = {**VERDICT_COLOURS, "TORCH": "#e6e0ff"}  # the conformance page's, and torch's own failures


# What the release's gloo does with ReduceOp.AVG (our engine's probe), and what follows for each engine.
GLOO = {
    True: "averages",
    False: "no AVG: ours reduces with SUM and divides. torch FSDP2 still asks gloo for AVG: its all-reduce "
    "refuses it (TORCH) and its reduce-scatter sums without a word (FSDP2's grads the world size times too "
    "large: the failing grads of its training cases on this release follow from it)",
}


def torchs_failure(failure: str | None) -> str | None:
    """``where: message`` when the innermost frame of a failure's first traceback (the first rank's)
    is torch's own code; plain Python tracebacks and IPython's (an engine's) alike."""
    if not failure:
        return None
    sections = failure.split("===== rank ")
    first = sections[1] if len(sections) > 1 else failure
    frames = [(quoted or bare, line or bare_line) for quoted, line, bare, bare_line in _FRAME.findall(first)]
    if not frames:
        return None
    path, line = frames[-1]
    marker = "/site-packages/torch/"
    if marker not in path:
        return None
    raised = _RAISED.search(first)
    message = f"{raised.group(1)}: {raised.group(2).strip()}" if raised else _last_exception(first)
    return f"torch/{path.split(marker, 1)[1]}:{line}: {message}"[:300]


def _last_exception(text: str) -> str:
    return next((row.strip() for row in reversed(text.splitlines()) if _EXCEPTION.match(row)), "")


def cell_status(row: dict[str, Any] | None, spec: str = "torch") -> str:
    """The verdict shown for one case of one implementation (``spec``) on one release: TORCH where
    torch FSDP2 failed inside torch's own code. Another implementation failing there (autograd
    finding its in-place write, say) keeps its verdict: the cause is its own."""
    if row is None:
        return "-"
    if spec == "torch" and row["status"] in ("ERROR", "FAIL") and torchs_failure(row.get("failure")):
        return "TORCH"
    return row["status"]


def counts(results: dict[str, dict[str, Any]], spec: str = "torch") -> dict[str, int]:
    """Verdict -> number of cases, over one implementation's results on one release."""
    found: dict[str, int] = {}
    for row in results.values():
        status = cell_status(row, spec)
        found[status] = found.get(status, 0) + 1
    return found


def engine_counts(engine: dict[str, Any]) -> dict[str, int]:
    tests = engine.get("tests", {})
    return {outcome: sum(1 for o in tests.values() if o == outcome) for outcome in sorted(set(tests.values()))}


def _spec(matrix: dict[str, Any], name: str) -> str:
    """The spec of the implementation named ``name`` in the run (torch FSDP2's is "torch")."""
    return matrix.get("implementations", {}).get(name, "torch" if name == "fsdp2" else name)


def write(out: Path, matrix: dict[str, Any]) -> Path:
    """``matrix.json`` and ``index.html`` in ``out``; the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.json").write_text(json.dumps(matrix, indent=1, default=str))
    page = out / "index.html"
    page.write_text(_page(matrix))
    return page


def _summary_rows(matrix: dict[str, Any]) -> str:
    rows = []
    for release, result in matrix["releases"].items():
        if "error" in result:
            rows.append(f"<tr><td><b>{release}</b></td><td colspan=5>{html.escape(result['error'])}</td></tr>")
            continue
        cases = result["cases"]["results"]
        per_impl = "<br>".join(
            f"<b>{html.escape(name)}</b>: "
            + ", ".join(f"{s} {k}" for s, k in sorted(counts(rows_, _spec(matrix, name)).items()))
            for name, rows_ in cases.items()
        )
        engine = ", ".join(f"{o} {k}" for o, k in engine_counts(result["engine"]).items())
        nb = result.get("nbval")
        nb_text = ", ".join(f"{o} {k}" for o, k in engine_counts(nb).items()) if nb else "not run"
        lacks = "<br>".join(f"{html.escape(f)}: {html.escape(', '.join(n))}" for f, n in result["fsdp2_lacks"].items())
        gloo = GLOO.get(result.get("gloo_averages"), "?")
        seconds = result.get("seconds", {})
        rows.append(
            f"<tr><td><b>{release}</b><div class='d'>{html.escape(result.get('torch', ''))}</div></td>"
            f"<td>{per_impl}</td><td>{engine}</td><td>{nb_text}</td><td class='d'>{gloo}</td>"
            f"<td class='d'>{lacks or 'nothing'}</td>"
            f"<td class='d'>{' · '.join(f'{step} {value:.0f} s' for step, value in seconds.items())}</td></tr>"
        )
    return "".join(rows)


def _case_rows(matrix: dict[str, Any]) -> tuple[str, str]:
    columns = [
        (release, name)
        for release, result in matrix["releases"].items()
        if "cases" in result
        for name in result["cases"]["results"]
    ]
    head = "".join(
        f"<th>{html.escape(release)}<div class='d'>{html.escape(name)}</div></th>" for release, name in columns
    )
    ids = sorted({cid for release, name in columns for cid in matrix["releases"][release]["cases"]["results"][name]})
    body = []
    for cid in ids:
        cells = []
        for release, name in columns:
            row = matrix["releases"][release]["cases"]["results"][name].get(cid)
            status = cell_status(row, _spec(matrix, name))
            detail = (
                (torchs_failure(row.get("failure")) if status == "TORCH" else row.get("first_failure")) if row else ""
            )
            cells.append(
                f"<td style='background:{_COLOURS.get(status, '#fff')}' title='{html.escape(detail or '')}'>"
                f"{status}</td>"
            )
        body.append(f"<tr><td>{html.escape(cid)}</td>{''.join(cells)}</tr>")
    return head, "".join(body)


def _page(matrix: dict[str, Any]) -> str:
    head, body = _case_rows(matrix)
    refused = "".join(f"<li>{html.escape(r)}</li>" for r in matrix.get("not_installable", []))
    return f"""<!doctype html><html><head><meta charset='utf-8'><title>torch matrix</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;margin-bottom:2em}}
td,th{{border:1px solid #ccc;padding:3px 6px;font-size:12px;text-align:left;vertical-align:top}}
.d{{color:#555;font-size:11px;max-width:380px}}</style></head><body>
<h1>torch releases x implementations</h1>
<p>{time.strftime("%Y-%m-%d %H:%M:%S")}, Python {html.escape(matrix.get("python", ""))}. Each release in its own venv
(<code>.venvs/torch-RELEASE</code>). A cell is the plan verdict of the case; <b>TORCH</b>: the run failed inside
torch's own code (that release's torch cannot do it); hover a cell for its first failure.</p>
<h2>Per release</h2>
<table><tr><th>torch</th><th>plan cases</th><th>engine tests (ours)</th><th>nbval</th><th>gloo's ReduceOp.AVG</th>
<th>FSDP2 names this torch lacks (features UNSUPPORTED)</th><th>seconds</th></tr>{_summary_rows(matrix)}</table>
{f"<p>Not installable here:</p><ul>{refused}</ul>" if refused else ""}
<h2>Per case</h2>
<table><tr><th>case</th>{head}</tr>{body}</table></body></html>"""
