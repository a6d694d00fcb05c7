"""A run's steps against torch FSDP2's: bitwise equal, within a tolerance, or where they first differ."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

Step = dict  # {"step": int, "loss": float, "grad_norm": float}


def read_steps(path: Path) -> list[Step]:
    """The steps a rank-0 record holds, in order (one JSON object a line)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Comparison:
    """How a run's steps compare with the reference's."""

    verdict: str  # "BITWISE", "CLOSE", "DIFFERS", "INCOMPLETE"
    first_difference: int | None = None  # the first step whose loss or grad norm differs
    largest_error: float = 0.0
    detail: str = ""


def compare(reference: list[Step], steps: list[Step], tol: float | None) -> Comparison:
    """``steps`` against ``reference``: every step's loss and grad norm bitwise equal, else within
    ``tol`` (None: bitwise is owed); a run with fewer or other steps is INCOMPLETE."""
    if not reference or [s["step"] for s in steps] != [s["step"] for s in reference]:
        got, want = [s["step"] for s in steps], [s["step"] for s in reference]
        return Comparison("INCOMPLETE", detail=f"steps {got} against the reference's {want}")
    first, largest = None, 0.0
    for ours, theirs in zip(steps, reference, strict=True):
        for key in ("loss", "grad_norm"):
            error = abs(ours[key] - theirs[key])
            if ours[key] != theirs[key] and first is None:
                first = ours["step"]
            largest = max(largest, error)
    if first is None:
        return Comparison("BITWISE")
    if tol is not None and largest <= tol:
        return Comparison("CLOSE", first, largest, f"within {tol:g} from step {first}")
    return Comparison("DIFFERS", first, largest, f"first at step {first}, largest error {largest:.3g}")


def owed(comparison: Comparison) -> bool:
    """Whether a comparison is a difference the implementation owes (anything but equal or close)."""
    return comparison.verdict not in ("BITWISE", "CLOSE")
