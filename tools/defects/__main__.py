"""``python -m tools.defects``: the kit measured on the defects upstream HyperParallel really had.

    python -m tools.defects --upstream /path/to/hyper-parallel[.git]        # every defect, L0+L1, L4
    python -m tools.defects --upstream URL --only D1,D6 --l4-examples 20 --seed 0
    python -m tools.defects --rejudge runs/defects-<time>    # the same runs judged again (no run)

For each defect of ``tools/defects/catalogue.py`` it rebuilds upstream's tree with the defect and
the same tree without it (from upstream's history, under ``runs/defects-<time>/``), judges both with
the plan cases of the defect's levels and with L4 (keep going, fresh engines per configuration),
and calls the defect found where a check fails with it and passes without it. Upstream's head is
surveyed by L4 once more on its own: its distinct failures, each shrunk once. The page:
``runs/defects-<time>/index.html`` (and ``defects.json``). Never part of ``make test``: hours of
CPU, and upstream is fetched at run time, not kept here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tools.defects.catalogue import select
from tools.defects.page import write_page
from tools.defects.trees import TreeError, repository, resolve, trees

REPO_ROOT = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.defects", description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", default="", help="upstream's git directory (a clone, a mirror) or URL")
    parser.add_argument(
        "--rejudge", default="", help="a finished run's folder: compare its saved runs again with today's rules"
    )
    parser.add_argument("--only", default="", help="defect ids, e.g. D1,D6 (default: all)")
    parser.add_argument("--levels", default="", help="plan levels to judge with, e.g. L1 (default: each defect's)")
    parser.add_argument("--l4-examples", type=int, default=10, help="L4 configurations per tree (0: no L4)")
    parser.add_argument("--seed", type=int, default=0, help="L4 seed (the same draws on every tree)")
    parser.add_argument("--engines", type=int, default=4, help="ranks (engines) per cluster")
    parser.add_argument("--out", default="", help="report folder (default: runs/defects-<time>)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.rejudge:
        return _rejudge(Path(args.rejudge))
    if not args.upstream:
        raise SystemExit("--upstream is required (or --rejudge a finished run's folder)")
    try:
        defects = select(args.only)
    except ValueError as exc:
        raise SystemExit(f"--only: {exc}") from None
    if args.l4_examples < 0:
        raise SystemExit(f"--l4-examples must be >= 0, got {args.l4_examples}")
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    from tests.kit.front.notebook import select as select_cases
    from tools.defects.judge import Finding, compare, judge_tree

    out = Path(args.out) if args.out else REPO_ROOT / "runs" / f"defects-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        gitdir = repository(args.upstream, out)
        head = resolve(gitdir, "HEAD")
    except TreeError as exc:
        raise SystemExit(f"--upstream: {exc}") from None
    started = time.monotonic()
    runs: dict[str, object] = {}  # tree path -> TreeRun, each tree judged once

    def judged(tree: Path, levels: tuple[str, ...]) -> object:
        key = f"{tree}|{','.join(levels)}"
        if key not in runs:
            print(f"judging {tree.name} ({', '.join(levels)}, L4 {args.l4_examples})", flush=True)
            cases = select_cases(list(levels), "")
            shrink = tree.name == head[:10]  # upstream's head: its distinct failures, each shrunk once
            runs[key] = judge_tree(tree, cases, args.l4_examples, args.seed, args.engines, shrink=shrink)
        return runs[key]

    findings: list[Finding] = []
    for defect in defects:
        print(f"{defect.id} {defect.fix} {defect.subject}: {defect.what}", flush=True)
        try:
            with_defect, without = trees(gitdir, head, defect, out / "trees")
        except TreeError as exc:
            findings.append(Finding(asdict(defect), error=str(exc)))
            print(f"  cannot build: {exc}", flush=True)
            continue
        levels = tuple(level.strip() for level in args.levels.split(",") if level.strip()) or defect.levels
        finding = compare(asdict(defect), judged(with_defect, levels), judged(without, levels))
        findings.append(finding)
        print(f"  {'FOUND' if finding.found else 'not found'}", flush=True)
        _save(out, head, findings, runs, started)
    page = _save(out, head, findings, runs, started)
    found = sum(f.found for f in findings)
    print(f"defects found: {found} / {len(findings)} in {time.monotonic() - started:.0f} s; page: {page}")
    return 0


def _rejudge(out: Path) -> int:
    """Findings and page of a finished run again, from its saved tree runs, with today's comparison
    and catalogue (nothing is run)."""
    from tools.defects.catalogue import DEFECTS
    from tools.defects.judge import Finding, TreeRun, compare

    path = out / "defects.json"
    if not path.exists():
        raise SystemExit(f"--rejudge: no defects.json under {out}")
    data = json.loads(path.read_text())
    runs = {key: TreeRun(**run) for key, run in data["trees"].items()}
    known = {d.id: asdict(d) for d in DEFECTS}
    findings = []
    for old in data["findings"]:
        defect = known.get(old["defect"]["id"], old["defect"])
        if old["error"]:
            findings.append(Finding(defect, error=old["error"]))
            continue
        with_key = next(k for k in runs if k.split("|")[0] == old["defect_tree"])
        without_key = next(k for k in runs if k.split("|")[0] == old["fixed_tree"])
        finding = compare(defect, runs[with_key], runs[without_key])
        finding.seconds = old["seconds"]
        findings.append(finding)
    data["findings"] = [f.as_dict() for f in findings]
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    page = write_page(out, data)
    print(f"defects found: {sum(f.found for f in findings)} / {len(findings)} (rejudged); page: {page}")
    return 0


def _save(out: Path, head: str, findings: list, runs: dict, started: float) -> Path:
    """defects.json and index.html as they stand (written after every defect: no lost work)."""
    data = {
        "upstream_head": head,
        "seconds": round(time.monotonic() - started, 1),
        "findings": [f.as_dict() for f in findings],
        "trees": {key: asdict(run) for key, run in runs.items()},
    }
    (out / "defects.json").write_text(json.dumps(data, indent=1, sort_keys=True))
    return write_page(out, data)


if __name__ == "__main__":
    sys.exit(main())
