"""The sweep (the main job): every case of every level through papermill, as evidence.

    python -m tests.kit.sweep [--levels L0,L1,L2,L3] [--cases L0-01,L1-03] [--out runs] [--engines 4]
                              [--implementation NAME=SPEC ...] [--verbose] [--kernel NAME] [--plain-kernels]
    python -m tests.kit.sweep --compare runs/A runs/B [--rtol 0]

One warm cluster per implementation serves the whole sweep: each case's notebook joins it
(papermill parameter ``cluster_id``), so a case costs its kernel and its own run, not a cluster
start. Kernels are forked from a warm parent (``tests.kit.sweep.kernel_fork``): each case still runs
in a fresh kernel of its own, from the notebook's first cell, without paying the imports again.
An implementation other than ours (``--implementation NAME=SPEC``, SPEC as in
``tests.kit.judging.surface``) gets fresh engines for every case (notebook parameter ``isolate``).

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
import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import nbformat

from tests.kit.front.evidence import (
    KERNEL,
    KernelMissing,
    case_banner,
    compare,
    render_notebook,
    resolve_kernel,
    tagged_output_html,
)
from tests.kit.front.notebook import select
from tests.kit.judging.case import Case
from tests.kit.judging.levels import LEVELS
from tests.kit.judging.surface import parse_implementations
from tests.kit.runtime.cluster import RankCluster
from tests.kit.sweep.execute import NOTEBOOKS, ROOT, Runner, execute
from tests.kit.sweep.index import case_line, not_passed, overhead_report, passed_count, write_index
from tests.kit.sweep.l4 import l4_line, run_l4

_SLACK_S = 120  # per-cell execution timeout beyond the case's own timeout
_ANSWER_TIMEOUT_S = 5.0  # an idle engine answers in milliseconds


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
    source = NOTEBOOKS / LEVELS[spec.level].notebook_file
    return execute(source, notebook, parameters, runner, int(spec.timeout) + _SLACK_S)


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
        failing = ""
        if row["status"] != "PASS":  # where it went wrong first, then the failing rows
            failing = tagged_output_html(notebook, "diagnosis") + tagged_output_html(notebook, "verdict-table")
        plan = tagged_output_html(notebook, "plan-table") + tagged_output_html(notebook, "plan-figures")
        render_notebook(notebook, page, case_banner(row, links, failing, plan))
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


# -- the command -------------------------------------------------------------------------------------
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
        help="implementation under test, repeatable (SPEC: docs/judging.md#specs; '' is ours, the default)",
    )
    parser.add_argument("--verbose", action="store_true", help="kernel and engine output on the terminal")
    parser.add_argument("--kernel", default=KERNEL, help=f"Jupyter kernel of the notebooks (default {KERNEL})")
    parser.add_argument(
        "--plain-kernels", action="store_true", help="start every kernel as plain papermill does (no fork)"
    )
    parser.add_argument(
        "--l4-examples", type=int, default=20, help="L4 configurations per implementation (0: no L4; default 20)"
    )
    parser.add_argument("--l4-replay", default="", help="L4: replay this saved configuration instead of exploring")
    parser.add_argument(
        "--l4-no-cover", action="store_true", help="L4: no covering phase, the random draws only (a quick check)"
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
        if args.l4_examples < 0:
            raise ValueError(f"--l4-examples must be >= 0, got {args.l4_examples}")
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

    from tests.kit.sweep.kernel_fork import kernel_zygote

    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    interrupted = False
    l4 = args.l4_examples > 0 or bool(args.l4_replay)
    total = (len(selected) + int(l4)) * len(implementations)
    named = bool(args.implementation)
    l4_rows: list[dict[str, Any]] = []
    with tqdm(total=total, unit="case", file=sys.stdout, dynamic_ncols=True) as bar, _quiet(log):
        runner = Runner(kernel=kernel, log=log, pages=ThreadPoolExecutor(1, thread_name_prefix="hpkit-page"))
        try:
            if not args.plain_kernels:
                try:  # its imports run while the first cluster starts
                    runner.zygote = kernel_zygote(stderr=log, wait=False)
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
                        bar.write(case_line(row))
                        bar.update(1)
                    if l4:
                        bar.set_description(f"{name + ' ' if named else ''}L4")
                        row = run_l4(
                            out_dir,
                            cluster,
                            spec,
                            name,
                            args.l4_examples,
                            args.l4_replay,
                            runner,
                            run_dir,
                            cover=not args.l4_no_cover,
                        )
                        l4_rows.append(row)
                        bar.write(l4_line(row))
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
    index = write_index(rows, run_dir, time.monotonic() - started, implementations, kernel, l4_rows)
    failed = not_passed(rows + l4_rows)
    print(f"{passed_count(rows, l4_rows)}; evidence: {index}")
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
