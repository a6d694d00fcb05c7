"""``python -m tests.kit.explore``: draw configurations of the whole API, run each on a cluster of
torch ranks against what the API promises, shrink a failure to its smallest configuration.

    python -m tests.kit.explore --examples 300 --seed 0               # ours, world sizes 1..4
    python -m tests.kit.explore --examples 100 --max-world 8           # up to 8 ranks (8 engines)
    python -m tests.kit.explore --implementation torch --examples 300  # torch FSDP2 behind its adapter
    python -m tests.kit.explore --replay 1a2b3c4d5e                    # a saved failure (or a .json path)
    python -m tests.kit.explore --implementation upstream:PATH --without ignored_params   # past a known defect
    python -m tests.kit.explore --implementation torch --features mixed_precision,gradient_sync  # only these

Exits 1 when a configuration fails (its minimal form is printed as JSON and saved under
``runs/l4/``), 0 otherwise; ``--profile deep`` keeps Hypothesis' example database under
``runs/l4/db`` so a failure found once is tried first next time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from typing import Any

from tests.kit.explore.pairs import covering as covering_of
from tests.kit.explore.pairs import ship_covering
from tests.kit.explore.runner import (
    ExampleResult,
    coverage_rows,
    diagnose_failing,
    explore,
    features_of,
    known_defects_of,
    load,
    needs_fresh_engines,
    run_config,
)
from tests.kit.explore.survey import explore_all
from tests.kit.judging.surface import FEATURES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.kit.explore", description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100, help="configurations to draw (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed: the same draws everywhere (default 0)")
    parser.add_argument("--max-world", type=int, default=4, help="largest world size drawn, 1..8 (default 4)")
    parser.add_argument("--min-world", type=int, default=1, help="smallest world size drawn (default 1)")
    parser.add_argument("--implementation", default="", help="spec of the implementation under test ('' = ours)")
    parser.add_argument("--budget", type=float, default=0.0, help="stop drawing after this many seconds (0: none)")
    parser.add_argument("--profile", choices=("ci", "deep"), default="ci", help="Hypothesis settings profile")
    parser.add_argument("--replay", default="", help="run one saved configuration: its id or a .json path")
    parser.add_argument(
        "--without",
        default="",
        metavar="FEATURE[,FEATURE]",
        help=(
            "declared features not to draw (to explore past a known defect; "
            "names: FEATURES in tests/kit/judging/surface.py)"
        ),
    )
    parser.add_argument(
        "--features",
        default="",
        metavar="FEATURE[,FEATURE]",
        help="draw only these declared features (and fully_shard): to focus the draws on a few, as a pattern",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="run every drawn configuration past failures; list each distinct failure, each shrunk once",
    )
    parser.add_argument(
        "--shrink-budget", type=float, default=300.0, help="--keep-going: seconds of shrinking per failure"
    )
    parser.add_argument(
        "--with-known-defects",
        action="store_true",
        help="draw the feature combinations the implementation's adapter lists as known defects too",
    )
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="fresh engines for every configuration (slow: seconds each; on by itself for an implementation "
        "whose adapter says it needs them, as upstream's)",
    )
    parser.add_argument(
        "--no-cover",
        action="store_true",
        help="no covering phase (the configurations holding every pair of features, run before the draws)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--ship-cover",
        action="store_true",
        help="write the covering of a default run of ours (every feature, --max-world) into tests/kit/explore/cover/ "
        "(committed, so a fresh clone draws no pool) and exit; run it after changing the space",
    )
    return parser


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad arguments in one line, before any cluster starts."""
    if args.examples < 1:
        raise SystemExit(f"--examples must be >= 1, got {args.examples}")
    if not 1 <= args.max_world <= 8:
        raise SystemExit(f"--max-world must be in 1..8, got {args.max_world}")
    if not 1 <= args.min_world <= args.max_world:
        raise SystemExit(f"--min-world must be in 1..--max-world ({args.max_world}), got {args.min_world}")
    if args.budget < 0:
        raise SystemExit(f"--budget must be >= 0 seconds, got {args.budget}")
    for flag, names in (("--without", _without(args)), ("--features", _listed(args.features))):
        unknown = sorted(set(names) - (set(FEATURES) - {"fully_shard"}))
        if unknown:
            raise SystemExit(f"{flag}: no such feature {', '.join(unknown)} (known: {', '.join(sorted(FEATURES))})")
    if args.replay:
        try:
            load(args.replay)
        except (FileNotFoundError, ValueError, KeyError) as exc:
            raise SystemExit(f"--replay: {exc}") from None
    if args.implementation:
        from tests.kit.judging.surface import parse_spec

        try:
            parse_spec(args.implementation)
        except ValueError as exc:
            raise SystemExit(f"--implementation: {exc}") from None


def _without(args: argparse.Namespace) -> list[str]:
    return _listed(args.without)


