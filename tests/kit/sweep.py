"""The sweep (the main job): every case of every level through papermill, as evidence.

    python -m tests.kit.sweep [--levels L0,L1,L2,L3] [--out runs] [--engines 4]

One warm cluster serves the whole sweep: each case's notebook joins it (papermill parameter
``cluster_id``), so a case costs its kernel start and its own run, not a cluster start. Output:
``runs/<timestamp>/<level>/<case>.ipynb`` (executed, with verdicts and plots), the verdict
summaries beside them as JSON, and ``runs/<timestamp>/index.html``: the precision matrix filled
with the measured errors against their tolerances, linking every executed notebook. The exit
status is non-zero if any case failed.
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

from tests.kit.case import Case
from tests.kit.cluster import RankCluster
from tests.kit.levels import LEVELS
from tests.kit.notebook import select_cases
from tests.kit.tolerances import PRECISION_MATRIX

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "hyper-parallel-kit"


def run_one(spec: Case, out_dir: Path, cluster: RankCluster) -> dict[str, Any]:
    """Execute the case's level notebook for this case alone; return its verdict summary."""
    import papermill

    level_dir = out_dir / spec.level
    level_dir.mkdir(parents=True, exist_ok=True)
    notebook = level_dir / f"{spec.id}.ipynb"
    results = level_dir / f"{spec.id}.json"
    started = time.monotonic()
    error = None
    try:
        papermill.execute_notebook(
            str(NOTEBOOKS / LEVELS[spec.level].notebook_file),
            str(notebook),
            parameters={
                "cases": spec.id,
                "cluster_id": cluster.cluster.cluster_id,
                "results_path": str(results),
            },
            kernel_name=KERNEL,
            cwd=str(NOTEBOOKS),
            execution_timeout=int(spec.timeout) + 120,
            progress_bar=False,
        )
    except Exception as exc:  # noqa: BLE001 - a failed case is recorded, the sweep goes on
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    if results.exists():
        (summary,) = json.loads(results.read_text())
    else:  # the notebook died before writing its results (kernel crash, timeout)
        summary = {
            "id": spec.id,
            "name": spec.name,
            "level": spec.level,
            "config": spec.config,
            "world_size": spec.world_size,
            "status": "ERROR",
            "passed": False,
            "checks": 0,
            "failed_checks": 0,
            "failure": error,
            "loss_error": None,
            "loss_tol": None,
            "grad_error": None,
            "grad_tol": None,
            "first_failure": error,
        }
    summary["notebook"] = str(notebook.relative_to(out_dir))
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    if error and summary["passed"]:
        summary["passed"], summary["status"], summary["failure"] = False, "ERROR", error
    return summary


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def _case_link(row: dict[str, Any]) -> str:
    color = "#1a7f37" if row["passed"] else "#cf222e"
    return f"<a href='{html.escape(row['notebook'])}' style='color:{color}'>{html.escape(row['id'])}</a>"


def write_index(rows: list[dict[str, Any]], out_dir: Path, seconds: float) -> Path:
    """The precision matrix with measured worst errors, and one line per case."""
    by_config: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_config.setdefault(row["config"], []).append(row)

    def worst(group: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in group if r.get(key) is not None]
        return max(values) if values else None

    matrix = []
    for config, tol in PRECISION_MATRIX.items():
        group = by_config.get(config, [])
        state = "" if not group else ("PASS" if all(r["passed"] for r in group) else "FAIL")
        matrix.append(
            f"<tr><td>{html.escape(config)}</td><td>{tol.loss:g}</td><td>{_fmt(worst(group, 'loss_error'))}</td>"
            f"<td>{tol.grad:g}</td><td>{_fmt(worst(group, 'grad_error'))}</td>"
            f"<td>{' '.join(_case_link(r) for r in group) or '<i>no case run</i>'}</td><td>{state}</td></tr>"
        )
    cases = [
        f"<tr style='background:{'#ffffff' if r['passed'] else '#fde2e2'}'><td>{_case_link(r)}</td>"
        f"<td>{html.escape(r['name'])}</td><td>{html.escape(r['config'])}</td><td>{r['world_size']}</td>"
        f"<td>{_fmt(r['loss_error'])} / {_fmt(r['loss_tol'])}</td>"
        f"<td>{_fmt(r['grad_error'])} / {_fmt(r['grad_tol'])}</td>"
        f"<td>{r['checks'] - r['failed_checks']}/{r['checks']}</td><td>{r['wall_seconds']}</td>"
        f"<td>{r['status']}</td><td><pre>{html.escape(r['first_failure'] or r['failure'] or '')[:600]}</pre></td></tr>"
        for r in rows
    ]
    passed = sum(r["passed"] for r in rows)
    page = f"""<!doctype html><html><head><meta charset='utf-8'><title>hyper-parallel-kit sweep</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;margin-bottom:2em}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px;text-align:left}}
pre{{margin:0;white-space:pre-wrap}}</style>
</head><body><h1>hyper-parallel-kit sweep: {passed}/{len(rows)} cases passed</h1>
<p>{time.strftime("%Y-%m-%d %H:%M:%S")}, {seconds:.0f} s. Errors are the worst absolute error over every rank,
step and check of that kind (loss checks; grad-norm and element-wise grad checks); tolerances come from the
precision matrix (tests/kit/tolerances.py).</p>
<h2>Precision matrix</h2><table><tr><th>configuration</th><th>loss tol</th><th>worst loss error</th>
<th>grad tol</th><th>worst grad error</th><th>cases (link: executed notebook)</th><th>verdict</th></tr>
{"".join(matrix)}</table>
<h2>Cases</h2><table><tr><th>id</th><th>plan name</th><th>configuration</th><th>ranks</th>
<th>loss error / tol</th><th>grad error / tol</th><th>checks passed</th><th>seconds</th><th>verdict</th>
<th>failure</th></tr>
{"".join(cases)}</table></body></html>"""
    index = out_dir / "index.html"
    index.write_text(page)
    (out_dir / "results.json").write_text(json.dumps(rows, indent=1))
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every case through papermill and write the evidence.")
    parser.add_argument("--levels", default=",".join(LEVELS), help="comma-separated levels (default: all)")
    parser.add_argument("--out", default=str(ROOT / "runs"), help="parent folder of runs/<timestamp>/")
    parser.add_argument("--engines", type=int, default=4, help="ranks of the warm cluster")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    levels = [level.strip() for level in args.levels.split(",") if level.strip()]
    selected = [spec for level in levels for spec in select_cases(level)]
    out_dir = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows = []
    interrupted = False
    try:
        with RankCluster.start(args.engines) as cluster, tqdm(selected, unit="case", file=sys.stdout) as bar:
            for spec in bar:
                bar.set_description(spec.id)
                cluster.ensure_engines()  # a case that killed a rank must not take the next ones down
                row = run_one(spec, out_dir, cluster)
                rows.append(row)
                bar.write(f"{'PASS' if row['passed'] else 'FAIL'}  {spec.id} {spec.name}  ({row['wall_seconds']} s)")
    except KeyboardInterrupt:  # the cluster is stopped by now; keep what finished
        interrupted = True
    index = write_index(rows, out_dir, time.monotonic() - started)
    failed = [r["id"] for r in rows if not r["passed"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} cases passed; evidence: {index}")
    if failed:
        print("failed:", ", ".join(failed))
    if interrupted:
        print(f"interrupted after {len(rows)} of {len(selected)} cases")
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
