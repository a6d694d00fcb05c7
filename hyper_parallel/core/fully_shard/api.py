"""``fully_shard`` and ``HSDPModule``: the public API, its argument checks and its policies.

Every argument is checked before any module is changed, so a bad call leaves the model as
it was. The mechanics (params, groups, hooks, collectives) live in
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
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from hyper_parallel.platform.torch.compat import root_mesh
from hyper_parallel.platform.torch.fully_shard.collectives import separate_group
from hyper_parallel.platform.torch.fully_shard.mesh_info import (
    default_mesh,
    device_of,
    mesh_info_of,
    post_forward_mesh,
)
from hyper_parallel.platform.torch.fully_shard.param import HSDPParam, ModuleSlot
from hyper_parallel.platform.torch.fully_shard.param_group import HSDPParamGroup, UnshardHandle
from hyper_parallel.platform.torch.fully_shard.state import (
    STATE_ATTR,
    HSDPState,
    forward_method,
    state_of,
)

from .errors import FullyShardMisuse
from .utils import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

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
        group = state_of(self).param_group
        if group is not None:
            group.finish_reductions()
            group.reshard()
        result = super()._apply(fn, recurse)
        if group is not None:
            group.refresh_after_apply()
        return result

    def _hsdp_states(self, recurse: bool = True) -> list[HSDPState]:
        if not recurse:
            return [state_of(self)]
        return [s for m in self.modules() if (s := state_of(m)) is not None]

    def _groups(self, recurse: bool = True) -> list[HSDPParamGroup]:
        return [s.param_group for s in self._hsdp_states(recurse) if s.param_group is not None]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward does not communicate; unsharded grads accumulate until a True backward."""
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        _check_bool("recurse", recurse)
        for group in self._groups(recurse):
            group.requires_gradient_sync = requires_gradient_sync

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
    modules = _check_modules(module)
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "fully_shard(dp_mesh_dims=...): a full SPMD mesh with DTensor params is not supported; "
            "pass the data-parallel (sub-)mesh as mesh"
        )
    mesh = _check_mesh(mesh)
    reshard_after_forward = _check_reshard_after_forward(reshard_after_forward, mesh)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn must be callable or None, got {shard_placement_fn!r}")
    mp_policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    offload_policy = OffloadPolicy() if offload_policy is None else offload_policy
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    _check_bool("comm_fusion", comm_fusion)
    device = _check_device(device, mesh)
    ignored = _check_param_set("ignored_params", ignored_params, modules)
    replicated = _check_param_set("replicate_params", replicate_params, modules)
    if both := ignored & replicated:
        raise ValueError(f"{len(both)} param(s) are in both ignored_params and replicate_params")
    plans = [_plan_module(m, mesh, shard_placement_fn, mp_policy, ignored, replicated) for m in modules]
    _check_disjoint(modules, plans)
    sharded = [
        _apply(m, plan, mesh, reshard_after_forward, mp_policy, offload_policy, comm_fusion, device, ignored)
        for m, plan in zip(modules, plans, strict=True)
    ]
    return sharded if isinstance(module, (list, tuple)) else sharded[0]


def _check_modules(module: object) -> list[nn.Module]:
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("module must be an nn.Module or a non-empty list of them")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"module must be an nn.Module or a list of them, got {type(m).__name__}")
        if state_of(m) is not None:
            raise FullyShardMisuse(
                f"module: {type(m).__name__} was already given to fully_shard (Each distinct composable "
                "distributed API can only be applied to a module once.)"
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"module: fully_shard does not support containers that do not implement forward "
                f"({type(m).__name__} has no forward to hook); shard its modules, or a list of them"
            )
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("module lists the same module twice")
    return modules


def _check_mesh(mesh: object) -> DeviceMesh:
    if mesh is None:
        return default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"mesh: fully_shard expects a 1D or 2D DeviceMesh but got {mesh} ({mesh.ndim}-D; "
            "1-D: FSDP, 2-D: HSDP over (replicate, shard))"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise FullyShardMisuse(
            "mesh: Please init the 2D mesh for HSDP with mesh_dim_names specified "
            "(init_device_mesh(..., mesh_dim_names=('replicate', 'shard')))"
        )
    return mesh


