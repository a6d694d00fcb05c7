"""The sweep's index and its one-line reports: the precision matrix filled with the worst measured
errors, one row per case coloured by its verdict, linking its page and notebook, with the run's
provenance in the header; results.json beside it; the per-case line and the overhead summary."""

from __future__ import annotations

import datetime
import html
import json
import platform
import socket
from pathlib import Path
from typing import Any

from tests.kit.front.evidence import KERNEL, STATUS_COLOURS, kit_state, status_badge
from tests.kit.judging.tolerances import PRECISION_MATRIX
from tests.kit.sweep.l4 import l4_section


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def _case_link(row: dict[str, Any]) -> str:
    """The case id linking its page (HTML), and its executed notebook beside it."""
    fore = STATUS_COLOURS.get(row["status"], ("", "#000000"))[1]
    target = row.get("page") or row["notebook"]
    return (
        f"<a class='case' href='{html.escape(target)}' style='color:{fore}'>{html.escape(row['id'])}</a>"
        f" <a class='ipynb' href='{html.escape(row['notebook'])}' style='font-size:11px'>ipynb</a>"
    )


def run_provenance(rows: list[dict[str, Any]], implementations: dict[str, str]) -> dict[str, Any]:
    """What the whole sweep ran: the kit, the driver, and each implementation as its ranks saw it."""
    seen: dict[str, dict[str, Any]] = {}
    for row in rows:
        origin = row.get("origin") or {}
        if origin.get("file") or origin.get("spec"):
            seen.setdefault(row.get("implementation", ""), origin)
    return {
        **kit_state(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "implementations": {
            name: {
                "spec": spec,
                **{
                    k: seen.get(name, {}).get(k)
                    for k in ("adapter", "file", "commit", "dirty", "torch", "backend", "host")
                },
            }
            for name, spec in implementations.items()
        },
    }


def _matrix(rows: list[dict[str, Any]]) -> str:
    by_config: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_config.setdefault(row["config"], []).append(row)

    def worst(group: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in group if r.get(key) is not None]
        return max(values) if values else None

    lines = []
    for config, tol in PRECISION_MATRIX.items():
        group = by_config.get(config, [])
        statuses = sorted({r["status"] for r in group}, key=lambda s: s != "PASS")
        state = " ".join(status_badge(s) for s in statuses)
        lines.append(
            f"<tr><td>{html.escape(config)}</td><td>{tol.loss:g}</td><td>{_fmt(worst(group, 'loss_error'))}</td>"
            f"<td>{tol.grad:g}</td><td>{_fmt(worst(group, 'grad_error'))}</td>"
            f"<td>{' '.join(_case_link(r) for r in group) or '<i>no case run</i>'}</td><td>{state}</td></tr>"
        )
    return (
        "<table><tr><th>configuration</th><th>loss tol</th><th>worst loss error</th><th>grad tol</th>"
        "<th>worst grad error</th><th>cases (link: page; ipynb: executed notebook)</th><th>verdicts</th></tr>"
        + "".join(lines)
        + "</table>"
    )


def _cases(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        back = STATUS_COLOURS.get(r["status"], ("#ffffff", ""))[0]
        extras = "" if not r.get("extras") else ("extras pass" if r.get("extras_passed") else "<b>extras FAIL</b>")
        detail = r.get("first_failure") or r.get("failure") or ""
        if r.get("diagnosis"):  # where it went wrong first, above the check that failed
            detail = f"{r['diagnosis']['line']}\n{detail}"
        notes = "".join(f"<div class='note'>note: {html.escape(n)}</div>" for n in r.get("notes") or [])
        lines.append(
            f"<tr style='background:{back}'><td>{_case_link(r)}</td><td>{html.escape(r['name'])}</td>"
            f"<td>{html.escape(r['config'])}</td><td>{r['world_size']}</td><td>{status_badge(r['status'])}</td>"
            f"<td>{_fmt(r['loss_error'])} / {_fmt(r['loss_tol'])}</td>"
            f"<td>{_fmt(r['grad_error'])} / {_fmt(r['grad_tol'])}</td>"
            f"<td>{r['checks'] - r['failed_checks']}/{r['checks']} {extras}</td>"
            f"<td>{r.get('seconds', 0):.1f} / {r['wall_seconds']}</td>"
            f"<td><pre>{html.escape(detail[:600])}</pre>{notes}</td></tr>"
        )
    return (
        "<table><tr><th>id</th><th>plan name</th><th>configuration</th><th>ranks</th><th>verdict</th>"
        "<th>loss error / tol</th><th>grad error / tol</th><th>checks passed</th><th>seconds (case / total)</th>"
        "<th>first failure</th></tr>" + "".join(lines) + "</table>"
    )


def write_index(
    rows: list[dict[str, Any]],
    out_dir: Path,
    seconds: float,
    implementations: dict[str, str] | None = None,
    kernel: str = KERNEL,
    l4_rows: list[dict[str, Any]] | None = None,
) -> Path:
    """index.html (provenance, the precision matrix with measured worst errors, one line per case)
    and results.json in ``out_dir``; ``kernel``: what the notebooks ran on."""
    implementations = implementations or {"": ""}
    run = run_provenance(rows, implementations)
    run["seconds"] = round(seconds, 1)
    run["kernel"] = kernel
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    tally = ", ".join(f"{status_badge(s)} {n}" for s, n in sorted(counts.items(), key=lambda kv: kv[0] != "PASS"))
    passed = counts.get("PASS", 0)
    kit = f"{str(run['kit_commit'] or 'not in git')[:12]}{' (dirty)' if run['kit_dirty'] else ''}"
    impl_lines = []
    for name, info in run["implementations"].items():
        label = name or "ours"
        where = info.get("file") or "?"
        commit = str(info.get("commit") or "not in git")[:12] + (" (dirty)" if info.get("dirty") else "")
        impl_lines.append(
            f"<li><b>{html.escape(label)}</b> ({html.escape(info['spec'] or 'this repository')}): "
            f"<code class='impl-file'>{html.escape(where)}</code> @ <code>{html.escape(commit)}</code>; "
            f"torch {html.escape(str(info.get('torch') or '?'))}, "
            f"backend {html.escape(str(info.get('backend') or '?'))}, "
            f"ranks on {html.escape(str(info.get('host') or '?'))}</li>"
        )
    sections = []
    for name in implementations:
        mine = [r for r in rows if r.get("implementation", "") == name]
        title = f"<h2>{html.escape(name)}</h2>" if len(implementations) > 1 or name else ""
        sections.append(f"{title}<h3>Precision matrix</h3>{_matrix(mine)}<h3>Cases</h3>{_cases(mine)}")
    page = f"""<!doctype html><html><head><meta charset='utf-8'><title>hyper-parallel-kit sweep</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;margin-bottom:2em}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px;text-align:left;vertical-align:top}}
pre{{margin:0;white-space:pre-wrap}} .note{{font-size:11px;color:#57606a}}</style>
</head><body><h1>hyper-parallel-kit sweep: {passed}/{len(rows)} cases passed</h1>
<p id='tally'>{tally}</p>
<div id='provenance'><p>{html.escape(run["date"])} on {html.escape(run["host"])} (Python {run["python"]}),
{seconds:.0f} s; kit <code>{html.escape(run["kit"])}</code> @ <code>{html.escape(kit)}</code>; notebooks on the
Jupyter kernel <code>{html.escape(kernel)}</code>.</p>
<ul>{"".join(impl_lines)}</ul></div>
<p>Errors are the worst absolute error over every rank, step and check of that kind (loss checks; grad-norm
and element-wise grad checks); tolerances come from the precision matrix (tests/kit/judging/tolerances.py). Each
case links its page (the executed notebook with its plots) and the executed notebook itself (ipynb).</p>
{"".join(sections)}{l4_section(l4_rows or [])}</body></html>"""
    index = out_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    (out_dir / "results.json").write_text(json.dumps({"run": run, "cases": rows, "l4": l4_rows or []}, indent=1))
    return index


def case_line(row: dict[str, Any]) -> str:
    """One progress line of the sweep: verdict, case, and its seconds split into case and notebook."""
    name = f"[{row['implementation']}] " if row.get("implementation") else ""
    overhead = row["wall_seconds"] - row.get("seconds", 0.0)
    return (
        f"{row['status']:<11} {name}{row['id']} {row['name']}  "
        f"({row.get('seconds', 0.0):.1f} s case + {overhead:.1f} s notebook)"
    )


def not_passed(rows: list[dict[str, Any]]) -> list[str]:
    """``[implementation/]id`` of every case row (and ``L4`` of every L4 row) that did not pass."""
    return [
        f"{r['implementation'] + '/' if r.get('implementation') else ''}{r.get('id', 'L4')}"
        for r in rows
        if not r["passed"]
    ]


def passed_count(rows: list[dict[str, Any]], l4_rows: list[dict[str, Any]]) -> str:
    """``N/M cases passed`` and, when L4 ran, ``L4 n/m passed``."""
    l4 = f", L4 {sum(r['passed'] for r in l4_rows)}/{len(l4_rows)} passed" if l4_rows else ""
    return f"{sum(r['passed'] for r in rows)}/{len(rows)} cases passed{l4}"


def overhead_report(rows: list[dict[str, Any]]) -> str:
    """Mean seconds per case spent beyond the case itself, and where they went."""
    if not rows:
        return ""
    n = len(rows)
    mean = sum(r["wall_seconds"] - r.get("seconds", 0.0) for r in rows) / n
    kernel = sum(r["timing"].get("kernel_start", 0.0) for r in rows) / n
    page = sum(r["timing"].get("html", 0.0) for r in rows) / n
    cells: dict[str, float] = {}
    for r in rows:
        for key, value in r["timing"].get("cells", {}).items():
            cells[key] = cells.get(key, 0.0) + value / n
    run_cell = next((v for k, v in cells.items() if k.startswith("verdicts = nb.run_cases")), 0.0)
    case = sum(r.get("seconds", 0.0) for r in rows) / n
    other_cells = sum(cells.values()) - run_cell
    executing = sum(r["timing"].get("notebook", 0.0) for r in rows) / n
    top = sorted(((v, k) for k, v in cells.items() if not k.startswith("verdicts = nb.run_cases")), reverse=True)
    detail = ", ".join(f"{k!r} {v:.2f}" for v, k in top[:4])
    engines = sum(r["timing"].get("engines", 0.0) for r in rows) / n
    fresh = f"; fresh or restarted engines before the notebook {engines:.2f}" if engines >= 0.05 else ""
    return (
        f"overhead {mean:.2f} s/case beyond the case itself: kernel start {kernel:.2f}, "
        f"papermill outside cells {executing - sum(cells.values()):.2f}, run cell beyond the case "
        f"{run_cell - case:.2f}, other cells {other_cells:.2f} ({detail}); HTML page {page:.2f}, "
        f"rendered while the next case runs{fresh}"
    )
