"""The case contract: a registry of plan cases, and the checks a case records on each rank.

A case is a function ``body(ctx: CaseContext)`` run on every rank of a fresh process group.
It builds the model under test and its baseline, then records checks through ``ctx``; it never
asserts by itself, so one run reports every check, and the kit turns the records of all ranks
into one verdict (``tests.kit.verdict``). Tolerances come from ``ctx.tol`` (the case's row of the
precision matrix) or ``tests.kit.tolerances.specific``; a case never writes a literal of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tests.kit.reference import full
from tests.kit.tolerances import Tolerance, tolerance

LEVELS = ("L0", "L1", "L2", "L3")
KIT_LEVEL = "KIT"  # the kit's own fault-injection cases: never part of a level or a sweep


@dataclass(frozen=True)
class Case:
    """One row of CASES.md: what runs, where, and which precision-matrix row judges it."""

    id: str
    name: str
    file: str
    world_size: int
    mesh_shape: tuple[int, ...]
    config: str
    body: Callable[[CaseContext], None]
    timeout: float = 120.0
    backend: str | None = None  # None: gloo on CPU, nccl where CUDA exists

    @property
    def level(self) -> str:
        return self.id.split("-")[0]

    @property
    def module(self) -> str:
        return self.body.__module__


REGISTRY: dict[str, Case] = {}


def case(
    id: str,
    name: str,
    file: str,
    world_size: int,
    mesh_shape: tuple[int, ...],
    config: str,
    timeout: float = 120.0,
) -> Callable[[Callable[[CaseContext], None]], Callable[[CaseContext], None]]:
    """Register ``body`` as the plan's case ``id`` (decorator)."""
    if id.split("-")[0] not in (*LEVELS, KIT_LEVEL):
        raise ValueError(f"case id {id!r} must start with one of {LEVELS}")
    tolerance(config)  # an unknown precision-matrix row fails at import, not mid-run
    if not file.startswith("_test_") or not file.endswith(".py"):
        raise ValueError(f"case {id}: file {file!r} is not one of the plan's _test_*.py files")

    def register(body: Callable[[CaseContext], None]) -> Callable[[CaseContext], None]:
        if body.__module__.rsplit(".", 1)[-1] != file[:-3]:
            raise ValueError(f"case {id} is registered from {body.__module__}, not from its plan file {file}")
        existing = REGISTRY.get(id)
        if existing is not None and existing.body.__qualname__ != body.__qualname__:
            raise ValueError(f"case id {id} registered twice ({existing.name}, {name})")
        REGISTRY[id] = Case(id, name, file, world_size, tuple(mesh_shape), config, body, timeout)
        return body

    return register


@dataclass
class Check:
    """One recorded check of one rank."""

    name: str
    rank: int
    measured: float | str
    reference: float | str
    tol: float | None
    passed: bool
    error: float | None = None  # |measured - reference| (max element-wise) where it applies


class PreconditionFailed(AssertionError):
    """A precondition that makes the case's checks meaningful does not hold: stop the case."""


