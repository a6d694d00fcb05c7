"""Expose registered cases as pytest tests named by the plan (``test_<plan name>``), marked by level.

L3's networks train at the plan's sizes for over two minutes on a 2-core machine: ``make test``
runs the two cheapest (the LLM decoder and the ViT); the rest are marked ``slow`` and run in
``make test-slow`` (with the L3 notebook through nbval) and in ``make sweep``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest

from tests.kit.judging.case import REGISTRY, Case
from tests.kit.judging.verdict import judge_case
from tests.kit.judging.verdict_store import shared

L3_IN_MAKE_TEST = ("L3-02", "L3-04")  # the cheapest decoder and the ViT: a few seconds each


def _test_for(case: Case) -> Callable[[Any], None]:
    def test(request) -> None:
        implementation = request.config.getoption("--implementation")
        isolate = request.config.getoption("--isolate")
        # the notebooks nbval ran in this session may have run the case already (verdict_store)
        verdict = None if isolate or implementation else shared(case.id, "")
        if verdict is None:
            verdict = judge_case(request.getfixturevalue("cluster"), case.id, isolate=isolate)
        else:
            print(f"{case.id}: the verdict of this session's earlier run (notebook or plan fidelity), judged here")
        # our engine passes the extra checks too; another implementation is judged on the plan's
        verdict.assert_passed(extras=not implementation)

    test.__name__ = case.name
    test.__doc__ = f"{case.id}: {case.name} ({case.world_size} ranks, {case.config})"
    test = getattr(pytest.mark, case.level)(test)
    return test if case.level != "L3" or case.id in L3_IN_MAKE_TEST else pytest.mark.slow(test)


def export_cases(namespace: dict[str, Any], *case_modules: str) -> None:
    """Put one test per case registered by ``case_modules`` into a test module's namespace."""
    for module in case_modules:
        importlib.import_module(module)
    for spec in REGISTRY.values():
        if spec.module in case_modules:
            if spec.name in namespace:
                raise ValueError(f"two cases export the test name {spec.name}")
            namespace[spec.name] = _test_for(spec)
