"""The engine's one device choice: the accelerator torch reports (``torch.accelerator``: CUDA,
NPU, XPU, ...) or the CPU, and the device a rank computes on for a mesh of a device type. No
other module of the engine names a device type."""

from __future__ import annotations

import torch

from .compat import accelerator_index

CPU = "cpu"


def default_device_type() -> str:
    """The accelerator torch sees here, else the CPU (``fully_shard(mesh=None)`` builds its mesh on it)."""
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return CPU


def current_device(device_type: str) -> torch.device:
    """The device this rank computes on for a mesh of ``device_type``: the current device of that
    accelerator (the one the rank bound before joining its process group), or the CPU."""
    if device_type == CPU:
        return torch.device(CPU)
    return torch.device(device_type, accelerator_index())
