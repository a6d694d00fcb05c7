"""Run inside a mutated tree by ``tools.mutants.reach``: L4's covering phase and ``examples`` draws from
``seed`` on ours, no regression replayed, stopped at the first failure with nothing shrunk. Prints one
``REACH {json}`` line: killed, at (the configuration that first failed, counted from 1), covering, ran."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("IPP_NONINTERACTIVE", "1")
os.environ["HPKIT_DIAGNOSE"] = "0"  # a kill is a kill: no diagnosis run


def main(examples: int, seed: int) -> dict[str, Any]:
    """The run's outcome as a dict (also printed)."""
    from tests.kit.explore.runner import explore, features_of, known_defects_of
    from tests.kit.runtime.cluster import RankCluster

    seen = {"ran": 0, "at": None, "failure": ""}

    def on_example(result: Any, shrinking: bool) -> None:
        if shrinking:
            return
        seen["ran"] += 1
        if not result.passed and seen["at"] is None:
            seen["at"], seen["failure"] = seen["ran"], result.failure[:200].replace("\n", " ")

    started = time.monotonic()
    with RankCluster.start(4, startup_timeout=180) as cluster:
        found = explore(
            cluster,
            features_of(cluster),
            examples=examples,
            seed=seed,
            max_world=4,
            min_world=1,
            avoid=tuple(known_defects_of(cluster)),
            on_example=on_example,
            cover=True,
            shrink_budget_s=0.0,
        )
    return {"killed": not found.passed, "covering": found.covering, **seen, "s": round(time.monotonic() - started)}


if __name__ == "__main__":
    print("REACH " + json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))), flush=True)
