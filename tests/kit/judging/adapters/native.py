"""Adapter of a ``hyper_parallel`` package built on torch's DeviceMesh and DTensor (ours, or
another checkout of it): the API is taken as it is."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from tests.kit.judging.surface import Implementation, Spec, import_package


class Native(Implementation):
    """The package's own names; torch's mesh and tensor types."""

    name = "native"
    Shard = Shard
    Replicate = Replicate
    recompute_gathers_again = False  # a recompute inside backward leaves its group gathered (no reshard)

    def __init__(self, spec: Spec) -> None:
        package = import_package("hyper_parallel", spec.path)
        super().__init__(spec, package)
        self.fully_shard = package.fully_shard
        self.HSDPModule = package.HSDPModule
        self.MixedPrecisionPolicy = package.MixedPrecisionPolicy
        self.OffloadPolicy = package.OffloadPolicy
        self.CPUOffloadPolicy = package.CPUOffloadPolicy
        self.register_fsdp_forward_method = getattr(package, "register_fsdp_forward_method", _not_in_package)
        self.share_comm_ctx = getattr(package, "share_comm_ctx", _no_share_comm_ctx)
        declared = getattr(package, "HPKIT_FEATURES", None)  # a package may declare less than all
        if declared is not None:
            self.features = frozenset(declared)


def _no_share_comm_ctx(modules: list[nn.Module]) -> None:
    """Stands in for a package without ``share_comm_ctx``: refused, named."""
    raise NotImplementedError("share_comm_ctx: this hyper_parallel package does not export it")


def _not_in_package(module: nn.Module, method_name: str) -> None:
    """Stands in for a package without ``register_fsdp_forward_method``: refused, named."""
    raise NotImplementedError("register_fsdp_forward_method: this hyper_parallel package does not export it")


def load(spec: Spec) -> Native:
    """The native implementation at ``spec.path``."""
    return Native(spec)
