"""Where a case went wrong: its first divergence from the baseline, step, phase, module and ranks.

``diagnose(cluster, case_id)`` runs the case twice on the warm cluster, with a tracer on every
rank (``tests.kit.judging.trace``): a trace run records the model under test and its baseline
tensor by tensor, a noise run perturbs the baseline by one rounding at every module and measures
each tensor's noise. A tensor diverges where its error exceeds ``DIAGNOSIS.k`` times its noise
(``tests.kit.judging.tolerances``). The first divergence in execution order (steps in order; in a
step forward, backward, reduction, optimizer) is what went wrong first: everything before it agrees.

The trace stays on each engine as ``case_trace`` (``case_trace.tensor("step 0 forward layers.0 output")``
in ``%%px`` gives both sides' tensors), and the case's own context as ``case_ctx``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tests.kit.judging.case import Check, case_by_id, run_on_rank
from tests.kit.judging.crash import as_traced_crash, crash_record, merged, merged_structure, published, records_of
from tests.kit.judging.tolerances import DIAGNOSIS
from tests.kit.judging.trace import PHASES, Tracer, tracing
from tests.kit.runtime.cluster import RankCluster, RankFailure
from tests.kit.runtime.diagnosis import site_text

# exit status of the command line and ``Diagnosis.exit_status``
AGREES, DIVERGES, NOT_RUN = 0, 1, 2
DIAGNOSE_ENV = "HPKIT_DIAGNOSE"  # "0": a failure is not diagnosed (the mutants harness, which only counts kills)


def wanted() -> bool:
    """A failing case (or L4 configuration) is diagnosed unless ``HPKIT_DIAGNOSE=0``."""
    return os.environ.get(DIAGNOSE_ENV, "1") != "0"


_TRACE_RUN: dict[str, Tracer] = {}  # rank side: this engine's last trace run, which a noise run reads


def traced_run_on_rank(
    case_id: str, module: str, mode: str, seed: int = 0, earlier: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Engine side: run the case with a tracer (``mode`` "trace" or "noise"); its records and the
    trace's rows. A noise run reads this engine's trace run of the same case, or ``earlier``; a
    trace run given ``earlier=[]`` hands its state back for that."""
    return traced_on_rank(case_id, mode, seed, lambda: run_on_rank(case_id, module), earlier)


