"""``python -m tools.kit_imports``: the kit's structure drawn from its imports.

Reads every module of ``tests/kit`` as source (its test modules left out) and prints the module
count, the import arrows between kit modules (imports inside functions included: a deferred import
is still a dependency), the import circles, the layers (a module's layer is one more than the
highest layer it imports; circles share one), the arrows between the kit's subpackages (each may
import only those before it in ``PACKAGES``) and the files over 450 lines. Issue 24 measured the
kit's layout with it, before and after; ``tests/kit_tests/test_structure.py`` keeps it so.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "tests" / "kit"
LIMIT = 450
# the kit's subpackages, bottom-up: each may import only those before it
PACKAGES = ("runtime", "judging", "workloads", "plan", "explore", "front", "sweep")


def modules() -> dict[str, Path]:
    """Dotted name -> file of every kit module that is not a test."""
    found = {}
    for path in sorted(KIT.rglob("*.py")):
        if path.name.startswith("test_") or path.name.startswith("_test_"):
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def arrows(names: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported) pairs between kit modules."""
    edges = set()
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target in names and target != name:
                    edges.add((name, target))
    return edges


def circles(names: dict[str, Path], edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    graph: dict[str, list[str]] = {n: [] for n in names}
    for a, b in edges:
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10000)
    for node in graph:
        if node not in index:
            visit(node)
    return groups


def layers(names: dict[str, Path], edges: set[tuple[str, str]], groups: list[list[str]]) -> dict[str, int]:
    """Each module's layer: 0 imports no kit module; else one more than what it imports."""
    rep = {m: g[0] for g in groups for m in g}
    deps: dict[str, set[str]] = {rep.get(n, n): set() for n in names}
    for a, b in edges:
        if rep.get(a, a) != rep.get(b, b):
            deps[rep.get(a, a)].add(rep.get(b, b))
    memo: dict[str, int] = {}

    def layer(node: str) -> int:
        if node not in memo:
            memo[node] = 1 + max((layer(d) for d in deps[node]), default=-1)
        return memo[node]

    return {n: layer(rep.get(n, n)) for n in names}


def package_of(name: str) -> str:
    """The kit subpackage a module belongs to ('' for the kit's own top-level modules)."""
    parts = name.removeprefix("tests.kit").lstrip(".").split(".")
    return parts[0] if len(parts) > 1 or parts[0] in PACKAGES else ""


def package_arrows(edges: set[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """(importer's package, imported package) -> import arrows, between different packages."""
    counts: dict[tuple[str, str], int] = {}
    for a, b in edges:
        pair = (package_of(a), package_of(b))
        if pair[0] != pair[1]:
            counts[pair] = counts.get(pair, 0) + 1
    return counts


def upward(edges: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """Imports from a subpackage to one after it in ``PACKAGES`` (the wrong way)."""
    rank = {name: place for place, name in enumerate(PACKAGES)}
    return sorted(
        (a, b)
        for a, b in edges
        if package_of(a) in rank and package_of(b) in rank and rank[package_of(b)] > rank[package_of(a)]
    )


def long_files(names: dict[str, Path]) -> list[tuple[int, str]]:
    """(lines, module) of the modules over ``LIMIT`` lines."""
    return [(n, m) for n, m in sorted((len(p.read_text().splitlines()), m) for m, p in names.items()) if n > LIMIT]


def main() -> int:
    names = modules()
    edges = arrows(names)
    groups = circles(names, edges)
    depth = layers(names, edges, groups)
    print(
        f"{len(names)} modules, {len(edges)} import arrows, {max(depth.values()) + 1} layers, {len(groups)} circle(s)"
    )
    for group in groups:
        print("  circle: " + " <-> ".join(group))
    for level in range(max(depth.values()) + 1):
        print(
            f"  layer {level}: "
            + ", ".join(sorted(n.removeprefix("tests.kit.") for n, d in depth.items() if d == level))
        )
    print(
        "  package arrows: "
        + ", ".join(f"{a or 'kit'} -> {b or 'kit'} {n}" for (a, b), n in sorted(package_arrows(edges).items()))
    )
    for a, b in upward(edges):
        print(f"  upward import: {a} -> {b}")
    for lines, name in long_files(names):
        print(f"  over {LIMIT} lines: {name} ({lines})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
