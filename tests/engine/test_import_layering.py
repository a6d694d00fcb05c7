"""The package's import direction (docs/architecture.md): core -> platform, never back."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hyper_parallel"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("hyper_parallel")}


def test_platform_imports_nothing_of_core():
    """The mechanics name what they read of the policies (``platform/torch/fully_shard/policy.py``),
    never the API's classes: imports run one way."""
    for path in (PACKAGE / "platform").rglob("*.py"):
        wrong = {m for m in _imports(path) if m.startswith("hyper_parallel.core")}
        assert not wrong, f"{path.relative_to(PACKAGE)} imports {wrong}"


def test_policies_import_nothing_of_the_package():
    path = PACKAGE / "core" / "fully_shard" / "utils.py"
    assert not _imports(path), f"utils.py imports {_imports(path)}"


def test_hyper_parallel_never_imports_the_kit():
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert "tests.kit" not in text and "import tests" not in text, f"{path.relative_to(PACKAGE)} imports the kit"
