"""The kit's layout keeps its layers (``tools/kit_imports.py`` draws them from the imports): no
import circle, no subpackage importing one above it, no module over 450 lines."""

from __future__ import annotations

from tools import kit_imports


def test_the_kit_has_no_import_circle() -> None:
    names = kit_imports.modules()
    assert kit_imports.circles(names, kit_imports.arrows(names)) == []


def test_subpackages_import_only_those_below_them() -> None:
    names = kit_imports.modules()
    assert kit_imports.upward(kit_imports.arrows(names)) == []
    assert {kit_imports.package_of(name) for name in names} <= {"", *kit_imports.PACKAGES}


def test_no_kit_module_is_over_450_lines() -> None:
    assert kit_imports.long_files(kit_imports.modules()) == []
