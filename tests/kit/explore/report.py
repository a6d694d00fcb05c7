"""What the L4 notebook shows: run (explore, or replay one saved configuration), the deterministic
summary nbval compares, the table and the plot of what was drawn, the minimal failing configuration."""

from __future__ import annotations

import html
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.kit.explore.runner import (
    ExampleResult,
    Exploration,
    coverage_rows,
    diagnose_failing,
    explore,
    features_of,
    known_defects_of,
    load,
    run_config,
)
from tests.kit.runtime.cluster import RankCluster


@dataclass
class L4Run:
    """An exploration, or one replayed configuration."""

    exploration: Exploration | None
    replayed: ExampleResult | None
    seed: int
    max_world: int
    replay_diagnosis: Any = None  # a failing replay's diagnosis (an exploration holds its own)

    @property
    def passed(self) -> bool:
        if self.replayed is not None:
            return self.replayed.passed
        return self.exploration is not None and self.exploration.passed

    @property
    def diagnosis(self) -> Any:
        """Where the minimal (or replayed) failing configuration first departed, or None."""
        return self.replay_diagnosis if self.replayed is not None else getattr(self.exploration, "diagnosis", None)


def run(
    cluster: RankCluster,
    seed: int,
    examples: int,
    max_world: int,
    budget_s: float = 0.0,
    replay: str = "",
    cover: bool = True,
) -> L4Run:
    """Explore (the covering phase first where ``cover``; a line every tenth configuration and for
    every failure), or replay one."""
    if replay:
        result = run_config(cluster, load(replay))
        verdict = "PASS" if result.passed else "FAIL"
        print(f"replayed {replay}: {verdict} ({result.checks} checks, {result.seconds:.1f} s)")
        diagnosis = None if result.passed else diagnose_failing(cluster, result, replay)
        return L4Run(None, result, seed, max_world, diagnosis)
    seen = Counter()

    def on_example(result: ExampleResult, shrinking: bool) -> None:
        seen["shrinking" if shrinking else "drawn"] += 1
        if not result.passed and not shrinking:
            print(f"configuration {seen['drawn']} FAILS ({result.id}); shrinking it", flush=True)
        elif not shrinking and seen["drawn"] % 10 == 0:
            print(f"{seen['drawn']} configurations run (covering phase and {examples} drawn)", flush=True)

    avoid = tuple(known_defects_of(cluster))
    found = explore(
        cluster,
        features_of(cluster),
        examples=examples,
        seed=seed,
        max_world=max_world,
        budget_s=budget_s,
        on_example=on_example,
        avoid=avoid,
        cover=cover,
    )
    print(found.summary(), flush=True)
    return L4Run(found, None, seed, max_world)


def summary_text(done: L4Run) -> str:
    """The deterministic text of the run (what nbval compares): no timings, no measured values."""
    if done.replayed is not None:
        r = done.replayed
        return f"replayed configuration {r.id}: {'PASS' if r.passed else 'FAIL'}"
    found = done.exploration
    verdict = "no failure" if found.passed else f"FAIL, minimal configuration {found.minimal.id}"
    lines = [
        f"L4: {found.covering} covering + {found.drawn} drawn configurations (seed {done.seed}, world sizes "
        f"1..{done.max_world}): {verdict}",
        found.pairs_line(),
    ]
    lines += [f"  {option} = {value}: {n}" for option, value, n in coverage_rows(found.coverage)]
    return "\n".join(lines)


def coverage_html(done: L4Run) -> str:
    """What was drawn: per option, how many configurations took each value."""
    if done.exploration is None:
        return ""
    rows = coverage_rows(done.exploration.coverage)
    body = "".join(
        f"<tr><td>{html.escape(o)}</td><td>{html.escape(v)}</td><td style='text-align:right'>{n}</td></tr>"
        for o, v, n in rows
    )
    return f"<table><tr><th>option</th><th>value</th><th>configurations</th></tr>{body}</table>"


def plot_coverage(done: L4Run) -> Any:
    """Bars: how often each world size, mesh shape and feature came up."""
    if done.exploration is None or not done.exploration.coverage:
        print("nothing was drawn")
        return None
    import matplotlib.pyplot as plt

    rows = coverage_rows(done.exploration.coverage)
    panels = {
        "world size": [(v, n) for o, v, n in rows if o == "world size"],
        "mesh": [(v, n) for o, v, n in rows if o == "mesh"],
        "features used": [(o.removeprefix("uses "), n) for o, v, n in rows if o.startswith("uses ")],
    }
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), gridspec_kw={"width_ratios": [1, 2, 4]})
    for ax, (title, data) in zip(axes, panels.items(), strict=True):
        data = sorted(data, key=lambda d: (len(d[0]), d[0])) if title != "features used" else data
        ax.bar([d[0] for d in data], [d[1] for d in data], color="#1f77b4")
        ax.set_title(f"{title} ({done.exploration.drawn + done.exploration.covering} configurations)", fontsize=10)
        ax.tick_params(axis="x", rotation=60 if title != "world size" else 0, labelsize=8)
    fig.tight_layout()
    return fig


def failure_text(done: L4Run) -> str:
    """The minimal failing configuration as JSON and how to replay it, or that there is none."""
    result = done.replayed if done.replayed is not None else (done.exploration.minimal if done.exploration else None)
    if result is None or result.passed:
        return "no failing configuration"
    return (
        f"{result.failure}\n\nminimal configuration {result.id} ({result.config.size()}); replay it with\n"
        f"  python -m tests.kit.explore --replay {result.id}\n"
        + json.dumps(json.loads(result.config.to_json()), indent=1, sort_keys=True)
    )


def write_results(done: L4Run, path: str) -> None:
    """The run's summary as JSON (the sweep's index links the L4 page with it)."""
    if not path:
        return
    found = done.exploration
    data = {
        "passed": done.passed,
        "summary": summary_text(done).splitlines()[0],
        "drawn": found.drawn if found else 0,
        "covering": found.covering if found else 0,
        "pairs": found.pairs if found else {},
        "seconds": round(found.seconds, 1) if found else 0,
        "minimal": found.minimal.id if found and found.minimal else None,
        "diagnosis": done.diagnosis.line() if done.diagnosis is not None else None,
    }
    Path(path).write_text(json.dumps(data, indent=1))


def raise_if_failed(done: L4Run) -> None:
    """The last cell: fail the execution (papermill, nbval) when a configuration failed."""
    if not done.passed:
        raise AssertionError(failure_text(done))
    print("every configuration kept the API's promise")
