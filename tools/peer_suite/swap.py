"""Replace torch FSDP2's public API by an implementation's, where the tests import it from.

Only public names move (``fully_shard``, ``FSDPModule``, ``register_fsdp_forward_method``,
``share_comm_ctx``, ``UnshardHandle`` and the policies), in every module a test or torch's test
helpers import them from, the old ``torch.distributed._composable.fsdp`` path included. A test
that reads FSDP2's internals still reads torch's: ``classify`` calls such a failure private.
"""

from __future__ import annotations

import importlib
from typing import Any

ENTRY_POINTS = ("fully_shard", "FSDPModule", "register_fsdp_forward_method", "share_comm_ctx", "UnshardHandle")
POLICIES = ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy")

# module -> the public names it exports that the swap replaces
PUBLIC_HOMES: dict[str, tuple[str, ...]] = {
    "torch.distributed.fsdp": ENTRY_POINTS + POLICIES,
    "torch.distributed.fsdp._fully_shard": ENTRY_POINTS + POLICIES,
    "torch.distributed.fsdp._fully_shard._fully_shard": ENTRY_POINTS,
    "torch.distributed.fsdp._fully_shard._fsdp_api": POLICIES,
    "torch.distributed._composable.fsdp": ENTRY_POINTS[:3] + POLICIES,
    "torch.distributed._composable.fsdp.fully_shard": ENTRY_POINTS[:3],
}


def replacements(spec: str) -> dict[str, Any] | None:
    """FSDP2's public name -> the implementation's object (None: ``torch``, FSDP2 itself, nothing swapped)."""
    from tests.kit.judging.surface import load, parse_spec

    parsed = parse_spec(spec)
    if parsed.adapter == "torch":
        return None
    impl = load(parsed)
    package = impl.package
    names = {
        "fully_shard": impl.fully_shard,
        "FSDPModule": impl.HSDPModule,
        "register_fsdp_forward_method": impl.register_fsdp_forward_method,
        "share_comm_ctx": impl.share_comm_ctx,
        "MixedPrecisionPolicy": impl.MixedPrecisionPolicy,
        "OffloadPolicy": impl.OffloadPolicy,
        "CPUOffloadPolicy": impl.CPUOffloadPolicy,
    }
    handle = getattr(package, "UnshardHandle", None) if package is not None else None
    if handle is not None:
        names["UnshardHandle"] = handle
    return names


def install(spec: str) -> list[str]:
    """Swap FSDP2's public names for ``spec``'s everywhere in ``PUBLIC_HOMES``; returns what moved."""
    names = replacements(spec)
    if names is None:
        return []
    moved = []
    for module_name, exported in PUBLIC_HOMES.items():
        module = importlib.import_module(module_name)
        for name in exported:
            if name in names:
                setattr(module, name, names[name])
                moved.append(f"{module_name}.{name}")
    return moved
