"""The sweep's L4 part: the generalization explorer's notebook, once per implementation, on the
sweep's warm cluster, with a small budget (``--l4-examples``) or one replayed configuration
(``--l4-replay``); its executed notebook and page land in ``<run>/[<NAME>/]L4/``, linked from the
index."""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

from tests.kit.front.evidence import render_notebook, status_badge
from tests.kit.runtime.cluster import RankCluster
from tests.kit.sweep.execute import execute

L4_NOTEBOOK = Path(__file__).resolve().parents[3] / "notebooks" / "L4_generalization.ipynb"
_CELL_TIMEOUT_S = 3600  # the exploration is one cell; each configuration is bounded on its own


def run_l4(
    out_dir: Path,
    cluster: RankCluster,
    implementation: str,
    name: str,
    examples: int,
    replay: str,
    runner: Any,
    run_dir: Path,
    cover: bool = True,
) -> dict[str, Any]:
    """Execute the L4 notebook on ``cluster`` (its covering phase first where ``cover``); its summary
    row for the index."""
    folder = out_dir / "L4"
    folder.mkdir(parents=True, exist_ok=True)
    notebook, results, page = (folder / f"L4_generalization{ext}" for ext in (".ipynb", ".json", ".html"))
    results.unlink(missing_ok=True)
    parameters = {
        "examples": max(examples, 1),
        "max_world_size": cluster.n_engines,
        "implementation": implementation,
        "replay": replay,
        "cover": cover,
        "cluster_id": cluster.cluster.cluster_id,
        "results_path": str(results),
    }
    started = time.monotonic()
    error, _ = execute(L4_NOTEBOOK, notebook, parameters, runner, _CELL_TIMEOUT_S)
    summary = json.loads(results.read_text()) if results.exists() else {}
    passed = bool(summary.get("passed")) and error is None
    row = {
        "implementation": name,
        "status": "PASS" if passed else ("FAIL" if summary else "ERROR"),
        "passed": passed,
        "summary": summary.get("summary") or error or "the notebook did not finish",
        "minimal": summary.get("minimal"),
        "diagnosis": summary.get("diagnosis"),
        "seconds": round(time.monotonic() - started, 1),
        "notebook": notebook.relative_to(run_dir).as_posix() if notebook.exists() else None,
        "page": None,
    }
    if notebook.exists():
        banner = (
            "<div id='hpkit-banner' style='font-family:sans-serif;margin:12px 24px;padding:10px 14px;"
            f"border:1px solid #d0d7de;border-radius:6px;background:#f6f8fa'>L4 generalization "
            f"{status_badge(row['status'])}<div style='font-size:13px'>{row['summary']}</div>"
            f"{_diagnosis_html(row)}</div>"
        )
        render_notebook(notebook, page, banner)
        row["page"] = page.relative_to(run_dir).as_posix()
    return row


def l4_line(row: dict[str, Any]) -> str:
    """The sweep's progress line for one implementation's L4 run (beside ``case_line``)."""
    name = f"[{row['implementation']}] " if row["implementation"] else ""
    where = f"\n            diagnosis: {row['diagnosis']}" if row.get("diagnosis") else ""
    return f"{row['status']:<11} {name}L4 generalization  {row['summary']}{where}"


def l4_section(rows: list[dict[str, Any]]) -> str:
    """The index's L4 section: one line per implementation, linking its page and notebook."""
    if not rows:
        return ""
    lines = []
    for row in rows:
        label = f"<b>{row['implementation']}</b>: " if row["implementation"] else ""
        links = " | ".join(
            f"<a href='{row[key]}'>{text}</a>" for key, text in (("page", "page"), ("notebook", "notebook")) if row[key]
        )
        lines.append(
            f"<li>{label}{status_badge(row['status'])} {row['summary']} ({row['seconds']:.0f} s; {links})"
            f"{_diagnosis_html(row)}</li>"
        )
    return "<h2>L4 generalization</h2><ul id='l4'>" + "".join(lines) + "</ul>"


def _diagnosis_html(row: dict[str, Any]) -> str:
    """The minimal failing configuration's diagnosis line (where it raised or first diverged), or nothing."""
    if not row.get("diagnosis"):
        return ""
    return f"<div style='font-size:13px;font-family:monospace'>diagnosis: {html.escape(row['diagnosis'])}</div>"
