"""The kit's one device choice: the accelerator torch reports (``torch.accelerator``: CUDA, NPU, XPU,
...), its backend from torch's device-to-backend map (nccl, hccl, xccl), gloo on the CPU; the
device a rank binds to (its host-local index: ranks grouped by host, in rank order); what the
plan's determinism rule needs on an accelerator; and the allocator's memory counters.

No other module of the kit names a device type or a backend: they ask here. (Adapters may name
their implementation's devices.)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

CPU, CPU_BACKEND = "cpu", "gloo"
CUBLAS_WORKSPACE = ":4096:8"  # what deterministic cuBLAS needs (CUBLAS_WORKSPACE_CONFIG)


def accelerator_type() -> str | None:
    """The accelerator torch sees here ("cuda", "npu", "xpu", ...), or None on a CPU-only host."""
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator().type


def backend_of(device_type: str) -> str:
    """The process-group backend torch pairs with a device type (cuda: nccl, xpu: xccl, npu: hccl
    once torch_npu is imported, cpu: gloo)."""
    return dist.Backend.default_device_backend_map.get(device_type, CPU_BACKEND)


def device_type_of(backend: str) -> str:
    """The device type a backend runs collectives on (gloo: the CPU, though torch maps mps to it too)."""
    if backend == CPU_BACKEND:
        return CPU
    for device_type, paired in dist.Backend.default_device_backend_map.items():
        if paired == backend and device_type != CPU:
            return device_type
    return CPU


def choose(requested: str | None, local_ranks: int) -> tuple[str, str]:
    """(device type, backend) of a rank: ``requested`` backend if given; else the accelerator's when
    this host has one device per rank it holds (one device shared by two ranks is an error of
    the accelerator's backend), else the CPU with gloo."""
    if requested:
        return device_type_of(requested), requested
    accelerator = accelerator_type()
    if accelerator and torch.accelerator.device_count() >= local_ranks:
        return accelerator, backend_of(accelerator)
    return CPU, CPU_BACKEND


def host_local_indices(hosts: Sequence[str]) -> list[int]:
    """Each rank's index among the ranks of its host, in rank order: ranks 0..3 on hosts
    a, a, b, b -> 0, 1, 0, 1 (the device each binds to)."""
    seen: dict[str, int] = {}
    indices = []
    for host in hosts:
        indices.append(seen.get(host, 0))
        seen[host] = seen.get(host, 0) + 1
    return indices


def bind(device_type: str, local_index: int) -> None:
    """Make the rank's accelerator device current (before its process group exists)."""
    if device_type != CPU:
        torch.accelerator.set_device_index(local_index % torch.accelerator.device_count())


def compute_device() -> torch.device:
    """The device this rank computes on: its accelerator under the accelerator's backend, else the CPU."""
    device_type = device_type_of(dist.get_backend())
    if device_type == CPU:
        return torch.device(CPU)
    return torch.device(device_type, torch.accelerator.current_device_index())


def barrier_args(backend: str) -> dict[str, Any]:
    """What ``dist.barrier`` needs to run on this rank's device under ``backend``."""
    if device_type_of(backend) == CPU:
        return {}
    return {"device_ids": [torch.accelerator.current_device_index()]}


def deterministic(device_type: str) -> dict[str, Any]:
    """The plan's determinism rule on an accelerator: deterministic kernels (with the cuBLAS
    workspace they need) and no TF32 for fp32; returns the settings, for the provenance."""
    if device_type == CPU:
        return {"deterministic": "cpu (kernels deterministic)"}
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("highest")  # no TF32 (nor bf16) behind fp32 matmuls
    if hasattr(torch.backends, "cudnn"):
        torch.backends.cudnn.allow_tf32 = False
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "fp32_matmul_precision": torch.get_float32_matmul_precision(),
    }


# -- the allocator ------------------------------------------------------------------------------
def has_allocator(device: torch.device) -> bool:
    """Whether the device has an allocator torch can count (an accelerator)."""
    return device.type != CPU


def allocator_start(device: torch.device) -> int:
    """Synchronise, reset the peak and return the bytes allocated now."""
    torch.accelerator.synchronize(device)
    torch.accelerator.reset_peak_memory_stats(device)
    return torch.accelerator.memory_allocated(device)


def allocator_peak(device: torch.device) -> int:
    """The allocator's peak bytes since ``allocator_start``."""
    torch.accelerator.synchronize(device)
    return torch.accelerator.max_memory_allocated(device)
