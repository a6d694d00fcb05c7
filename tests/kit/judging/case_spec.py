"""What one plan case is (``Case``): its id and name, world size, mesh, precision-matrix row and
body. Both the case registry (``tests.kit.judging.case``) and what a body sees
(``tests.kit.judging.checks``) need it, so it lives below both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


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

    @property
    def level(self) -> str:
        return self.id.split("-")[0]

    @property
    def module(self) -> str:
        return self.body.__module__

    @property
    def file(self) -> str:
        """The plan's file the case lives in (``_test_*.py``)."""
        return self.module.rsplit(".", 1)[-1] + ".py"

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.values())
