"""The sweep (the main job): every case of every level through papermill, as evidence.

    python -m tests.kit.sweep [--levels L0,L1,L2,L3] [--cases L0-01,L1-03] [--out runs] [--engines 4]
                              [--implementation NAME=SPEC ...] [--verbose] [--kernel NAME] [--plain-kernels]
    python -m tests.kit.sweep --compare runs/A runs/B [--rtol 0]

One warm cluster per implementation serves the whole sweep: each case's notebook joins it
(papermill parameter ``cluster_id``), so a case costs its kernel and its own run, not a cluster
start. Kernels are forked from a warm parent (``tests.kit.kernel_fork``): each case still runs
in a fresh kernel of its own, from the notebook's first cell, without paying the imports again.
An implementation other than ours (``--implementation NAME=SPEC``, SPEC as in
``tests.kit.surface``) gets fresh engines for every case (notebook parameter ``isolate``).

Output, under ``runs/<timestamp>/`` (``<NAME>/`` in between when ``--implementation`` is given):
``<level>/<case>.ipynb`` (executed), ``<case>.html`` (the same, as a page with its plots, a
status banner and the failing rows first), ``<case>.json`` (verdict summary with provenance),
``results.json`` (every summary, with the run's provenance), ``index.html`` (the precision
matrix filled with the worst measured errors against their tolerances, every case linked) and
``sweep.log`` (kernel and engine output; ``--verbose`` shows it instead). The exit status is
non-zero if any case did not pass. ``--compare A B`` lists the cases whose verdict or worst error
changed between two sweeps (exit status 1 when any did).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import html
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import nbformat
import papermill
from papermill.engines import NBClientEngine, papermill_engines

from tests.kit.case import Case
from tests.kit.cluster import RankCluster
from tests.kit.evidence import (
    KERNEL,
    STATUS_COLOURS,
    KernelMissing,
    case_banner,
    compare,
    kit_state,
    render_notebook,
    resolve_kernel,
    status_badge,
    tagged_output_html,
)
from tests.kit.levels import LEVELS
from tests.kit.notebook import select_cases
from tests.kit.surface import parse_spec
from tests.kit.tolerances import PRECISION_MATRIX

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
_SLACK_S = 120  # per-cell execution timeout beyond the case's own timeout
_PAGE_TIMEOUT_S = 300  # rendering one HTML page
_ENGINE = "hpkit-sweep"
_ANSWER_TIMEOUT_S = 5.0  # an idle engine answers in milliseconds


class _RecordingEngine(NBClientEngine):
    """papermill's nbclient engine, remembering the notebook it executes: the sweep saves it once at
    the end (not after every cell), and still has what ran when a kernel dies or a cell times out."""

    current: Any = None

    @classmethod
    def execute_managed_notebook(cls, nb_man: Any, kernel_name: str, **kwargs: Any) -> Any:
        """Execute as papermill does, remembering the notebook."""
        cls.current = nb_man
        return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)


papermill_engines.register(_ENGINE, _RecordingEngine)


@dataclass
class Runner:
    """How the sweep executes notebooks: kernels (forked from a zygote, one started ahead), and HTML
    pages rendered in the background while the next case runs."""

    kernel: str = KERNEL
    zygote: Any = None  # tests.kit.kernel_fork.Zygote, or None: kernels start the ordinary way
    log: IO[Any] | None = None  # kernel output of ordinary starts (None: the terminal)
    ahead: bool = False  # start the next notebook's kernel while this one runs
    pages: ThreadPoolExecutor | None = None  # None: render each page before run_one returns
    pending: list[Future] = field(default_factory=list)
    _pool: Any = None

    def kernel_pool(self) -> Any:
        """The pool this runner takes kernels from."""
        from tests.kit.kernel_fork import KernelPool

        if self._pool is None:
            self._pool = KernelPool(self.kernel, str(NOTEBOOKS), zygote=self.zygote, stdout=self.log)
        return self._pool

    def finish(self) -> None:
        """Wait for every page."""
        for future in self.pending:
            future.result(timeout=_PAGE_TIMEOUT_S)
        self.pending.clear()

    def close(self) -> str | None:
        """Stop the spare kernel and the zygote (pages are waited for by finish()); why kernels
        stopped being forked, if they did."""
        fallback = None
        if self._pool is not None:
            self._pool.close()
            fallback = self._pool.fallback
        if self.zygote is not None:
            self.zygote.stop()
        return fallback


def _cell_seconds(nb: Any) -> dict[str, float]:
    """Seconds per code cell of an executed notebook, by its first line."""
    seconds: dict[str, float] = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        key = (cell.source.strip().splitlines() or [""])[0][:48]
        seconds[key] = round(seconds.get(key, 0.0) + (cell.metadata.get("papermill", {}).get("duration") or 0.0), 3)
    return seconds


def _failed_row(spec: Case, error: str | None) -> dict[str, Any]:
    """The summary of a case whose notebook died before writing its own (kernel crash, timeout)."""
    return {
        "id": spec.id,
        "name": spec.name,
        "level": spec.level,
        "config": spec.config,
        "world_size": spec.world_size,
        "status": "ERROR",
        "passed": False,
        "extras_passed": True,
        "extras": 0,
        "checks": 0,
        "failed_checks": 0,
        "first_failure": error,
        "unsupported": [],
        "leak": None,
        "notes": [],
        "origin": {},
        "failure": error,
        "loss_error": None,
        "loss_tol": None,
        "grad_error": None,
        "grad_tol": None,
        "seconds": 0.0,
    }


def _execute(spec: Case, notebook: Path, parameters: dict[str, Any], runner: Runner) -> tuple[str | None, float]:
    """Run the level notebook of ``spec`` into ``notebook`` on a fresh kernel: (error, kernel start s)."""
    from tests.kit.kernel_fork import stop_kernel

    started = time.monotonic()
    pool = runner.kernel_pool()
    km = None
    error = None
    kernel_start = 0.0
    _RecordingEngine.current = None
    try:
        km = pool.take()
        kernel_start = time.monotonic() - started
        if runner.ahead:
            pool.prepare()
        papermill.execute_notebook(
            str(NOTEBOOKS / LEVELS[spec.level].notebook_file),
            str(notebook),
            parameters=parameters,
            engine_name=_ENGINE,
            request_save_on_cell_execute=False,
            kernel_name=runner.kernel,
            km=km,
            cwd=str(NOTEBOOKS),
            execution_timeout=int(spec.timeout) + _SLACK_S,
            progress_bar=False,
        )
    except Exception as exc:  # noqa: BLE001 - a failed case is recorded, the sweep goes on
        text = str(exc).strip()
        error = f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
        executing = _RecordingEngine.current
        if executing is not None and not isinstance(exc, papermill.PapermillExecutionError):
            nbformat.write(executing.nb, notebook)  # the kernel died or a cell timed out: keep what ran
    finally:
        if km is not None:
            stop_kernel(km)
    return error, kernel_start


def _render(row: dict[str, Any], notebook: Path, page: Path, results: Path, run_dir: Path) -> None:
    """The case's HTML page: the executed notebook under a banner (status, links, provenance,
    failing rows)."""
    started = time.monotonic()
    links = {
        "sweep index": os.path.relpath(run_dir / "index.html", page.parent),
        "executed notebook (.ipynb)": notebook.name,
        "verdict summary (.json)": results.name,
    }
    try:
        failing = tagged_output_html(notebook, "verdict-table") if row["status"] != "PASS" else ""
        render_notebook(notebook, page, case_banner(row, links, failing))
    except Exception as exc:  # noqa: BLE001 - the notebook stays the evidence; the index says why
        row["page"] = None
        row["page_error"] = f"{type(exc).__name__}: {exc}"
    row["timing"]["html"] = round(time.monotonic() - started, 3)


def run_one(
    spec: Case,
    out_dir: Path,
    cluster: RankCluster,
    *,
    implementation: str = "",
    isolate: bool = False,
    name: str = "",
    runner: Runner | None = None,
    run_dir: Path | None = None,
) -> dict[str, Any]:
    """Execute the case's level notebook for this case alone on ``cluster``; write its .ipynb,
    .json and .html in ``out_dir/<level>/``; return its summary (paths relative to ``run_dir``,
    the folder of the index; default ``out_dir``)."""
    runner = runner or Runner()
    run_dir = run_dir or out_dir
    level_dir = out_dir / spec.level
    level_dir.mkdir(parents=True, exist_ok=True)
    notebook, results, page = (level_dir / f"{spec.id}{ext}" for ext in (".ipynb", ".json", ".html"))
    results.unlink(missing_ok=True)
    started = time.monotonic()
    parameters = {
        "cases": spec.id,
        "implementation": implementation,
        "isolate": isolate,
        "cluster_id": cluster.cluster.cluster_id,
        "results_path": str(results),
    }
    error, kernel_start = _execute(spec, notebook, parameters, runner)
    executed = time.monotonic()
    row = json.loads(results.read_text())[0] if results.exists() else _failed_row(spec, error)
    if error and row["passed"]:
        row.update(passed=False, status="ERROR", failure=error, first_failure=error)
    if not results.exists():
        results.write_text(json.dumps([row], indent=1))
    nb = nbformat.read(notebook, as_version=4) if notebook.exists() else None
    row["implementation"] = name
    row["notebook"] = notebook.relative_to(run_dir).as_posix()
    row["json"] = results.relative_to(run_dir).as_posix()
    row["page"] = page.relative_to(run_dir).as_posix() if nb is not None else None
    row["timing"] = {
        "kernel_start": round(kernel_start, 3),
        "notebook": round(executed - started - kernel_start, 3),
        "cells": _cell_seconds(nb) if nb is not None else {},
        "html": 0.0,
    }
    row["wall_seconds"] = round(executed - started, 2)  # the page is rendered while the next case runs
    if nb is not None:
        if runner.pages is None:
            _render(row, notebook, page, results, run_dir)
        else:
            runner.pending.append(runner.pages.submit(_render, row, notebook, page, results, run_dir))
    return row


# -- the index ---------------------------------------------------------------------------------------
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
and element-wise grad checks); tolerances come from the precision matrix (tests/kit/tolerances.py). Each
case links its page (the executed notebook with its plots) and the executed notebook itself (ipynb).</p>
{"".join(sections)}</body></html>"""
    index = out_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    (out_dir / "results.json").write_text(json.dumps({"run": run, "cases": rows}, indent=1))
    return index


