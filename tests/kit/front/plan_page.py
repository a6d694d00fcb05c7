"""The head of a case's page: the plan's assertions as a short table (assertion, checks, measured,
reference, tolerance, verdict), the figures the plan names (peak memory with and without AC, the
per-chunk losses, the per-expert grad norms), and the full check list folded below.

The level notebooks call these (``tests.kit.front.notebook``); the sweep's case pages are those notebooks
rendered, so a reader sees the plan first and the 500 rows of checks only when asked.
"""

from __future__ import annotations

import html
import math
from typing import Any

from tests.kit.judging.verdict import Verdict
from tests.kit.plan import Judged, judge

_COLOURS = {"pass": "#1a7f37", "FAIL": "#cf222e", "not run": "#57606a", "no check": "#9a6700"}


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1e}" if value else "0"


def _measured(row: Judged) -> str:
    if row.detail:
        return row.detail
    if row.status in ("not run", "no check"):
        return "-"
    if row.worst_error is not None:
        return f"worst error {_fmt(row.worst_error)}"
    if row.seen:
        return row.seen
    return f"{row.checks - row.failed} of {row.checks} hold"


def _tolerance(row: Judged) -> str:
    if row.assertion.judged_by != "checks" or not row.checks:
        return "-"
    if row.worst_error is None:
        return "exact" if row.kinds <= {"equal"} else "a property"
    return _fmt(row.tol) if row.tol else "exact (bitwise)"


def _row_html(row: Judged) -> str:
    a = row.assertion
    colour = _COLOURS.get(row.status, "#000000")
    checks = f"{row.checks} ({row.failed} failed)" if row.failed else str(row.checks or "-")
    reading = f"<div style='font-size:11px;color:#57606a'>reading: {html.escape(a.reading)}</div>" if a.reading else ""
    device = " <span style='font-size:11px;color:#57606a'>(needs an accelerator)</span>" if a.device else ""
    cells = (
        f"{html.escape(a.says)}{device}{reading}",
        checks,
        html.escape(_measured(row)),
        html.escape(a.baseline),
        html.escape(_tolerance(row)),
        f"<b style='color:{colour}'>{html.escape(row.status)}</b>",
    )
    style = "text-align:left;vertical-align:top"
    wide = {1, 2, 4, 5}  # counts, figures, tolerances and verdicts on one line
    return (
        "<tr>"
        + "".join(
            f"<td style='{style}{';white-space:nowrap' if i in wide else ''}'>{c}</td>" for i, c in enumerate(cells)
        )
        + "</tr>"
    )


def plan_table_html(verdict: Verdict) -> str:
    """The plan's assertions of one case, judged (empty for the kit's own L0 cases)."""
    rows = judge(verdict)
    if not rows:
        return ""
    head = "".join(
        f"<th style='text-align:left'>{h}</th>"
        for h in ("plan assertion", "checks", "measured", "reference", "tolerance", "verdict")
    )
    notes = "".join(f"<div style='font-size:12px'>note: {html.escape(n)}</div>" for n in verdict.notes)
    title = f"{verdict.case.id} {verdict.case.name}: {verdict.status}"
    return (
        f"<h4 class='hpkit-plan'>{html.escape(title)}</h4>{notes}<table class='hpkit-plan'><tr>{head}</tr>"
        + "".join(_row_html(r) for r in rows)
        + "</table>"
    )


def plans_html(verdicts: list[Verdict]) -> str:
    """Every case's plan table."""
    tables = [plan_table_html(v) for v in verdicts]
    return "".join(t for t in tables if t) or "<p>no plan assertions in these cases (the kit's own L0 coverage)</p>"


def folded_checks_html(verdicts: list[Verdict]) -> str:
    """Every check of every case, folded; the failing rows of a case that failed stay in view."""
    parts = []
    for verdict in verdicts:
        failing = [c for c in verdict.checks if not c.passed]
        summary = f"{verdict.case.id}: every check ({len(verdict.checks)} rows, {len(failing)} failing)"
        shown = verdict.html_rows(failing) if failing else ""
        parts.append(f"{shown}<details><summary>{html.escape(summary)}</summary>{verdict.html()}</details>")
    return "".join(parts)


def plot_figures(verdicts: list[Verdict]) -> Any:
    """The figures the cases drew (``ctx.bar``): grouped bars per label; a series named with "tol" is
    a dashed tolerance mark; a log scale where the values span more than a factor of 100."""
    import matplotlib.pyplot as plt

    panels = [(v, title, groups) for v in verdicts for title, groups in v.figures.items()]
    if not panels:
        print("no case of this run draws a figure")
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(9.5, 3.3 * len(panels)), squeeze=False)
    for ax, (verdict, title, groups) in zip(axes.flat, panels, strict=True):
        _bars(ax, groups)
        ax.set_title(f"{verdict.case.id}: {title}", fontsize=10)
    fig.tight_layout()
    return fig


def _bars(ax: Any, groups: dict[str, dict[str, float]]) -> None:
    labels = list(groups)
    series = list(dict.fromkeys(name for values in groups.values() for name in values))
    bars = [name for name in series if "tol" not in name]
    width = 0.8 / max(1, len(bars))
    values = [v for g in groups.values() for v in g.values() if v > 0]
    log = bool(values) and max(values) / min(values) > 100
    for i, name in enumerate(bars):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(labels))]
        heights = [groups[label].get(name, math.nan) for label in labels]
        if log:
            heights = [max(h, 1e-12) if not math.isnan(h) else h for h in heights]
        ax.bar(xs, heights, width=width, label=name)
    for name in series:
        if "tol" in name:
            for j, label in enumerate(labels):
                if name in groups[label]:
                    ax.hlines(groups[label][name], j - 0.45, j + 0.45, colors="#2ca02c", linestyles="dashed")
            ax.plot([], [], color="#2ca02c", linestyle="dashed", label=name)
    if log:
        ax.set_yscale("log")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(
        labels, rotation=30 if len(labels) > 4 else 0, ha="right" if len(labels) > 4 else "center", fontsize=8
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
