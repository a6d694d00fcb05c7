"""What the level notebooks call: select cases, join or start the cluster, run, show, plot, judge.

The notebooks stay thin (parameters, then one call per cell) so every level looks alike and
papermill, nbval and a person at Jupyter all see the same thing.

Text the notebooks print for nbval is deterministic except for measured errors, which are
printed as ``err=<value>`` and masked by ``notebooks/nbval_sanitize.cfg``: the recorded output
matches while every check passes, and differs (``FAIL``) as soon as one does not.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tests.kit.case import Case, Check, load_plan_cases
from tests.kit.cluster import RankCluster
from tests.kit.levels import LEVELS
from tests.kit.surface import parse_spec
from tests.kit.verdict import Verdict, judge_case


def select_cases(level: str, cases: str | Iterable[str] = "all") -> list[Case]:
    """The level's cases, all or those named (ids like ``L1-03`` or plan names), in id order."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {tuple(LEVELS)}, got {level!r}")
    of_level = sorted((c for c in load_plan_cases().values() if c.level == level), key=lambda c: _id_key(c.id))
    if cases == "all" or cases == "" or cases is None:
        return of_level
    wanted = [w.strip() for w in (cases.split(",") if isinstance(cases, str) else cases) if w.strip()]
    by_key = {c.id: c for c in of_level} | {c.name: c for c in of_level}
    unknown = [w for w in wanted if w not in by_key]
    if unknown:
        raise ValueError(f"unknown {level} case(s) {unknown}; known: {[c.id for c in of_level]}")
    return [by_key[w] for w in wanted]


def select(levels: list[str], cases: str) -> list[Case]:
    """The cases of ``levels``, all or those named in ``cases`` (ids or plan names, comma-separated)."""
    selected = [spec for level in levels for spec in select_cases(level)]
    if not cases:
        return selected
    wanted = [w.strip() for w in cases.split(",") if w.strip()]
    known = {c.id: c for c in selected} | {c.name: c for c in selected}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown} in levels {levels}")
    picked = {known[w].id for w in wanted}
    return [c for c in selected if c.id in picked]


def _id_key(case_id: str) -> tuple:
    """L1-02 < L1-10; L3-01 < L3-01-FSDP < L3-02; named cases (L0-TP) after the numbered ones."""
    rest = case_id.split("-", 1)[1]
    number, _, layout = rest.partition("-")
    return (0, int(number), layout) if number.isdigit() else (1, 0, rest)


def connect(cluster_id: str = "", profile: str = "", engines: int = 4, implementation: str = "") -> RankCluster:
    """Join the running cluster ``cluster_id`` (the sweep's), or start one of ``engines`` ranks
    running ``implementation`` (a spec of ``tests.kit.surface``; '' = this repository's engine)."""
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    spec = str(parse_spec(implementation)) if implementation else ""
    if cluster_id:
        return RankCluster.join(cluster_id, profile=profile or None, implementation=spec or None)
    return RankCluster.start(engines, profile=profile or None, implementation=spec or None)


def run_cases(
    cluster: RankCluster, cases: list[Case], timeout: float = 0, backend: str = "auto", isolate: bool = False
) -> list[Verdict]:
    """Run each case on the warm cluster (fresh engines each with ``isolate``), one summary line each;
    every verdict's ``origin`` carries its provenance (``tests.kit.evidence.provenance``).

    A joined cluster cannot renew engines it does not own: with ``isolate`` its owner must hand
    over fresh engines (the sweep renews them before each case's notebook) for one case."""
    from tests.kit.evidence import engines_fresh, provenance

    verdicts = []
    owner_renews = isolate and cluster.cluster is None
    if owner_renews and (len(cases) > 1 or not engines_fresh(cluster)):
        raise ValueError(
            "isolate on a joined cluster needs fresh engines for each case, which only the cluster's owner "
            "can give: run one case per notebook on engines its owner just renewed, or leave cluster_id empty"
        )
    for spec in cases:
        if spec.world_size > cluster.n_engines:
            raise ValueError(f"{spec.id} needs {spec.world_size} ranks; the cluster has {cluster.n_engines}")
        requested = None if backend == "auto" else backend
        verdict = judge_case(
            cluster,
            spec.id,
            isolate=isolate and not owner_renews,
            timeout=timeout or None,
            backend=requested,
        )
        verdict.origin = provenance(cluster, spec.world_size, requested or spec.backend, verdict.origin)
        print(verdict.summary(), flush=True)
        verdicts.append(verdict)
    return verdicts


