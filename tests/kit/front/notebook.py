"""What the level notebooks call: select cases, join or start the cluster, run, show, plot, judge.

The notebooks stay thin (parameters, then one call per cell) so every level looks alike and
papermill, nbval and a person at Jupyter all see the same thing.

Text the notebooks print for nbval is deterministic except for measured errors, printed as
``err=<value>``, and texts a check saw, printed between ``⟨ ⟩``; ``notebooks/nbval_sanitize.cfg``
masks both, and other measured numbers of passing checks are not printed: the recorded output
matches while every check passes, and differs (``FAIL``) as soon as one does not.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tests.kit.judging.case import Case, Check, load_plan_cases
from tests.kit.judging.levels import LEVELS
from tests.kit.judging.surface import parse_spec
from tests.kit.judging.verdict import Verdict, judge_case
from tests.kit.plan import judge as judge_plan
from tests.kit.runtime.cluster import RankCluster


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


JOIN_ENV = "HPKIT_JOIN_CLUSTER"  # "PROFILE:CLUSTER_ID": the cluster a notebook joins when given none


def connect(cluster_id: str = "", profile: str = "", engines: int = 4, implementation: str = "") -> RankCluster:
    """Join the running cluster ``cluster_id`` (the sweep's), or start one of ``engines`` ranks
    running ``implementation`` (a spec of ``tests.kit.judging.surface``; '' = this repository's engine).

    Without ``cluster_id``, a notebook of our engine joins the cluster named by ``HPKIT_JOIN_CLUSTER``
    if it is set: ``make test`` sets it so the notebooks nbval runs share the session's cluster."""
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    spec = str(parse_spec(implementation)) if implementation else ""
    if not cluster_id and not spec and os.environ.get(JOIN_ENV):
        profile, _, cluster_id = os.environ[JOIN_ENV].rpartition(":")
    if cluster_id:
        return RankCluster.join(cluster_id, profile=profile or None, implementation=spec or None)
    return RankCluster.start(engines, profile=profile or None, implementation=spec or None)


def run_cases(
    cluster: RankCluster, cases: list[Case], timeout: float = 0, backend: str = "auto", isolate: bool = False
) -> list[Verdict]:
    """Run each case on the warm cluster (fresh engines each with ``isolate``), one summary line each;
    every verdict's ``origin`` carries its provenance (``tests.kit.front.evidence.provenance``).

    A joined cluster cannot renew engines it does not own: with ``isolate`` its owner must hand
    over fresh engines (the sweep renews them before each case's notebook) for one case."""
    from tests.kit.front.evidence import engines_fresh, provenance
    from tests.kit.judging.verdict_store import share

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
        share(verdict, cluster.implementation)  # this session's pytest case judges it (verdict_store)
        print(verdict.summary(), flush=True)
        verdicts.append(verdict)
    return verdicts


# -- what nbval checks -----------------------------------------------------------------------
# What a passing check saw but does not decide (a message, a type; a fraction inside a value an
# exact check agreed on) is shown between these marks; notebooks/nbval_sanitize.cfg masks it, as
# it masks ``err=``: the recorded text holds on any machine where the verdicts do.
SEEN_OPEN, SEEN_CLOSE = "\u27e8", "\u27e9"  # ⟨ ⟩
_DECIMAL = re.compile(r"(?<![\w.])-?\d+\.\d+(?:e[-+]?\d+)?")


def seen(value: float | str) -> str:
    """``value`` between the marks that nbval masks (the sanitizer's ``seen`` rule)."""
    return f"{SEEN_OPEN}{_plain(value)}{SEEN_CLOSE}"


def _plain(value: float | str | None) -> str:
    """A number as the checks record it (counts arrive as floats: 3.0 -> 3), text as it is."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def _decided(value: float | str) -> str:
    """A value an exact check decided: shown, but any fraction in it (a float, a decimal inside a
    text) between the masking marks, since its last digits are the machine's, not the check's."""
    if isinstance(value, float) and not value.is_integer():
        return seen(value)
    return _DECIMAL.sub(lambda m: seen(m.group(0)), _plain(value))


def _what_it_saw(group: list[Check]) -> str:
    """The part of a merged row after the name: the worst error (masked by nbval), or for checks
    without an error what the verdict depends on (a failing row: both values, masked)."""
    errors = [c.error for c in group if c.error is not None]
    if errors:
        return f"err={max(errors):.3e}"
    first = next((c for c in group if not c.passed), group[0])
    if not first.passed:  # the word FAIL tells; the values vary with the machine (the table has them)
        return f"{seen(_short(first.measured))} vs {seen(_short(first.reference))}"
    if first.kind == "equal":
        return f"= {_decided(first.measured)}"
    # A number a passing inequality saw, or the bound it was held to, is left out, whole or not: its
    # digits are the machine's and the verdict does not hang on them (the table shows them). A text
    # it saw (a message, a type) stays, masked; what it compared with ("> 0", an int) is its own.
    measured = "" if _number(first.measured) or not _plain(first.measured) else seen(first.measured)
    bound = first.kind == "at_most" or isinstance(first.reference, float)
    reference = "" if bound else _decided(first.reference)
    return f"{measured} vs {reference}".strip() if measured else reference


def _number(value: object) -> bool:
    """A measured number (not a flag): whole or not, its value is the machine's arithmetic."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fraction(value: object) -> bool:
    """A float with a fraction (a failing row shortens it)."""
    return isinstance(value, float) and not value.is_integer()


def _short(value: float | str) -> float | str:
    """A failing row's value, short: four significant digits of a fraction (the table has all)."""
    return float(f"{value:.4g}") if _fraction(value) else value


def _merged(checks: list[Check]) -> list[tuple[str, float | None, float | None, str, bool]]:
    """One row per check name: worst error over ranks, its tolerance, what the text shows, pass.
    Extra checks (beyond the plan) are named ``[extra] ...``."""
    rows: dict[str, list[Check]] = {}
    for check in checks:
        name = check.name if check.extra is None else f"[extra] {check.name}"
        rows.setdefault(name, []).append(check)
    merged = []
    for name, group in rows.items():
        errors = [c.error for c in group if c.error is not None]
        passed = all(c.passed for c in group)
        merged.append((name, max(errors) if errors else None, group[0].tol, _what_it_saw(group), passed))
    return merged


def verdict_text(verdict: Verdict) -> str:
    """The text of one verdict that nbval compares: the plan's assertions (pass / FAIL / not run /
    no check, and how many checks judge each), then per check pass/FAIL with its tolerance and what
    it decides; measured values it does not decide are masked (``err=``, ``⟨...⟩``) or left out."""
    head = f"{verdict.case.id} {verdict.case.name} [{verdict.case.world_size} ranks, {verdict.case.config}]"
    lines = [f"{head}: {verdict.status}"]
    if verdict.diagnosis is not None:  # where it went wrong first, its numbers masked
        lines.append("  diagnosis: " + _DECIMAL.sub(lambda number: seen(number.group(0)), verdict.diagnosis.line()))
    for row in judge_plan(verdict):
        count = f"[{row.checks} checks]" if row.assertion.judged_by == "checks" else f"[{row.assertion.judged_by}]"
        lines.append(f"  plan {row.status}: {row.assertion.says} {count}")
    if verdict.unsupported:
        lines.append("  unsupported: " + ", ".join(verdict.unsupported))
    if verdict.leak:
        lines.append("  " + verdict.leak)
    lines.extend(f"  note: {note}" for note in verdict.notes)
    if verdict.failure:
        lines.append("  run failed: " + verdict.failure.splitlines()[0])
    for name, _, tol, shown, passed in sorted(_merged(verdict.checks), key=lambda row: row[4]):  # FAIL first
        limit = f"tol={tol:g}" if tol is not None else ""
        lines.append("  " + "  ".join(part for part in ("pass" if passed else "FAIL", name, shown, limit) if part))
    return "\n".join(lines)


def diagnose(cluster: RankCluster, case_id: str, timeout: float = 0) -> Any:
    """Where a case goes wrong, on the warm cluster: its first divergence from the baseline, module
    by module and rank by rank, with the picture (``tests.kit.front.diagnose``); the trace stays on
    each engine as ``case_trace`` for ``%%px``."""
    from tests.kit.front.diagnose import notebook_diagnose

    return notebook_diagnose(cluster, case_id, timeout)


def show_diagnoses(verdicts: list[Verdict]) -> None:
    """Each failed case's diagnosis (its line and picture); nothing where every case passed."""
    from tests.kit.front.diagnose import show

    for verdict in verdicts:
        if verdict.diagnosis is not None:
            show(verdict.diagnosis)


def show_l4_failure(done: Any) -> None:
    """The L4 notebook's failing configuration (``explore.report.failure_text``) and, above it, its
    diagnosis: the line and the picture (where it raised, hung or first diverged), as for a case."""
    from tests.kit.explore.report import failure_text
    from tests.kit.front.diagnose import show

    if done.diagnosis is not None:
        show(done.diagnosis)
    print(failure_text(done))


def print_verdicts(verdicts: list[Verdict]) -> None:
    for verdict in verdicts:
        print(verdict_text(verdict))


def plans_html(verdicts: list[Verdict]) -> str:
    """The plan's assertions of every case, judged (``tests.kit.front.plan_page``)."""
    from tests.kit.front.plan_page import plans_html as tables

    return tables(verdicts)


def checks_html(verdicts: list[Verdict]) -> str:
    """Every check, folded; failing rows in view (``tests.kit.front.plan_page``)."""
    from tests.kit.front.plan_page import folded_checks_html

    return folded_checks_html(verdicts)


def plot_figures(verdicts: list[Verdict]) -> Any:
    """The figures the plan names, as the cases drew them (``tests.kit.front.plan_page``)."""
    from tests.kit.front.plan_page import plot_figures as bars

    return bars(verdicts)


def print_provenance(verdicts: list[Verdict]) -> None:
    """What each verdict ran on: implementation file @ commit (dirty), torch, backend, ranks, host,
    date, kit commit (``tests.kit.front.evidence.provenance_text``)."""
    from tests.kit.front.evidence import provenance_text

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
        "diagnosis": None if verdict.diagnosis is None else _diagnosis_summary(verdict.diagnosis),
    }


def _diagnosis_summary(diagnosis: Any) -> dict[str, Any]:
    """The diagnosis without its per-tensor rows (``nb.diagnose`` and ``python -m tests.kit.diagnose
    --json`` give those): what a sweep's index and page need."""
    return {k: v for k, v in diagnosis.to_json().items() if k != "modules"}


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
