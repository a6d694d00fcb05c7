"""L4's failing configurations diagnosed: where the minimal one first departs from its promised
reference, step, phase, module and ranks (``tests.kit.judging.divergence``)."""

from __future__ import annotations

from typing import Any

from tests.kit.explore.oracle import run_example
from tests.kit.explore.space import Config
from tests.kit.judging.divergence import Diagnosis, diagnose_runs, traced_on_rank
from tests.kit.runtime.cluster import RankCluster

TIMEOUT_S = 180.0


def traced_example_on_rank(config_json: str, mode: str, seed: int = 0) -> dict[str, Any]:
    """Engine side: one configuration run with a tracer (``traced_on_rank``)."""
    return traced_on_rank(f"L4 {config_json}", mode, seed, lambda: run_example(config_json))


def diagnose_config(cluster: RankCluster, config: Config, name: str, timeout: float = TIMEOUT_S) -> Diagnosis:
    """Trace ``config`` (named ``name``: its id) against its promised reference, twice (trace, noise)."""

    def run(mode: str) -> list[dict[str, Any]]:
        return cluster.run(traced_example_on_rank, config.world, config.to_json(), mode, timeout=timeout)

    return diagnose_runs(Diagnosis(f"L4 {name}", cluster.implementation or ""), run)
