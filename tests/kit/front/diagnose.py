"""The diagnosis where a user meets it: its picture, its notebook call and its command line.

``python -m tests.kit.diagnose CASE_ID [--implementation SPEC] [--json PATH] [--figure PATH]``
diagnoses one case on a cluster of its own and prints the first divergence; exit status 0 with no
divergence, 1 with one, 2 when the case could not be diagnosed (``tests.kit.judging.divergence``).
"""

from __future__ import annotations

import argparse
import html
import math
import os
import sys
import textwrap
from typing import Any

from tests.kit.judging.divergence import NOT_RUN, Diagnosis, diagnose
from tests.kit.judging.trace import PHASES
from tests.kit.runtime.cluster import RankCluster

PANELS = (("forward", ("forward",)), ("backward", ("backward",)), ("grads and params", ("reduction", "optimizer")))
DIAGNOSIS_CLASS = "hpkit-diagnosis"  # the line's block: a case page shows it once
_FLOOR = 1e-4  # ratios below this are drawn at it (an exact agreement is 0 on a log scale)


def _panel_tensors(diagnosis: Diagnosis, phases: tuple[str, ...]) -> list[Any]:
    """The panel's tensors: of the first divergence's step (or the first step), in execution order."""
    first = diagnosis.first
    step = first.step if first is not None else (diagnosis.tensors[0].step if diagnosis.tensors else "")
    return [t for t in diagnosis.tensors if t.step == step and t.phase in phases]


def figure(diagnosis: Diagnosis) -> Any:
    """error / threshold per traced tensor in execution order, one panel per phase, one line per
    rank; the threshold is the line at 1, the first divergence is marked with a red ring."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.2), sharey=True)
    ranks = sorted({r for t in diagnosis.tensors for r in t.errors})
    first = diagnosis.first
    for ax, (title, phases) in zip(axes, PANELS, strict=True):
        tensors = _panel_tensors(diagnosis, phases)
        for rank in ranks:  # later ranks drawn thinner, so a rank hidden under another still shows
            ys = [_drawn(t.ratio(rank)) for t in tensors]
            width = max(0.6, 2.4 - 0.5 * rank)
            ax.plot(range(len(tensors)), ys, marker="o", markersize=3 + width, linewidth=width, label=f"rank {rank}")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.axhspan(1.0, 1e7, color="#fde2e2", zorder=0)  # the diverging side of the threshold
        if first is not None and first in tensors:
            x = tensors.index(first)
            worst = max(_drawn(first.ratio(r)) for r in first.diverging_ranks)
            ax.scatter([x], [worst], s=220, facecolors="none", edgecolors="red", linewidths=2, zorder=5)
            ax.annotate("first divergence", (x, worst), textcoords="offset points", xytext=(10, -14), color="red")
        ax.set_yscale("log")
        ax.set_ylim(_FLOOR / 2, 1e7)
        ax.set_title(f"{title} ({tensors[0].step})" if tensors else f"{title} (nothing traced)")
        ax.set_xticks(range(len(tensors)))
        ax.set_xticklabels([_label(t) for t in tensors], rotation=90, fontsize=6)
        ax.set_xlabel("in execution order")
    axes[0].set_ylabel("error / threshold (diverges above 1)")
    axes[-1].legend(loc="upper right", fontsize=7)
    verdict = "no divergence" if first is None else f"first divergence: {first.phase} {first.module or '(root)'}"
    fig.suptitle(f"{diagnosis.case} on {diagnosis.implementation or 'ours'}: {verdict}")
    fig.tight_layout()
    return fig


def crash_figure(diagnosis: Diagnosis) -> Any:
    """Where a traced run raised: the phases of its step left to right, one row per rank, a red cross
    on each rank that raised, at its phase, labelled with the module and the error."""
    crash = diagnosis.crash
    label = f"{crash['module'] or '(root)'} {crash['tensor']}: {crash['error'][:100]}"
    places = {rank: (crash["phase"], label if rank == crash["ranks"][0] else "") for rank in crash["ranks"]}
    title = f"raised at {crash['step']}, {crash['phase']}"
    return _places_figure(diagnosis, places, title, marker="x")


def hang_figure(diagnosis: Diagnosis) -> Any:
    """Where each rank of a hung traced run was: its step's phases left to right, one row per stuck
    rank, a red square at the phase it was in, labelled with its module."""
    places = {
        rank: (site["phase"], f"{site['step']}: {site['module'] or '(root)'} {site['tensor']}")
        for rank, site in sorted(diagnosis.hang.items())
    }
    return _places_figure(diagnosis, places, "hung", marker="s")


def picture(diagnosis: Diagnosis) -> Any | None:
    """The diagnosis's picture: where it raised, where it hung, or the traced tensors (None: nothing)."""
    if diagnosis.crash is not None:
        return crash_figure(diagnosis)
    if diagnosis.hang:
        return hang_figure(diagnosis)
    return figure(diagnosis) if diagnosis.tensors else None