def _as_number(value: Any) -> float | str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(full(value).detach().double().item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return str(value)


@dataclass
class CaseContext:
    """What a case body sees on one rank: its place in the run, its tolerances, its recorder."""

    case: Case | None  # None outside a registered case (StrictChecks)
    rank: int
    world_size: int
    checks: list[Check] = field(default_factory=list)
    # name -> {"ours": [...], "reference": [...]} per step, for the notebooks' plots
    series: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    kept: dict[str, Any] = field(default_factory=dict)

    @property
    def tol(self) -> Tolerance:
        """The case's row of the precision matrix."""
        return tolerance(self.case.config)

    # -- checks ----------------------------------------------------------------------
    def close(self, name: str, measured: Any, reference: Any, tol: float) -> bool:
        """Element-wise ``max |measured - reference| <= tol`` (tensors, DTensors or numbers)."""
        ours, ref = self._tensor(measured), self._tensor(reference)
        if ours.shape != ref.shape:
            return self._record(name, f"shape {tuple(ours.shape)}", f"shape {tuple(ref.shape)}", tol, False)
        error = (ours - ref).abs().max().item() if ours.numel() else 0.0
        passed = math.isfinite(error) and error <= tol
        shown_ours = _as_number(ours) if ours.numel() == 1 else f"tensor{tuple(ours.shape)}"
        shown_ref = _as_number(ref) if ref.numel() == 1 else f"tensor{tuple(ref.shape)}"
        return self._record(name, shown_ours, shown_ref, tol, passed, error)

    def equal(self, name: str, measured: Any, reference: Any) -> bool:
        """Exact equality: bitwise for tensors, ``==`` otherwise."""
        if isinstance(measured, torch.Tensor) or isinstance(reference, torch.Tensor):
            ours, ref = self._tensor(measured), self._tensor(reference)
            same = ours.shape == ref.shape and torch.equal(ours, ref)
            error = (ours - ref).abs().max().item() if same is False and ours.shape == ref.shape else 0.0
            return self._record(name, f"tensor{tuple(ours.shape)}", f"tensor{tuple(ref.shape)}", 0.0, same, error)
        return self._record(name, _as_number(measured), _as_number(reference), None, measured == reference)

    def true(self, name: str, condition: bool, measured: Any = "", reference: Any = "") -> bool:
        """A property that must hold (e.g. a dtype, a type, a count), with what was seen."""
        return self._record(name, _as_number(measured), _as_number(reference), None, bool(condition))

    def at_most(self, name: str, value: Any, bound: float, slack: float = 0.0) -> bool:
        """``value <= bound + slack`` (e.g. a clipped norm against max_norm)."""
        number = float(_as_number(value))
        return self._record(name, number, bound, slack, number <= bound + slack)

    def require(self, name: str, condition: bool, detail: str = "") -> None:
        """Record a precondition; if it fails the rest of the case would prove nothing: stop."""
        self._record(f"precondition: {name}", detail or str(bool(condition)), "True", None, bool(condition))
        if not condition:
            raise PreconditionFailed(f"{self.case.id} precondition failed on rank {self.rank}: {name} {detail}")

    def step(self, series: str, ours: Any, reference: Any) -> None:
        """Append one step of a curve (e.g. loss) for the plots; checks are separate."""
        entry = self.series.setdefault(series, {"ours": [], "reference": []})
        entry["ours"].append(float(_as_number(ours)))
        entry["reference"].append(float(_as_number(reference)))

    def keep(self, **objects: Any) -> None:
        """Leave objects on this engine for interactive inspection after the run."""
        self.kept.update(objects)

    # -- internals -----------------------------------------------------------------------
    @staticmethod
    def _tensor(value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return full(value).detach().double().cpu()
        return torch.tensor(value, dtype=torch.float64)

    def _record(self, name, measured, reference, tol, passed, error=None) -> bool:
        self.checks.append(Check(name, self.rank, measured, reference, tol, bool(passed), error))
        return bool(passed)

    def result(self) -> dict[str, Any]:
        """What travels back to the driver: plain data only."""
        return {"checks": [asdict(c) for c in self.checks], "series": self.series}


def run_on_rank(case_id: str, module: str) -> dict[str, Any]:
    """Engine side: run one registered case on this rank and return its records."""
    import importlib

    importlib.import_module(module)  # registers the case on this engine
    spec = REGISTRY[case_id]
    ctx = CaseContext(spec, dist.get_rank(), dist.get_world_size())
    torch.manual_seed(0)
    try:
        spec.body(ctx)
    except PreconditionFailed:
        pass  # recorded as a failed check: the verdict fails with the table of what ran
    finally:
        _leave_for_inspection(ctx)
    return ctx.result()


def _leave_for_inspection(ctx: CaseContext) -> None:
    try:
        from tests.kit.cluster import keep
    except ImportError:  # pragma: no cover - the cluster module is always there on engines
        return
    keep(case_ctx=ctx, **ctx.kept)


class StrictChecks(CaseContext):
    """The same checks outside a case (engine tests): the first one that fails raises at once."""

    def __init__(self) -> None:
        super().__init__(case=None, rank=dist.get_rank(), world_size=dist.get_world_size())

    def _record(self, name, measured, reference, tol, passed, error=None) -> bool:
        super()._record(name, measured, reference, tol, passed, error)
        if not passed:
            raise AssertionError(
                f"{name}: measured {measured}, reference {reference}, error {error}, tol {tol} (rank {self.rank})"
            )
        return True

    def worst_error(self, word: str) -> float:
        """The largest error among the checks whose name contains ``word``."""
        return max((c.error for c in self.checks if word in c.name and c.error is not None), default=0.0)