# -- what nbval checks -----------------------------------------------------------------------
def _merged(checks: list[Check]) -> list[tuple[str, float | None, float | None, str, bool]]:
    """One row per check name: worst error over ranks, its tolerance, what was seen, pass.
    Extra checks (beyond the plan) are named ``[extra] ...``."""
    rows: dict[str, list[Check]] = {}
    for check in checks:
        name = check.name if check.extra is None else f"[extra] {check.name}"
        rows.setdefault(name, []).append(check)
    merged = []
    for name, group in rows.items():
        errors = [c.error for c in group if c.error is not None]
        seen = "" if errors else f"{group[0].measured} vs {group[0].reference}"
        merged.append((name, max(errors) if errors else None, group[0].tol, seen, all(c.passed for c in group)))
    return merged


def verdict_text(verdict: Verdict) -> str:
    """The deterministic text of one verdict: per check, pass/FAIL with its tolerance."""
    head = f"{verdict.case.id} {verdict.case.name} [{verdict.case.world_size} ranks, {verdict.case.config}]"
    lines = [f"{head}: {verdict.status}"]
    if verdict.unsupported:
        lines.append("  unsupported: " + ", ".join(verdict.unsupported))
    if verdict.leak:
        lines.append("  " + verdict.leak)
    lines.extend(f"  note: {note}" for note in verdict.notes)
    if verdict.failure:
        lines.append("  run failed: " + verdict.failure.splitlines()[0])
    for name, error, tol, seen, passed in sorted(_merged(verdict.checks), key=lambda row: row[4]):  # FAIL first
        measure = f"err={error:.3e}" if error is not None else seen
        limit = f"tol={tol:g}" if tol is not None else ""
        lines.append(f"  {'pass' if passed else 'FAIL'}  {name}  {measure}  {limit}".rstrip())
    return "\n".join(lines)


def print_verdicts(verdicts: list[Verdict]) -> None:
    for verdict in verdicts:
        print(verdict_text(verdict))


def verdicts_html(verdicts: list[Verdict]) -> str:
    """Every verdict as an HTML table, failing rows first."""
    return "".join(v.html() for v in verdicts)


def print_provenance(verdicts: list[Verdict]) -> None:
    """What each verdict ran on: implementation file @ commit (dirty), torch, backend, ranks, host,
    date, kit commit (``tests.kit.evidence.provenance_text``)."""
    from tests.kit.evidence import provenance_text

    for verdict in verdicts:
        print(f"{verdict.case.id}: {provenance_text(verdict.origin)}")


def raise_if_failed(verdicts: list[Verdict]) -> None:
    """The notebook's last cell: fail the execution (papermill, nbval, CI) if any case failed."""
    failed = [v for v in verdicts if not v.passed]
    if failed:
        raise AssertionError("failed cases:\n\n" + "\n\n".join(v.report() for v in failed))
    extras = [v for v in verdicts if not v.extras_passed]
    if extras:
        print("extra checks (beyond the plan) failed in: " + ", ".join(v.case.id for v in extras))
    print(f"all {len(verdicts)} case(s) passed")


