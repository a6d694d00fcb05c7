"""Expose registered cases as pytest tests named by the plan (``test_<plan name>``), marked by level."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest

from tests.kit.case import REGISTRY, Case
from tests.kit.verdict import judge_case


def _test_for(case: Case) -> Callable[[Any, Any], None]:
    def test(cluster, request) -> None:
        verdict = judge_case(cluster, case.id, isolate=request.config.getoption("--isolate"))
        # our engine passes the extra checks too; another implementation is judged on the plan's
        verdict.assert_passed(extras=not cluster.implementation)

    test.__name__ = case.name
    test.__doc__ = f"{case.id}: {case.name} ({case.world_size} ranks, {case.config})"
    return getattr(pytest.mark, case.level)(test)


def export_cases(namespace: dict[str, Any], *case_modules: str) -> None:
    """Put one test per case registered by ``case_modules`` into a test module's namespace."""
    for module in case_modules:
        importlib.import_module(module)
    for spec in REGISTRY.values():
        if spec.module in case_modules:
            if spec.name in namespace:
                raise ValueError(f"two cases export the test name {spec.name}")
            namespace[spec.name] = _test_for(spec)
