"""The verdict text nbval compares holds on any machine where the verdicts do: every value a check
measured may move within what keeps its verdict (the last digits of another CPU's arithmetic, or
more) and the sanitized text stays the same; a verdict that changes changes the text.

Checks are recorded through the real ``CaseContext`` methods, rendered by ``verdict_text`` and
sanitized with the patterns of ``notebooks/nbval_sanitize.cfg`` as nbval reads them.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nbval.plugin import get_sanitize_patterns

from tests.kit.front.notebook import verdict_text
from tests.kit.judging.case import Case
from tests.kit.judging.checks import CaseContext
from tests.kit.judging.verdict import Verdict

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
SANITIZE = get_sanitize_patterns((NOTEBOOKS / "nbval_sanitize.cfg").read_text())
CASE = Case("L1-99", "test_text", 2, {"dp": 2}, "FSDP 1D fp32", body=lambda ctx: None)
TOLS = (1e-6, 1e-5, 1e-3)
finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)
fraction = st.floats(0.0, 1.0)


# What the recorded text may hold besides verdicts: the masked error. A fraction a passing check
# saw is not printed at all (a reader of the notebook sees no digits of this machine's arithmetic).
ERR_ONLY = [(regex, replace) for regex, replace in SANITIZE if regex.startswith("err=")]
# A float printed whole (its repr): what the recorded outputs must not hold outside err=.
RAW_FLOAT = re.compile(r"\d\.\d{5,}")


def sanitized(text: str, patterns: list = SANITIZE) -> str:
    for regex, replace in patterns:
        text = re.sub(regex, replace, text)
    return text


def render(records: list, patterns: list = SANITIZE) -> str:
    """Record ``(kind, name, values)`` on a context (rank 0 and rank 1), render the verdict, sanitize
    with ``patterns`` (by default nbval's)."""
    verdict = Verdict(CASE)
    for rank in (0, 1):
        ctx = CaseContext(CASE, rank, 2)
        for kind, name, values in records:
            _record(ctx, kind, name, values[rank])
        verdict.checks.extend(ctx.checks)
    verdict.checks.sort(key=lambda c: (c.name, c.rank))
    return sanitized(verdict_text(verdict), patterns)


def _record(ctx: CaseContext, kind: str, name: str, v: dict) -> None:
    if kind == "close":
        as_tensor = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
        ctx.close(name, as_tensor(v["measured"]), as_tensor(v["reference"]), v["tol"])
    elif kind == "close scalar":
        ctx.close(name, v["measured"], v["reference"], v["tol"])
    elif kind == "equal":
        ctx.equal(name, v["measured"], v["reference"])
    elif kind == "true":
        ctx.true(name, v["holds"], v["measured"], v["reference"])
    elif kind == "at_most":
        ctx.at_most(name, v["measured"], v["bound"], v["tol"])
    elif kind == "precondition":
        try:
            ctx.require(name, v["holds"], f"{v['measured']:.4g} (of {v['count']})")
        except AssertionError:
            pass


@st.composite
def close_pair(draw, passes: bool) -> tuple[dict, dict]:
    """One close check as two machines measure it: both pass, or both fail."""
    tol = draw(st.sampled_from(TOLS))

    def one() -> dict:
        reference = draw(finite)
        gap = draw(fraction) * tol / 2 if passes else tol * (2 + draw(fraction))  # clear of the edge
        return {"measured": reference + gap * draw(st.sampled_from((-1, 1))), "reference": reference, "tol": tol}

    return one(), one()


@st.composite
def inequality_pair(draw, kind: str, passes: bool) -> tuple[dict, dict]:
    """A true / at_most / precondition check as two machines measure it, keeping its verdict."""
    tol = draw(st.sampled_from(TOLS))
    count = draw(st.integers(1, 10))

    def one() -> dict:
        bound = draw(finite)
        measured = bound - draw(fraction) * 10 if passes else bound + tol + 1 + draw(fraction)
        return {"measured": measured, "bound": bound, "tol": tol, "holds": passes, "reference": "> 0", "count": count}

    return one(), one()


@st.composite
def equal_pair(draw, passes: bool) -> tuple[dict, dict]:
    """An exact check: the value it agreed on is the same on every machine where it passes."""
    value = draw(st.one_of(st.integers(0, 10**6), st.sampled_from(("torch.bfloat16", "[2, 1, 0]", "(7, 7)"))))
    other = value if passes else f"{value}!"
    return {"measured": value, "reference": other}, {"measured": value, "reference": other}


@st.composite
def records(draw, flip: bool = False) -> tuple[list, list]:
    """The same checks measured on two machines (``flip``: one check changes its verdict on the second)."""
    kinds = draw(
        st.lists(
            st.sampled_from(("close", "close scalar", "equal", "true", "at_most", "precondition")),
            min_size=1,
            max_size=8,
        )
    )
    flipped = draw(st.integers(0, len(kinds) - 1)) if flip else -1
    first, second = [], []
    for i, kind in enumerate(kinds):
        passes = draw(st.booleans())

        def pair(passes: bool, kind: str = kind) -> tuple[dict, dict]:
            if kind.startswith("close"):
                return draw(close_pair(passes))
            if kind == "equal":
                return draw(equal_pair(passes))
            return draw(inequality_pair(kind, passes))

        a, b = pair(passes)
        if i == flipped:
            b = pair(not passes)[1]
        name = f"check {i} {kind}"
        first.append((kind, name, (a, a)))
        second.append((kind, name, (b, b)))
    return first, second


@settings(max_examples=300, derandomize=True, deadline=None)
@given(records())
def test_measured_values_moved_within_their_verdicts_leave_the_text_unchanged(pair):
    first, second = pair
    assert render(first) == render(second)


@settings(max_examples=100, derandomize=True, deadline=None)
@given(records(flip=True))
def test_a_verdict_that_changes_changes_the_text(pair):
    first, second = pair
    assert render(first) != render(second)


def test_the_text_keeps_what_the_checks_decide():
    """Exact values, counts and tolerances stay readable; fractions a check does not decide do not."""
    text = render(
        [
            ("equal", "all-gather dtype", ({"measured": "['torch.bfloat16']", "reference": "['torch.bfloat16']"},) * 2),
            ("equal", "reduce-scatters", ({"measured": 3, "reference": 3},) * 2),
            ("true", "loss finite", ({"measured": 4.218904495239258, "holds": True, "reference": ""},) * 2),
            ("close scalar", "step 0 loss", ({"measured": 0.5, "reference": 0.5 + 1e-7, "tol": 1e-5},) * 2),
        ]
    )
    assert "pass  all-gather dtype  = ['torch.bfloat16']" in text
    assert "pass  reduce-scatters  = 3" in text
    assert "pass  loss finite\n" in text and "4.2189" not in text
    assert "pass  step 0 loss  err=<err>  tol=1e-05" in text


@st.composite
def passing_fractions(draw) -> tuple[list, list]:
    """Passing checks that measure fractions (errors, inequalities, bounds), on two machines."""
    kinds = draw(st.lists(st.sampled_from(("close", "close scalar", "true", "at_most")), min_size=1, max_size=6))
    first, second = [], []
    for i, kind in enumerate(kinds):
        a, b = draw(close_pair(True)) if kind.startswith("close") else draw(inequality_pair(kind, True))
        first.append((kind, f"check {i} {kind}", (a, a)))
        second.append((kind, f"check {i} {kind}", (b, b)))
    return first, second


@settings(max_examples=200, derandomize=True, deadline=None)
@given(passing_fractions())
def test_a_passing_row_prints_no_fraction_it_measured(pair):
    """Not masked but absent: the recorded text of passing checks is the same on both machines with
    only ``err=`` masked, so the notebook holds no digits of the recording machine's arithmetic."""
    first, second = pair
    text = render(first, ERR_ONLY)
    assert text == render(second, ERR_ONLY)
    assert not RAW_FLOAT.search(text), text


def _compared_outputs(notebook: Path) -> list[str]:
    """The output texts of ``notebook`` that nbval compares (cells not tagged to be ignored)."""
    texts = []
    for cell in nbformat.read(notebook, as_version=4).cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.cell_type != "code" or {"nbval-ignore-output", "nbval-skip"} & set(tags):
            continue
        for output in cell.get("outputs", []):
            if "text" in output:
                texts.append(output["text"])
            texts.extend(str(v) for k, v in output.get("data", {}).items() if k.startswith("text/"))
    return texts


@pytest.mark.parametrize("notebook", sorted(NOTEBOOKS.glob("L*.ipynb")), ids=lambda p: p.stem)
def test_the_recorded_outputs_hold_no_raw_float(notebook):
    """What nbval compares in the committed notebooks holds verdicts and tolerances: no float printed
    whole outside the masked ``err=`` (its last digits would be the recording machine's)."""
    raw = [
        line.strip()
        for text in _compared_outputs(notebook)
        for line in sanitized(text, ERR_ONLY).splitlines()
        if RAW_FLOAT.search(line)
    ]
    assert not raw, f"{len(raw)} lines with raw floats, e.g. {raw[:3]}"


def _seeded_sum() -> str:
    """The float32 sum of a fixed tensor, exactly: its last digits depend on the kernel's add order."""
    import torch

    values = torch.randn(4097, 33, generator=torch.Generator().manual_seed(0))
    return repr(values.sum().item())


def test_the_notebooks_engines_really_compute_otherwise(notebooks_cluster):
    """What makes nbval's pass mean something: the engines the notebooks run on (``conftest.py``,
    ``OTHER_ARITHMETIC``) add a float32 sum in another order than this process does (the recording's
    arithmetic), so their last digits differ."""
    theirs = notebooks_cluster.view(0).apply_sync(_seeded_sum)
    assert theirs != _seeded_sum(), f"the notebooks' engines compute {theirs}, the same as the recording's arithmetic"
