"""``fully_shard``'s set-up: its argument checks, the plan of what each module's call will manage
(params, their slots and placements; tied, ignored, replicated and tensor-parallel params), and
applying a plan. Every check runs, and every plan is made, before any module changes, so a refused
call leaves the model as it was. ``api.py`` calls these in that order, then swaps the classes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from hyper_parallel.platform.torch.compat import joined_mesh
from hyper_parallel.platform.torch.fully_shard.mesh_info import MeshInfo, default_mesh, mesh_info_of
from hyper_parallel.platform.torch.fully_shard.param import HSDPParam, ModuleSlot
from hyper_parallel.platform.torch.fully_shard.param_group import HSDPParamGroup
from hyper_parallel.platform.torch.fully_shard.state import STATE_ATTR, HSDPState, state_of

from .errors import FullyShardMisuse
from .utils import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy


def check_modules(module: object) -> list[nn.Module]:
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


def check_mesh(mesh: object) -> MeshInfo:
    """The mesh, described once (``MeshInfo``): None is a 1-D mesh over the world."""
    if mesh is None:
        return mesh_info_of(default_mesh())
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
    return mesh_info_of(mesh)


def check_reshard_after_forward(value: object, info: MeshInfo) -> bool | int | None:
    """True / False / None, or an int: the number of ranks to reshard to after forward, a divisor of
    the shard dim's size (1 means False and the shard dim's size means True, as in FSDP2)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward must be a bool, an int or None, got {value!r}")
    shard_size = info.shard_size
    if value < 1 or shard_size % value:
        raise ValueError(
            f"reshard_after_forward={value}: an int must divide the shard dim's size {shard_size} "
            "(the ranks to reshard to after forward)"
        )
    if value == 1:
        return False
    return True if value == shard_size else value


def check_device(device: object, info: MeshInfo) -> torch.device:
    if device is None:
        return info.device
    try:
        resolved = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"device must be a torch.device or device string, got {device!r}") from exc
    if resolved.type != info.mesh.device_type:
        raise ValueError(f"device {resolved} does not match the mesh's device type {info.mesh.device_type}")
    if resolved.type != "cpu" and resolved.index is None:
        resolved = info.device
    return resolved


def check_param_set(name: str, params: Iterable[nn.Parameter] | None, modules: list[nn.Module]) -> set[int]:
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


class ModulePlan:
    """What ``fully_shard`` will manage for one module, computed before anything changes."""

    def __init__(self) -> None:
        self.params: list[nn.Parameter] = []
        self.slots: dict[int, list[ModuleSlot]] = {}
        self.placements: dict[int, Placement] = {}


def plan_module(
    module: nn.Module,
    info: MeshInfo,
    shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None,
    mp_policy: MixedPrecisionPolicy,
    ignored: set[int],
    replicated: set[int],
) -> ModulePlan:
    plan = ModulePlan()
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
            _check_tensor_parallel_param(name, param, info.mesh)
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
    dims: FSDP's one, or HSDP's two), from one mesh, as other dims of it."""
    problem = _tensor_parallel_problem(param.device_mesh, mesh)
    if problem:
        raise ValueError(f"parameter {name!r} is a DTensor on {param.device_mesh}: {problem}")


def _tensor_parallel_problem(tp_mesh: DeviceMesh, mesh: DeviceMesh) -> str | None:
    """Why a param tensor-parallel on ``tp_mesh`` cannot be sharded over ``mesh``, or None."""
    if tp_mesh.ndim != 1:
        return "tensor parallel composes with fully_shard on a 1-D TP mesh"
    if mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        return "mesh and the TP mesh must be named dims of one DeviceMesh"
    try:
        joined_mesh([mesh, tp_mesh])
    except ValueError as error:
        return f"mesh {mesh.mesh_dim_names} and the TP mesh {tp_mesh.mesh_dim_names}: {error}"
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


def check_disjoint(modules: list[nn.Module], plans: list[ModulePlan]) -> None:
    seen: dict[int, int] = {}
    for index, plan in enumerate(plans):
        for param in plan.params:
            if id(param) in seen:
                raise ValueError(
                    f"modules {seen[id(param)]} and {index} of the list share a parameter of shape "
                    f"{tuple(param.shape)}; shard their common parent instead"
                )
            seen[id(param)] = index


def shard_module(
    module: nn.Module,
    plan: ModulePlan,
    info: MeshInfo,
    reshard_after_forward: bool | int | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    comm_fusion: bool,
    device: torch.device,
    ignored: set[int],
) -> nn.Module:
    """Apply ``plan`` to ``module``: its params sharded (``HSDPParam``), one group, buffers on the
    compute device, and the state that hooks its forward; ``fully_shard`` then swaps its class."""
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
        post_forward = info.post_forward(reshard_after_forward)
    state = HSDPState(module, group, mp_policy, reshard_after_forward, ignored, post_forward)
    module.__dict__[STATE_ATTR] = state
    return module


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.device != device and not buf.is_meta:  # meta: to_empty() places it
                sub._buffers[name] = buf.to(device)
