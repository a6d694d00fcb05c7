"""Which module of the model a raise in backward (or between phases) belongs to.

Two witnesses, both read only through what torch and Python show every implementation alike:

- **The engine's frames.** An implementation's hooks raise in its own Python code, deeper on the stack
  than the kit's last frame. Those frames hold the implementation's objects for the module it was
  handling: the module itself, one of its params, or an object holding either a step or two away (a
  param group's modules, a param's owner record). The innermost frame holding one names it.
- **The autograd node that ran.** A raise inside a node's own backward (a saved param whose storage
  was freed, a kernel given the wrong dtype) runs no engine code at all. Each node forward created
  is tagged with the innermost module whose forward created it (``tag_nodes``, from the module's
  forward hook), and a pre-hook on it tells the site when backward runs it.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

TAG = "hpkit_module"  # the key of a node's metadata naming the module whose forward created it
_KIT = str(Path(__file__).resolve().parents[1]) + os.sep  # frames under tests/kit/ are the kit's, not the engine's
_DEPTH = 3  # steps from a frame's locals: a group, its list of param records, a record, its param
_MODES = ("__torch_dispatch__", "__torch_function__")
_BUDGET = 4000  # objects looked at per frame, at most


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's inputs or outputs (tuples, lists, dicts: what pytree flattens)."""
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def input_nodes(args: Any, kwargs: Any) -> list[Any]:
    """The autograd nodes a module's inputs came from: where tagging its forward's nodes stops."""
    return [t.grad_fn for t in tensors_in((args, kwargs)) if t.grad_fn is not None]


def stored_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Tensors a forward left on its module as plain attributes (a loss term read later, a cache):
    their nodes are the module's too, though its outputs may not reach them."""
    return [value for value in vars(module).values() if isinstance(value, torch.Tensor)]


def tag_nodes(path: str, outputs: Any, stops: list[Any], reached: Callable[[str, str], None]) -> None:
    """Tag every node between ``outputs`` and the module's inputs (``stops``) that no inner module
    tagged first with ``path``, and have each call ``reached(path, node name)`` when backward runs it.
    A param's grad accumulator is no module's computation and is left alone."""
    pending = [t.grad_fn for t in tensors_in(outputs) if t.grad_fn is not None]
    while pending:
        node = pending.pop()
        if node is None or any(node is stop for stop in stops) or node.name().endswith("AccumulateGrad"):
            continue
        metadata = node.metadata
        if TAG in metadata:
            continue
        metadata[TAG] = path
        node.register_prehook(_announcing(reached, path, node.name()))
        pending.extend(next_node for next_node, _ in node.next_functions)


def _announcing(reached: Callable[[str, str], None], path: str, name: str) -> Callable[[Any], None]:
    """A node pre-hook telling ``reached`` that backward runs the node (it changes no grad)."""

    def hook(_grads: Any) -> None:
        reached(path, name)

    return hook


def engine_module(error: BaseException, owners: dict[int, tuple[str, str]]) -> tuple[str, str] | None:
    """(module path, param name or "") of the innermost frame past the kit's own that holds a module or
    param of the model (``owners``: id -> (module path, param leaf name, "" for a module)), or None."""
    frames: list[types.FrameType] = []  # outermost first
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        if frame.f_code.co_name in _MODES:
            continue  # a mode the kit (or anyone) stacks over every op: no module's code
        if frame.f_code.co_filename.startswith(_KIT) or frame.f_code.co_name == "_engine_run_backward":
            return None  # the kit's own frame, or autograd's entry: the caller's frames name no engine work
        found = _held(frame.f_locals.values(), owners)
        if found is not None:
            return found
    return None


def _held(values: Iterable[Any], owners: dict[int, tuple[str, str]]) -> tuple[str, str] | None:
    """The module or param of the model nearest to ``values`` (a frame's locals), within _DEPTH steps
    (attributes, items). Where the nearest are several, reached from one local (a param group's list of
    params), the module holding them all: the group is what was being handled, not its first param."""
    level, seen, budget = [(index, value) for index, value in enumerate(values)], set(), _BUDGET
    for _ in range(_DEPTH + 1):
        hits: dict[int, list[tuple[str, str]]] = {}
        following: list[tuple[int, Any]] = []
        for local, value in level:
            if id(value) in seen or budget <= 0:
                continue
            seen.add(id(value))
            budget -= 1
            if id(value) in owners:
                hits.setdefault(local, []).append(owners[id(value)])
            else:
                following += [(local, inner) for inner in _inside(value)]
        if hits:
            return _common(hits[min(hits)])
        level = following
    return None


def _common(found: list[tuple[str, str]]) -> tuple[str, str]:
    """One (module, param) for several found together: itself if one, else the innermost module
    holding every one of them (no param named)."""
    if len(set(found)) == 1:
        return found[0]
    parts = [path.split(".") if path else [] for path, _ in found]
    shared: list[str] = []
    for names in zip(*parts, strict=False):
        if len(set(names)) > 1:
            break
        shared.append(names[0])
    return ".".join(shared), ""


def _inside(value: Any) -> list[Any]:
    """What one step from ``value`` reaches: a container's items, a plain object's attributes; nothing
    from tensors, modules (the model's own are found before), types, functions or modules of code."""
    if isinstance(value, (torch.Tensor, torch.nn.Module, type, types.ModuleType, types.FunctionType, str, bytes)):
        return []
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)[:64]
    if isinstance(value, dict):
        return list(value.values())[:64]
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return list(attributes.values())
    slots = getattr(type(value), "__slots__", ())
    return [getattr(value, name) for name in slots if isinstance(name, str) and hasattr(value, name)]


def owners_of(modules: list[tuple[str, Any]]) -> dict[int, tuple[str, str]]:
    """id -> (module path, param leaf name or "") for every module and param of the model."""
    owners: dict[int, tuple[str, str]] = {}
    for path, module in modules:
        owners.setdefault(id(module), (path, ""))
        for leaf, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), (path, leaf))
    return owners