def _places_figure(diagnosis: Diagnosis, places: dict[int, tuple[str, str]], title: str, marker: str) -> Any:
    """Ranks (rows) over the phases (columns), each drawn up to the phase it is at, marked and labelled."""
    import matplotlib.pyplot as plt

    phases = ["set-up", *PHASES]
    ranks = sorted(places)
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.5 * max(2, len(ranks))))
    for rank in ranks:
        phase, label = places[rank]
        column = phases.index(phase) if phase in phases else 0
        ax.plot(range(column + 1), [rank] * (column + 1), color="#4a7", linewidth=3)  # what ran
        ax.scatter([column], [rank], marker=marker, s=160, color="red", linewidths=3, zorder=5)
        if label:  # wrapped, and written leftwards past the middle, so it stays inside the frame
            right = column > len(phases) / 2
            ax.annotate(
                textwrap.fill(label, 48),
                (column, rank),
                textcoords="offset points",
                xytext=(-8 if right else 8, 8),
                ha="right" if right else "left",
                color="red",
                fontsize=8,
            )
    ax.set_xticks(range(len(phases)))
    ax.set_xticklabels(phases)
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_xlim(-0.5, len(phases) - 0.5)
    ax.set_ylim(min(ranks) - 0.7, max(ranks) + 0.7)
    ax.set_title(f"{diagnosis.case} on {diagnosis.implementation or 'ours'}: {title}")
    fig.tight_layout()
    return fig


def _drawn(ratio: float | None) -> float:
    if ratio is None:
        return math.nan
    return 1e6 if not math.isfinite(ratio) else max(ratio, _FLOOR)


def _label(tensor: Any) -> str:
    where = tensor.module or "(root)"
    return where if tensor.phase in ("forward", "backward") else f"{where}.{tensor.tensor}"


def html_line(diagnosis: Diagnosis) -> str:
    """The diagnosis's line as a coloured banner (a notebook's or a case page's first line)."""
    colour = {0: "#e6f4ea", 1: "#fde2e2", NOT_RUN: "#fff4d6"}[diagnosis.exit_status]
    return (
        f"<div class='{DIAGNOSIS_CLASS}' style='background:{colour};padding:6px 10px;border-left:4px solid #444;"
        "font-family:monospace'>"
        f"<b>diagnosis</b>: {html.escape(diagnosis.line())}</div>"
    )


def diverging_table(diagnosis: Diagnosis, limit: int = 12) -> str:
    """The first diverging tensors as text, in execution order: where, ranks, error, threshold."""
    rows = [t for t in diagnosis.tensors if t.diverging_ranks][:limit]
    lines = []
    for t in rows:
        rank = t.diverging_ranks[0]
        lines.append(
            f"  {t.where}: ranks {','.join(map(str, t.diverging_ranks))}, "
            f"error {t.errors[rank]:.2e}, threshold {t.thresholds[rank]:.2e}"
        )
    return "\n".join(lines)


