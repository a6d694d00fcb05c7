"""The plan case files: each case exported under its name by the plan's target file it belongs to
(``Case.plan_file``), and no case file over 500 lines (a target's cases split by level instead)."""

from __future__ import annotations

import importlib

from tests.kit.judging.case import PLAN_DIR, PLAN_PACKAGE, load_plan_cases

MOST_LINES = 500


def _plan_cases() -> list:
    """The plan's cases (the registry may hold the kit's own fault cases too, registered by its tests)."""
    return [c for c in load_plan_cases().values() if c.module.startswith(f"{PLAN_PACKAGE}.")]


def test_each_case_is_a_test_of_its_plan_target_file():
    missing = []
    for spec in _plan_cases():
        target = importlib.import_module(f"{PLAN_PACKAGE}.{spec.plan_file.removesuffix('.py')}")
        if not callable(getattr(target, spec.name, None)):
            missing.append(f"{spec.id} ({spec.file}) is no test {spec.name} of {spec.plan_file}")
    assert not missing, "\n".join(missing)


def test_no_case_file_is_over_500_lines():
    long = {p.name: n for p in PLAN_DIR.glob("_test_*.py") if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert not long, long


def test_a_case_on_another_layout_is_a_case_of_its_own_with_the_same_body():
    """``@case(..., layouts=(Layout(...),))``: the other mesh registers as ``<id>-<suffix>``, named
    ``<name>_<suffix>_layout``, on its own world size, mesh and precision row, running the same body."""
    cases = {c.id: c for c in _plan_cases()}
    twins = {i: c for i, c in cases.items() if i.endswith(("-FSDP", "-HSDP"))}
    assert len(twins) == 6, sorted(twins)
    for twin_id, twin in twins.items():
        base = cases[twin_id.rsplit("-", 1)[0]]
        suffix = twin_id.rsplit("-", 1)[1].lower()
        assert twin.body is base.body and twin.name == f"{base.name}_{suffix}_layout", twin_id
        assert (twin.mesh, twin.config) != (base.mesh, base.config) and twin.about, twin_id
