"""On every rank: one configuration run against what the API promises for it.

``run_example(config_json)`` builds the configuration's model twice from its seed: one copy is
sharded through ``impl`` as the configuration says and trained on this rank's micro-batches, the
other is the reference, ``PromisedReference``: an unsharded copy per rank that computes in the
policy's compute dtype with the casts the API makes at every sharded module's boundary, keeps its
local grads in the reduce dtype, and reduces them itself, per param, over the process groups and
with the reduce op the API promises for that param at that moment (the global-batch mean, or the
sum; per replica group with the all-reduce off; nothing for ignored params, no grad for frozen
ones; accumulated across held-back micro-batches). It is the same explicit data-parallel baseline
as the L1-L3 cases' ``SameDtypeReference``, generalised to per-param groups and ops, and to
FSDP2's per-module reduction controls (divide factor, scaling factor, all-reduce hook). The model
under test may come from deferred init (meta, ``to_empty``, rank 0's full state dict) or be cast to
float64 after sharding: the reference is the materialised model, in float64 where cast.

Beside the numbers (loss per micro-batch, grads, the global grad norm and params after each step,
within the registry's row for the configuration's precision), the invariants every configuration
keeps: local shard shapes follow the ``torch.chunk`` rule and placements are as placed; after
forward and backward the params hold their shards or the whole as the reshard settings say, and
the storage a module's params used while unsharded is freed once it is sharded again; each
forward and backward all-gathers every sharded module it needs once and no more (the bytes on the
wire at their minimum; a recompute may fetch a module once more); the reductions carry exactly the
trainable managed params (none of the frozen or ignored ones); the
collectives run in the policy's dtypes; the output keeps its structure and dtype; a state dict
taken at any point holds the sharded params, and loading it back changes nothing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.utils._pytree import tree_map

from tests.kit.checks import CaseContext, PreconditionFailed
from tests.kit.devices import compute_device
from tests.kit.explore.gathers import GatherLedger, Unit
from tests.kit.explore.grammar import HALF_PRECISION_LOSS_SCALE, Out, Tied, batch, build, first_tensor, loss_of
from tests.kit.explore.space import PRECISIONS, Config, Group, checkpointed
from tests.kit.explore.storages import UnshardedStorages
from tests.kit.layout import local_numel, shard_shape
from tests.kit.recorder import CollectiveRecorder, record_collectives
from tests.kit.reference import full
from tests.kit.surface import impl
from tests.kit.tolerances import Tolerance, tolerance

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HOOK_SCALE = 0.5  # the all-reduce hook L4 sets multiplies the reduced grads by this, in place (exact)


def precision_row(config: Config) -> str:
    """The precision-matrix row judging a configuration."""
    param = PRECISIONS[config.precision.name][0]
    if param == "bf16":
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


class PromisedReference:
    """What the API promises, computed without sharding (module docstring)."""

    def __init__(self, config: Config, meshes: Meshes, plans: dict[str, ParamPlan]) -> None:
        self.config = config
        self.meshes = meshes
        self.plans = plans
        self.master = build(config)
        if config.cast:  # the model under test is cast to float64 after sharding: its reference all along
            self.master.double()
        self.compute = copy.deepcopy(self.master)
        param, reduce = PRECISIONS[config.precision.name]
        self.param_dtype = torch.float64 if config.cast else DTYPES[param]
        self.reduce_dtype = DTYPES[reduce] if reduce else self.param_dtype
        self.output_dtype = DTYPES[config.precision.output] if config.precision.output else None
        self.ops = ["avg"] * len(config.groups)  # the reduce op of each call's groups
        self.all_reduce = [True] * len(config.groups)
        self._held: dict[str, torch.Tensor] = {}
        self.got_grad: set[str] = set()  # params whose grad the last backward computed
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
            if param.grad is None:
                continue
            self.got_grad.add(path)
            grad, param.grad = param.grad, None
            plan = self.plans[path]
            master = masters[path]
            if plan.kind == "ignored":
                master.grad = grad.to(master.dtype) if master.grad is None else master.grad + grad.to(master.dtype)
                continue
            held = grad.to(self.reduce_dtype)
            if path in self._held:
                held = self._held.pop(path) + held
            if not reduces[plan.group]:
                self._held[path] = held
                continue
            reduced = self._reduce(held, plan).to(master.dtype)
            master.grad = reduced if master.grad is None else master.grad + reduced

    def _reduce(self, grad: torch.Tensor, plan: ParamPlan) -> torch.Tensor:
        """The reduction promised for one param: the sum over its ranks divided by the call's divide
        factor where set (else the op's mean or sum), then the all-reduce hook (where the reduction
        ends in the all-reduce: not on a 2-D mesh with the all-reduce off), then the scaling factor."""
        group = self.config.groups[plan.group]
        op = dist.ReduceOp.AVG if self.ops[plan.group] == "avg" else dist.ReduceOp.SUM
        grad = grad.contiguous()
        if group.divide_factor is not None:
            op = dist.ReduceOp.SUM
            grad = grad * (1.0 / group.divide_factor)
        dist.all_reduce(grad, op=op, group=self.meshes.shard_group(plan.mesh))
        replicas = self.meshes.replicate_group(plan.mesh)
        if replicas is not None and self.all_reduce[plan.group]:
            dist.all_reduce(grad, op=op, group=replicas)
        if group.hook and (replicas is None or self.all_reduce[plan.group]):
            grad = grad * HOOK_SCALE
        if group.scaling_factor is not None:
            grad = grad * group.scaling_factor
        return grad

    def master_dtype(self, path: str) -> torch.dtype:
        """The dtype the sharded param ``path`` is promised to have (its master's)."""
        return self.master.get_parameter(path).dtype

    def zero_grad(self, set_to_none: bool) -> None:
        self._held.clear()
        for param in self.master.parameters():
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()


class Example:
    """One configuration on this rank: the model under test beside its reference, checked."""

    def __init__(self, config: Config, ctx: CaseContext) -> None:
        self.config, self.ctx = config, ctx
        self.tol: Tolerance = tolerance(precision_row(config))
        half = PRECISIONS[config.precision.name][0] != "fp32"
        self.loss_scale = HALF_PRECISION_LOSS_SCALE if half else 1.0
        self.meshes = Meshes(ctx, config)
        with torch.device("meta") if config.init == "meta" else contextlib.nullcontext():
            self.model = build(config)
        self.plans = param_plans(config, self.model)
        self.reference = PromisedReference(config, self.meshes, self.plans)
        self.shapes = {path: tuple(p.shape) for path, p in self.model.named_parameters()}
        self.hsdp_modules: list[list[Any]] = []
        self.after_forward: dict[tuple[int, str], dict[str, int]] = {}
        self.reached: set[int] = set()  # the calls whose modules backward reached in this micro-batch
        self._recording_forward = False
        self.forward_prefetch: dict[Unit, list[Unit]] = {}  # unit -> the units its forward prefetches
        self.backward_prefetch: dict[Unit, list[Unit]] = {}  # unit -> the units its backward prefetches
        self.started: list[Unit] = []  # the units whose forward has started, in this forward
        self.finished: list[Unit] = []  # the units in the order their forwards finished, in this forward
        # per unit whose backward started, in order: the elements all-gathered in backward by then
        self.backward_starts: list[tuple[Unit, int]] = []
        self._backward_rec: CollectiveRecorder | None = None
        self._forward_rec: CollectiveRecorder | None = None
        self._where = ""
        # the effective reshard settings per call: None = True except for the root
        self.reshard_after_forward = [g.reshard_after_forward for g in config.groups]
        self.reshard_after_backward = [True] * len(config.groups)
        skipped = {unit for unit in self._units() if config.groups[unit[0]].skips_backward_gather}
        self.gathers = GatherLedger(*self._gather_sizes(), skip_backward=skipped)  # what forward/backward fetch
        self.storages = UnshardedStorages()  # what each unit used while unsharded, watched weakly

    # -- set-up --------------------------------------------------------------------------------
    def shard(self) -> None:
        """The configuration's fully_shard calls, bottom-up, then the layout checks."""
        by_id = {id(p): path for path, p in self.model.named_parameters()}
        for index, group in enumerate(self.config.groups):
            modules = [self.model.get_submodule(p) if p else self.model for p in group.paths]
            result = impl.fully_shard(modules if len(modules) > 1 else modules[0], **self._options(group, by_id))
            self.hsdp_modules.append(result if isinstance(result, list) else [result])
            for path, module in zip(group.paths, modules, strict=True):
                module.register_forward_hook(self._seen_after_forward(index, path))
                # first of its pre-forward hooks: before the implementation's own unshard
                module.register_forward_pre_hook(self._seen_start(index, path), prepend=True)
                # last of them: after the implementation's unshard, the module's params unsharded
                module.register_forward_pre_hook(self._seen_unsharded(index, path))
                if self._times_backward():
                    # torch wraps the output after every forward hook: this runs before the
                    # implementation's pre-backward hooks on the output it returned
                    module.register_full_backward_pre_hook(self._seen_backward_start(index, path))
            for module in self.hsdp_modules[-1]:
                self._set_controls(module, group)
        if self.config.prefetch:
            self._set_prefetch()
        if any(step.method != "forward" for step in self.config.steps):
            impl.register_fsdp_forward_method(self.model, "generate")
        if self.config.init == "meta":
            self._materialise()
        if self.config.cast == "to":
            self.model.to(torch.float64)
        elif self.config.cast == "double":
            self.model.double()
        self._check_layout()

    def _set_controls(self, module: Any, group: Group) -> None:
        """The call's own reduction and backward controls (FSDP2's setters act on one module)."""
        if group.divide_factor is not None:
            module.set_gradient_divide_factor(group.divide_factor)
        if group.force_sum:
            module.set_force_sum_reduction_for_comms(True)
        if group.scaling_factor is not None:
            module.set_gradient_scaling_factor(group.scaling_factor)
        if group.hook:
            module.set_all_reduce_hook(lambda reduced: reduced.mul_(HOOK_SCALE))
        if not group.unshard_in_backward:
            module.set_unshard_in_backward(False)
        if group.undone:  # set back: as if never set
            if group.force_sum:
                module.set_force_sum_reduction_for_comms(False)
            if not group.unshard_in_backward:
                module.set_unshard_in_backward(True)
        if group.unused_reduce:
            module.set_reduce_scatter_unused_params(True, recurse=False)
        if group.separate_reduce:
            module.set_separate_reduce_scatter_group(True, recurse=False)

    def _materialise(self) -> None:
        """Deferred init: the meta-built, sharded model's storage made on this rank's device, then
        filled from rank 0's full state dict (broadcast; the other ranks pass none), as FSDP2
        users load a checkpoint into a model too big for one device."""
        self.model.to_empty(device=compute_device())
        for path, param in self.model.named_parameters():
            self.ctx.true(
                f"after to_empty {path}: materialised (not on the meta device)", not impl.local(param).is_meta
            )
        if self._layout_broken():
            return  # a load into meta shards could only raise, and hide this
        for module in self.model.modules():
            if isinstance(module, Tied):
                module.tie()
        full_state = build(self.config).state_dict() if self.ctx.rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, full_state, options=options)

    def _options(self, group: Group, by_id: dict[int, str]) -> dict[str, Any]:
        named = dict(self.model.named_parameters())
        options: dict[str, Any] = {"mesh": self.meshes.of(group.mesh)}
        if group.reshard_after_forward is not None:
            options["reshard_after_forward"] = group.reshard_after_forward
        if not group.comm_fusion:
            options["comm_fusion"] = False
        if group.placements:

            def placement(param: nn.Parameter, placements: dict[str, str] = group.placements) -> Any:
                chosen = placements.get(by_id.get(id(param), ""))
                if chosen is None:
                    return None
                return impl.Replicate() if chosen == "Replicate()" else impl.Shard(int(chosen[6:-1]))

            options["shard_placement_fn"] = placement
        if group.ignored:
            options["ignored_params"] = [named[p] for p in group.ignored]
        if group.replicated:
            options["replicate_params"] = [named[p] for p in group.replicated]
        if group.offload:
            options["offload_policy"] = impl.CPUOffloadPolicy(pin_memory=False)
        policy = self._policy()
        if policy is not None:
            options["mp_policy"] = policy
        return options

    def _policy(self) -> Any:
        p = self.config.precision
        if p.name == "fp32" and p.output is None and p.cast_inputs:
            return None
        param, reduce = PRECISIONS[p.name]
        kwargs: dict[str, Any] = {}
        if param != "fp32":
            kwargs["param_dtype"] = DTYPES[param]
        if reduce:
            kwargs["reduce_dtype"] = DTYPES[reduce]
        if p.output:
            kwargs["output_dtype"] = DTYPES[p.output]
        if not p.cast_inputs:
            kwargs["cast_forward_inputs"] = False
        if p.main_grad:
            kwargs["apply_grad_on_fp32_main_grad"] = True
        return impl.MixedPrecisionPolicy(**kwargs)

    def _set_prefetch(self) -> None:
        """Each sharded module prefetches the one whose forward starts next, and in backward the one
        whose backward comes next (the reverse of the order forwards finish in): the lists a user
        writes for the model's order, so a prefetch never fetches a module that is done."""
        modules = {
            (index, path): hsdp
            for index, calls in enumerate(self.hsdp_modules)
            for path, hsdp in zip(self.config.groups[index].paths, calls, strict=True)
        }
        starts, finishes = self._unit_orders()
        for order, setter in (
            (starts, "set_modules_to_forward_prefetch"),
            (finishes[::-1], "set_modules_to_backward_prefetch"),
        ):
            for place, unit in enumerate(order[:-1]):
                following = order[place + 1 : place + 1 + self.config.prefetch_depth]
                getattr(modules[unit], setter)([modules[f] for f in following])
                lists = self.forward_prefetch if setter == "set_modules_to_forward_prefetch" else self.backward_prefetch
                lists[unit] = following

    def _unit_orders(self) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        """The units in the order their forwards start (pre-order of the module tree, which this
        grammar runs in registration order) and the order they finish (post-order)."""
        unit_of = {path: (index, path) for index, path in self._units()}
        starts: list[tuple[int, str]] = []
        finishes: list[tuple[int, str]] = []

        def walk(module: nn.Module, path: str) -> None:
            if path in unit_of:
                starts.append(unit_of[path])
            for name, child in module.named_children():
                walk(child, f"{path}.{name}" if path else name)
            if path in unit_of:
                finishes.append(unit_of[path])

        walk(self.model, "")
        return starts, finishes

    def _seen_start(self, index: int, module_path: str) -> Callable[..., None]:
        """A pre-forward hook of one module of call ``index``, run before the implementation's."""

        def start(module: nn.Module, args: tuple) -> None:
            if self._recording_forward and (index, module_path) not in self.started:
                self._check_started((index, module_path))

        return start

    def _check_started(self, unit: Unit) -> None:
        """Prefetch timing: when a module's forward starts (before its own unshard), the forward has
        all-gathered every module started before it and every module their forward lists prefetch
        (so a prefetched module's gather is issued before it starts), and nothing beyond them."""
        rec = self._forward_rec
        if rec is not None:
            due = set(self.started) | {t for u in self.started for t in self.forward_prefetch.get(u, [])}
            least = sum(self.gathers.gather(u)[0] for u in due)
            most = sum(self.gathers.gather(u)[1] for u in due)
            gathered = sum(c.numel for c in rec.calls if c.op == "all_gather" and c.group_size > 1)
            label = (
                f"{self._where} forward, as call {unit[0]}'s module starts: elements all-gathered so far "
                "(the modules started before it and those their lists prefetch)"
            )
            self.ctx.true(label, least <= gathered <= most, str(gathered), f"{least}..{most}")
        self.started.append(unit)

    def _seen_unsharded(self, index: int, module_path: str) -> Callable[..., None]:
        """A pre-forward hook of one module of call ``index``, run after the implementation's: the
        storages of its sharded params, unsharded now, watched until they are freed."""

        def unsharded(module: nn.Module, args: tuple) -> None:
            params = dict(self.model.named_parameters())
            own = self._own_numels(index, module_path)
            sharded = [impl.local(params[path]) for path in own if self.plans[path].kind == "sharded"]
            self.storages.note((index, module_path), sharded)

        return unsharded

    def _check_storage_freed(self, where: str) -> None:
        """Each module the ledger says is sharded again holds none of the storage its params used
        while unsharded: resharding frees it (FSDP2 resizes it to nothing)."""
        params = dict(self.model.named_parameters())
        for unit in self._units():
            if not self.gathers.is_sharded(unit) or unit not in self.storages.watched:
                continue
            shards = [impl.local(params[path]) for path in self._own_numels(*unit)]
            label = f"{where}, call {unit[0]} sharded: bytes still held of its unsharded params' storage"
            self.ctx.equal(label, self.storages.held(unit, shards), 0)

    def _times_backward(self) -> bool:
        """Whether backward prefetch timing is judged: each module's backward starts once, in the
        reverse of the order forwards finish (no recompute, no list call, one param group per call,
        every call gathered in backward, no registered method skipping the root's hooks)."""
        groups = self.config.groups
        return not (
            self.recompute
            or any(len(g.paths) > 1 or g.placements or g.skips_backward_gather for g in groups)
            or any(step.method != "forward" for step in self.config.steps)
        )

    def _seen_backward_start(self, index: int, module_path: str) -> Callable[..., None]:
        """A backward pre-hook of one module of call ``index``: the elements all-gathered in this
        backward when its backward starts, before the implementation's own pre-backward."""

        def start(module: nn.Module, grad_output: Any) -> None:
            rec = self._backward_rec
            if rec is not None:
                gathered = sum(c.numel for c in rec.calls if c.op == "all_gather" and c.group_size > 1)
                self.backward_starts.append(((index, module_path), gathered))

        return start

    def _backward_targets(self, unit: Unit) -> list[Unit]:
        """The modules ``unit``'s backward prefetches: its backward list where lists are set, else
        the module managing params whose forward finished just before its own (FSDP2's implicit
        prefetch: a call managing no params has no param group, so takes no part)."""
        if self.config.prefetch:
            return self.backward_prefetch.get(unit, [])
        order = [u for u in self.finished if any(self.plans[p].kind != "ignored" for p in self._own_numels(*u))]
        place = order.index(unit) if unit in order else 0
        return order[place - 1 : place] if place > 0 else []

    def _check_backward_starts(self, where: str) -> None:
        """Backward prefetch timing: when a module's backward starts (before its own hooks), this
        backward has all-gathered the modules whose backward started before it and those they
        prefetch (so a prefetched module's gather is issued before it starts), nothing beyond them;
        a prefetched module backward never reaches may or may not have been gathered."""
        units = [unit for unit, _ in self.backward_starts]
        reached = sorted(u for u in self._units() if u[0] in self.reached)
        if sorted(set(units)) != reached or len(set(units)) < len(units):
            return  # a module whose start torch could not see (no tensor output): its prefetch unknown
        for place, (unit, gathered) in enumerate(self.backward_starts):
            before = units[:place]
            due = set(before) | {t for u in before for t in self._backward_targets(u)}
            least = sum(self.gathers.gather(u)[0] for u in due if u[0] in self.reached)
            most = sum(self.gathers.gather(u)[1] for u in due)
            label = (
                f"{where} backward, as call {unit[0]}'s module starts: elements all-gathered so far "
                "(the modules whose backward started before it and those they prefetch)"
            )
            self.ctx.true(label, least <= gathered <= most, str(gathered), f"{least}..{most}")

    def _seen_after_forward(self, index: int, module_path: str) -> Callable[..., None]:
        """A forward hook of one module of call ``index``: its own params' numels once its forward
        is done (a list call's modules each finish their forward at their own time)."""

        def seen(module: nn.Module, args: tuple, output: Any) -> None:
            self._note_forward(index, module_path, output)

        return seen

    def _note_forward(self, index: int, module_path: str, output: Any) -> None:
        """A module of call ``index`` finished its forward: its params' numels now, and a hook that
        notes when backward reaches it."""
        if self._recording_forward and (index, module_path) not in self.after_forward:
            self.after_forward[(index, module_path)] = self._own_numels(index, module_path)
            self.finished.append((index, module_path))
            out = first_tensor(output)
            if out.requires_grad:  # backward reaches the module only through its output's grad
                out.register_hook(lambda grad: self.reached.add(index))

    def _own_numels(self, index: int, module_path: str | None = None) -> dict[str, int]:
        """Elements held of the params of call ``index`` (of its module ``module_path`` only)."""
        params = dict(self.model.named_parameters())
        return {
            path: local_numel(params[path])
            for path, plan in self.plans.items()
            if plan.group == index and (module_path is None or module_path == "" or path.startswith(module_path + "."))
        }

    def _expected_local(self, plan: ParamPlan) -> tuple[int, ...]:
        shape = self.shapes[plan.path]
        if plan.kind != "sharded":
            return shape
        size, place = self.meshes.shard_coordinate(plan.mesh)
        return shard_shape(shape, size, place, plan.dim)

    def _check_layout(self) -> None:
        params = dict(self.model.named_parameters())
        for path, plan in self.plans.items():
            param = params[path]
            local = tuple(impl.local(param).shape)
            self.ctx.equal(f"layout {path}: local shape", str(local), str(self._expected_local(plan)))
            self.ctx.equal(f"layout {path}: dtype", str(param.dtype), str(self.reference.master_dtype(path)))
            if plan.kind == "ignored":
                self.ctx.true(
                    f"layout {path}: ignored, a plain tensor", not impl.is_sharded(param), type(param).__name__
                )
                continue
            self.ctx.true(f"layout {path}: sharded tensor", impl.is_sharded(param), type(param).__name__)
            placements = [str(p) for p in impl.placements(param)]
            self.ctx.equal(f"layout {path}: placements", str(placements), str(self._placements(plan)))
        for index in range(len(self.config.groups)):
            self._check_shard_storage(index, params)

    def _check_shard_storage(self, index: int, params: dict[str, nn.Parameter]) -> None:
        """What call ``index``'s params hold once sharded is no more than their shards: the distinct
        storages under its local shards at most each sharded param's padded shard (ceil(rows / ranks)
        rows) and each replicated param whole. A shard that is a view of the whole tensor fails it
        (nothing would be freed by sharding)."""
        held: dict[int, int] = {}
        bound = 0
        for path, plan in self.plans.items():
            if plan.group != index or plan.kind == "ignored":
                continue
            local = impl.local(params[path])
            storage = local.untyped_storage()
            held[storage.data_ptr()] = storage.nbytes()
            size, _ = self.meshes.shard_coordinate(plan.mesh)
            shape = shard_shape(self.shapes[path], size, 0, plan.dim) if plan.kind == "sharded" else self.shapes[path]
            bound += torch.Size(shape).numel() * local.element_size()
        label = f"layout call {index}: bytes of storage under its local shards (at most their padded shards)"
        self.ctx.true(label, sum(held.values()) <= bound, str(sum(held.values())), f"<= {bound}")

    def _layout_broken(self) -> bool:
        """Whether a layout check failed on any rank (one all-reduce, so every rank stops together)."""
        broken = torch.tensor([float(any(not check.passed for check in self.ctx.checks))])
        dist.all_reduce(broken, op=dist.ReduceOp.MAX)
        return bool(broken.item())

    def _placements(self, plan: ParamPlan) -> list[str]:
        inner = str(impl.Replicate()) if plan.kind == "replicated" else str(impl.Shard(plan.dim))
        if plan.mesh == "mesh" and self.config.hsdp:
            return [str(impl.Replicate()), inner]
        return [inner]

    # -- training ------------------------------------------------------------------------------
    def run(self) -> None:
        self.shard()
        if self._layout_broken():
            return  # training on a wrong layout only repeats the failure, or raises and hides it
        opts = self._optimizer(self.model.parameters()), self._optimizer(self.reference.master.parameters())
        steps = self.config.steps
        for index, step in enumerate(steps):
            if step.reset_iter_state:  # nothing in flight here: it only reshards
                self.hsdp_modules[-1][0].reset_iter_state()
                self.gathers.maybe_resharded()
            self._controls(step)
            if step.state_dict_at == "before":
                self._state_dict_round_trip(f"step {index} before forward")
            if step.unshard is not None and not (index and step.unshard_how == "across step"):
                self._unshard(step.unshard, step.unshard_how)
            for micro, syncs in enumerate(step.micro):
                self._micro(index, micro, step, syncs)
                if micro == 0 and step.zero_held:  # what was held back is dropped, as the plan's L1-04 says
                    self.hsdp_modules[-1][0].zero_grad(True)
                    self.reference.zero_grad(True)
            if not all(self.reshard_after_backward):
                # kept unsharded after backward: the user reshards before reading the grads or
                # stepping the shards (the contract of set_reshard_after_backward)
                for modules in self.hsdp_modules:
                    for module in modules:
                        module.reshard()
                self.gathers.all_resharded()
                self._check_storage_freed(f"step {index} after reshard()")
            self._check_grads(f"step {index}")
            following = steps[index + 1] if index + 1 < len(steps) else None
            across = following is not None and following.unshard is not None and following.unshard_how == "across step"
            handle = self.hsdp_modules[following.unshard][0].unshard(async_op=True) if across else None
            with impl.optimizer_step():
                for opt in opts:
                    opt.step()
            self._zero_grad(step, opts)
            self._check_params(f"step {index}")
            if across:  # issued before the step, waited after it: the next forward must use the stepped params
                if handle is not None:
                    handle.wait()
                # unsharded but stale: gathered again at the wait or at the next unshard, either way
                self.gathers.forget([self._first_unit(following.unshard)])

    def _unshard(self, index: int, how: str) -> None:
        """Call ``index``'s first module unsharded before the step's first forward, as ``how`` says."""
        module = self.hsdp_modules[index][0]
        if how == "sync" or how == "then reshard":
            self.ctx.true(f"unshard() of call {index} returns None", module.unshard() is None)
        else:
            handle = module.unshard(async_op=True)
            if handle is not None:
                handle.wait()
        if how == "then reshard":
            module.reshard()
        self.gathers.mark([self._first_unit(index)], how != "then reshard")

    def _first_unit(self, index: int) -> Unit:
        """Call ``index``'s first module, the one ``unshard`` is called on."""
        return index, self.config.groups[index].paths[0]

    def _optimizer(self, params: Any) -> torch.optim.Optimizer:
        if self.config.optimizer == "adamw":
            # eps well above the rounding of a zero true grad, so it cannot become a full lr step
            return torch.optim.AdamW(params, lr=1e-3, eps=1e-3, weight_decay=0.01)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    def _controls(self, step: Any) -> None:
        root = self.hsdp_modules[-1][0]
        ref = self.reference
        if step.reduce_op:
            if step.reduce_op_group is None:
                root.set_reduce_op_type(step.reduce_op)
                ref.ops = [step.reduce_op] * len(ref.ops)
            else:
                for module in self.hsdp_modules[step.reduce_op_group]:
                    module.set_reduce_op_type(step.reduce_op, recurse=False)
                ref.ops[step.reduce_op_group] = step.reduce_op
        if step.all_reduce is not None and step.all_reduce_group is None:
            root.set_requires_all_reduce(step.all_reduce)
            ref.all_reduce = [step.all_reduce] * len(ref.all_reduce)
        elif step.all_reduce is not None:
            for module in self.hsdp_modules[step.all_reduce_group]:
                module.set_requires_all_reduce(step.all_reduce, recurse=False)
            ref.all_reduce[step.all_reduce_group] = step.all_reduce
        for setter, control in (
            ("set_reshard_after_forward", step.reshard_after_forward),
            ("set_reshard_after_backward", step.reshard_after_backward),
        ):
            if control:
                self._reshard_control(setter, *control)

    def _reshard_control(self, setter: str, index: int, flag: bool) -> None:
        """A reshard setter on call ``index`` alone (``recurse=False``), or on the root for every
        call (index -1, the default ``recurse=True``)."""
        settings = self.reshard_after_forward if setter == "set_reshard_after_forward" else self.reshard_after_backward
        if index < 0:
            getattr(self.hsdp_modules[-1][0], setter)(flag)
            settings[:] = [flag] * len(settings)
            return
        for module in self.hsdp_modules[index]:
            getattr(module, setter)(flag, recurse=False)
        settings[index] = flag

    def _micro(self, step_index: int, micro: int, step: Any, syncs: bool) -> None:
        where = f"step {step_index} micro {micro}"
        root = self.hsdp_modules[-1][0]
        last = micro == len(step.micro) - 1
        if step.hold_with_last_backward:
            root.set_is_last_backward(last)
        elif step.sync_group is None:
            root.set_requires_gradient_sync(syncs)
        else:  # only this call holds back; the others reduce at every backward
            for module in self.hsdp_modules[step.sync_group]:
                module.set_requires_gradient_sync(syncs, recurse=False)
        args, kwargs = batch(self.config, step_index, micro, self.ctx.rank)
        self.after_forward.clear()
        self.reached.clear()
        gathers, calls = self.gathers.forward(), self.gathers.forward_calls()
        out, forward = self._forward(step, args, kwargs, where)
        self._check_gathers(f"{where} forward", forward, gathers, calls)
        self.gathers.after_forward(self._resharded_after_forward(), self._rows_gather)
        taken = None
        if step.state_dict_at == "between" and last:  # loaded back after backward: torch's in-place rule
            taken = self._state_dict_check(f"{where} between forward and backward")
        ordered = self._ordered_pairs()
        self.backward_starts = []
        with record_collectives() as backward:
            self._backward_rec = backward
            loss = loss_of(out, self.loss_scale)
            loss.backward()
            self._backward_rec = None
        self._check_gathers(f"{where} backward", backward, self.gathers.backward(self.reached, self.recompute))
        self._check_backward_order(where, backward, ordered)
        if self._times_backward():
            self._check_backward_starts(where)
        self.gathers.after_backward(self.reached, self.reshard_after_backward)
        self._check_storage_freed(f"{where} after backward")
        rec = CollectiveRecorder()
        rec.calls = forward.calls + backward.calls
        ref_out = self.reference.forward(args, kwargs, step.method)
        ref_loss = loss_of(ref_out, self.loss_scale)
        ref_loss.backward()
        held = not (syncs or step.hold_with_last_backward)  # the calls holding back (their sync off)
        reduces = [not held or step.sync_group not in (None, i) for i in range(len(self.config.groups))]
        self.reference.after_backward(reduces)
        self.ctx.close(f"{where} loss", loss, ref_loss, self.tol.loss)
        self._check_output(where, out, ref_out)
        self._check_reshard(where)
        self._check_collectives(where, rec, reduces)
        if taken is not None:  # loading reshards: after the checks of what backward left
            self.model.load_state_dict(taken)
        if step.state_dict_at == "after" and last:
            self._state_dict_round_trip(f"{where} after backward")

    def _forward(self, step: Any, args: tuple, kwargs: dict, where: str) -> tuple[Any, CollectiveRecorder]:
        """The model's forward (or its registered method) with its collectives recorded and the
        prefetch timing checked as each sharded module starts."""
        with record_collectives() as forward:
            self._recording_forward, self._forward_rec, self._where = True, forward, where
            self.started, self.finished = [], []
            if step.method != "forward":  # the registered method gathers the root first, no hook of it runs
                self._check_started((len(self.config.groups) - 1, ""))
            if step.method == "forward":
                out = self.model(*args, **kwargs)
            else:  # a registered method runs outside __call__: no module hook of the root sees it
                out = getattr(self.model, step.method)(*args, **kwargs)
                self._note_forward(len(self.config.groups) - 1, "", out)
            self._recording_forward, self._forward_rec = False, None
        return out, forward

    def _ordered_pairs(self) -> list[tuple[Unit, Unit]]:
        """The pairs (first, second) of one backward prefetch list whose all-gathers the coming
        backward must issue in that order, where the recorder tells them apart: both sharded now
        (one whole gather each, fused), sizes no other module shares, no recompute in between."""
        if self.recompute or self.config.prefetch_depth < 2:
            return []
        sizes = self.gathers.sizes
        pairs = []
        listed = [
            pair for targets in self.backward_prefetch.values() for pair in zip(targets, targets[1:], strict=False)
        ]
        for first, second in listed:
            whole = all(
                self.gathers.gather(u) == (sizes[u], sizes[u]) and sizes[u] > 0 and self.gathers.calls[u] == 1
                for u in (first, second)
            )
            unique = all(sum(size == sizes[u] for size in sizes.values()) == 1 for u in (first, second))
            if whole and unique:
                pairs.append((first, second))
        return pairs

    def _check_backward_order(self, where: str, rec: CollectiveRecorder, pairs: list[tuple[Unit, Unit]]) -> None:
        """Backward prefetch lists issue their all-gathers in the lists' order (a module gathered on
        demand comes after those prefetched ahead of it, so the order holds without a prefetch too)."""
        gathered = [c.numel for c in rec.calls if c.op == "all_gather" and c.group_size > 1]
        sizes = self.gathers.sizes
        for first, second in pairs:
            if sizes[first] in gathered and sizes[second] in gathered:
                label = (
                    f"{where} backward: call {first[0]}'s module all-gathered before call {second[0]}'s (list order)"
                )
                self.ctx.true(label, gathered.index(sizes[first]) < gathered.index(sizes[second]))

    # -- all-gathers: each sharded module's params fetched once when needed, never more -------------
    def _units(self) -> list[Unit]:
        return [(index, path) for index, group in enumerate(self.config.groups) for path in group.paths]

    def _gather_sizes(self) -> tuple[dict[Unit, int], dict[Unit, int]]:
        """Per unit, the elements this rank contributes to gathering its sharded params (each shard
        padded to ceil(rows / ranks) rows; none where they shard over one rank: a copy, which may be
        skipped), and the all-gathers that takes (one; one per param with ``comm_fusion=False``)."""
        sizes: dict[Unit, int] = {}
        calls: dict[Unit, int] = {}
        for unit in self._units():
            shards = []
            for path in self._own_numels(*unit):
                plan = self.plans[path]
                size, _ = self.meshes.shard_coordinate(plan.mesh)
                if plan.kind == "sharded" and size > 1:
                    shards.append(torch.Size(shard_shape(self.shapes[path], size, 0, plan.dim)).numel())
            sizes[unit] = sum(shards)
            fused = self.config.groups[unit[0]].comm_fusion
            calls[unit] = 0 if not shards else 1 if fused else len(shards)
        return sizes, calls

    @property
    def recompute(self) -> bool:
        """Whether a block runs under activation checkpointing (a recompute may gather again)."""
        return checkpointed(self.config.body)

    def _resharded_after_forward(self) -> list[bool | int]:
        """Each call's effective reshard_after_forward: None reshards all but the root; an int ``k``
        stays an int where it keeps rows of ``k`` ranks (1 is False, the shard group's size True)."""
        last = len(self.config.groups) - 1
        return [self._effective(i, flag, last) for i, flag in enumerate(self.reshard_after_forward)]

    def _effective(self, index: int, flag: bool | int | None, last: int) -> bool | int:
        if flag is None:
            return index != last
        if type(flag) is not int:
            return flag
        shard, _ = self.meshes.shard_coordinate(self.config.groups[index].mesh)
        return False if flag == 1 else True if flag == shard else flag

    def _rows_gather(self, unit: Unit, k: int) -> tuple[int, int]:
        """(least, most) elements this rank contributes to gathering ``unit`` back from rows of
        ``k`` ranks: its row's share of each sharded param (its chunk of the unpadded param), up to
        1/k of the param as padded for the whole shard group (FSDP2 keeps that padding)."""
        least = most = 0
        for path in self._own_numels(*unit):
            plan = self.plans[path]
            size, _ = self.meshes.shard_coordinate(plan.mesh)
            if plan.kind != "sharded" or size == 1:
                continue
            least += torch.Size(shard_shape(self.shapes[path], k, 0, plan.dim)).numel()
            most += size * torch.Size(shard_shape(self.shapes[path], size, 0, plan.dim)).numel() // k
        return least, most

    def _check_gathers(self, where: str, rec: Any, bounds: tuple[int, int], calls: int | None = None) -> None:
        gathers = [c for c in rec.calls if c.op == "all_gather" and c.group_size > 1]
        gathered = sum(c.numel for c in gathers)
        least, most = bounds
        label = f"{where}: elements all-gathered (each sharded module it needs, once)"
        self.ctx.true(label, least <= gathered <= most, str(gathered), f"{least}..{most}")
        if calls is not None and least == most and "comm_fusion" in impl.features:
            label = f"{where}: all-gathers (one per module, one per param with comm_fusion=False)"
            self.ctx.equal(label, len(gathers), calls)

    def _check_output(self, where: str, out: Any, ref_out: Any) -> None:
        self.ctx.equal(f"{where} output type", type(out).__name__, type(ref_out).__name__)
        received, promised = self.model.received, self.reference.compute.received
        self.ctx.equal(f"{where} dtype of the input the root module's forward received", received, promised)
        if isinstance(out, (dict, Out)) or isinstance(ref_out, (dict, Out)):
            keys = sorted(out) if isinstance(out, dict) else sorted(vars(out)) if isinstance(out, Out) else []
            ref_keys = sorted(ref_out) if isinstance(ref_out, dict) else sorted(vars(ref_out))
            self.ctx.equal(f"{where} output fields", str(keys), str(ref_keys))
        self.ctx.equal(f"{where} output dtype", str(first_tensor(out).dtype), str(first_tensor(ref_out).dtype))

    def _check_reshard(self, where: str) -> None:
        after_forward = self._resharded_after_forward()
        for (index, _), numels in sorted(self.after_forward.items()):
            setting = self.reshard_after_forward[index]
            label = f"{where} after forward, call {index} reshard_after_forward={setting}"
            self._numels(label, numels, after_forward[index])
        for index in sorted(self.reached):  # a call backward never reached stays as forward left it
            resharded = self.reshard_after_backward[index]
            kept = after_forward[index] if self.config.groups[index].skips_backward_gather else False
            self._numels(
                f"{where} after backward, call {index} reshard_after_backward={resharded}",
                self._own_numels(index),
                True if resharded else kept,  # not gathered in backward: as forward left it
            )

    def _numels(self, label: str, numels: dict[str, int], resharded: bool | int) -> None:
        """Each sharded param holds its shard (True), the whole param (False), or its chunk of a row
        of ``k`` ranks (an int: cut on the placement's dim like torch.chunk; FSDP2 cuts dim 0, the
        same numel wherever it can shard, as it shards dims other than 0 only evenly)."""
        for path, held in numels.items():
            plan = self.plans[path]
            if plan.kind != "sharded":
                continue
            if type(resharded) is int:
                _, place = self.meshes.shard_coordinate(plan.mesh)
                shape = shard_shape(self.shapes[path], resharded, place % resharded, plan.dim)
            else:
                shape = self._expected_local(plan) if resharded else self.shapes[path]
            want = torch.Size(shape).numel()
            self.ctx.equal(f"{label}: {path} local numel", held, want)

    def _check_collectives(self, where: str, rec: CollectiveRecorder, reduces: list[bool]) -> None:
        param, _ = PRECISIONS[self.config.precision.name]
        compute, reduce = self.reference.param_dtype, self.reference.reduce_dtype
        gathers = {str(c.dtype) for c in rec.of("all_gather")}
        self.ctx.true(f"{where} all-gather dtypes", gathers <= {str(compute)}, str(sorted(gathers)), str(compute))
        reductions = rec.of("reduce_scatter") + [c for c in rec.of("all_reduce")]
        dtypes = {str(c.dtype) for c in reductions}
        self.ctx.true(f"{where} reduction dtypes", dtypes <= {str(reduce)}, str(sorted(dtypes)), str(reduce))
        # a reduce-scatter over one rank is a copy an implementation may skip: only real ones count
        scattered = sum(c.numel for c in rec.of("reduce_scatter") if c.group_size > 1)
        label = f"{where} elements reduce-scattered (the trainable sharded params only)"
        self.ctx.equal(label, scattered, self._scatter(reduces))
        if not any(reduces):
            self.ctx.equal(f"{where} all-reduces while held back", len(rec.of("all_reduce")), 0)

    def _scatter(self, reduces: list[bool]) -> int:
        """What this rank puts into the reduce-scatters of one backward that reduces: each trainable
        sharded param padded to ceil(rows / ranks) rows, times the ranks of its shard group."""
        total = 0
        for plan in self.plans.values():
            if plan.kind != "sharded" or plan.path not in self.reference.got_grad:  # frozen, or no grad
                continue
            if not reduces[plan.group]:  # held back
                continue
            size, _ = self.meshes.shard_coordinate(plan.mesh)
            if size > 1:
                total += size * torch.Size(shard_shape(self.shapes[plan.path], size, 0, plan.dim)).numel()
        return total

    def _check_grads(self, where: str) -> None:
        params = dict(self.model.named_parameters())
        masters = dict(self.reference.master.named_parameters())
        total, ref_total = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for path in self.plans:
            grad, ref_grad = params[path].grad, masters[path].grad
            if grad is None or ref_grad is None:
                self.ctx.equal(f"{where} grad {path} present", grad is not None, ref_grad is not None)
                continue
            whole = full(grad)
            self.ctx.close(f"{where} grad {path}", whole, ref_grad, self.tol.grad)
            total += whole.double().square().sum()
            ref_total += ref_grad.double().square().sum()
        self.ctx.close(f"{where} grad norm", total.sqrt(), ref_total.sqrt(), self.tol.grad)

    def _zero_grad(self, step: Any, opts: tuple) -> None:
        if step.zero_grad == "optimizer":
            opts[0].zero_grad()
            self.reference.zero_grad(set_to_none=True)
            return
        set_to_none = step.zero_grad == "module"
        self.hsdp_modules[-1][0].zero_grad(set_to_none)
        self.reference.zero_grad(set_to_none)
        for path, param in self.model.named_parameters():
            grad = param.grad
            ok = grad is None if set_to_none else grad is None or not bool(full(grad).any())
            self.ctx.true(f"after zero_grad(set_to_none={set_to_none}): {path} grad cleared", ok)
            main = getattr(param, "main_grad", None) if self.config.precision.main_grad else None
            if main is not None:  # HyperParallel's fp32 main grad: cleared too (None or zeros)
                self.ctx.true(
                    f"after zero_grad(set_to_none={set_to_none}): {path} main grad cleared", not bool(full(main).any())
                )

    def _check_params(self, where: str) -> None:
        masters = dict(self.reference.master.named_parameters())
        for path, param in self.model.named_parameters():
            self.ctx.close(f"{where} param {path}", full(param), masters[path], self.tol.grad)

    def _state_dict_round_trip(self, where: str) -> None:
        """A state dict taken now holds the sharded params (the reference's values); loading it
        back raises nothing (the numbers after it show that it changed nothing)."""
        self.model.load_state_dict(self._state_dict_check(where))

    def _state_dict_check(self, where: str) -> dict[str, Any]:
        """The model's state dict, checked: every param there, sharded (but the ignored ones), with
        the reference's values."""
        state = self.model.state_dict()
        self.gathers.maybe_resharded()
        masters = dict(self.reference.master.named_parameters())
        for path, plan in self.plans.items():
            value = state.get(path)
            if value is None:
                self.ctx.true(f"{where}: state dict holds {path}", False)
                continue
            if plan.kind != "ignored":
                self.ctx.true(f"{where}: state dict {path} sharded", impl.is_sharded(value), type(value).__name__)
            held = full(value).detach()
            self.ctx.close(f"{where}: state dict {path} value", held, masters[path].detach(), self.tol.grad)
        return state


def run_example(config_json: str) -> dict[str, Any]:
    """Engine side: run one configuration on this rank; its checks, as a case's."""
    config = Config.from_json(config_json)
    ctx = CaseContext(None, dist.get_rank(), dist.get_world_size())
    torch.manual_seed(config.seed)
    try:
        Example(config, ctx).run()
    except PreconditionFailed:
        pass
    finally:
        from tests.kit.rank_runtime import keep

        keep(case_ctx=ctx, l4_config=config)
    return ctx.result()
