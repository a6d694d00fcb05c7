"""Regenerate the case catalogue in docs/cases.md from the case registry, and docs/plan_fidelity.md
from the plan's assertions (``tests/kit/plan/``).

    python docs/catalogue.py           # rewrite the generated part of docs/cases.md, and plan_fidelity.md
    python docs/catalogue.py --check   # exit 1 if either is not what this would write

Only the text between the two marker comments is generated: the precision matrix and the
case-specific tolerances (``tests/kit/judging/tolerances.py``), the features a case may need
(``tests/kit/judging/surface.py``), and one table per level with every case registered by the plan
files (``tests.kit.judging.case.load_plan_cases``): id, plan name, ranks, mesh, precision-matrix row,
needs, timeout, plan file, and the first sentence of the case's docstring (with the next ones
while it is shorter than 60 characters). Everything outside the markers is written by hand.
``tests/test_docs.py`` fails when the file is stale.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES_MD = ROOT / "docs" / "cases.md"
PLAN_DIR = ROOT / "tests" / "torch" / "fully_shard"
TOLERANCES = ROOT / "tests" / "kit" / "judging" / "tolerances.py"
BEGIN = "<!-- BEGIN GENERATED: python docs/catalogue.py writes everything down to END GENERATED -->"
END = "<!-- END GENERATED -->"


def _kit() -> tuple[Any, Any, Any, Any]:
    """The registry and its tables (imported here: the repository root must be on sys.path first)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.kit.judging import case, levels, surface, tolerances

    return case, levels, surface, tolerances


def tol_text(value: float) -> str:
    """A tolerance as the plan writes it: ``1e-5``, ``1e-3``, ``2.5e-4``."""
    mantissa, exponent = f"{value:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


SUMMARY_MIN = 60  # a first sentence shorter than this (a set-up, not a check) takes the next one too


def first_sentence(body: Any, about: str = "") -> str:
    """The first sentence of a case body's docstring, or of ``about`` where the case says what it is
    (another layout's): up to a '.' followed by a space, or the end, with the sentences after it
    while the summary is shorter than ``SUMMARY_MIN`` characters."""
    doc = " ".join((about or inspect.getdoc(body) or "").split())
    sentences = re.findall(r".*?[.!?](?=\s|$)|.+$", doc)
    summary = ""
    for sentence in sentences:
        summary = f"{summary} {sentence.strip()}".strip()
        if len(summary) >= SUMMARY_MIN:
            break
    return summary


def case_order(case_id: str) -> tuple[int, int, str]:
    """L0-02 before L0-10, L3-01 before L3-01-FSDP before L3-02, named ids (L0-TP) last."""
    rest = case_id.split("-", 1)[1]
    number, _, variant = rest.partition("-")
    return (0, int(number), variant) if number.isdigit() else (1, 0, rest)


def mesh_text(mesh: dict[str, int]) -> str:
    """``dp 2`` or ``replicate 2 x shard 2``."""
    return " x ".join(f"{name} {size}" for name, size in mesh.items())


def plan_link(file: str) -> str:
    """A link, relative to docs/, to a plan file under tests/torch/fully_shard/."""
    return f"[{file}](../tests/torch/fully_shard/{file})"


def registry_comments() -> dict[str, str]:
    """Trailing comments of the registry's rows (``"name": value,  # comment``) by row name."""
    found = {}
    for line in TOLERANCES.read_text().splitlines():
        match = re.match(r'\s*"([^"]+)":\s*[^#]+#\s*(.+)$', line)
        if match:
            found[match.group(1)] = match.group(2).strip()
    return found


def specific_users() -> dict[str, list[str]]:
    """Plan files that call ``specific("name")``, by name."""
    users: dict[str, list[str]] = {}
    for path in sorted(PLAN_DIR.glob("_test_*.py")):
        for name in re.findall(r'specific\(\s*"([^"]+)"\s*\)', path.read_text()):
            if path.name not in users.setdefault(name, []):
                users[name].append(path.name)
    return users