def traced_on_rank(
    name: str, mode: str, seed: int, run: Callable[[], dict[str, Any]], earlier: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Engine side: ``run()`` (a case, an L4 configuration) with a tracer; its records and the
    trace's rows. The trace run stays on the engine (``case_trace``) for the noise run of ``name``;
    on fresh engines (an implementation that needs them) the noise run is handed every rank's
    trace run instead (``earlier``, as the trace runs returned ``state``) and takes its own rank's."""

    from tests.kit.runtime.rank_runtime import keep, stack_path

    found = _TRACE_RUN.get(name)
    if mode == "noise" and earlier is not None:
        found = Tracer.from_state(earlier[dist.get_rank()])
    if mode == "noise" and found is None:
        raise RuntimeError(f"no trace run of {name} on this engine to measure the noise against")
    tracer = Tracer(mode, found if mode == "noise" else None, seed)
    try:
        with tracing(tracer), published(tracer.site, stack_path()):
            try:
                result = run()
            except Exception as error:  # where it raised travels with it (``tests.kit.judging.crash``)
                record = crash_record(tracer.step_label, tracer.site, error)
                record["diverged_before"] = _diverged_so_far(tracer)
                raise as_traced_crash(record, error) from error
    finally:
        keep(case_trace=found if mode == "noise" else tracer)
    answer = {"result": result, "rows": tracer.rows(), "structure": tracer.structure}
    if mode == "trace":
        _TRACE_RUN.clear()
        _TRACE_RUN[name] = tracer
        if earlier is not None:  # the noise run will be on fresh engines
            answer["state"] = tracer.state()
    return answer


def _diverged_so_far(tracer: Tracer) -> str | None:
    """A difference of structure this rank saw, else the first tensor it traced before a crash that left
    the baseline by more than the threshold floor (k roundings: a crash leaves no noise run), or None."""
    if tracer.structure is not None:
        return f"{tracer.structure['step']}, structure: {tracer.structure['error']}"
    try:
        rows = tracer.rows()
    except Exception:  # noqa: BLE001 - a trace cut short mid-tensor: nothing to say of what came before
        return None
    for row in rows:
        error = row.get("error")  # a noise run's rows hold the noise, no error
        if error is not None and (not math.isfinite(error) or error > threshold(None, row.get("dtype", ""))):
            return f"{row['step']} {row['phase']} {row['module'] or '(root)'} {row['tensor']}"
    return None


@dataclass
class Tensor:
    """One traced tensor: where, and per rank its error against the baseline and its threshold."""

    step: str
    phase: str
    module: str
    tensor: str
    errors: dict[int, float | None] = field(default_factory=dict)
    thresholds: dict[int, float] = field(default_factory=dict)

    @property
    def diverging_ranks(self) -> list[int]:
        """Ranks whose error exceeds its threshold (an error that is not finite always does)."""
        return sorted(
            rank
            for rank, error in self.errors.items()
            if error is not None and (not math.isfinite(error) or error > self.thresholds[rank])
        )

    def ratio(self, rank: int) -> float | None:
        """error / threshold on ``rank`` (None where the two sides could not be compared)."""
        error = self.errors.get(rank)
        return None if error is None else error / self.thresholds[rank]

    @property
    def where(self) -> str:
        return f"{self.step} {self.phase} {self.module or '(root)'} {self.tensor}"


@dataclass
class Diagnosis:
    """What ``diagnose`` found for one case on one implementation."""

    case: str
    implementation: str
    status: str = ""  # the case's verdict in the trace run (PASS, FAIL, ...)
    tensors: list[Tensor] = field(default_factory=list)  # execution order
    reason: str = ""  # why the case could not be diagnosed (exit status 2)
    seconds: float = 0.0
    first_failing_check: str = ""
    compared_failing: bool = False  # a failing plan check compares a value with the baseline's ("close")
    crash: dict[str, Any] | None = None  # where the traced run raised (``tests.kit.judging.crash.merged``)
    structure: dict[str, Any] | None = None  # params one side alone has (``crash.merged_structure``)
    hang: dict[int, dict[str, Any]] | None = None  # rank -> where its traced run was when found stuck
    before_training: bool = False  # a check failed and nothing was traced (L4: the layout after sharding)

    @property
    def first(self) -> Tensor | None:
        """The first diverging tensor in execution order."""
        return next((t for t in self.tensors if t.diverging_ranks), None)

    @property
    def exit_status(self) -> int:
        if self.reason:
            return NOT_RUN
        located = self.first is not None or self.crash is not None or self.structure or self.hang
        located = located or self.before_training
        return DIVERGES if located else AGREES

    def first_divergence(self) -> dict[str, Any] | None:
        """The first divergence as the JSON holds it: a difference of structure before any tensor."""
        if self.structure is not None:
            return {**self.structure, "error": None, "threshold": None, "difference": self.structure["error"]}
        return self._first_tensor()

    def _first_tensor(self) -> dict[str, Any] | None:
        first = self.first
        if first is None:
            return None
        ranks = first.diverging_ranks
        worst = max(ranks, key=lambda r: _sortable(first.ratio(r)))
        return {
            "step": first.step,
            "phase": first.phase,
            "module": first.module,
            "tensor": first.tensor,
            "ranks": ranks,
            "error": _finite(first.errors[worst]),
            "threshold": first.thresholds[worst],
        }

    def line(self) -> str:
        """One line: the first divergence and that everything before it agrees, or no divergence."""
        if self.reason:
            return f"{self.case}: not diagnosed: {self.reason}"
        if self.structure is not None:
            return self._structure_line()
        if self.crash is not None:
            return self._crash_line()
        if self.hang:
            return self._hang_line()
        if self.before_training:
            before = "failed before any traced tensor (the set-up's checks)"
            return f"{self.case}: {before}: first at {self.first_failing_check}"
        first = self._first_tensor()
        if first is None:
            compared = sum(1 for t in self.tensors if any(e is not None for e in t.errors.values()))
            line = f"{self.case}: no divergence: {compared} traced tensors, each within its threshold"
            if self.status == "FAIL":  # the failing check judges something the trace does not hold
                line += f"; the case fails outside them, first at {self.first_failing_check}"
            return line
        ranks = ",".join(map(str, first["ranks"]))
        error = "not finite (a grad missing, or NaN)" if first["error"] is None else f"{first['error']:.2e}"
        return (
            f"{self.case}: first divergence at {first['step']}, {first['phase']}, "
            f"{first['module'] or '(root)'} {first['tensor']}, rank{'s' if len(first['ranks']) > 1 else ''} {ranks}: "
            f"relative error {error} > threshold {first['threshold']:.2e}; everything before this agrees"
        )

    def _structure_line(self) -> str:
        """The difference of structure, then what the trace of the params both sides have found after it."""
        where = self.structure
        ranks = ",".join(map(str, where["ranks"]))
        head = f"{self.case}: first divergence at {where['step']}, structure: {where['error']} (ranks {ranks})"
        rest = Diagnosis(self.case, self.implementation, self.status, self.tensors, crash=self.crash)
        after = rest.line().removeprefix(f"{self.case}: ")
        return f"{head}; then, on the params both have: {after}"

    def _hang_line(self) -> str:
        """Where each stuck rank's traced run was (ranks not named finished, raised or died)."""
        places = "; ".join(f"rank {rank} in {site_text(site)}" for rank, site in sorted(self.hang.items()))
        return f"{self.case}: hung: {places}"

    def _crash_line(self) -> str:
        crash = self.crash
        ranks = ",".join(map(str, crash["ranks"]))
        if crash["phase"] == "structure":
            return f"{self.case}: first divergence at {crash['step']}, structure: {crash['error']} (ranks {ranks})"
        before = crash.get("diverged_before")
        agrees = f"a divergence first, at {before}" if before else "everything before this agrees"
        return (
            f"{self.case}: raised at {crash['step']}, {crash['phase']}, {crash['module'] or '(root)'} "
            f"{crash['tensor']} (rank{'s' if len(crash['ranks']) > 1 else ''} {ranks}): {crash['error']}; {agrees}"
        ).replace("  ", " ")

    def to_json(self) -> dict[str, Any]:
        modules = [
            {
                **{k: v for k, v in asdict(t).items() if k not in ("errors", "thresholds")},
                "ranks": [
                    {"rank": r, "error": _finite(t.errors[r]), "threshold": t.thresholds[r], "diverged": r in bad}
                    for r in sorted(t.errors)
                ],
            }
            for t in self.tensors
            for bad in [set(t.diverging_ranks)]
        ]
        return {
            "case": self.case,
            "implementation": self.implementation,
            "status": self.status,
            "first_divergence": self.first_divergence(),
            "crash": self.crash,
            "structure": self.structure,
            "hang": {str(rank): site for rank, site in sorted(self.hang.items())} if self.hang else None,
            "line": self.line(),
            "reason": self.reason or None,
            "seconds": round(self.seconds, 2),
            "first_failing_check": self.first_failing_check or None,
            "compared_failing": self.compared_failing,
            "modules": modules,
        }

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as out:
            json.dump(self.to_json(), out, indent=1)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _sortable(value: float | None) -> float:
    return -1.0 if value is None else (math.inf if math.isnan(value) else value)


def threshold(noise: float | None, dtype: str) -> float:
    """k times the tensor's noise, never below one rounding of its compute dtype; k roundings where
    the noise run could not perturb it (a module returning a named tuple)."""
    eps = torch.finfo(getattr(torch, dtype)).eps if dtype else torch.finfo(torch.float32).eps
    if noise is None:
        return DIAGNOSIS.k * eps
    return max(DIAGNOSIS.k * noise, eps)


def merge(trace_rows: list[list[dict[str, Any]]], noise_rows: list[list[dict[str, Any]]]) -> list[Tensor]:
    """Every rank's rows as one list of tensors in execution order: steps as rank 0 met them, then
    phase, then where the tensor first came among any rank's rows of that step and phase."""
    by_key: dict[tuple[str, str, str, str], Tensor] = {}
    position: dict[tuple[str, str, str, str], int] = {}
    steps: list[str] = []
    for rank, (rows, noises) in enumerate(zip(trace_rows, noise_rows, strict=True)):
        noise_of = {(n["step"], n["phase"], n["module"], n["tensor"]): n["noise"] for n in noises}
        for index, row in enumerate(rows):
            key = (row["step"], row["phase"], row["module"], row["tensor"])
            if row["step"] not in steps:
                steps.append(row["step"])
            tensor = by_key.setdefault(key, Tensor(*key))
            tensor.errors[rank] = row["error"]
            tensor.thresholds[rank] = threshold(noise_of.get(key), row.get("dtype", ""))
            position[key] = min(position.get(key, index), index)
    return sorted(
        by_key.values(),
        key=lambda t: (steps.index(t.step), PHASES.index(t.phase), position[(t.step, t.phase, t.module, t.tensor)]),
    )


def _first_failing(results: list[dict[str, Any]]) -> tuple[str, str]:
    """(the run's status, its first failing plan check) from every rank's records."""
    if any(r["result"].get("unsupported") for r in results):
        return "UNSUPPORTED", ""
    checks = sorted((Check(**c) for r in results for c in r["result"]["checks"]), key=lambda c: (c.name, c.rank))
    failed = [c for c in checks if not c.passed and c.extra is None]
    plan = [c for c in checks if c.extra is None]
    if not plan:
        return "UNSUPPORTED", ""
    if failed:
        # a comparison with the baseline first: what the trace can explain
        compared = [c for c in failed if c.kind == "close"] or failed
        return "FAIL", f"{compared[0].name} (rank {compared[0].rank})"
    return "PASS", ""


def diagnose(
    cluster: RankCluster, case_id: str, timeout: float | None = None, seed: int = 0, failing_only: bool = False
) -> Diagnosis:
    """Trace the case against its baseline on the cluster's implementation, measure each tensor's
    noise, and find the first divergence (collective over the case's ranks; two runs of the case).
    ``failing_only``: stop after the trace run where the case passed (its tensors, no thresholds)."""
    spec = case_by_id(case_id)

    fresh = needs_fresh_engines(cluster)
    states: list[dict[str, Any]] | None = None

    def run(mode: str) -> list[dict[str, Any]]:
        nonlocal states
        if fresh:  # its process-global state does not survive a second process group
            cluster.renew()
        timeout_s = timeout or spec.timeout
        earlier = ([] if fresh else None) if mode == "trace" else states
        args = (spec.id, spec.module, mode, seed, earlier)
        results = cluster.run(traced_run_on_rank, spec.world_size, *args, timeout=timeout_s, backend=spec.backend)
        if mode == "trace" and fresh:
            states = [r["state"] for r in results]
        return results

    return diagnose_runs(Diagnosis(spec.id, cluster.implementation or ""), run, failing_only)


def needs_fresh_engines(cluster: RankCluster) -> bool:
    """Whether the implementation on the cluster needs fresh engines for every run (its adapter says)."""
    return bool(cluster.view(0).apply_sync(_fresh_engines))


def _fresh_engines() -> bool:
    from tests.kit.judging.surface import impl

    return bool(impl.fresh_engines)


def diagnose_runs(
    diagnosis: Diagnosis, run: Callable[[str], list[dict[str, Any]]], failing_only: bool = False
) -> Diagnosis:
    """Fill ``diagnosis`` from ``run("trace")`` and ``run("noise")`` (every rank's ``traced_on_rank``
    answer), for a case or anything else the kit's training loops or ``traced`` trace."""
    started = time.monotonic()
    try:
        traced = run("trace")
        diagnosis.status, diagnosis.first_failing_check = _first_failing(traced)
        diagnosis.structure = merged_structure([r.get("structure") for r in traced])
        checks = [c for r in traced for c in r["result"]["checks"]]
        diagnosis.compared_failing = any(not c["passed"] and c["kind"] == "close" and not c["extra"] for c in checks)
        diagnosis.before_training = diagnosis.status == "FAIL" and not _traced_any(traced)
        if not diagnosis.before_training:  # else located by its failing check: no noise to measure
            diagnosis.reason = _why_not_diagnosed(diagnosis.status, traced, failing_only and not diagnosis.structure)
            if not diagnosis.reason:
                noise = run("noise")
                diagnosis.tensors = merge([r["rows"] for r in traced], [r["rows"] for r in noise])
    except RankFailure as failure:
        diagnosis.crash = merged(records_of(failure.raised))
        diagnosis.hang = failure.sites if diagnosis.crash is None and failure.timed_out else None
        if diagnosis.crash is None and not diagnosis.hang:  # a rank that died, set-up, an untraced hang
            diagnosis.reason = f"a run failed: {str(failure).splitlines()[0][:300]}"
        diagnosis.status = diagnosis.status or "ERROR"
    diagnosis.seconds = time.monotonic() - started
    return diagnosis


def _why_not_diagnosed(status: str, traced: list[dict[str, Any]], failing_only: bool) -> str:
    """Why the trace run ends the diagnosis ('' where the noise run follows)."""
    if status == "UNSUPPORTED":
        return "the implementation does not support the case"
    if not _traced_any(traced):
        return (
            "the case trains no model beside a baseline through the kit's training loops "
            "(tests.kit.workloads.training, or tests.kit.judging.trace.traced): nothing to compare tensor by tensor"
        )
    if failing_only and status == "PASS":
        return "the case passed; asked to diagnose failing cases only"
    return ""


def _traced_any(traced: list[dict[str, Any]]) -> bool:
    """Whether the trace run compared any tensor with its baseline (on any rank)."""
    return any(row["error"] is not None for result in traced for row in result["rows"])
