"""Where a traced run raised: step, phase, module and tensor, from what the tracer saw and the exception.

A ``Tracer`` (``tests.kit.judging.trace``) keeps a ``Site``: the step it is in, the phase the kit's
training loop marked (forward, backward, reduction, optimizer, or a call between them: ``zero_grad``,
``state_dict``, a setter), the innermost module of the model under test whose forward was entered and
not left, and in backward the module whose output grad backward reached last (its backward is what runs
next). When the run raises, ``crash_record`` turns that and the exception into one record; a raise under a
reduction collective (``reduce_scatter``, ``all_reduce``: every implementation's reductions go through
c10d) is the reduction phase whatever the loop had marked, as the end of backward lands reductions inside
``backward()``.

Through the cluster the record travels as the first line of a ``TracedCrash``'s message, so that every
raising rank's record reaches the driver (``RankFailure.raised``) however the other ranks end.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.kit.judging.raising_module import engine_module, input_nodes, owners_of, stored_tensors, tag_nodes
from tests.kit.runtime.diagnosis import SITE_BYTES, site_file

PREFIX = "HPKIT-CRASH "
# c10d functions whose frames on the raising stack mean a gradient reduction was under way
_REDUCTIONS = ("reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_reduce", "reduce_scatter_single")


@contextlib.contextmanager
def published(site: Site, stack_path: str | None) -> Iterator[None]:
    """While a traced run runs on an engine, its site is published beside the engine's stacks, stamped
    with the run's start (wall clock). A run that ends normally takes its file away; one that raises
    (a collective's own timeout, the driver's interrupt) leaves its last place there, as the driver
    may read it a moment after (``tests.kit.runtime.diagnosis.read_site``)."""
    if stack_path is None:
        yield
        return
    path = site_file(stack_path)
    site.since = time.time()
    site.sink = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    site.at(site.phase)
    ended = False
    try:
        yield
        ended = True
    finally:
        os.close(site.sink)
        site.sink = None
        if ended:
            with contextlib.suppress(OSError):
                os.unlink(path)


class TracedCrash(RuntimeError):
    """A traced run raised: its first line is the crash record (JSON), the rest the original error."""


class StructureDiffers(KeyError):
    """The model under test and its baseline do not have the same params (a tied param come untied, a
    param registered again under another name, a module one side lacks): the diagnosis's first
    divergence, phase ``structure``, before any tensor is compared."""

    def __init__(self, model_only: list[str], reference_only: list[str]) -> None:
        self.model_only, self.reference_only = list(model_only), list(reference_only)
        super().__init__(self.describe())

    def describe(self) -> str:
        return (
            f"the reference has no params named {self.model_only}; params of the reference alone: {self.reference_only}"
        )

    def __str__(self) -> str:
        return self.describe()


@dataclass
class Site:
    """Where the rank's run is now, as far as the tracer can tell."""

    phase: str = "set-up"
    module: str = ""
    tensor: str = ""
    entered: list[str] = field(default_factory=list)  # forward: modules entered and not left, outermost first
    step: str | None = None  # the tracer's step label
    sink: int | None = None  # a file each change of place is written to, for the driver to read in a hang
    since: float = 0.0  # when the run publishing it started (wall clock)
    modules: list[tuple[str, Any]] = field(default_factory=list)  # the model's (path, module), as hooked

    def at(self, phase: str) -> None:
        """The training loop starts a phase (or a call between phases)."""
        self.phase, self.module, self.tensor = phase, "", ""
        self.entered.clear()
        self._publish()

    def enter(self, path: str) -> None:
        if self.phase != "backward":
            self.entered.append(path)
            self._publish()

    def leave(self, path: str) -> None:
        if self.entered and self.entered[-1] == path:
            self.entered.pop()
            self._publish()

    def backward_reached(self, path: str) -> None:
        """Backward reached ``path``'s output grad: its backward runs next."""
        self.phase, self.module, self.tensor = "backward", path, "output grad"
        self._publish()

    def node_reached(self, path: str, node: str) -> None:
        """Backward runs ``node``, an autograd node ``path``'s forward created."""
        if (self.phase, self.module, self.tensor) != ("backward", path, node):
            self.phase, self.module, self.tensor = "backward", path, node
            self._publish()

    def _publish(self) -> None:
        """Where the rank is now, over the sink's last record (a rank stuck in a collective runs no Python
        the driver could ask; it reads this instead: ``read_site``)."""
        if self.sink is not None:
            phase, module, tensor = self.where()
            record = {"step": self.step or "before step 0", "phase": phase, "module": module, "tensor": tensor}
            record["since"] = self.since
            os.pwrite(self.sink, json.dumps(record).encode().ljust(SITE_BYTES), 0)

    def where(self) -> tuple[str, str, str]:
        """(phase, module, tensor) now."""
        if self.phase == "forward" and self.entered:
            return "forward", self.entered[-1], "output"
        return self.phase, self.module, self.tensor


