"""``fully_shard`` and ``HSDPModule``: the public API.

``fully_shard`` checks every argument and plans every module before any module changes (``init.py``,
so a bad call leaves the model as it was), applies the plans, then swaps each module's class to one
with ``HSDPModule`` mixed in, whose methods check their arguments and control the groups below. The
policies are in ``utils.py``; the mechanics (params, groups, hooks, collectives) live in
``hyper_parallel.platform.torch.fully_shard``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from hyper_parallel.platform.torch.fully_shard.collectives import separate_group
from hyper_parallel.platform.torch.fully_shard.param_group import HSDPParamGroup, UnshardHandle
from hyper_parallel.platform.torch.fully_shard.state import (
    HSDPState,
    forward_method,
    state_of,
)

from .errors import FullyShardMisuse
from .init import (
    check_device,
    check_disjoint,
    check_mesh,
    check_modules,
    check_param_set,
    check_reshard_after_forward,
    plan_module,
    shard_module,
)
from .utils import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["fully_shard", "HSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]

_REDUCE_OP_TYPES = ("sum", "avg")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


class HSDPModule:
    """Mixed into every module given to ``fully_shard``; controls its group and those below."""

    def __new__(cls, *args: Any, **kwargs: Any) -> nn.Module:
        """A container that builds a new instance of its own class (``ModuleList`` or ``Sequential``
        sliced) gets the original class: the new module was not given to ``fully_shard``."""
        original = cls.__mro__[2]  # HSDP<cls>: (HSDP<cls>, HSDPModule, cls, ...)
        module = original.__new__(original)
        module.__init__(*args, **kwargs)
        return module

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        """Refused, as FSDP2 refuses it: the copy would share this module's groups and hooks. Copy the
        model before ``fully_shard`` (and shard the copy: a second root), or use its state dict."""
        raise FullyShardMisuse(
            f"{type(self).__name__}: HSDP/FSDP does not support deepcopy of a module given to fully_shard; "
            "deep-copy the model before fully_shard, or use its state dict"
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        """``to`` / ``to_empty`` / ``double`` / ...: applied to the sharded params (resharded first), then
        this group follows their new dtype and device (deferred init materialises its shards here)."""
        state = state_of(self)
        group = state.param_group
        if group is not None:
            group.finish_reductions()
            group.reshard()
        result = super()._apply(fn, recurse)
        if group is not None:
            group.refresh_after_apply(state.mp_policy)
        return result

    def _hsdp_states(self, recurse: bool = True) -> list[HSDPState]:
        if not recurse:
            return [state_of(self)]
        return [s for m in self.modules() if (s := state_of(m)) is not None]

    def _groups(self, recurse: bool = True) -> list[HSDPParamGroup]:
        return [s.param_group for s in self._hsdp_states(recurse) if s.param_group is not None]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward does not communicate; unsharded grads accumulate until a True backward. On HSDP
        it sets the all-reduce over the replicas too, as FSDP2's does (``set_requires_all_reduce`` after it
        turns that alone off again)."""
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        _check_bool("recurse", recurse)
        for group in self._groups(recurse):
            group.requires_gradient_sync = requires_gradient_sync
            group.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP only: False skips the all-reduce over the replicate dim (reduce-scatter still runs)."""
        _check_bool("requires_all_reduce", requires_all_reduce)
        _check_bool("recurse", recurse)
        for group in self._groups(recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free (True) or keep (False) the unsharded params after forward, from the next forward on."""
        _check_bool("reshard_after_forward", reshard_after_forward)
        _check_bool("recurse", recurse)
        for state in self._hsdp_states(recurse):
            state.reshard_after_forward = reshard_after_forward
            state.post_forward = None  # a bool replaces an int's smaller mesh (FSDP2 does the same)

    def set_reshard_after_backward(self, reshard_after_backward: bool, recurse: bool = True) -> None:
        """Free (True) or keep (False) the unsharded params after backward, from the next one on."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        _check_bool("recurse", recurse)
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_reduce_op_type(self, reduce_op_type: str, *, recurse: bool = True) -> None:
        """Gradient reduction op: ``"avg"`` (default) or ``"sum"`` over the data-parallel ranks."""
        if not isinstance(reduce_op_type, str) or reduce_op_type.lower() not in _REDUCE_OP_TYPES:
            raise ValueError(f"reduce_op_type must be one of {_REDUCE_OP_TYPES}, got {reduce_op_type!r}")
        _check_bool("recurse", recurse)
        for group in self._groups(recurse):
            group.reduce_op = reduce_op_type.lower()
            group.gradient_divide_factor = None  # the op type replaces a divide factor set before

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        """This group's reduced grad is the sum over its data-parallel ranks divided by ``factor``
        (None: back to the reduce op type), until ``set_reduce_op_type`` replaces it. Not recursive."""
        if factor is not None:
            factor = _check_number("factor", factor)
            if factor <= 0:
                raise ValueError(f"factor must be positive, got {factor}")
        for group in self._groups(recurse=False):
            group.gradient_divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of ``set_gradient_divide_factor`` (as in FSDP2)."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """True: gradient collectives only sum, and the average (or divide factor) is a division after
        them. Not recursive."""
        _check_bool("enable", enable)
        for group in self._groups(recurse=False):
            group.force_sum_reduction = enable

    def set_gradient_scaling_factor(self, factor: float | int | torch.Tensor | None = None) -> None:
        """HyperParallel's: multiply this group's reduced grads by ``factor`` before they land in the
        grads (None: no scaling). Not recursive."""
        if factor is not None:
            if isinstance(factor, torch.Tensor):
                if factor.numel() != 1:
                    raise ValueError(f"factor must be a 1-element tensor, got shape {tuple(factor.shape)}")
            else:
                _check_number("factor", factor, error=ValueError)
        for group in self._groups(recurse=False):
            group.gradient_scaling_factor = factor

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(output)`` on this group's reduced grads (after the HSDP all-reduce, else after the
        reduce-scatter; not at all where ``set_requires_all_reduce(False)`` skips the HSDP all-reduce,
        as FSDP2), before any division after the collectives. Not recursive. This engine issues
        its collectives on the current stream, so ``stream`` is refused under HSDP (as FSDP2 does)
        and otherwise has no effect."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {hook!r}")
        for group in self._groups(recurse=False):
            if stream is not None and group.mesh_info.is_hsdp:
                raise ValueError("stream cannot be set when using native HSDP")
            group.all_reduce_hook = hook

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not gather this group's params (none is needed to compute the grads,
        as an embedding's weight). Not recursive."""
        _check_bool("unshard_in_backward", unshard_in_backward)
        for group in self._groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: params that got no grad in a backward reduce zeros, so ranks that used different
        params (conditional control flow) still issue the same collectives."""
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        _check_bool("recurse", recurse)
        for group in self._groups(recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """True: gradient reduce-scatters run on a process group of their own over the shard ranks
        (one per set of ranks), so they can overlap the all-gathers; False: back to the shard group."""
        _check_bool("enable", enable)
        _check_bool("recurse", recurse)
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            group.reduce_scatter_group = separate_group(group.mesh_info.shard_group, made) if enable else None

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The root's next forward waits for ``event`` (recorded after the optimizer step) before it
        gathers, once. On the CPU there are no streams to wait on."""
        if not isinstance(event, torch.Event):
            raise TypeError(f"event must be a torch.Event, got {type(event).__name__}")
        state_of(self).post_optim_event = event

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: finish in-flight gathers, reshard every
        group and forget the iteration; its in-flight and accumulated grads are discarded. On the root."""
        if state_of(self).is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root module (the one forward starts at)")
        for group in self._groups():
            group.discard_iteration()
        state_of(self).iteration.forget()

    def set_custom_all_gather(self, comm: Any) -> None:
        """Refused: the all-gather's buffers are this engine's (flat, padded per param)."""
        raise NotImplementedError("set_custom_all_gather: this engine allocates and issues its own all-gathers")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Refused: the reduce-scatter's buffers are this engine's (flat, padded per param)."""
        raise NotImplementedError("set_custom_reduce_scatter: this engine allocates and issues its own reduce-scatters")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Refused: communication buffers come from torch's allocator."""
        raise NotImplementedError(
            "set_allocate_memory_from_process_group_for_comm: buffers come from torch's allocator"
        )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Refused: NCCL symmetric memory is not used."""
        raise NotImplementedError("set_symm_mem_for_comm: NCCL symmetric memory is not used by this engine")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Refused: each reduction allocates its own input buffer, on the current stream."""
        raise NotImplementedError("set_reduce_scatter_max_input_buffers: each reduction allocates its own input buffer")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backwards leave their reductions in flight (pipeline microbatches);
        the backward after ``set_is_last_backward(True)`` lands them all in the grads."""
        _check_bool("is_last_backward", is_last_backward)
        for state in self._hsdp_states():
            state.is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: list[HSDPModule]) -> None:
        """Start these modules' all-gathers, in this order, when this module's forward starts."""
        state_of(self).forward_prefetch = _prefetch_states("modules", modules)

    def set_modules_to_backward_prefetch(self, modules: list[HSDPModule]) -> None:
        """Start these modules' all-gathers, in this order, when this module's backward starts."""
        state_of(self).backward_prefetch = _prefetch_states("modules", modules)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's params now; with ``async_op`` return a handle to ``wait()`` on."""
        _check_bool("async_op", async_op)
        group = state_of(self).param_group
        if group is not None:
            group.unshard(async_op=async_op)
        handle = UnshardHandle(group)
        if not async_op:
            handle.wait()
            return None
        return handle

    def reshard(self) -> None:
        """Free this module's unsharded params (idempotent)."""
        group = state_of(self).param_group
        if group is not None:
            group.reshard()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear grads, main grads and locally accumulated unsharded grads of every group below."""
        _check_bool("set_to_none", set_to_none)
        for group in self._groups():
            group.zero_grad(set_to_none)
        nn.Module.zero_grad(self, set_to_none)  # params the groups do not manage (ignored)


def _check_number(name: str, value: object, error: type[Exception] = TypeError) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{name} must be a float or an int, got {value!r}")
    return float(value)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` between the module's forward hooks, as ``forward`` runs (gather
    before, reshard after, grads reduced in backward). A no-op on a module not given to
    ``fully_shard``, as in FSDP2."""
    state = state_of(module)
    if state is None:
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"{type(module).__name__} does not have a method {method_name}")
    setattr(module, method_name, forward_method(state, getattr(module, method_name)))


