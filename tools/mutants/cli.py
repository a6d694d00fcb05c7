"""``python -m tools.mutants``: baseline, then each mutant through the suites; the report as it goes.

Exit status: 0 the run completed (survivors are in the report, not an error), 2 bad arguments,
a mutant that does not apply, or a failing baseline, 3 a mutated tree that does not import,
130 interrupted (Ctrl-C or SIGTERM: the current run is stopped, the partial report written).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import matrix
from .catalogue import MUTANTS, Mutant, MutantError, select, tree_sources
from .report import format_score, write_report
from .runner import (
    REPO_ROOT,
    RunConfig,
    check_applies,
    child_env,
    import_error,
    make_scratch,
    plan_cases,
    resolve_cases,
    run_tree,
    snapshot_tree,
    tree_files,
    tree_fingerprint,
)

DEFAULT_TIMEOUT_S = 900.0
BASELINE_CACHE = REPO_ROOT / "runs" / "mutants-baseline-cache.json"  # passing baselines by tree digest
BASELINE_CACHE_SIZE = 8


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.mutants",
        description="Apply engine mutants one at a time to a scratch copy of the repository, run the plan "
        "cases and the engine tests against each, and write a kill matrix (HTML and JSON).",
    )
    parser.add_argument("--only", help="mutant ids: 03,07 or 10-12 (default: all)")
    parser.add_argument(
        "--suite",
        choices=("cases", "engine", "both", "l4"),
        default="both",
        help="default: both (cases and engine); l4: the generalization explorer alone (HPKIT_L4_EXAMPLES)",
    )
    parser.add_argument("--cases", help="plan cases to run, ids or plan names: L1-03,L0-06 (default: all)")
    parser.add_argument("--engine-k", default="", help="pytest -k expression selecting engine tests")
    parser.add_argument(
        "--timeout-per-run", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per pytest run (default 900)"
    )
    parser.add_argument("--out", help="report directory (default: runs/mutants-<timestamp>)")
    parser.add_argument("--no-baseline", action="store_true", help="judge mutants without running the baseline")
    parser.add_argument(
        "--fresh-baseline", action="store_true", help="rerun the baseline even if this exact tree passed before"
    )
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    parser.add_argument(
        "--check", action="store_true", help="only check that every mutant applies once and its tree imports"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    try:
        mutants = select(args.only)
    except MutantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        print_catalogue(mutants)
        return 0
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with tempfile.TemporaryDirectory(prefix="hpkit-mutants-tree-") as tmp:
            snapshot = snapshot_tree(REPO_ROOT, tree_files(REPO_ROOT), Path(tmp))
            problems = check_applies(snapshot, mutants)
            if problems:
                print("error: mutants that do not apply to the tree:\n  " + "\n  ".join(problems), file=sys.stderr)
                return 2
            if args.check:
                return check_imports(snapshot, mutants)
            return run(args, mutants, snapshot)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def print_catalogue(mutants: Sequence[Mutant], root: Path = REPO_ROOT) -> None:
    """One line per mutant: id, where its code is now (file and function), feature, bug (and why it
    is equivalent, if it is)."""
    sources = tree_sources(root)
    for m in mutants:
        extra = f"  [equivalent: {m.equivalent}]" if m.equivalent else ""
        try:
            where = m.locate(sources)
            place = f"{Path(where.file).name}:{where.qualname or '<module>'}"
        except MutantError as exc:
            place = f"NOT FOUND ({exc})"
        print(f"{m.id}  {place:<48} {m.feature:<32} {m.description}{extra}")


def check_imports(snapshot: Path, mutants: Sequence[Mutant]) -> int:
    """Apply each mutant in turn to one scratch copy and import ``hyper_parallel`` there."""
    root = make_scratch(snapshot, "check")
    failed = 0
    try:
        env = child_env(root, "check")
        for mutant in mutants:
            path, original, mutated = mutant.apply_in_tree(root)
            path.write_text(mutated, encoding="utf-8")
            try:
                problem = import_error(root, env)
            finally:
                path.write_text(original, encoding="utf-8")
            failed += problem is not None
            print(f"[{mutant.id}] {'imports' if problem is None else 'DOES NOT IMPORT: ' + problem}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{len(mutants) - failed}/{len(mutants)} mutant(s) apply once and import")
    return 3 if failed else 0


class Progress:
    """A tqdm bar when tqdm is there, and one printed line per finished tree either way."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, unit="mutant", dynamic_ncols=True, file=sys.stderr)

    def say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def status(self, label: str, suite: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{label} {suite}")
        else:
            print(f"[{label}] running {suite} ...", flush=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Session:
    """One harness run's state; writes the report after every tree."""

    def __init__(self, meta: dict[str, Any], mutants: Sequence[Mutant], suites: Sequence[str], out: Path) -> None:
        self.meta, self.mutants, self.suites, self.out = meta, list(mutants), tuple(suites), out
        self.baseline: dict[str, matrix.SuiteRun] = {}
        self.results: matrix.Results = {}

    def build(self, state: str) -> dict[str, Any]:
        self.meta["state"] = state
        self.meta["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
        return matrix.build(self.meta, self.mutants, self.baseline, self.results, self.suites)

    def write(self, state: str) -> dict[str, Any]:
        built = self.build(state)
        write_report(self.out, built)
        return built


def run(args: argparse.Namespace, mutants: Sequence[Mutant], snapshot: Path) -> int:
    """Baseline, then every mutant; the report is rewritten after each tree."""
    suites = matrix.SUITES if args.suite == "both" else (args.suite,)
    registry = plan_cases(REPO_ROOT) if "cases" in suites else {}
    try:
        targets = resolve_cases(args.cases, registry) if args.cases and "cases" in suites else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else REPO_ROOT / "runs" / f"mutants-{started}"
    config = RunConfig(
        suites=suites,
        out=out,
        timeout=args.timeout_per_run,
        case_targets=targets or RunConfig.case_targets,
        engine_k=args.engine_k,
        names={name: case_id for name, (case_id, _) in registry.items()},
    )
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "repo": str(REPO_ROOT),
        "argv": sys.argv[1:],
        "only": args.only or "",
        "cases_filter": args.cases or "",
        "engine_filter": args.engine_k,
        "timeout_per_run": args.timeout_per_run,
        "no_baseline": args.no_baseline,
        "catalogue_size": len(MUTANTS),
    }
    session = Session(meta, mutants, suites, out)
    session.write("starting")
    print(f"report: {out / 'index.html'}", flush=True)
    progress = Progress(len(mutants))
    try:
        if not args.no_baseline and not _baseline_passes(session, snapshot, config, progress, args.fresh_baseline):
            return 2
        for mutant in mutants:
            session.results[mutant.id] = run_tree(snapshot, mutant, config, on_suite=progress.status)
            session.write("running")
            progress.say(summary_line(mutant, session.results[mutant.id]))
            progress.advance()
    except KeyboardInterrupt:
        progress.close()
        session.write("interrupted")
        print(f"interrupted: partial report in {out / 'index.html'}", file=sys.stderr)
        return 130
    progress.close()
    built = session.write("complete")
    print_summary(built, out)
    return 3 if any(row["verdict"] == "INVALID" for row in built["mutants"]) else 0


def _baseline_key(snapshot: Path, config: RunConfig) -> str:
    """What a passing baseline depends on: the tree's bytes, the suites, the selection, python."""
    selection = (*config.suites, *config.case_targets, config.engine_k, sys.executable, sys.version)
    return tree_fingerprint(snapshot, *selection)


def _cached_baseline(key: str) -> dict[str, Any] | None:
    """A passing baseline recorded earlier for exactly this tree and selection, if any."""
    try:
        return json.loads(BASELINE_CACHE.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError):
        return None


def _remember_baseline(key: str, out: Path, baseline: Mapping[str, matrix.SuiteRun]) -> None:
    """Record a passing baseline (the last few only), its logs linked where they are."""
    try:
        cache = json.loads(BASELINE_CACHE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cache = {}
    runs = {suite: {**run.to_json(), "log": str((out / run.log).resolve())} for suite, run in baseline.items()}
    cache[key] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": runs}
    with contextlib.suppress(OSError):
        BASELINE_CACHE.parent.mkdir(parents=True, exist_ok=True)
        BASELINE_CACHE.write_text(json.dumps(dict(list(cache.items())[-BASELINE_CACHE_SIZE:]), indent=1))


def _baseline_passes(
    session: Session, snapshot: Path, config: RunConfig, progress: Progress, fresh: bool = False
) -> bool:
    """Run the unmutated tree (unless it passed before, byte for byte); False (and say which
    tests fail) unless every suite passes."""
    key = _baseline_key(snapshot, config)
    cached = None if fresh else _cached_baseline(key)
    if cached is not None:
        session.baseline = {s: matrix.SuiteRun.from_json(r) for s, r in cached["runs"].items()}
        session.meta["baseline_cached_from"] = cached["when"]
        progress.say(f"[baseline] passed on this exact tree at {cached['when']} (cached; --fresh-baseline reruns it)")
        session.write("baseline passed (cached)")
        return True
    session.baseline = run_tree(snapshot, None, config, on_suite=progress.status)
    failing = {suite: run.failing() for suite, run in session.baseline.items() if run.failing()}
    seconds = sum(run.seconds for run in session.baseline.values())
    if not failing:
        progress.say(f"[baseline] passes ({seconds:.0f} s)")
        _remember_baseline(key, config.out, session.baseline)
        session.write("baseline passed")
        return True
    progress.close()
    session.write("baseline failed")
    print("error: the unmutated tree fails, mutants cannot be judged (or pass --no-baseline):", file=sys.stderr)
    for suite, tests in failing.items():
        run = session.baseline[suite]
        why = [f"pytest exit {run.exit_code}"] if run.status == "crashed" else []
        why += [run.note] if run.note else []
        detail = f" ({'; '.join(why)})" if why else ""
        print(f"  {suite}: {', '.join(tests)}{detail}; log: {config.out / run.log}", file=sys.stderr)
    return False


def summary_line(mutant: Mutant, runs: Mapping[str, matrix.SuiteRun]) -> str:
    """``[03] KILLED    cases: 2 (L1-03, L1-04) | engine: 1 ...  41 s  api.py zero_grad``."""
    parts = []
    for suite, run in runs.items():
        if not run.judged:
            parts.append(f"{suite}: {run.status}{f' ({run.note})' if run.note else ''}")
            continue
        killers = run.killers()
        shown = ", ".join(killers[:4]) + (", ..." if len(killers) > 4 else "")
        parts.append(f"{suite}: killed by {len(killers)}" + (f" ({shown})" if killers else ""))
    seconds = sum(run.seconds for run in runs.values())
    verdict = matrix.verdict(mutant, runs)
    return (
        f"[{mutant.id}] {verdict:<10} {' | '.join(parts)}  {seconds:.0f} s  {Path(mutant.file).name} {mutant.feature}"
    )


def print_summary(built: Mapping[str, Any], out: Path) -> None:
    """Scores and the mutants that survived, at the end of a complete run."""
    for key, entry in built["scores"].items():
        print(f"score {key}: {format_score(entry)}")
    for row in built["mutants"]:
        if row["verdict"] in ("SURVIVED", "INVALID"):
            print(f"  {row['id']} {row['verdict']}  {Path(row['file']).name}  {row['feature']}: {row['description']}")
    for mutant_id in built.get("contradicted_equivalents", []):
        print(f"  {mutant_id} was declared equivalent but was killed")
    print(f"report: {out / 'index.html'}")