def site_hooks(site: Site, modules: list[tuple[str, Any]], first_tensor: Callable[[Any], Any]) -> list[Any]:
    """Hooks keeping ``site`` on the model's modules (path, module), first of each module's own (an
    implementation's hooks may raise): entering and leaving forward; once backward reaches a module's
    output grad (its ``first_tensor``, as the trace records it), its backward; and each autograd node
    its forward created, as backward runs it (``raising_module.tag_nodes``)."""
    site.modules = list(modules)
    stops: dict[str, list[list[Any]]] = {}  # path -> per open call, the nodes its inputs came from

    def enter(path: str) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            site.enter(path)
            if site.phase != "backward":
                stops.setdefault(path, []).append(input_nodes(args, kwargs))

        return hook

    def leave(path: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            site.leave(path)
            if site.phase == "backward":
                return
            tag_nodes(path, (output, stored_tensors(module)), (stops.get(path) or [[]]).pop(), site.node_reached)
            tensor = first_tensor(output)
            if tensor is not None and tensor.requires_grad:
                tensor.register_hook(lambda grad: site.backward_reached(path))

        return hook

    handles = []
    for path, module in modules:
        handles.append(module.register_forward_pre_hook(enter(path), prepend=True, with_kwargs=True))
        handles.append(module.register_forward_hook(leave(path), prepend=True))
    return handles


def structure_record(step: str | None, difference: StructureDiffers) -> dict[str, Any]:
    """A difference of structure as one record: where it appeared, the first name one side alone has,
    and both sides' names (``model_only``, ``reference_only``)."""
    module, _, leaf = (difference.model_only + difference.reference_only + [""])[0].rpartition(".")
    return {
        "step": step or "before step 0",
        "phase": "structure",
        "module": module,
        "tensor": leaf,
        "error": f"model only {difference.model_only}, reference only {difference.reference_only}",
        "model_only": difference.model_only,
        "reference_only": difference.reference_only,
    }


def merged_structure(records: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The structure difference as the diagnosis reports it: the first rank's, with every rank that saw
    the same one (``records``: each rank's, or None)."""
    seen = {rank: rec for rank, rec in enumerate(records) if rec}
    if not seen:
        return None
    first = seen[min(seen)]
    return {**first, "ranks": sorted(r for r, rec in seen.items() if rec["error"] == first["error"])}


def crash_record(step: str | None, site: Site, error: BaseException) -> dict[str, Any]:
    """One rank's crash: where (``site``, the reduction phase where a reduction collective raised) and
    the exception's type and first line."""
    if isinstance(error, StructureDiffers):
        return structure_record(step, error)
    phase, module, tensor = site.where()
    frames = {frame.name for frame in traceback.extract_tb(error.__traceback__)}
    if phase in ("backward", "reduction") and frames & set(_REDUCTIONS):
        phase, tensor = "reduction", "grads"
    if phase != "forward":  # an engine's own code raised: the module its frames were handling
        owners = owners_of(site.modules)
        held = engine_module(error, owners)
        if held is not None:
            module, leaf = held
            tensor = (f"{leaf}.grad" if phase == "reduction" else leaf) if leaf else "hooks"
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    return {
        "step": step or "before step 0",
        "phase": phase,
        "module": module,
        "tensor": tensor,
        "error": f"{type(error).__name__}: {first_line}".rstrip(": "),
    }


def as_traced_crash(record: dict[str, Any], error: BaseException) -> TracedCrash:
    return TracedCrash(PREFIX + json.dumps(record) + "\n" + f"{type(error).__name__}: {error}")


def records_of(raised: dict[int, tuple[str, str]]) -> dict[int, dict[str, Any]]:
    """Each raising rank's crash record, from ``RankFailure.raised`` (rank -> (type, first line))."""
    found = {}
    for rank, (_, line) in raised.items():
        start = line.find(PREFIX)
        if start >= 0:
            try:
                found[rank] = json.loads(line[start + len(PREFIX) :])
            except ValueError:
                continue
    return found


def merged(records: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The crash as the diagnosis reports it: the first raising rank's site, with every rank that raised
    at that site (the other ranks raised elsewhere, or waited for them)."""
    if not records:
        return None
    first = records[min(records)]
    site = ("step", "phase", "module", "tensor")
    ranks = sorted(r for r, rec in records.items() if all(rec[k] == first[k] for k in site))
    crash = {**{k: first[k] for k in site}, "ranks": ranks, "error": first["error"]}
    crash["diverged_before"] = next(
        (rec.get("diverged_before") for rec in records.values() if rec.get("diverged_before")), None
    )
    return crash
