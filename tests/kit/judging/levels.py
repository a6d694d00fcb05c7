"""The plan's levels, once: id, notebook, title and scope (cases, the sweep and the notebook
builder all read them from here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Level:
    """One level of the plan and the notebook that runs its cases."""

    id: str
    notebook: str  # file stem under notebooks/
    title: str
    scope: str

    @property
    def notebook_file(self) -> str:
        """The notebook's file name."""
        return f"{self.notebook}.ipynb"


LEVELS: dict[str, Level] = {
    level.id: level
    for level in (
        Level(
            "L0",
            "L0_coverage",
            "L0 — coverage the plan takes as existing",
            "mesh=None, nested groups, uneven shapes, offload, replicate_params, comm fusion, list input, "
            "gradient sync, prefetch, mixed precision, TP + FSDP, DCP, argument validation; beyond the plan, "
            "FSDP2's usages (L0-FSDP2-*)",
        ),
        Level(
            "L1",
            "L1_interface",
            "L1 — HSDPModule interface, one point each",
            "the fully_shard() arguments and HSDPModule methods the plan found untested, "
            "and the mixed-precision matrix",
        ),
        Level(
            "L2",
            "L2_coupling",
            "L2 — feature coupling",
            "gradient accumulation, frozen params, activation checkpointing (reentrant, non-reentrant, "
            "selective, swap), clipping, dynamic shapes, PP + FSDP, EP + FSDP",
        ),
        Level(
            "L3",
            "L3_networks",
            "L3 — real network structures",
            "decoder LLM (HSDP and FSDP), MoE with EP, ViT, chunked CE, a multimodal model; 2 steps, "
            "dual metrics, bitwise rerun",
        ),
    )
}
KIT_LEVEL = "KIT"  # the kit's own fault-injection cases: never part of a level or a sweep