def _check_reshard_after_forward(value: object, mesh: DeviceMesh) -> bool | int | None:
    """True / False / None, or an int: the number of ranks to reshard to after forward, a divisor of
    the shard dim's size (1 means False and the shard dim's size means True, as in FSDP2)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward must be a bool, an int or None, got {value!r}")
    shard_size = mesh.size(mesh.ndim - 1)
    if value < 1 or shard_size % value:
        raise ValueError(
            f"reshard_after_forward={value}: an int must divide the shard dim's size {shard_size} "
            "(the ranks to reshard to after forward)"
        )
    if value == 1:
        return False
    return True if value == shard_size else value


def _check_device(device: object, mesh: DeviceMesh) -> torch.device:
    if device is None:
        return device_of(mesh)
    try:
        resolved = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"device must be a torch.device or device string, got {device!r}") from exc
    if resolved.type != mesh.device_type:
        raise ValueError(f"device {resolved} does not match the mesh's device type {mesh.device_type}")
    if resolved.type != "cpu" and resolved.index is None:
        resolved = device_of(mesh)
    return resolved


def _check_param_set(name: str, params: Iterable[nn.Parameter] | None, modules: list[nn.Module]) -> set[int]:
    if params is None:
        return set()
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        raise TypeError(f"{name} must be an iterable of parameters, got {type(params).__name__}")
    owned = {id(p) for m in modules for p in m.parameters()}
    ids = set()
    for p in params:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"{name} must contain only nn.Parameters, got {type(p).__name__}")
        if id(p) not in owned:
            raise ValueError(f"{name} contains a parameter of shape {tuple(p.shape)} not in module")
        ids.add(id(p))
    return ids


class _ModulePlan:
    """What ``fully_shard`` will manage for one module, computed before anything changes."""

    def __init__(self) -> None:
        self.params: list[nn.Parameter] = []
        self.slots: dict[int, list[ModuleSlot]] = {}
        self.placements: dict[int, Placement] = {}


def _plan_module(
    module: nn.Module,
    mesh: DeviceMesh,
    shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None,
    mp_policy: MixedPrecisionPolicy,
    ignored: set[int],
    replicated: set[int],
) -> _ModulePlan:
    plan = _ModulePlan()
    ignored = ignored | _ignored_below(module)
    managed_below = _params_managed_below(module)
    for owner, name, param in _params_outside_groups(module):
        if id(param) in ignored:
            continue
        if id(param) in managed_below:
            raise ValueError(
                f"parameter {name!r} of {type(owner).__name__} is tied to a parameter of a "
                "module already given to fully_shard; shard their common parent instead"
            )
        _check_shardable(name, param, id(param) in replicated)
        if isinstance(param, DTensor):
            _check_tensor_parallel_param(name, param, mesh)
        if id(param) not in plan.slots:
            plan.params.append(param)
            plan.slots[id(param)] = []
            plan.placements[id(param)] = _placement_of(param, name, shard_placement_fn, id(param) in replicated)
        plan.slots[id(param)].append((owner, name))
    if mp_policy.apply_grad_on_fp32_main_grad:
        for param in plan.params:
            if param.is_floating_point() and param.dtype != torch.float32:
                raise ValueError(
                    "mp_policy.apply_grad_on_fp32_main_grad needs fp32 params (param.grad is the "
                    f"fp32 main grad), got a {param.dtype} param of shape {tuple(param.shape)}"
                )
    return plan


def _check_shardable(name: str, param: nn.Parameter, is_replicated: bool) -> None:
    """Refuse what FSDP2 refuses to shard: a scalar (no dim to shard; one named in
    ``replicate_params`` is kept whole instead) and a non-contiguous param (channels-last)."""
    if param.ndim == 0 and not is_replicated:
        raise ValueError(
            f"parameter {name!r} is a scalar and fully_shard doesn't support scalar parameters: "
            f"Change {name} to a 1D tensor with numel equal to 1., or name it in replicate_params"
        )
    if not param.is_contiguous():
        raise NotImplementedError(
            f"parameter {name!r}: HSDP/FSDP does not support non-contiguous parameters yet (shape "
            f"{tuple(param.shape)}, stride {param.stride()}); make it contiguous before fully_shard"
        )


def _check_tensor_parallel_param(name: str, param: DTensor, mesh: DeviceMesh) -> None:
    """A DTensor param must come from tensor parallel on a 1-D TP mesh cut, like ``mesh`` (the dp
    dims: FSDP's one, or HSDP's two), from one named mesh, where the dp dims precede the TP dim."""
    problem = _tensor_parallel_problem(param.device_mesh, mesh)
    if problem:
        raise ValueError(f"parameter {name!r} is a DTensor on {param.device_mesh}: {problem}")


def _tensor_parallel_problem(tp_mesh: DeviceMesh, mesh: DeviceMesh) -> str | None:
    """Why a param tensor-parallel on ``tp_mesh`` cannot be sharded over ``mesh``, or None. The mesh
    both were cut from is ``mesh``'s: a DTensor's own mesh may be an equal one cut from another."""
    root = root_mesh(mesh)
    if tp_mesh.ndim != 1:
        return "tensor parallel composes with fully_shard on a 1-D TP mesh"
    if root.mesh_dim_names is None or mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        return "mesh and the TP mesh must be named dims of one DeviceMesh"
    names = (*mesh.mesh_dim_names, *tp_mesh.mesh_dim_names)
    if not set(names) <= set(root.mesh_dim_names) or len(set(names)) != len(names) or root[names[-1]] != tp_mesh:
        return (
            f"mesh {mesh.mesh_dim_names} and the TP mesh must be distinct dims of one mesh, "
            f"got mesh's dims {root.mesh_dim_names}"
        )
    order = [root.mesh_dim_names.index(n) for n in names]
    if order != sorted(order):
        return f"mesh's dims {mesh.mesh_dim_names} must precede the TP dim in their mesh {root.mesh_dim_names}"
    return None


def _params_outside_groups(module: nn.Module) -> Iterable[tuple[nn.Module, str, nn.Parameter]]:
    """Params registered on module and its descendants, not below an already sharded module."""
    stack = [module]
    while stack:
        owner = stack.pop()
        for name, param in owner._parameters.items():
            if param is not None:
                yield owner, name, param
        stack.extend(child for child in reversed(list(owner.children())) if state_of(child) is None)


def _params_managed_below(module: nn.Module) -> set[int]:
    ids = set()
    for sub in module.modules():
        state = state_of(sub)
        if state is not None and sub is not module and state.param_group is not None:
            for p in state.param_group.params:
                ids.add(id(p.sharded_param))
                ids.add(id(p.unsharded_param))
    return ids


def _ignored_below(module: nn.Module) -> set[int]:
    return {pid for sub in module.modules() if (s := state_of(sub)) is not None for pid in s.ignored_param_ids}


def _placement_of(
    param: nn.Parameter,
    name: str,
    shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None,
    is_replicated: bool,
) -> Placement:
    if is_replicated:
        return Replicate()
    placement = shard_placement_fn(param) if shard_placement_fn is not None else None
    if placement is None:
        return Shard(0) if param.ndim else Replicate()
    if isinstance(placement, Replicate):
        return placement
    if type(placement).__name__ == "ShardPlacementResult":
        raise NotImplementedError(
            f"shard_placement_fn returned a ShardPlacementResult for {name!r}: a mesh per param is not "
            "supported; shard such params with a fully_shard call of their own on that mesh"
        )
    if isinstance(placement, Shard) and type(placement) is Shard:
        if not -param.ndim <= placement.dim < max(param.ndim, 1) or param.ndim == 0:
            raise FullyShardMisuse(
                f"shard_placement_fn returned Shard({placement.dim}) for {name!r} of shape "
                f"{tuple(param.shape)}: Shard dim {placement.dim} is invalid for {param.ndim}D tensor"
            )
        return Shard(placement.dim % param.ndim)
    raise ValueError(f"shard_placement_fn must return Shard(dim), Replicate() or None, got {placement!r} for {name!r}")


def _check_disjoint(modules: list[nn.Module], plans: list[_ModulePlan]) -> None:
    seen: dict[int, int] = {}
    for index, plan in enumerate(plans):
        for param in plan.params:
            if id(param) in seen:
                raise ValueError(
                    f"modules {seen[id(param)]} and {index} of the list share a parameter of shape "
                    f"{tuple(param.shape)}; shard their common parent instead"
                )
            seen[id(param)] = index


def _apply(
    module: nn.Module,
    plan: _ModulePlan,
    mesh: DeviceMesh,
    reshard_after_forward: bool | int | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    comm_fusion: bool,
    device: torch.device,
    ignored: set[int],
) -> HSDPModule:
    info = mesh_info_of(mesh)
    offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
    params = [
        HSDPParam(p, plan.slots[id(p)], plan.placements[id(p)], info, device, mp_policy, offload) for p in plan.params
    ]
    for param in params:
        param.use_sharded()
    group = HSDPParamGroup(params, info, comm_fusion) if params else None
    _move_buffers(module, device)
    post_forward = None
    if group is not None and not isinstance(reshard_after_forward, bool) and isinstance(reshard_after_forward, int):
        post_forward = post_forward_mesh(info, reshard_after_forward)
    state = HSDPState(module, group, mp_policy, reshard_after_forward, ignored, post_forward)
    module.__dict__[STATE_ATTR] = state
    module.__class__ = _hsdp_class(type(module))
    return module


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.device != device and not buf.is_meta:  # meta: to_empty() places it
                sub._buffers[name] = buf.to(device)


_CLASS_CACHE: dict[type, type] = {}


def _hsdp_class(cls: type) -> type:
    """``HSDP<cls>``: the module's class with ``HSDPModule`` mixed in first."""
    if issubclass(cls, HSDPModule):
        return cls
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"HSDP{cls.__name__}", (HSDPModule, cls), {})
    return _CLASS_CACHE[cls]
