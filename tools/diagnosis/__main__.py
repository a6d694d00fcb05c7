"""``python -m tools.diagnosis survey [--implementation SPEC] [--cases IDS] [--levels L1,L2,L3]``: diagnose
every L1-L3 precision case (no false alarm: every exit status 0 where the case passes);
``python -m tools.diagnosis mutants [--only 10,11]``: the accuracy on the mutants;
``python -m tools.diagnosis known-defects``: torch FSDP2's known defects (L4 replays) diagnosed on it
(docs/diagnosis.md)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from tests.kit.judging.divergence import diagnose
from tools.diagnosis.accuracy import GROUND_TRUTH, mutated_engine, row
from tools.diagnosis.survey import survey


def _cases(args: argparse.Namespace) -> list[Any]:
    """The cases of ``--levels``, all or those of ``--cases``: the sweep's selection."""
    from tests.kit.front.notebook import select

    return select([level.strip() for level in args.levels.split(",") if level.strip()], args.cases)


def _cluster(implementation: str, engines: int) -> Any:
    from tests.kit.front.notebook import connect

    return connect(engines=engines, implementation=implementation)


def run_survey(args: argparse.Namespace, out: Path) -> int:
    cluster = _cluster(args.implementation, args.engines)
    try:
        rows = survey(cluster, _cases(args), out / "survey.json", args.failing_only)
    finally:
        cluster.stop()
    false_alarms = [r for r in rows if r["status"] == "PASS" and r["exit"] == 1]
    print(f"{len(rows)} cases; {len(false_alarms)} false divergences on passing cases: {out / 'survey.json'}")
    return 1 if false_alarms else 0


def run_mutants(args: argparse.Namespace, out: Path) -> int:
    ids = [i.strip() for i in args.only.split(",") if i.strip()] or sorted(GROUND_TRUTH)
    unknown = [i for i in ids if i not in GROUND_TRUTH]
    if unknown:
        print(f"diagnosis: no ground truth for mutants {unknown}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    for mutant_id in ids:
        engine = mutated_engine(mutant_id)
        cluster = _cluster(f"native:{engine}", args.engines)
        try:
            for case_id in GROUND_TRUTH[mutant_id].cases:
                found = row(mutant_id, case_id, diagnose(cluster, case_id, failing_only=True))
                rows.append(found)
                mark = {True: "right", False: "WRONG", None: "-"}[found["right"]]
                print(f"{mutant_id} {case_id:<8} {found['status']:<11} {mark:<5} {found['line']}", flush=True)
                (out / "mutants.json").write_text(json.dumps(rows, indent=1))
        finally:
            cluster.stop()
            shutil.rmtree(engine, ignore_errors=True)
    judged = [r for r in rows if r["right"] is not None]
    by_mutant: dict[str, bool] = {}
    for r in judged:  # a mutant is diagnosed right when its first failing case is
        by_mutant.setdefault(r["mutant"], bool(r["right"]))
    right = sum(by_mutant.values())
    print(f"{len(by_mutant)} mutants fail a traced precision case; diagnosis right on {right}: {out / 'mutants.json'}")
    return 0


def run_known_defects(args: argparse.Namespace, out: Path) -> int:
    """Each replay torch FSDP2's known defects name (L4 regressions it fails), diagnosed on FSDP2."""
    from tests.kit.explore.diagnosis import diagnose_config
    from tests.kit.explore.runner import load
    from tests.kit.judging.adapters.fsdp2 import KNOWN_DEFECTS

    names = sorted({n for why in KNOWN_DEFECTS.values() for n in re.findall(r"\b[0-9a-f]{10}\b", why)})
    configs = {name: load(name) for name in names}
    cluster = _cluster("torch", max(c.world for c in configs.values()))
    rows = []
    try:
        for name, config in configs.items():
            diagnosis = diagnose_config(cluster, config, name)
            rows.append({"replay": name, "status": diagnosis.status, "line": diagnosis.line()})
            print(f"{name} {diagnosis.status:<6} {diagnosis.line()}", flush=True)
            (out / "known_defects.json").write_text(json.dumps(rows, indent=1))
    finally:
        cluster.stop()
    return 0


def run_cost(args: argparse.Namespace, out: Path) -> int:
    """Each case's own run beside its diagnosis, on one warm cluster: the diagnosis's cost as a ratio."""
    from tests.kit.judging.verdict import run_case

    cluster = _cluster(args.implementation, args.engines)
    rows = []
    try:
        for spec in _cases(args):
            run_case(cluster, spec.id)  # warm: the first run of a case pays its imports
            own = run_case(cluster, spec.id).seconds
            diagnosed = diagnose(cluster, spec.id).seconds
            rows.append({"case": spec.id, "case_s": round(own, 2), "diagnosis_s": round(diagnosed, 2)})
            ratio = diagnosed / own
            print(f"{spec.id:<11} case {own:6.1f} s  diagnosis {diagnosed:6.1f} s  ratio {ratio:4.2f}", flush=True)
            (out / "cost.json").write_text(json.dumps(rows, indent=1))
    finally:
        cluster.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.diagnosis", description=__doc__)
    parser.add_argument("what", choices=("survey", "mutants", "known-defects", "cost"))
    parser.add_argument("--levels", default="L1,L2,L3", help="survey: the levels' cases (default L1,L2,L3)")
    parser.add_argument("--failing-only", action="store_true", help="survey: diagnose the failing cases only")
    parser.add_argument("--implementation", default="", help="survey: a spec (docs/judging.md#specs); '' is ours")
    parser.add_argument("--cases", default="", help="survey: only these case ids (comma-separated)")
    parser.add_argument("--only", default="", help="mutants: only these ids (comma-separated)")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--out", default="", help="folder of the JSON (default runs/diagnosis-<time>)")
    args = parser.parse_args(argv)
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    out = Path(args.out or f"runs/diagnosis-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    runs = {"survey": run_survey, "mutants": run_mutants, "known-defects": run_known_defects, "cost": run_cost}
    try:
        return runs[args.what](args, out)
    except ValueError as exc:  # an unknown level or case: said in one line, before any cluster starts
        print(f"diagnosis: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