def share_comm_ctx(modules: list[HSDPModule]) -> None:
    """FSDP2 shares its communication streams between roots (pipeline stages); this engine issues
    every collective on the current stream, so there is nothing to share. Checks its argument."""
    for module in modules:
        if state_of(module) is None:
            raise ValueError(f"share_comm_ctx expects modules given to fully_shard, got {type(module).__name__}")


def _prefetch_states(name: str, modules: object) -> list[HSDPState]:
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"{name} must be a list of HSDPModules, got {type(modules).__name__}")
    states = []
    for module in modules:
        state = state_of(module) if isinstance(module, nn.Module) else None
        if state is None:
            raise TypeError(f"{name} must contain only modules given to fully_shard, got {module!r}")
        states.append(state)
    return states


# -- fully_shard ----------------------------------------------------------------------------
@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> HSDPModule: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[HSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    replicate_params: Iterable[nn.Parameter] | None = None,
    comm_fusion: bool = True,
    device: torch.device | str | None = None,
    dp_mesh_dims: Any = None,
) -> HSDPModule | list[HSDPModule]:
    """Shard ``module``'s params over ``mesh`` (1-D: FSDP, 2-D: HSDP) and hook its forward.

    A list shards each module as its own independently controlled group and returns a list.
    docs/api.md ("Arguments") describes every argument.
    """
    modules = check_modules(module)
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "fully_shard(dp_mesh_dims=...): a full SPMD mesh with DTensor params is not supported; "
            "pass the data-parallel (sub-)mesh as mesh"
        )
    info = check_mesh(mesh)  # the mesh, described once
    reshard_after_forward = check_reshard_after_forward(reshard_after_forward, info)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn must be callable or None, got {shard_placement_fn!r}")
    mp_policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    offload_policy = OffloadPolicy() if offload_policy is None else offload_policy
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    _check_bool("comm_fusion", comm_fusion)
    device = check_device(device, info)
    ignored = check_param_set("ignored_params", ignored_params, modules)
    replicated = check_param_set("replicate_params", replicate_params, modules)
    if both := ignored & replicated:
        raise ValueError(f"{len(both)} param(s) are in both ignored_params and replicate_params")
    plans = [plan_module(m, info, shard_placement_fn, mp_policy, ignored, replicated) for m in modules]
    check_disjoint(modules, plans)
    sharded = [
        shard_module(m, plan, info, reshard_after_forward, mp_policy, offload_policy, comm_fusion, device, ignored)
        for m, plan in zip(modules, plans, strict=True)
    ]
    for m in sharded:
        m.__class__ = _hsdp_class(type(m))
    return sharded if isinstance(module, (list, tuple)) else sharded[0]


_CLASS_CACHE: dict[type, type] = {}


def _hsdp_class(cls: type) -> type:
    """``HSDP<cls>``: the module's class with ``HSDPModule`` mixed in first."""
    if issubclass(cls, HSDPModule):
        return cls
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"HSDP{cls.__name__}", (HSDPModule, cls), {})
    return _CLASS_CACHE[cls]
