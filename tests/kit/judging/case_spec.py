"""What one plan case is (``Case``): its id and name, world size, mesh, precision-matrix row and
body. Both the case registry (``tests.kit.judging.case``) and what a body sees
(``tests.kit.judging.checks``) need it, so it lives below both."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def plan_file_of(case_file: str, targets: list[str]) -> str:
    """The plan's target file a case file ``_test_*.py`` belongs to: the longest of ``targets`` (the
    plan's ``test_*.py`` files) its name starts with."""
    stem = case_file.removeprefix("_").removesuffix(".py")
    found = [t for t in targets if stem == t[:-3] or stem.startswith(t[:-3] + "_")]
    if not found:
        raise ValueError(f"{case_file} names no plan target file ({', '.join(targets)})")
    return max(found, key=len)


@dataclass(frozen=True)
class Case:
    """One row of the plan: what runs, where, on which mesh, judged by which precision-matrix row."""

    id: str
    name: str
    world_size: int
    mesh: dict[str, int]  # dim name -> size, in order: the case's own mesh
    config: str
    body: Callable[..., None]  # body(ctx: CaseContext) on every rank
    needs: tuple[str, ...] = ("fully_shard",)
    timeout: float = 120.0
    # None: the accelerator's backend where there is one, else gloo (tests.kit.runtime.devices)
    backend: str | None = None
    about: str = ""  # what this case is, where its body's docstring says another's (a case's other layout)

    @property
    def level(self) -> str:
        return self.id.split("-")[0]

    @property
    def module(self) -> str:
        return self.body.__module__

    @property
    def file(self) -> str:
        """The file the case lives in (``_test_*.py``)."""
        return self.module.rsplit(".", 1)[-1] + ".py"

    @property
    def plan_file(self) -> str:
        """The plan's target file of the case: ``_test_<target>[_<part>].py`` lives in the plan's
        ``test_<target>.py`` (a target's cases split by level keep its name first)."""
        folder = Path(inspect.getfile(self.body)).parent
        return plan_file_of(self.file, sorted(p.name for p in folder.glob("test_*.py")))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.values())