# -- the command -------------------------------------------------------------------------------------
def parse_implementations(items: list[str]) -> dict[str, str]:
    """``NAME=SPEC`` items -> name -> normalised spec ('' = ours)."""
    named: dict[str, str] = {}
    for item in items:
        name, sep, spec = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--implementation {item!r}: expected NAME=SPEC (SPEC '' = ours)")
        if name in named:
            raise ValueError(f"--implementation {item!r}: the name {name!r} is given twice")
        if "/" in name or name in LEVELS:
            raise ValueError(f"--implementation {item!r}: {name!r} cannot name a folder of the run")
        named[name] = str(parse_spec(spec)) if spec.strip() else ""
    return named


def select(levels: list[str], cases: str) -> list[Case]:
    """The cases of ``levels``, all or those named in ``cases`` (ids or plan names, comma-separated)."""
    selected = [spec for level in levels for spec in select_cases(level)]
    if not cases:
        return selected
    wanted = [w.strip() for w in cases.split(",") if w.strip()]
    known = {c.id: c for c in selected} | {c.name: c for c in selected}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown} in levels {levels}")
    picked = {known[w].id for w in wanted}
    return [c for c in selected if c.id in picked]


@contextlib.contextmanager
def _quiet(log: IO[Any] | None) -> Iterator[None]:
    """Send this process's stderr (and so its children's: kernels, engines) to ``log`` for the block."""
    if log is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _engines_answer(cluster: RankCluster) -> bool:
    """Whether every engine answers within a few seconds (one still busy with a case does not)."""
    try:
        cluster.view().apply_async(os.getpid).get(timeout=_ANSWER_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - a timeout or a dead engine: either way, not usable as it is
        return False
    return True


def _line(row: dict[str, Any]) -> str:
    name = f"[{row['implementation']}] " if row.get("implementation") else ""
    overhead = row["wall_seconds"] - row.get("seconds", 0.0)
    return (
        f"{row['status']:<11} {name}{row['id']} {row['name']}  "
        f"({row.get('seconds', 0.0):.1f} s case + {overhead:.1f} s notebook)"
    )


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


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description="Run every case through papermill and write the evidence.")
    parser.add_argument("--levels", default=",".join(LEVELS), help="comma-separated levels (default: all)")
    parser.add_argument("--cases", default="", help="only these cases (ids or plan names, comma-separated)")
    parser.add_argument("--out", default=str(ROOT / "runs"), help="parent folder of runs/<timestamp>/")
    parser.add_argument("--engines", type=int, default=4, help="ranks of the warm cluster")
    parser.add_argument(
        "--implementation",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="implementation under test, repeatable (SPEC: '' ours, torch, upstream:PATH, PATH; default: ours)",
    )
    parser.add_argument("--verbose", action="store_true", help="kernel and engine output on the terminal")
    parser.add_argument("--kernel", default=KERNEL, help=f"Jupyter kernel of the notebooks (default {KERNEL})")
    parser.add_argument(
        "--plain-kernels", action="store_true", help="start every kernel as plain papermill does (no fork)"
    )
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="list cases that changed from sweep A to B")
    parser.add_argument("--rtol", type=float, default=0.0, help="--compare: ignore error changes within this")
    args = parser.parse_args(argv)
    if args.compare:
        lines = compare(*args.compare, rtol=args.rtol)
        print("\n".join(lines) if lines else "no case changed its verdict or worst error")
        return 1 if lines else 0
    try:
        implementations = parse_implementations(args.implementation) if args.implementation else {"": ""}
        levels = [level.strip() for level in args.levels.split(",") if level.strip()]
        bad = [level for level in levels if level not in LEVELS]
        if bad:
            raise ValueError(f"unknown level(s) {bad}; known: {list(LEVELS)}")
        selected = select(levels, args.cases)
        kernel, note = resolve_kernel(args.kernel)
    except (ValueError, KernelMissing) as exc:
        print(f"sweep: {exc}", file=sys.stderr)
        return 2
    if note:
        print(note)
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    run_dir = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "sweep.log"
    with open(log_path, "a", buffering=1) as log:
        return _sweep(args, implementations, selected, kernel, run_dir, None if args.verbose else log)


