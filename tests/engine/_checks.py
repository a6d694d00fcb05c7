"""What the engine tests check beyond the kit: the collectives our engine issues per step for a
nested model (one per group fused, one per param unfused), by count, group size and dtype."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tests.kit.judging.checks import StrictChecks
from tests.kit.judging.recorder import CollectiveRecorder


def check_step_collectives(
    checks: StrictChecks,
    recorders: Sequence[CollectiveRecorder],
    mesh: dict[str, int],
    children: Sequence[int],
    root: int,
    fused: bool,
    gather_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
) -> None:
    """Per recorded step of a nested model: each child group (``children``: its params' count)
    gathered in forward and again in backward, the root's own params (``root`` of them) once (the
    root keeps them after forward); every group reduce-scattered once and, on a 2-D mesh, all-reduced
    once over the replicas. One collective per group when ``fused``, one per param when not.
    Gathers and reduce-scatters run over the last mesh dim in ``gather_dtype`` / ``reduce_dtype``,
    all-reduces over the others."""
    sizes = list(mesh.values())
    shard, replicas = sizes[-1], math.prod(sizes[:-1])

    def units(params: int) -> int:
        return min(params, 1) if fused else params

    gathers = 2 * sum(units(n) for n in children) + units(root)
    reductions = sum(units(n) for n in children) + units(root)
    want = {"all_gather": gathers, "reduce_scatter": reductions, "all_reduce": reductions if replicas > 1 else 0}
    group = {"all_gather": shard, "reduce_scatter": shard, "all_reduce": replicas}
    dtype = {"all_gather": gather_dtype, "reduce_scatter": reduce_dtype, "all_reduce": reduce_dtype}
    for step, rec in enumerate(recorders):
        for op, count in want.items():
            calls = rec.of(op)
            checks.equal(f"step {step} {op} count", len(calls), count)
            if calls:
                checks.equal(
                    f"step {step} {op} group sizes", str(sorted({c.group_size for c in calls})), str([group[op]])
                )
                checks.equal(
                    f"step {step} {op} dtypes", str(sorted({str(c.dtype) for c in calls})), str([str(dtype[op])])
                )