def show(diagnosis: Diagnosis) -> Diagnosis:
    """In a notebook: the line, the picture, the first diverging tensors."""
    from IPython.display import HTML, display

    display(HTML(html_line(diagnosis)))
    drawn = picture(diagnosis)
    if drawn is not None:
        display(drawn)
        import matplotlib.pyplot as plt

        plt.close("all")
    table = diverging_table(diagnosis)
    if table:
        print("diverging tensors, in execution order:\n" + table)
    return diagnosis


def notebook_diagnose(cluster: RankCluster, case_id: str, timeout: float = 0) -> Diagnosis:
    """``nb.diagnose(cluster, "L3-01")``: diagnose a case on the warm cluster and show it. The trace
    stays on each engine as ``case_trace`` (``%%px``: ``case_trace.tensor("step 0 forward layers.0 output")``)."""
    return show(diagnose(cluster, case_id, timeout=timeout or None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.kit.diagnose",
        description="Trace a case against its baseline, tensor by tensor, and name its first divergence.",
    )
    parser.add_argument("case", help="a case id, e.g. L3-01, or an L4 configuration's id (runs/l4/) or .json path")
    parser.add_argument("--implementation", default="", help="a spec (docs/judging.md#specs); '' is ours")
    parser.add_argument("--json", default="", metavar="PATH", help="write the diagnosis as JSON here")
    parser.add_argument("--figure", default="", metavar="PATH", help="write the picture here (PNG or SVG)")
    parser.add_argument("--engines", type=int, default=4, help="ranks of the cluster (default 4)")
    parser.add_argument("--timeout", type=float, default=0, help="bound of each run (default: the case's own)")
    args = parser.parse_args(argv)
    from tests.kit.judging.case import load_plan_cases
    from tests.kit.judging.surface import parse_spec

    load_plan_cases()
    try:
        run, world = _diagnosis_of(args.case, args.timeout)
        if world > args.engines:
            raise ValueError(f"{args.case} needs {world} ranks; --engines is {args.engines}")
        implementation = str(parse_spec(args.implementation)) if args.implementation else ""
        os.environ.setdefault("IPP_NONINTERACTIVE", "1")
        cluster = RankCluster.start(args.engines, implementation=implementation or None)
    except (KeyError, ValueError) as exc:
        print(f"diagnose: {exc}", file=sys.stderr)
        return NOT_RUN
    try:
        diagnosis = run(cluster)
    finally:
        cluster.stop()
    print(diagnosis.line())
    table = diverging_table(diagnosis)
    if table:
        print("diverging tensors, in execution order:\n" + table)
    if args.json:
        diagnosis.write_json(args.json)
    drawn = picture(diagnosis) if args.figure else None
    if drawn is not None:
        drawn.savefig(args.figure, dpi=110)
    return diagnosis.exit_status


def _diagnosis_of(name: str, timeout: float) -> tuple[Any, int]:
    """How to diagnose ``name`` on a cluster, and the ranks it needs: a plan case by its id, else a
    saved L4 configuration (its id or path); KeyError naming both when it is neither."""
    from tests.kit.explore.diagnosis import TIMEOUT_S, diagnose_config
    from tests.kit.explore.runner import load
    from tests.kit.judging.case import case_by_id

    try:
        spec = case_by_id(name)
    except KeyError:
        try:
            config = load(name)
        except (FileNotFoundError, ValueError, KeyError):
            raise KeyError(f"{name!r} is neither a case id (e.g. L3-01) nor a saved L4 configuration") from None
        return (lambda cluster: diagnose_config(cluster, config, name, timeout or TIMEOUT_S)), max(2, config.world)
    return (lambda cluster: diagnose(cluster, spec.id, timeout=timeout or None)), spec.world_size


__all__ = [
    "PHASES",
    "crash_figure",
    "figure",
    "hang_figure",
    "html_line",
    "main",
    "notebook_diagnose",
    "picture",
    "show",
]