def _sweep(
    args: argparse.Namespace,
    implementations: dict[str, str],
    selected: list[Case],
    kernel: str,
    run_dir: Path,
    log: IO[Any] | None,
) -> int:
    from tqdm import tqdm

    from tests.kit.kernel_fork import Zygote

    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    interrupted = False
    total = len(selected) * len(implementations)
    named = bool(args.implementation)
    with tqdm(total=total, unit="case", file=sys.stdout, dynamic_ncols=True) as bar, _quiet(log):
        runner = Runner(kernel=kernel, log=log, pages=ThreadPoolExecutor(1, thread_name_prefix="hpkit-page"))
        try:
            if not args.plain_kernels:
                try:  # its imports run while the first cluster starts
                    runner.zygote = Zygote.start(stderr=log, wait=False)
                except OSError as exc:
                    bar.write(f"kernels start the ordinary way (no zygote: {exc})")
            done = 0
            for name, spec in implementations.items():
                out_dir = run_dir / name if named else run_dir
                isolate = spec != ""
                bar.set_description(f"{name or 'cluster'}: starting {args.engines} engines")
                with RankCluster.start(args.engines, implementation=spec or None) as cluster:
                    for case in selected:
                        bar.set_description(f"{name + ' ' if named else ''}{case.id}")
                        renewing = time.monotonic()
                        if isolate:
                            cluster.renew()  # fresh engines: the notebook checks it got them
                        else:
                            cluster.ensure_engines()  # a case that killed a rank must not take the next ones
                        renewed = time.monotonic() - renewing
                        done += 1
                        if log is not None:  # what follows in the log is this case's (and the next kernel's)
                            log.write(f"\n===== {name + ' ' if named else ''}{case.id} {case.name} =====\n")
                        runner.ahead = runner.zygote is not None and done < total
                        row = run_one(
                            case,
                            out_dir,
                            cluster,
                            implementation=spec,
                            isolate=isolate,
                            name=name,
                            runner=runner,
                            run_dir=run_dir,
                        )
                        row["timing"]["engines"] = round(renewed, 3)  # fresh (isolate) or restarted engines
                        if row["status"] != "PASS" and not _engines_answer(cluster):
                            cluster.renew()  # a rank still stuck in the case would hold up the next ones
                            row.setdefault("notes", []).append("engines renewed after the case: a rank was stuck")
                        rows.append(row)
                        bar.write(_line(row))
                        bar.update(1)
            bar.set_description("pages")
            runner.finish()
        except KeyboardInterrupt:  # the clusters are stopped by now; keep what finished
            interrupted = True
        finally:
            runner.pages.shutdown(wait=not interrupted, cancel_futures=interrupted)
            fallback = runner.close()
    if fallback:
        print(f"kernels were started the ordinary way after the zygote failed: {fallback}")
    index = write_index(rows, run_dir, time.monotonic() - started, implementations, kernel)
    failed = [
        f"{r['implementation'] + '/' if r.get('implementation') else ''}{r['id']}" for r in rows if not r["passed"]
    ]
    print(f"{len(rows) - len(failed)}/{len(rows)} cases passed; evidence: {index}")
    print(overhead_report(rows))
    if log is not None:
        print(f"kernel and engine output: {run_dir / 'sweep.log'}")
    if failed:
        print("not passed:", ", ".join(failed))
    if interrupted:
        print(f"interrupted after {len(rows)} of {total} cases")
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
