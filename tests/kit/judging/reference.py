"""References and comparisons shared by cases and engine tests.

The baseline is always torch's own: DDP over the same ranks (fp32), never FSDP alone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.kit.judging.surface import impl
from tests.kit.runtime.torch_compat import all_reduce_mean


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor on every rank, whatever the implementation's tensor type (None stays None)."""
    return None if t is None else impl.full(t)


def ddp_of(model: nn.Module, **kwargs) -> DistributedDataParallel:
    """A DDP replica of ``model`` (deep-copied, so sharding ``model`` later does not touch it)."""
    return DistributedDataParallel(copy.deepcopy(model), **kwargs)


def named_params(model: Any) -> dict[str, nn.Parameter]:
    """Params by name; DDP's ``module.`` prefix removed so names match the model under test. A dict
    (params captured earlier, by name) is returned as it is."""
    if isinstance(model, dict):
        return model
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return dict(inner.named_parameters())


class SameDtypeReference:
    """The mixed-precision baseline: every rank runs the whole model in the compute dtype on its
    own data, then averages grads explicitly in the reduce dtype and steps fp32 master weights.

    This is what a correct mixed-precision data-parallel engine computes, without any sharding.
    With ``global_batch`` it is the plan's single card in the compute dtype instead: one copy runs
    the global batch (every rank's batch, in rank order) and its grads, computed in the compute
    dtype, are the master grads as they are, with no reduction at all (compare the mean of the
    model's per-rank losses).
    """

    def __init__(
        self,
        model: nn.Module,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
        cast_forward_inputs: bool = True,
        global_batch: bool = False,
    ) -> None:
        self.master = copy.deepcopy(model)
        self.compute = copy.deepcopy(model).to(param_dtype)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype or param_dtype
        self.output_dtype = output_dtype
        self.cast_forward_inputs = cast_forward_inputs
        self.global_batch = global_batch
        self._unreduced: dict[str, torch.Tensor] = {}

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        return self.master.named_parameters()

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.master.parameters()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for master, compute in zip(self.master.parameters(), self.compute.parameters(), strict=True):
                compute.copy_(master)
        if self.global_batch:
            x = torch.cat(gather_from(x))
        if self.cast_forward_inputs and x.is_floating_point():
            x = x.to(self.param_dtype)
        out = self.compute(x)
        return out.to(self.output_dtype) if self.output_dtype is not None else out

    def reduce_grads(self, sync: bool = True) -> None:
        """Take the compute grads (accumulated in the reduce dtype); if ``sync``, average them
        over ranks in the reduce dtype and accumulate into the fp32 master grads."""
        for (name, master), compute in zip(self.master.named_parameters(), self.compute.parameters(), strict=True):
            if compute.grad is None:
                continue
            # the single card's grads stay as computed (the compute dtype); no reduction follows
            grad = compute.grad if self.global_batch else compute.grad.to(self.reduce_dtype)
            compute.grad = None
            if name in self._unreduced:
                grad = self._unreduced.pop(name).add_(grad)
            if not sync:
                self._unreduced[name] = grad
                continue
            if not self.global_batch:
                all_reduce_mean(grad)
            grad = grad.to(master.dtype)
            master.grad = grad if master.grad is None else master.grad.add_(grad)


def gather_from(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (its full value for a DTensor, else the local tensor), in the rank
    order of ``group`` (collective: all ranks of ``group`` call, with tensors of one shape)."""
    local = full(tensor).detach().contiguous()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return gathered


class GlobalBatchReference:
    """The single-device fp32 baseline: every rank runs one unsharded copy of the model on the
    global batch (all ranks' batches concatenated in rank order), so its loss is the global-batch
    loss and its grads the full-batch grads, with no gradient communication at all. Compare the
    model's loss with ``train_against(..., mean_loss_over_ranks=True)``."""

    def __init__(self, model: nn.Module) -> None:
        self.module = copy.deepcopy(model)

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.module.parameters()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(torch.cat(gather_from(x)))
