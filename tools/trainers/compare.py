"""A run's steps against torch FSDP2's: bitwise equal, within a tolerance, or where they first differ."""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from tests.kit.judging.tolerances import Tolerance

Step = dict  # {"step": int, "loss": float, "grad_norm": float}


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_steps(path: Path) -> list[Step]:
    """The training steps a run's record holds, in order (one JSON object a line)."""
    return [record for record in _records(path) if "step" in record]


def read_validations(path: Path) -> list[dict]:
    """The validations a run's record holds, in order: ``{"validation_at": step, "loss": x}``."""
    return [record for record in _records(path) if "validation_at" in record]


def validation_difference(reference: list[dict], validations: list[dict], tol: Tolerance | None) -> str:
    """Where a run's validation losses first differ from the reference's ('' where they agree:
    bitwise, or within ``tol``'s loss tolerance when one is given)."""
    got, want = [v["validation_at"] for v in validations], [v["validation_at"] for v in reference]
    if got != want:
        return f"validations after steps {got} against the reference's {want}"
    for ours, theirs in zip(validations, reference, strict=True):
        error = abs(ours["loss"] - theirs["loss"])
        if ours["loss"] != theirs["loss"] and (tol is None or error > tol.loss):
            return f"validation loss after step {ours['validation_at']} off by {error:.3g}"
    return ""


@dataclass(frozen=True)
class Comparison:
    """How a run's steps compare with the reference's."""

    verdict: str  # "BITWISE", "CLOSE", "DIFFERS", "INCOMPLETE"
    first_difference: int | None = None  # the first step whose loss or grad norm differs
    largest_error: float = 0.0
    detail: str = ""


def compare(reference: list[Step], steps: list[Step], tol: Tolerance | None) -> Comparison:
    """``steps`` against ``reference``: every step's loss and grad norm bitwise equal, else within
    ``tol`` (a precision-matrix row: its loss and grad tolerances; None: bitwise is owed); a run with
    fewer or other steps is INCOMPLETE."""
    if not reference or [s["step"] for s in steps] != [s["step"] for s in reference]:
        got, want = [s["step"] for s in steps], [s["step"] for s in reference]
        return Comparison("INCOMPLETE", detail=f"steps {got} against the reference's {want}")
    first, largest, within = None, 0.0, tol is not None
    for ours, theirs in zip(steps, reference, strict=True):
        for key in ("loss", "grad_norm"):
            error = abs(ours[key] - theirs[key])
            if ours[key] != theirs[key] and first is None:
                first = ours["step"]
            largest = max(largest, error)
            within = within and error <= (tol.loss if key == "loss" else tol.grad)
    if first is None:
        return Comparison("BITWISE")
    if within:
        return Comparison("CLOSE", first, largest, f"within loss {tol.loss:g} / grad {tol.grad:g} from step {first}")
    return Comparison("DIFFERS", first, largest, f"first at step {first}, largest error {largest:.3g}")


def owed(comparison: Comparison) -> bool:
    """Whether a comparison is a difference the implementation owes (anything but equal or close)."""
    return comparison.verdict not in ("BITWISE", "CLOSE")


def after(steps: list[Step], step: int) -> list[Step]:
    """The steps past ``step`` (what a run resumed from step ``step``'s checkpoint records)."""
    return [s for s in steps if s["step"] > step]


@dataclass(frozen=True)
class Cost:
    """What a run cost on its recording rank: its median step time (past the first step) and peak RSS."""

    step_seconds: float | None
    peak_rss_mib: float | None


def cost(steps: list[Step]) -> Cost:
    """A run's cost from its record's times and RSS (None where the record has too few steps)."""
    times = [s["time"] for s in steps if "time" in s]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    rss = [s["rss_mib"] for s in steps if "rss_mib" in s]
    return Cost(statistics.median(gaps) if gaps else None, max(rss) if rss else None)


ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?((?:\w+\.)*\w*(?:Error|Exception)\b.*)$")


def first_error(log: str) -> str:
    """The first exception a run's ranks raised, as its log shows it ('' where none did)."""
    for line in log.splitlines():
        found = ERROR_LINE.match(line.strip())
        if found and "ChildFailedError" not in found.group(1):
            return found.group(1)
    return ""
