"""Policies of ``fully_shard``: mixed precision and offload.

Plain frozen dataclasses that validate their fields on construction, so a bad policy
fails where it is written, naming the field, before any module is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]


def _check_dtype(name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(f"MixedPrecisionPolicy.{name} must be a torch.dtype or None, got {value!r}")
    if not value.is_floating_point:
        raise ValueError(
            f"MixedPrecisionPolicy.{name} must be a floating dtype, got {value} "
            "(parameters, gradients and outputs are cast to it)"
        )


def _check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool, got {value!r}")


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Compute/communication dtypes of one ``fully_shard`` group.

    param_dtype: dtype of the unsharded compute params; the all-gather runs in it.
    reduce_dtype: dtype gradients are reduced in (None: the compute dtype).
    output_dtype: floating outputs of the module's forward are cast to it.
    cast_forward_inputs: cast floating forward inputs (nested too) to ``param_dtype``.
    apply_grad_on_fp32_main_grad: accumulate reduced grads into a persistent fp32
        ``param.main_grad`` that ``param.grad`` refers to.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    apply_grad_on_fp32_main_grad: bool = False

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name))
        for name in ("cast_forward_inputs", "apply_grad_on_fp32_main_grad"):
            _check_bool("MixedPrecisionPolicy", name, getattr(self, name))


@dataclass(frozen=True)
class OffloadPolicy:
    """No offload: sharded params and grads live on the compute device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded params and grads live on the CPU; copied to the compute device to communicate.

    pin_memory: page-lock the CPU shards for faster copies (only where an accelerator exists).
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        _check_bool("CPUOffloadPolicy", "pin_memory", self.pin_memory)
