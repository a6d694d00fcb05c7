"""The case contract: a registry of plan cases, and how one runs on a rank.

A case is a function ``body(ctx: CaseContext)`` registered with the plan's id and name, from
the plan's file (``_test_*.py``, the module it lives in), with its world size, its mesh (named
dims, built for it as ``ctx.mesh``), its precision-matrix row and the plan features it needs.
It builds the model under test through the implementation surface and its baseline, then
records checks through ``ctx`` (``tests.kit.judging.checks``).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.kit.judging.case_spec import Case
from tests.kit.judging.checks import CaseContext, Check, PreconditionFailed
from tests.kit.judging.levels import KIT_LEVEL, LEVELS
from tests.kit.judging.surface import FEATURES, current
from tests.kit.judging.tolerances import tolerance

__all__ = [
    "Case",
    "CaseContext",
    "HSDP_2X2",
    "Layout",
    "Check",
    "REGISTRY",
    "case",
    "case_by_id",
    "load_plan_cases",
    "run_on_rank",
    "ImplementationRefused",
]


REGISTRY: dict[str, Case] = {}
PLAN_DIR = Path(__file__).resolve().parents[2] / "torch" / "fully_shard"
PLAN_PACKAGE = "tests.torch.fully_shard"


def load_plan_cases() -> dict[str, Case]:
    """Import every plan file (``_test_*.py``) so its cases register; return the registry."""
    for path in sorted(PLAN_DIR.glob("_test_*.py")):
        importlib.import_module(f"{PLAN_PACKAGE}.{path.stem}")
    return REGISTRY


def case_by_id(case_id: str) -> Case:
    """A registered case (plan files are imported when it is not registered yet)."""
    if case_id not in REGISTRY:
        load_plan_cases()
    try:
        return REGISTRY[case_id]
    except KeyError:
        raise KeyError(f"no case {case_id!r}; known: {sorted(REGISTRY)}") from None


@dataclass(frozen=True)
class Layout:
    """Another mesh a case runs on, as a case of its own: id ``<case id>-<suffix>``, name
    ``<case name>_<suffix>_layout``, the same body; ``about`` says what differs (docs/cases.md)."""

    suffix: str
    world_size: int
    mesh: dict[str, int]
    config: str
    needs: tuple[str, ...] = ()
    about: str = ""  # may name the case's own id as ``{id}``


# the plan's other mesh shape of its 1-D cases: HSDP over 4 ranks, replicate 2 x shard 2
HSDP_2X2 = Layout(
    "HSDP",
    world_size=4,
    mesh={"replicate": 2, "shard": 2},
    config="HSDP 2D fp32",
    needs=("hsdp",),
    about="{id} on its other mesh shape: HSDP (replicate 2 x shard 2) against DDP over the 4 ranks.",
)


def case(
    id: str,
    name: str,
    world_size: int,
    mesh: dict[str, int],
    config: str,
    needs: tuple[str, ...] = (),
    timeout: float = 120.0,
    layouts: tuple[Layout, ...] = (),
) -> Callable[[Callable[[CaseContext], None]], Callable[[CaseContext], None]]:
    """Register ``body`` as the plan's case ``id`` (decorator), and as one case more per other
    mesh in ``layouts``. ``needs``: plan features beyond the basic ``fully_shard`` (see
    ``tests.kit.judging.surface.FEATURES``)."""
    specs = [(id, name, world_size, mesh, config, needs, "")]
    specs += [
        (
            f"{id}-{o.suffix}",
            f"{name}_{o.suffix.lower()}_layout",
            o.world_size,
            o.mesh,
            o.config,
            o.needs,
            o.about.format(id=id),
        )
        for o in layouts
    ]
    for spec_id, _, ranks, spec_mesh, spec_config, spec_needs, _ in specs:
        _check_case_arguments(spec_id, ranks, spec_mesh, spec_config, spec_needs)

    def register(body: Callable[[CaseContext], None]) -> Callable[[CaseContext], None]:
        for spec_id, spec_name, ranks, spec_mesh, spec_config, spec_needs, about in specs:
            needed = ("fully_shard", *spec_needs)
            spec = Case(spec_id, spec_name, ranks, dict(spec_mesh), spec_config, body, needed, timeout, about=about)
            if not spec.file.startswith("_test_"):
                raise ValueError(f"case {spec_id} is registered from {body.__module__}, not a plan file _test_*.py")
            existing = REGISTRY.get(spec_id)
            if existing is not None and existing.body.__qualname__ != body.__qualname__:
                raise ValueError(f"case id {spec_id} registered twice ({existing.name}, {spec_name})")
            REGISTRY[spec_id] = spec
        return body

    return register


def _check_case_arguments(id: str, world_size: int, mesh: dict[str, int], config: str, needs: tuple[str, ...]) -> None:
    """A case's arguments, checked as the plan file is imported (never mid-run)."""
    if id.split("-")[0] not in (*LEVELS, KIT_LEVEL):
        raise ValueError(f"case id {id!r} must start with one of {tuple(LEVELS)}")
    tolerance(config)  # an unknown precision-matrix row fails at import, not mid-run
    if math.prod(mesh.values()) > world_size:
        raise ValueError(f"case {id}: mesh {mesh} needs more than its {world_size} ranks")
    unknown = [n for n in needs if n not in FEATURES]
    if unknown:
        raise ValueError(f"case {id}: unknown features {unknown}; known: {sorted(FEATURES)}")


class ImplementationRefused(Exception):
    """The implementation refused a plan feature the case needs (the verdict is UNSUPPORTED)."""


def run_on_rank(case_id: str, module: str) -> dict[str, Any]:
    """Engine side: run one registered case on this rank and return its records.

    Features the implementation does not declare make the case UNSUPPORTED before it runs;
    a refusal while it runs (NotImplementedError inside the implementation, an unknown
    keyword) is raised again as ``ImplementationRefused`` naming the feature."""
    importlib.import_module(module)  # registers the case on this engine
    spec = REGISTRY[case_id]
    implementation = current()
    origin = implementation.origin
    missing = [n for n in spec.needs if n not in implementation.features]
    if missing:
        return {"checks": [], "series": {}, "unsupported": missing, "origin": origin}
    ctx = CaseContext(spec, dist.get_rank(), dist.get_world_size())
    torch.manual_seed(0)
    try:
        spec.body(ctx)
    except PreconditionFailed:
        pass  # recorded as a failed check: the verdict fails with the table of what ran
    except (NotImplementedError, TypeError) as exc:
        feature = implementation.refusal(exc)
        if feature is None:
            raise
        raise ImplementationRefused(feature) from exc
    finally:
        _leave_for_inspection(ctx)
    return {**ctx.result(), "unsupported": [], "origin": origin}


def _leave_for_inspection(ctx: CaseContext) -> None:
    from tests.kit.runtime.rank_runtime import keep

    keep(case_ctx=ctx, **ctx.kept)