# -- evidence for the sweep ------------------------------------------------------------------
def summarize(verdict: Verdict) -> dict[str, Any]:
    """Plain-data summary of a verdict: the worst loss and grad errors beside their tolerances."""

    def worst(word: str) -> tuple[float | None, float | None]:
        rows = [c for c in verdict.checks if word in c.name and c.error is not None]
        if not rows:
            return None, None

        # the check closest to (or furthest past) its tolerance; exact checks (tol 0) count
        # only when they missed
        def margin(c: Check) -> tuple[float, float]:
            ratio = c.error / c.tol if c.tol else (float("inf") if c.error else 0.0)
            return ratio, c.tol or 0.0

        top = max(rows, key=margin)
        return top.error, top.tol

    loss_err, loss_tol = worst("loss")
    grad_err, grad_tol = worst("grad")
    return {
        "id": verdict.case.id,
        "name": verdict.case.name,
        "level": verdict.case.level,
        "config": verdict.case.config,
        "world_size": verdict.case.world_size,
        "status": verdict.status,
        "passed": verdict.passed,
        "extras_passed": verdict.extras_passed,
        "extras": len(verdict.extra_checks),
        "checks": len(verdict.checks),
        "failed_checks": len(verdict.failed_checks),
        "first_failure": verdict.first_failure,
        "unsupported": verdict.unsupported,
        "leak": verdict.leak,
        "notes": verdict.notes,
        "origin": verdict.origin,
        "failure": verdict.failure,
        "loss_error": loss_err,
        "loss_tol": loss_tol,
        "grad_error": grad_err,
        "grad_tol": grad_tol,
        "seconds": round(verdict.seconds, 3),
    }


def write_results(verdicts: list[Verdict], path: str) -> None:
    """Write the verdict summaries as JSON (the sweep's index is built from these)."""
    if path:
        Path(path).write_text(json.dumps([summarize(v) for v in verdicts], indent=1))


# -- pictures ---------------------------------------------------------------------------------
def plot_losses(verdicts: list[Verdict]) -> Any:
    """Loss per step of each case (rank 0) against its baseline."""
    import matplotlib.pyplot as plt

    curves = [(v, v.series["loss"]) for v in verdicts if "loss" in v.series]
    if not curves:
        print("no case of this run records a loss curve")
        return None
    cols = min(3, len(curves))
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, (verdict, series) in zip(axes.flat, curves, strict=False):
        steps = range(len(series["ours"]))
        ax.plot(steps, series["reference"], "o-", color="#888888", lw=3, label="baseline")
        ax.plot(steps, series["ours"], "x--", color="#d62728" if not verdict.passed else "#1f77b4", label="ours")
        gap = max(abs(a - b) for a, b in zip(series["ours"], series["reference"], strict=True))
        ax.set_title(f"{verdict.case.id} {'PASS' if verdict.passed else 'FAIL'}  max |Δloss| {gap:.1e}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (rank 0)")
        ax.set_xticks(list(steps))
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(curves) :]:
        ax.axis("off")
    if len(curves) > 1:  # one axes needs no layout pass: the inline backend crops to what is drawn
        fig.tight_layout()
    return fig


def plot_errors(verdicts: list[Verdict]) -> Any:
    """Every check's worst error (log scale) against its tolerance: points above their bar fail."""
    import matplotlib.pyplot as plt

    rows = [
        (v.case.id, name, error, tol, passed)
        for v in verdicts
        for name, error, tol, _, passed in _merged(v.checks)
        if error is not None and tol
    ]
    if not rows:
        print("no numeric checks to plot")
        return None
    floor = 1e-12  # exact agreement (error 0) is drawn on the floor of the log axis
    fig, ax = plt.subplots(figsize=(min(14, 2 + 0.12 * len(rows)), 4.2))
    xs = range(len(rows))
    ax.scatter(
        xs,
        [max(r[2], floor) for r in rows],
        c=["#1f77b4" if r[4] else "#d62728" for r in rows],
        s=14,
        zorder=3,
        label="worst error over ranks",
    )
    ax.step(xs, [r[3] for r in rows], where="mid", color="#2ca02c", lw=1.5, label="tolerance")
    ax.set_yscale("log")
    ax.set_ylim(floor / 3, max(1.0, 3 * max(r[2] for r in rows)))
    ax.set_ylabel("abs error (log)")
    starts = {}
    for i, row in enumerate(rows):
        starts.setdefault(row[0], i)
    ax.set_xticks(list(starts.values()))
    ax.set_xticklabels(list(starts.keys()), rotation=45, ha="right", fontsize=8)
    for i in starts.values():
        ax.axvline(i - 0.5, color="#dddddd", lw=0.8, zorder=1)
    ax.set_title("per-check error against tolerance (exact agreement drawn at 1e-12)")
    # beside the axes: "best" would search every point for a free spot; the inline backend crops
    # the picture to what is drawn, so no layout pass is needed
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
