"""What a case body sees on one rank (``CaseContext``): its mesh, its tolerances, and the checks
it records. A body never asserts by itself: one run reports every check, and the driver turns
the records of all ranks into one verdict (``tests.kit.judging.verdict``).

Checks beyond what the plan and the API promise are recorded inside ``with ctx.extra(why):``;
they are reported beside the plan's checks, and our engine must pass both.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tests.kit.judging.case_spec import Case
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import Tolerance, tolerance
from tests.kit.runtime.devices import compute_device


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
    extra: str | None = None  # why the check goes beyond the plan (None: a plan check)
    # how it judges: "close" (error <= tol), "equal" (exact), "true" (a property), "at_most"
    # (value <= bound + slack) or "precondition"; the verdict text shows only what the kind
    # decides (tests.kit.front.notebook.verdict_text)
    kind: str = "true"


class PreconditionFailed(AssertionError):
    """A precondition that makes the case's checks meaningful does not hold: stop the case."""


def as_number(value: Any) -> float | str:
    """A float for numbers and one-element tensors (DTensors too), else the value's text."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(impl.full(value).detach().double().item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return str(value)


def raised(call: Callable[[], Any]) -> BaseException | None:
    """What ``call`` raised (None if nothing): a refusal is a measured value, not a crash."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - what it raised is the measured value
        return exc
    return None


def refused_with(ctx: CaseContext, name: str, call: Callable[[], Any], kind: type[BaseException]) -> None:
    """Check that ``call`` raises ``kind`` (the error the API promises for it)."""
    error = raised(call)
    ctx.true(f"{name}: refused with {kind.__name__}", isinstance(error, kind), repr(error)[:160], kind.__name__)


def device_type() -> str:
    """The device type this rank computes on (``tests.kit.runtime.devices``: its accelerator, or the CPU)."""
    return compute_device().type


