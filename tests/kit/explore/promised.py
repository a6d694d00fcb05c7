"""What the API promises for one L4 configuration, computed without it: ``PromisedReference``, an
unsharded copy of the model per rank that computes in the policy's compute dtype with the casts the
API makes at every sharded module's boundary, keeps its local grads in the reduce dtype and reduces
them itself, per param, over the process groups and with the reduce op the API promises for that
param at that moment; ``param_plans`` (what each param is: sharded, replicated, ignored, and where)
and ``Meshes`` (the configuration's meshes on this rank) beside it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from tests.kit.explore.grammar import build
from tests.kit.explore.space import PRECISIONS, Config
from tests.kit.judging.checks import CaseContext
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import reduction_order
from tests.kit.runtime.torch_compat import averages

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _halve(reduced: torch.Tensor) -> None:
    reduced.mul_(0.5)


def _leaky(reduced: torch.Tensor) -> None:
    """Negative entries halved: not additive (summing before or after it differs), but it commutes
    with a positive factor, so a division before or after it changes nothing (halving is exact)."""
    reduced.copy_(torch.where(reduced < 0, reduced * 0.5, reduced))


# the maps L4's all-reduce hooks make of the reduced grads, in place (``Group.hook_map``)
HOOK_MAPS = {"halve": _halve, "leaky": _leaky}


def precision_row(config: Config) -> str:
    """The precision-matrix row judging a configuration."""
    param = PRECISIONS[config.precision.name][0]
    if param == "bf16" or config.grad_dtype:
        return "FSDP 1D bf16"
    if param == "fp16":
        return "FSDP 1D fp16"
    return "HSDP 2D fp32" if config.hsdp else "FSDP 1D fp32"


@dataclasses.dataclass
class ParamPlan:
    """What the API promises for one param of the model."""

    path: str
    group: int  # index of the fully_shard call that manages it (or names it ignored)
    kind: str  # "sharded", "replicated" (whole on every rank), "ignored"
    dim: int  # the sharded dim (sharded params)
    mesh: str  # the group's mesh: "mesh", "shard", "flat"
    trainable: bool


def param_plans(config: Config, model: nn.Module) -> dict[str, ParamPlan]:
    """Each param's group, placement and reduction, from the configuration (bottom-up calls: a
    param belongs to the first call whose modules hold it)."""
    plans: dict[str, ParamPlan] = {}
    for index, group in enumerate(config.groups):
        for path, param in model.named_parameters():
            if path in plans or not any(p == "" or path.startswith(p + ".") for p in group.paths):
                continue
            placement = group.placements.get(path, "Shard(0)")
            if path in group.ignored:
                kind = "ignored"
            elif path in group.replicated or placement == "Replicate()":
                kind = "replicated"
            else:
                kind = "sharded"
            dim = int(placement[6:-1]) if placement.startswith("Shard(") else 0
            plans[path] = ParamPlan(path, index, kind, dim, group.mesh, param.requires_grad)
    return plans


class Meshes:
    """The configuration's mesh and the sub-meshes its groups use, and their process groups."""

    def __init__(self, ctx: CaseContext, config: Config) -> None:
        self.config = config
        self.rank = ctx.rank
        if config.hsdp:
            r, s = config.mesh
            self.main = ctx.mesh_of(replicate=r, shard=s)
        else:
            self.main = ctx.mesh_of(dp=config.world)
        self._ctx = ctx

    def of(self, kind: str) -> Any:
        if kind == "shard":
            return impl.submesh(self.main, "shard")
        if kind == "flat":
            return self._ctx.mesh_of(flat=self.config.world)
        return self.main

    def shard_group(self, kind: str) -> Any:
        """The process group a group on mesh ``kind`` shards over (and reduce-scatters over)."""
        if kind == "flat":
            return impl.process_group(self.of("flat"), "flat")
        return impl.process_group(self.main, "shard" if self.config.hsdp else "dp")

    def replicate_group(self, kind: str) -> Any:
        """The group a 2-D mesh all-reduces over after the reduce-scatter (None on a 1-D mesh)."""
        return impl.process_group(self.main, "replicate") if kind == "mesh" and self.config.hsdp else None

    def shard_coordinate(self, kind: str) -> tuple[int, int]:
        """(ranks sharded over, this rank's place among them)."""
        if kind == "flat" or not self.config.hsdp:
            return self.config.world, self.rank
        return self.config.mesh[1], impl.local_rank(self.main, "shard")


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors anywhere in ``value`` (tuples, lists, dicts, dataclasses) cast to ``dtype``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value)(**{f.name: _cast(getattr(value, f.name), dtype) for f in dataclasses.fields(value)})
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def grad_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype of ``param``'s grads: its ``grad_dtype`` (torch 2.9 on; the param's dtype unless set)."""
    return getattr(param, "grad_dtype", None) or param.dtype


def bf16_with_fp32_grads(model: nn.Module) -> None:
    """``grad_dtype``: the model's params cast to bf16 and given fp32 grads (pure bf16 training; the frozen
    ones too: torch keeps it for when they are unfrozen)."""
    model.to(torch.bfloat16)
    for param in model.parameters():
        param.grad_dtype = torch.float32


class PromisedReference:
    """What the API promises, computed without sharding (module docstring)."""

    def __init__(self, config: Config, meshes: Meshes, plans: dict[str, ParamPlan]) -> None:
        self.config = config
        self.meshes = meshes
        self.plans = plans
        self.master = build(config)
        if config.cast:  # the model under test is cast to float64 after sharding: its reference all along
            self.master.double()
        if config.grad_dtype:  # bf16 params with fp32 grads, as the model under test is set up before sharding
            bf16_with_fp32_grads(self.master)
        self.compute = copy.deepcopy(self.master)
        if config.grad_dtype:
            bf16_with_fp32_grads(self.compute)
        param, reduce = PRECISIONS[config.precision.name]
        self.param_dtype = torch.float64 if config.cast else torch.bfloat16 if config.grad_dtype else DTYPES[param]
        self.reduce_dtype = torch.float32 if config.grad_dtype else DTYPES[reduce] if reduce else self.param_dtype
        self.output_dtype = DTYPES[config.precision.output] if config.precision.output else None
        self.ops = ["avg"] * len(config.groups)  # the reduce op of each call's groups
        self.all_reduce = [True] * len(config.groups)
        self._held: dict[str, torch.Tensor] = {}
        # HSDP with the all-reduce off: each param's per-replica parts (as sums over its shard group), kept
        # for the next all-reducing backward to reduce over the replicas with its own (FSDP2's partial
        # output: through zero_grad and steps, until then or reset_iter_state); and the master grad they
        # landed in, with what it held before them (replaced by that backward's result)
        self._replica_parts: dict[str, torch.Tensor] = {}
        self._landed: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.got_grad: set[str] = set()  # params whose grad the last backward computed (or zeros for)
        # params that get zeros where this rank's backward gives them no grad (another rank's may: DDP's
        # find_unused_parameters rule), set by the driver per micro-batch (``ranks_skip_params``)
        self.zeros_for: set[str] = set()
        # per master grad, element-wise: how far the order of its half-precision reductions may move it
        # (the registry's reduction_order; none where the reduce dtype is fp32 or wider)
        self.order: dict[str, torch.Tensor] = {}
        for group in config.groups:
            for path in group.paths:
                module = self.compute.get_submodule(path) if path else self.compute
                module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
                module.register_forward_hook(self._cast_outputs)

    def _cast_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.config.precision.cast_inputs or PRECISIONS[self.config.precision.name][0] == "fp32":
            return args, kwargs
        return _cast(args, self.param_dtype), _cast(kwargs, self.param_dtype)

    def _cast_outputs(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast(output, self.output_dtype) if self.output_dtype is not None else output

    def forward(self, args: tuple, kwargs: dict, method: str = "forward") -> Any:
        """The forward of this rank's micro-batch on the compute copy (the masters' current values,
        managed params in the compute dtype, ignored ones as they are); another ``method`` of the
        root gets the root's casts as its forward does (what register_fsdp_forward_method promises)."""
        computed = dict(self.compute.named_parameters())
        with torch.no_grad():
            for path, master in self.master.named_parameters():
                target = computed[path]
                dtype = master.dtype if self.plans[path].kind == "ignored" else self.param_dtype
                target.data = master.detach().to(dtype).clone()
        if method == "forward":
            return self.compute(*args, **kwargs)
        args, kwargs = self._cast_inputs(self.compute, args, kwargs)
        return self._cast_outputs(self.compute, args, getattr(self.compute, method)(*args, **kwargs))

    def after_backward(self, reduces: list[bool]) -> None:
        """Take this backward's grads: ignored params keep theirs locally; the others accumulate in
        the reduce dtype and, when the implementation reduces at this backward, are reduced as
        promised and added to the fp32 master grads."""
        masters = dict(self.master.named_parameters())
        self.got_grad = set()
        for path, param in self.compute.named_parameters():
            plan, master = self.plans[path], masters[path]
            unused = path in self.zeros_for and plan.kind != "ignored" and master.requires_grad
            if param.grad is None and unused:
                param.grad = torch.zeros_like(param, dtype=grad_dtype(param))
            if param.grad is None:
                continue
            self.got_grad.add(path)
            grad, param.grad = param.grad, None
            if plan.kind == "ignored":
                grad = grad.to(grad_dtype(master))
                master.grad = grad if master.grad is None else master.grad + grad
                continue
            held = grad.to(self.reduce_dtype)
            if path in self._held:
                held = self._held.pop(path) + held
            if not reduces[plan.group]:
                self._held[path] = held
                continue
            carried, keeps = path in self._replica_parts, self._keeps_replica_part(plan)
            reduced, order = self._reduce(held, plan)
            reduced = reduced.to(grad_dtype(master))
            if order is not None:  # added to the bound of what the master grad holds
                kept = self.order.get(path) if master.grad is not None else None
                self.order[path] = order if kept is None else kept + order
            landed = self._landed.pop(path, None)
            still_in = landed is not None and master.grad is not None and landed[0] is master.grad
            if keeps:  # a per-replica part: added now, replaced when the all-reduce next runs
                before = landed[1] if still_in else (None if master.grad is None else master.grad.clone())
                master.grad = reduced if master.grad is None else master.grad + reduced
                self._landed[path] = (master.grad, before)
            elif carried and still_in:  # the parts in the grad give way to the result that holds them
                master.grad = reduced if landed[1] is None else landed[1] + reduced
            else:
                master.grad = reduced if master.grad is None else master.grad + reduced

    def _keeps_replica_part(self, plan: ParamPlan) -> bool:
        """Whether a reduction of ``plan``'s param now lands a per-replica part (HSDP, all-reduce off)."""
        return self.meshes.replicate_group(plan.mesh) is not None and not self.all_reduce[plan.group]

    @property
    def keeps_replica_parts(self) -> bool:
        """Whether per-replica parts are kept for the next all-reducing backward (the implementation
        holds its own then, FSDP2's partial output)."""
        return bool(self._replica_parts)

    def reset_iter_state(self) -> None:
        """The root's ``reset_iter_state()``: kept per-replica parts are dropped."""
        self._replica_parts.clear()
        self._landed.clear()

    def _reduce(self, grad: torch.Tensor, plan: ParamPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reduction promised for one param: the sum over its ranks divided by the call's divide
        factor where set (else the op's mean or sum), then the all-reduce hook (where the reduction
        ends in the all-reduce: not on a 2-D mesh with the all-reduce off), then the scaling factor.
        With it, in half precision, its order's bound from the terms' magnitudes summed alike (else None)."""
        group = self.config.groups[plan.group]
        shards, replicas = self.meshes.shard_group(plan.mesh), self.meshes.replicate_group(plan.mesh)
        mean = self.ops[plan.group] == "avg" and group.divide_factor is None
        # a backend without AVG (gloo before torch 2.8): the sum, divided by the ranks it ran over
        op = dist.ReduceOp.AVG if mean and averages(shards) else dist.ReduceOp.SUM
        grad = grad.contiguous()
        if group.divide_factor is not None:
            grad = grad * (1.0 / group.divide_factor)
        half = self.reduce_dtype in (torch.bfloat16, torch.float16)
        magnitude = grad.detach().double().abs() if half else None  # the sum of the terms' magnitudes
        dist.all_reduce(grad, op=op, group=shards)
        if magnitude is not None:
            dist.all_reduce(magnitude, group=shards)
        ranks = shards.size()
        as_sum = ranks if op == dist.ReduceOp.AVG else 1  # what turns the collective's output into the sum
        if self._keeps_replica_part(plan):
            kept = self._replica_parts.get(plan.path)
            self._replica_parts[plan.path] = grad * as_sum if kept is None else kept + grad * as_sum
        if replicas is not None and self.all_reduce[plan.group]:
            kept = self._replica_parts.pop(plan.path, None)
            if kept is not None:  # the parts kept since the all-reduce was last on, reduced with this one
                grad = grad + kept / as_sum
                magnitude = None if magnitude is None else magnitude + kept.detach().double().abs()
            dist.all_reduce(grad, op=op, group=replicas)
            if magnitude is not None:
                dist.all_reduce(magnitude, group=replicas)
            ranks *= replicas.size()
        if mean and op == dist.ReduceOp.SUM:
            grad.div_(ranks)
        order = None if magnitude is None else self._order_of(magnitude, ranks, mean)
        if group.hook and (replicas is None or self.all_reduce[plan.group]):
            HOOK_MAPS[group.hook_map](grad)  # on the sum over every rank (the replicas' too)
        if group.scaling_factor is not None:
            grad = grad * group.scaling_factor
            order = None if order is None else order * abs(group.scaling_factor)
        return grad, order

    def _order_of(self, magnitude: torch.Tensor, ranks: int, mean: bool) -> torch.Tensor:
        """How far another order of a half-precision reduction over ``ranks`` (a mean where ``mean``)
        may move its result, element-wise, from the sum of its terms' magnitudes (a bound on every
        partial sum). The hooks' maps (halving, negatives halved) move it less, never more."""
        to_mean = ranks if mean else 1
        additions = ranks - 1 + (1 if mean and ranks & (ranks - 1) else 0)  # an inexact division rounds once more
        return reduction_order(magnitude, additions, self.reduce_dtype) / to_mean

    def master_dtype(self, path: str) -> torch.dtype:
        """The dtype the sharded param ``path`` is promised to have (its master's)."""
        return self.master.get_parameter(path).dtype

    def zero_grad(self, set_to_none: bool) -> None:
        self._held.clear()
        self.order.clear()
        self._landed.clear()  # the kept per-replica parts stay (FSDP2's rule), no longer in a grad
        for param in self.master.parameters():
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()