def generated() -> str:
    """The generated part of docs/cases.md, markers excluded."""
    case_mod, levels_mod, surface, tolerances = _kit()
    levels = levels_mod.LEVELS
    cases = [c for c in case_mod.load_plan_cases().values() if c.level in levels]
    cases.sort(key=lambda c: (list(levels).index(c.level), case_order(c.id)))
    out: list[str] = []

    out += [
        "## Precision matrix",
        "",
        "From `tests/kit/judging/tolerances.py` (`PRECISION_MATRIX`). Absolute tolerances: a check passes when",
        "`|measured - reference| <= tol`. Each case names one row (its `config`); the loss checks use the",
        "row's loss tolerance, grad norms and element-wise grads and params its grad tolerance.",
        "",
        "| configuration | loss tol | grad tol | cases judged by this row |",
        "|---|---|---|---|",
    ]
    for config, tol in tolerances.PRECISION_MATRIX.items():
        ids = ", ".join(c.id for c in cases if c.config == config) or "(none)"
        out.append(f"| {config} | {tol_text(tol.loss)} | {tol_text(tol.grad)} | {ids} |")

    comments, users = registry_comments(), specific_users()
    out += [
        "",
        "Case-specific tolerances (`SPECIFIC`, read with `specific(name)`):",
        "",
        "| name | tol | what it bounds | plan files using it |",
        "|---|---|---|---|",
    ]
    for name, tol in tolerances.SPECIFIC.items():
        files = ", ".join(plan_link(f) for f in users.get(name, [])) or "(none)"
        out.append(f"| {name} | {tol_text(tol)} | {cell(comments.get(name, ''))} | {files} |")

    out += [
        "",
        "A half-precision reduction's order (`reduction_order`, `ROUNDINGS_PER_ADDITION` ="
        f" {tolerances.ROUNDINGS_PER_ADDITION:g}): a grad reduced in bf16 or fp16",
        "is defined only up to the order of its sum, so L4 holds it to its row or to that many roundings of",
        "the sum of its terms' magnitudes per addition, whichever is wider (element-wise; the row decides",
        "wherever the sum is small). It bounds an order, measured on gloo; it is no looser row.",
        "",
        "## Features a case may need",
        "",
        "From `tests/kit/judging/surface.py` (`FEATURES`). Every case needs `fully_shard`; the `needs` column",
        "below lists the rest. An implementation whose adapter does not declare a feature gets",
        "UNSUPPORTED, naming it, for every case that needs it.",
        "",
        "| feature | meaning |",
        "|---|---|",
    ]
    out += [f"| `{name}` | {cell(text)} |" for name, text in surface.FEATURES.items()]

    for level in levels.values():
        of_level = [c for c in cases if c.level == level.id]
        out += [
            "",
            f"## {level.title}",
            "",
            f"Scope: {cell(level.scope)}.",
            "",
            f"Notebook: [{level.notebook_file}](../notebooks/{level.notebook_file}); {len(of_level)} cases.",
            "",
            "| id | plan name | ranks | mesh | config | needs | timeout | plan file | checks |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in of_level:
            needs = ", ".join(f"`{n}`" for n in c.needs if n != "fully_shard") or "-"
            out.append(
                f"| {c.id} | `{c.name}` | {c.world_size} | {mesh_text(c.mesh)} | {c.config} | {needs} "
                f"| {c.timeout:g} s | `{c.plan_file}`: {plan_link(c.file)} | {cell(first_sentence(c.body, c.about))} |"
            )
    out.append("")
    out.append(f"{len(cases)} cases in all.")
    return "\n".join(out)


FIDELITY_MD = ROOT / "docs" / "plan_fidelity.md"


def fidelity() -> str:
    """docs/plan_fidelity.md, whole: every plan assertion of L1-L3 (``tests/kit/plan/``), the checks
    that judge it, the baseline, the tolerance row, and where the kit reads the plan differently."""
    case_mod, _, _, tolerances = _kit()
    from tests.kit import plan

    cases = case_mod.load_plan_cases()
    out = [
        "# Plan fidelity",
        "",
        "<!-- written by python docs/catalogue.py from tests/kit/plan/; tests/test_docs.py fails when stale -->",
        "",
        "Every assertion of the plan's L1-L3 rows (the plan, v1.1: the core assertions of each case and the",
        "L3 assertion specs), the checks that judge it, what they compare with, the tolerance, and where",
        "the kit reads the plan differently, with the reason. The checks column is a regular expression",
        "searched in the names of the checks a case records (`tests.kit.plan.Assertion`);",
        "`tests/kit_tests/test_plan_fidelity.py` runs every case and fails when an assertion is judged by no",
        "check. A case's other layouts (`-FSDP`, `-HSDP`) are judged by the same rows. Each case page of",
        "the sweep, and each level notebook, opens with this table filled with the measured errors.",
        "",
        "Tolerance: the case's precision-matrix row (loss / grad), or the registry's case-specific",
        "tolerance it names; `exact` for equalities (bitwise for tensors), `property` for checks that",
        "hold or not; run properties (`timeout`, `clean run`) are judged by how the run ended.",
    ]
    for base, assertions in plan.PLAN.items():
        spec = cases[base]
        layouts = sorted(c.id for c in cases.values() if c.id != base and plan.base_id(c.id) == base)
        also = f" (and {', '.join(layouts)})" if layouts else ""
        row = tolerances.tolerance(spec.config)
        out += [
            "",
            f"## {base} `{spec.name}`{also}",
            "",
            f"{spec.world_size} ranks, mesh {mesh_text(spec.mesh)}; precision-matrix row {spec.config} "
            f"(loss {tol_text(row.loss)}, grad {tol_text(row.grad)}).",
            "",
            "| plan assertion | judged by | baseline | tolerance | kit's reading |",
            "|---|---|---|---|---|",
        ]
        for a in assertions:
            judged = f"`{a.checks}`" if a.checks else a.judged_by
            if a.device:
                judged += " (on an accelerator; noted as not run on a CPU-only host)"
            if a.tol == "row":
                tol = f"row: {tol_text(row.loss)} / {tol_text(row.grad)}"
            elif a.tol in tolerances.SPECIFIC:
                tol = f"{tol_text(tolerances.SPECIFIC[a.tol])} ({a.tol})"
            else:
                tol = a.tol if a.judged_by == "checks" else "-"
            out.append(
                f"| {cell(a.says)} | {cell(judged)} | {cell(a.baseline)} | {cell(tol)} | {cell(a.reading) or '-'} |"
            )
    out.append("")
    return "\n".join(out)


def splice(text: str, body: str) -> str:
    """``text`` with the part between the markers replaced by ``body``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{CASES_MD} must hold each marker once, BEGIN before END:\n{BEGIN}\n{END}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{body}\n\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the case catalogue in docs/cases.md.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/cases.md is stale; write nothing")
    args = parser.parse_args(argv)
    text = CASES_MD.read_text()
    pages = {CASES_MD: (text, splice(text, generated()))}
    pages[FIDELITY_MD] = (FIDELITY_MD.read_text() if FIDELITY_MD.exists() else "", fidelity())
    stale = [path for path, (old, fresh) in pages.items() if old != fresh]
    if args.check:
        for path in stale:
            print(f"{path} is stale: run python docs/catalogue.py", file=sys.stderr)
        if not stale:
            print("docs/cases.md and docs/plan_fidelity.md are up to date")
        return 1 if stale else 0
    for path, (_, fresh) in pages.items():
        if path in stale:
            path.write_text(fresh)
            print(f"rewrote {path}")
        else:
            print(f"{path} was already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
