"""L4's reach over the mutants at a draw budget: ``python -m tools.mutants.reach --only 75,83 --seeds 0,1,2``.

For each mutant and seed, a scratch copy of the repository (or of ``--tree REV``, the whole tree at a
commit: the grammar and engine as they were) with the mutant applied runs L4's covering phase and
``--examples`` draws alone (no committed regression replayed, nothing shrunk) and records where it
first failed. It measures the grammar's own reach as it grows (issue 53's before / after table); CI's
reach, regressions included, is ``python -m tools.mutants --suite l4``. One JSON line per run in
``--out`` (appended, so a run stopped half-way keeps what it measured), and a table at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .catalogue import MutantError, by_id, select
from .runner import REPO_ROOT, apply_mutant, child_env, snapshot_tree, tree_files

DRIVER = Path(__file__).with_name("_reach_driver.py")
RUN_TIMEOUT_S = 1800  # one mutant at one seed: 300 draws on 4 ranks take 3-9 minutes on 2 cores


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.mutants.reach", description=__doc__.splitlines()[0])
    parser.add_argument("--only", required=True, help="mutant ids (03,07 or 10-12); 'none' is the unmutated tree")
    parser.add_argument("--seeds", default="0,1,2", help="Hypothesis seeds (default 0,1,2)")
    parser.add_argument("--examples", type=int, default=300, help="draws after the covering phase (default 300)")
    parser.add_argument("--tree", default="", help="a commit: run its whole tree instead of the working one")
    parser.add_argument("--out", default="runs/reach.jsonl", help="JSON lines, appended (default runs/reach.jsonl)")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error(f"--examples must be >= 1, got {args.examples}")
    return args


def mutant_ids(only: str) -> list[str]:
    """``--only``'s ids in the catalogue's order, ``none`` (the unmutated tree) first where named."""
    tokens = [token.strip() for token in only.split(",") if token.strip()]
    named = [token for token in tokens if token != "none"]
    return (["none"] if "none" in tokens else []) + ([m.id for m in select(",".join(named))] if named else [])


def snapshot(tree: str, dest: Path) -> Path:
    """The files a run copies: the working tree's, or the whole tree of commit ``tree``."""
    if not tree:
        return snapshot_tree(REPO_ROOT, tree_files(REPO_ROOT), dest)
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", tree], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def run_one(snap: Path, mutant_id: str, seed: int, examples: int) -> dict[str, Any]:
    """One mutant at one seed in a fresh copy of ``snap``: the driver's outcome, or its error."""
    root = Path(tempfile.mkdtemp(prefix=f"hpkit-reach-{mutant_id}-"))
    try:
        shutil.copytree(snap, root, dirs_exist_ok=True)
        if mutant_id != "none":
            apply_mutant(root, by_id()[mutant_id])
        shutil.copy(DRIVER, root / "_reach_driver.py")  # an older tree has none
        started = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, "_reach_driver.py", str(examples), str(seed)],
                cwd=root,
                env=child_env(root, f"reach-{mutant_id}-{seed}"),
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT_S,
            )
            line = next((x[6:] for x in done.stdout.splitlines() if x.startswith("REACH ")), None)
            row = json.loads(line) if line else {"error": (done.stderr or done.stdout)[-400:]}
        except subprocess.TimeoutExpired:
            row = {"error": f"no outcome within {RUN_TIMEOUT_S} s"}
        return {"mutant": mutant_id, "seed": seed, "wall": round(time.monotonic() - started), **row}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def cell(row: dict[str, Any]) -> str:
    """A table cell: where the run first failed (c: covering phase, d: draw), or what it ran clean."""
    if row.get("error"):
        return "error"
    if not row["killed"]:
        return f"survives {row['ran']}"
    at, covering = row["at"], row["covering"]
    return f"killed c{at}" if at <= covering else f"killed d{at - covering}"


def table(rows: list[dict[str, Any]], seeds: list[int]) -> str:
    """Mutants by seed, as markdown."""
    lines = ["| mutant | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---" * (len(seeds) + 1) + "|"]
    for mutant in dict.fromkeys(r["mutant"] for r in rows):
        runs = {r["seed"]: r for r in rows if r["mutant"] == mutant}
        lines.append(f"| {mutant} | " + " | ".join(cell(runs[s]) if s in runs else "-" for s in seeds) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        ids = mutant_ids(args.only)
    except MutantError as exc:
        print(f"error: --only: {exc}", file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpkit-reach-tree-") as tmp:
        snap = snapshot(args.tree, Path(tmp))
        for mutant_id in ids:
            for seed in seeds:
                row = run_one(snap, mutant_id, seed, args.examples)
                rows.append(row)
                with out.open("a", encoding="utf-8") as fh:
                    fh.write(json.dumps(row) + "\n")
                print(f"mutant {mutant_id} seed {seed}: {cell(row)} ({row['wall']} s)", flush=True)
    print(table(rows, seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