def _listed(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _progress(total: int, quiet: bool):
    """A progress bar over the drawn configurations; shrinking runs shown in its postfix."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="config", disable=quiet, file=sys.stderr, dynamic_ncols=True)
    state = Counter()

    def on_example(result: ExampleResult, shrinking: bool) -> None:
        if shrinking:
            state["shrinking runs"] += 1
        else:
            bar.update(1)
            state["failed"] += 0 if result.passed else 1
        bar.set_postfix(world=result.config.world, **state, refresh=False)

    return bar, on_example


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _check_arguments(args)
    if args.ship_cover:
        path = ship_covering(frozenset(FEATURES), args.max_world)
        print(f"covering of a default run (world sizes 1..{args.max_world}) written to {path}")
        return 0
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    from tests.kit.runtime.cluster import RankCluster

    engines = load(args.replay).world if args.replay else args.max_world
    with RankCluster.start(max(2, engines), implementation=args.implementation or None, startup_timeout=180) as cluster:
        if args.replay:
            result = run_config(cluster, load(args.replay))
            print(f"replay {args.replay}: {'PASS' if result.passed else 'FAIL'} ({result.checks} checks)")
            if not result.passed:
                print(result.failure)
                diagnosis = diagnose_failing(cluster, result, args.replay)
                if diagnosis is not None:  # None with HPKIT_DIAGNOSE=0
                    print(f"diagnosis: {diagnosis.line()}")
            return 0 if result.passed else 1
        features = features_of(cluster) - set(_without(args))
        if args.features:  # only these (and fully_shard), where declared
            features &= set(_listed(args.features)) | {"fully_shard"}
        known = {} if args.with_known_defects else known_defects_of(cluster)
        isolate = args.isolate or needs_fresh_engines(cluster)
        started = time.monotonic()
        avoid = tuple(known)
        covering = 0
        if not args.no_cover:  # drawn (not run) here so the bar knows the total; explore reads the cache
            max_world = min(args.max_world, cluster.n_engines)
            covering = len(covering_of(features, max_world, min(args.min_world, max_world), avoid).configs)
        bar, on_example = _progress(args.examples + covering, args.quiet)
        draws = {  # what both modes draw and how they run it
            "examples": args.examples,
            "seed": args.seed,
            "max_world": args.max_world,
            "min_world": args.min_world,
            "isolate": isolate,
            "avoid": avoid,
            "on_example": on_example,
            "cover": not args.no_cover,
        }
        if args.keep_going:
            survey = explore_all(cluster, features, shrink_budget_s=args.shrink_budget, **draws)
            bar.close()
            return _report_survey(args, survey, features, known, started)
        found = explore(cluster, features, budget_s=args.budget, profile=args.profile, **draws)
        bar.close()
    print(found.summary())
    print(found.pairs_line())
    print(f"implementation {args.implementation or '(ours)'}; features drawn from: {', '.join(sorted(features))}")
    for names, why in sorted(known.items(), key=lambda item: sorted(item[0])):
        print(f"not drawn together (a known defect; --with-known-defects draws it): {' + '.join(sorted(names))}: {why}")
    print(_coverage_table(found.coverage, found.drawn + found.covering))
    if found.minimal is not None:
        print("minimal failing configuration (replay: python -m tests.kit.explore --replay " + found.minimal.id + "):")
        print(json.dumps(json.loads(found.minimal.config.to_json()), indent=1, sort_keys=True))
    print(f"{time.monotonic() - started:.0f} s")
    return 0 if found.passed else 1


def _report_survey(args: argparse.Namespace, survey: Any, features: frozenset[str], known: dict, started: float) -> int:
    """The keep-going run's page: each distinct failure, its count, its smallest configuration."""
    print(survey.summary())
    print(survey.exploration.pairs_line())
    print(f"implementation {args.implementation or '(ours)'}; features drawn from: {', '.join(sorted(features))}")
    for names, why in sorted(known.items(), key=lambda item: sorted(item[0])):
        print(f"not drawn together (a known defect; --with-known-defects draws it): {' + '.join(sorted(names))}: {why}")
    for number, defect in enumerate(survey.defects, 1):
        shown = defect.minimal or defect.first
        print(f"{number}. {defect.signature}\n   replay: python -m tests.kit.explore --replay {shown.id}")
        print("   " + shown.failure[:400].replace("\n", " "))
    print(f"{time.monotonic() - started:.0f} s")
    return 0 if survey.passed else 1


def _coverage_table(coverage: Counter, drawn: int) -> str:
    """What came up, as text: option, value, configurations."""
    rows = coverage_rows(coverage)
    width = max((len(f"{o} = {v}") for o, v, _ in rows), default=10)
    lines = [f"what the {drawn} configurations run (covering and drawn) used:"]
    lines += [f"  {f'{o} = {v}'.ljust(width)}  {n}" for o, v, n in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
