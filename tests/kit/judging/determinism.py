"""The plan's determinism rule: a run repeated in the same processes from the same seed is
bitwise identical (losses, grads, params), as L3 requires."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.kit.judging.checks import CaseContext
from tests.kit.judging.trace import active

Run = Callable[[CaseContext, bool], dict[str, torch.Tensor]]


def rerun_bitwise(ctx: CaseContext, run: Run, label: str = "") -> None:
    """Run ``run(ctx, compare)`` twice from seed 0 and compare what it returns (what this rank
    holds: losses, grads, params per step) with ``torch.equal``. The first run compares with its
    baseline and records its checks on ``ctx`` (``compare=True``); the rerun trains the model
    alone (``compare=False``: the baseline has been judged) on a scratch context of the same case
    and meshes, whose only verdict is the bitwise comparison."""
    prefix = f"{label} " if label else ""
    torch.manual_seed(0)
    first = run(ctx, True)
    tracer = active()
    if tracer is not None and tracer.mode == "noise":
        return  # the diagnosis's noise run measures the baseline alone: the rerun has none
    scratch = CaseContext(ctx.case, ctx.rank, ctx.world_size, _meshes=ctx._meshes)
    torch.manual_seed(0)
    second = run(scratch, False)
    ctx.require(f"{prefix}bitwise rerun: the run recorded tensors", bool(first), str(len(first)))
    unmatched = sorted(set(first) ^ set(second))
    ctx.equal(f"{prefix}bitwise rerun: tensors recorded by one run only", str(unmatched[:4]), "[]")
    differing = [name for name, tensor in first.items() if name in second and not torch.equal(tensor, second[name])]
    shown = ", ".join(differing[:3]) + (" ..." if len(differing) > 3 else "")
    ctx.true(
        f"{prefix}bitwise rerun: tensors differing of {len(first)} (loss, grads, params per step)",
        not differing,
        f"{len(differing)}: {shown}" if differing else "0",
        "0",
    )