@dataclass
class CaseContext:
    """What a case body sees on one rank: its place in the run, its mesh, tolerances and checks."""

    case: Case | None  # None outside a registered case (StrictChecks)
    rank: int
    world_size: int
    checks: list[Check] = field(default_factory=list)
    # name -> {"ours": [...], "reference": [...]} per step, for the notebooks' plots
    series: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # figure -> label -> series -> value: bar charts of what the plan names (``bar``)
    figures: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    kept: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # parts of the case that did not run, and why
    _meshes: dict[tuple, Any] = field(default_factory=dict, repr=False)
    _extra: str | None = field(default=None, repr=False)

    @property
    def tol(self) -> Tolerance:
        """The case's row of the precision matrix."""
        return tolerance(self.case.config)

    # -- the case's mesh ---------------------------------------------------------------------
    @property
    def mesh(self) -> Any:
        """The case's own mesh, of the shape and dim names it declares (built on first use)."""
        return self.mesh_of(**self.case.mesh)

    def mesh_of(self, **dims: int) -> Any:
        """A mesh with these named dims over the first ranks (e.g. ``mesh_of(dp=4)``), built once."""
        key = tuple(dims.items())
        if key not in self._meshes:
            self._meshes[key] = impl.init_mesh(device_type(), tuple(dims.values()), tuple(dims))
        return self._meshes[key]

    def submesh(self, *dim_names: str) -> Any:
        """The named dims of the case's mesh (this rank's slice), e.g. ``ctx.submesh("dp")``."""
        return impl.submesh(self.mesh, *dim_names)

    # -- checks ------------------------------------------------------------------------------
    def close(self, name: str, measured: Any, reference: Any, tol: float) -> bool:
        """Element-wise ``max |measured - reference| <= tol`` (tensors, sharded tensors or numbers)."""
        ours, ref = self._tensor(measured), self._tensor(reference)
        if ours.shape != ref.shape:
            return self._record(
                name, f"shape {tuple(ours.shape)}", f"shape {tuple(ref.shape)}", tol, False, kind="close"
            )
        error = (ours - ref).abs().max().item() if ours.numel() else 0.0
        passed = math.isfinite(error) and error <= tol
        shown_ours = as_number(ours) if ours.numel() == 1 else f"tensor{tuple(ours.shape)}"
        shown_ref = as_number(ref) if ref.numel() == 1 else f"tensor{tuple(ref.shape)}"
        return self._record(name, shown_ours, shown_ref, tol, passed, error, kind="close")

    def close_each(self, name: str, measured: Any, reference: Any, tol: float, allowed: torch.Tensor) -> bool:
        """Element-wise ``|measured - reference| <= max(tol, allowed)``: ``allowed`` a per-element
        bound the arithmetic itself sets (the registry's ``reduction_order``), the row's ``tol`` below it."""
        ours, ref = self._tensor(measured), self._tensor(reference)
        if ours.shape != ref.shape or allowed.shape != ref.shape:
            return self.close(name, measured, reference, tol)
        difference = (ours.double() - ref.double()).abs()
        bound = allowed.double().clamp(min=tol)
        error = difference.max().item() if ours.numel() else 0.0
        passed = math.isfinite(error) and bool((difference <= bound).all())
        shown = f"tensor{tuple(ours.shape)}"
        widest = bound.max().item() if ours.numel() else tol
        return self._record(name, shown, f"tensor{tuple(ref.shape)}", widest, passed, error, kind="close")

    def equal(self, name: str, measured: Any, reference: Any) -> bool:
        """Exact equality: bitwise for tensors, ``==`` otherwise."""
        if isinstance(measured, torch.Tensor) or isinstance(reference, torch.Tensor):
            ours, ref = self._tensor(measured), self._tensor(reference)
            same = ours.shape == ref.shape and torch.equal(ours, ref)
            error = (ours - ref).abs().max().item() if same is False and ours.shape == ref.shape else 0.0
            shapes = f"tensor{tuple(ours.shape)}", f"tensor{tuple(ref.shape)}"
            return self._record(name, *shapes, 0.0, same, error, kind="equal")
        return self._record(name, as_number(measured), as_number(reference), None, measured == reference, kind="equal")

    def true(self, name: str, condition: bool, measured: Any = "", reference: Any = "") -> bool:
        """A property that must hold (e.g. a dtype, a type, a count), with what was seen."""
        return self._record(name, as_number(measured), as_number(reference), None, bool(condition), kind="true")

    def at_most(self, name: str, value: Any, bound: float, slack: float = 0.0) -> bool:
        """``value <= bound + slack`` (e.g. a clipped norm against max_norm)."""
        number = float(as_number(value))
        return self._record(name, number, bound, slack, number <= bound + slack, kind="at_most")

    def require(self, name: str, condition: bool, detail: str = "") -> None:
        """Record a precondition; if it fails the rest of the case would prove nothing: stop."""
        self._record(
            f"precondition: {name}", detail or str(bool(condition)), "True", None, bool(condition), kind="precondition"
        )
        if not condition:
            case_id = self.case.id if self.case else "check"
            raise PreconditionFailed(f"{case_id} precondition failed on rank {self.rank}: {name} {detail}")

    @contextlib.contextmanager
    def extra(self, why: str) -> Iterator[None]:
        """Checks recorded inside go beyond the plan and the API (``why``); an exception inside is
        a failed extra check, not the end of the case (keep collectives symmetric in here)."""
        outer, self._extra = self._extra, why
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - reported as the extra check that failed
            self.true(f"{why}: raises nothing", False, repr(exc)[:200], "no exception")
        finally:
            self._extra = outer

    def run_part(self, label: str, needs: tuple[str, ...], body: Callable[[], None]) -> None:
        """Run one part of the case that needs plan features of its own. A part whose features the
        implementation does not declare is noted, not run: the case still judges the rest, and the
        verdict lists what did not run. A part it declares but refuses while running
        (``NotImplementedError``, an unknown keyword) is a failed check: declaring a feature is a
        promise, and a refusal must not leave the case passing."""
        missing = [n for n in needs if n not in impl.features]
        if missing:
            self.notes.append(f"{label}: not run, the implementation lacks {', '.join(missing)}")
            return
        try:
            body()
        except (NotImplementedError, TypeError) as exc:
            feature = impl.refusal(exc)
            if feature is None:
                raise
            declared = ", ".join(needs) or "fully_shard"
            self.true(f"{label}: runs (declared: {declared})", False, f"refused: {feature}", "runs")

    def step(self, series: str, ours: Any, reference: Any) -> None:
        """Append one step of a curve (e.g. loss) for the plots; checks are separate."""
        entry = self.series.setdefault(series, {"ours": [], "reference": []})
        entry["ours"].append(float(as_number(ours)))
        entry["reference"].append(float(as_number(reference)))

    def bar(self, figure: str, label: str, **values: Any) -> None:
        """One group of bars (``label``, a value per series) of a figure the plan names, drawn on the
        case's page beside its assertions (e.g. peak memory with and without AC); not a check."""
        group = self.figures.setdefault(figure, {}).setdefault(label, {})
        group.update({series: float(as_number(value)) for series, value in values.items()})

    def keep(self, **objects: Any) -> None:
        """Leave objects on this engine for interactive inspection after the run."""
        self.kept.update(objects)

    # -- internals -----------------------------------------------------------------------------
    @staticmethod
    def _tensor(value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return impl.full(value).detach().double().cpu()
        return torch.tensor(value, dtype=torch.float64)

    def _record(self, name, measured, reference, tol, passed, error=None, kind="true") -> bool:
        check = Check(name, self.rank, measured, reference, tol, bool(passed), error, self._extra, kind)
        self.checks.append(check)
        return bool(passed)

    def result(self) -> dict[str, Any]:
        """What travels back to the driver: plain data only."""
        return {
            "checks": [asdict(c) for c in self.checks],
            "series": self.series,
            "figures": self.figures,
            "notes": self.notes,
        }


class StrictChecks(CaseContext):
    """The same checks outside a case (engine tests): the first one that fails raises at once."""

    def __init__(self, config: str = "FSDP 1D fp32", **mesh_dims: int) -> None:
        """``config``: the precision-matrix row judging it (``.tol``); ``mesh_dims``: its mesh
        (``StrictChecks("HSDP 2D fp32", replicate=2, shard=2)``; default: 1-D over the world)."""
        tolerance(config)  # an unknown row fails here, before any collective
        super().__init__(case=None, rank=dist.get_rank(), world_size=dist.get_world_size())
        self.config = config
        self._mesh_dims = mesh_dims or {"dp": dist.get_world_size()}

    @property
    def tol(self) -> Tolerance:
        """The row of the precision matrix it was given."""
        return tolerance(self.config)

    @property
    def mesh(self) -> Any:
        """The test's mesh (``StrictChecks(dp=2)``; default: 1-D over the world)."""
        return self.mesh_of(**self._mesh_dims)

    def _record(self, name, measured, reference, tol, passed, error=None, kind="true") -> bool:
        super()._record(name, measured, reference, tol, passed, error, kind)
        if not passed:
            raise AssertionError(
                f"{name}: measured {measured}, reference {reference}, error {error}, tol {tol} (rank {self.rank})"
            )
        return True
