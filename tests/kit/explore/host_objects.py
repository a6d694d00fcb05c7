"""What an implementation keeps on the host from step to step: the Python objects reachable from the
model and from the globals of the implementation's own modules, counted by type at each step's end.

A storage kept is seen by ``lifetimes.KeptStorages``; this sees what holds no storage, or holds one the
kit cannot name: a handle, a work object, a record of each step appended to a list that nobody empties
(upstream's hooks-per-step report #660 is the hook-shaped case of it). The walk follows
``gc.get_referents`` from those roots and stops at types, modules, code, other modules' globals and
the kit's own objects (its hooks' closures reach the whole example), so it costs milliseconds, not a
scan of the heap (``gc.get_objects()`` is about 0.4 s with torch loaded).
"""

from __future__ import annotations

import gc
import sys
from collections import Counter
from types import BuiltinFunctionType, CodeType, FrameType, ModuleType
from typing import Any

_LIMIT = 200_000  # objects walked at most: past it the count is cut short (and says so)
_OPAQUE = (type, ModuleType, CodeType, FrameType, BuiltinFunctionType, str, bytes, int, float, bool)
_KIT = "tests."


def _module_globals() -> dict[int, str]:
    """id of each loaded module's globals -> its name."""
    return {id(vars(m)): name for name, m in list(sys.modules.items()) if isinstance(m, ModuleType)}


def held_objects(model: Any, packages: tuple[str, ...]) -> Counter[str]:
    """Objects reachable from ``model`` and from the globals of the modules named by ``packages``
    (prefixes), by type (``module.QualName``); ``"(walk cut short)"`` counts 1 where the limit hit."""
    globals_of = _module_globals()
    roots = [model, *(vars(m) for name, m in list(sys.modules.items()) if _ours(name, packages, m))]
    root_ids = {id(r) for r in roots}
    seen: set[int] = set()
    counts: Counter[str] = Counter()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or _stops_at(obj, root_ids, globals_of):
            continue
        seen.add(id(obj))
        if len(seen) > _LIMIT:
            counts["(walk cut short)"] += 1
            break
        kind = type(obj)
        counts[f"{kind.__module__}.{kind.__qualname__}"] += 1
        stack.extend(gc.get_referents(obj))
    return counts


def _ours(name: str, packages: tuple[str, ...], module: Any) -> bool:
    return isinstance(module, ModuleType) and any(name == p or name.startswith(p + ".") for p in packages)


def _stops_at(obj: Any, root_ids: set[int], globals_of: dict[int, str]) -> bool:
    """Objects the walk neither counts nor enters: immutable leaves, types and modules, other modules'
    globals (a function's ``__globals__``), and the kit's own objects."""
    if isinstance(obj, _OPAQUE):
        return True
    if id(obj) in globals_of and id(obj) not in root_ids:
        return True
    return type(obj).__module__.startswith(_KIT)


def grown(before: Counter[str], after: Counter[str]) -> list[tuple[str, int]]:
    """Types with more objects ``after`` than ``before``, and by how many."""
    return sorted((kind, after[kind] - before[kind]) for kind in after if after[kind] > before[kind])
