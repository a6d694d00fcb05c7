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
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.kit.explore.gathers import Unit
from tests.kit.explore.grammar import HALF_PRECISION_LOSS_SCALE, batch, build, loss_of
from tests.kit.explore.invariants import Invariants
from tests.kit.explore.lifetimes import Lifetimes
from tests.kit.explore.patterns import Patterns
from tests.kit.explore.promised import DTYPES, Meshes, PromisedReference, param_plans, precision_row
from tests.kit.explore.received import Received
from tests.kit.explore.setups import SetUps, registrations
from tests.kit.explore.space import PRECISIONS, Config, Group
from tests.kit.explore.storages import UnshardedStorages
from tests.kit.explore.timing import Timing
from tests.kit.explore.user_hooks import UserHooks
from tests.kit.judging.checks import CaseContext, PreconditionFailed
from tests.kit.judging.recorder import CollectiveRecorder, record_collectives
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import Tolerance, tolerance
from tests.kit.judging.trace import mark, traced
from tests.kit.runtime.devices import compute_device
from tests.kit.runtime.rank_runtime import keep


class Example(Invariants, Timing, Received, SetUps, UserHooks, Lifetimes, Patterns):
    """One configuration on this rank: the model under test beside its reference, checked."""

    def __init__(self, config: Config, ctx: CaseContext) -> None:
        self.config, self.ctx = config, ctx
        self.tol: Tolerance = tolerance(precision_row(config))
        half = PRECISIONS[config.precision.name][0] != "fp32" or config.grad_dtype
        self.loss_scale = HALF_PRECISION_LOSS_SCALE if half else 1.0
        self.meshes = Meshes(ctx, config)
        with torch.device("meta") if config.init else contextlib.nullcontext():
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
        self.gathers = self._ledger()  # what forward and backward fetch
        self.storages = UnshardedStorages()  # what each unit used while unsharded, watched weakly
        self.hook_inputs, self.stepped = {}, None  # what the all-reduce hooks received; params stepped
        # every name a param is registered under (a tied weight has two): the calls above its call see them all
        self.registered: dict[str, list[str]] = registrations(self.model)
        self.ignored_objects: dict[str, nn.Parameter] = {}  # ignored params, as their own call left them

    # -- set-up --------------------------------------------------------------------------------
    def shard(self) -> None:
        """The configuration's fully_shard calls, bottom-up, then the layout checks."""
        self._grad_dtype_before_sharding()
        by_id = {id(p): path for path, p in self.model.named_parameters()}
        self._watch_before_sharding()
        self._hook_before_sharding()
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
                self._set_controls(module, group, index)
            self._check_ignored_below(index)
        if self.config.prefetch:
            self._set_prefetch()
        if any(step.method != "forward" for step in self.config.steps):
            impl.register_fsdp_forward_method(self.model, "generate")
        if self.config.init:
            self._materialise()
        if self.config.cast:
            self._leave_gathered(self.config.cast_gathered)
        if self.config.cast == "to":
            self.model.to(torch.float64)
        elif self.config.cast == "double":
            self.model.double()
        if self.config.cast:  # FSDP2 reshards before it casts: the next forward gathers the cast shards
            self.gathers.all_resharded()
        self._hook_after_sharding()
        self._check_layout()
        self._check_kept_storages("after sharding")

    def _set_controls(self, module: Any, group: Group, index: int) -> None:
        """The call's own reduction and backward controls (FSDP2's setters act on one module)."""
        if group.divide_factor is not None and group.divide_alias:
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                module.set_reduce_scatter_divide_factor(group.divide_factor)
            deprecated = any(issubclass(w.category, (DeprecationWarning, FutureWarning)) for w in warned)
            self.ctx.true("set_reduce_scatter_divide_factor warns that it is deprecated", deprecated)
        elif group.divide_factor is not None:
            module.set_gradient_divide_factor(group.divide_factor)
        if group.force_sum:
            module.set_force_sum_reduction_for_comms(True)
        if group.scaling_factor is not None:
            factor = group.scaling_factor
            module.set_gradient_scaling_factor(
                torch.tensor(factor, device=compute_device()) if group.scaling_tensor else factor
            )
        if group.hook:
            module.set_all_reduce_hook(self._all_reduce_hook(index, group))
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

    # -- training ------------------------------------------------------------------------------
    def run(self) -> None:
        if self._refused_split_tie(self.shard):
            return  # refused as promised: nothing sharded to train
        if self._layout_broken():
            return  # training on a wrong layout only repeats the failure, or raises and hides it
        self.trace = traced(self.model, self.reference)  # the diagnosis's (tests.kit.judging.divergence)
        opts = self._before_training()
        if opts is None:
            return  # the first forward refused a weight two calls share, as promised
        steps = self.config.steps
        for index, step in enumerate(steps):
            self._toggle(step.toggle)  # a module's params frozen or unfrozen, as a user does between steps
            if step.reset_iter_state:  # nothing in flight here: it only reshards
                self.hsdp_modules[-1][0].reset_iter_state()
                self.reference.reset_iter_state()
                self.gathers.maybe_resharded()
            if step.fail is not None:
                self._failed_forward(index, step.fail)
            self._controls(step)
            if step.eval_forward:
                self._eval_forward(index, f"step {index}")
            if step.state_dict_at == "before":
                self._state_dict_round_trip(f"step {index} before forward")
            self._note_shards(when=self._all_sharded())  # only where the registered params are the shards
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
            self._check_hook_inputs(f"step {index}")
            self._check_grads(f"step {index}")
            self._check_user_hooks(f"step {index}")
            self._check_lifetimes(f"step {index}")
            following = steps[index + 1] if index + 1 < len(steps) else None
            across = following if following is not None and following.unshard_how == "across step" else None
            if self._end_step(index, step, opts, across):
                return  # the step refused, as promised: nothing stepped, nothing more to judge
            self._check_hooks_flat(f"step {index} end", pending=across is not None and across.unshard is not None)
        self._check_early_state_dict()

    def _end_step(self, index: int, step: Any, opts: tuple, across: Any) -> bool:
        """The optimizer step and zero_grad, with the next step's "across step" unshard issued where
        it says (before clip_grad_norm_, before the step, or before zero_grad) and its handle waited
        after them or never: the next forward, or a prefetch in it, must use the stepped params.
        True where the model's optimizer step was refused (``Patterns._refused``)."""
        at = across.across_at if across is not None and across.unshard is not None else None
        handle = None
        if at in ("clip", "step"):
            handle = self.hsdp_modules[across.unshard][0].unshard(async_op=True)
        if at == "clip":  # no clipping (an infinite bound scales by exactly 1): the norm's collectives meet the gather
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), math.inf)
        mark("optimizer")
        with impl.optimizer_step():
            if self._refused(opts[0].step):
                if handle is not None:
                    handle.wait()  # the issued gather ends before the example does
                return True
            opts[1].step()
        mark("zero_grad")
        if at == "zero_grad":
            handle = self.hsdp_modules[across.unshard][0].unshard(async_op=True)
        self._zero_grad(step, opts)
        self._check_params(f"step {index}")
        if at is None:
            return False
        self._note_stepped(self._first_unit(across.unshard))
        if across.across_waited and handle is not None:
            handle.wait()
        # unsharded but stale, or still gathering: gathered again, waited, or both by the next unshard
        self.gathers.forget([self._first_unit(across.unshard)])
        return False

    def _unshard(self, index: int, how: str) -> None:
        """Call ``index``'s first module unsharded before the step's first forward, as ``how`` says."""
        module = self.hsdp_modules[index][0]
        if how == "sync" or how == "then reshard":
            self.ctx.true(f"unshard() of call {index} returns None", module.unshard() is None)
        elif (handle := module.unshard(async_op=True)) is not None:
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
        if step.reduce_op:
            self._reduce_op(step.reduce_op, step.reduce_op_group)
        self._all_reduce_controls(step)
        for setter, control in (
            ("set_reshard_after_forward", step.reshard_after_forward),
            ("set_reshard_after_backward", step.reshard_after_backward),
        ):
            if control:
                self._reshard_control(setter, *control)

    def _reshard_control(self, setter: str, index: int, flag: bool) -> None:
        """A reshard setter on call ``index`` alone (``recurse=False``), or on the root for all (index -1)."""
        settings = self.reshard_after_forward if setter == "set_reshard_after_forward" else self.reshard_after_backward
        if index < 0:
            getattr(self.hsdp_modules[-1][0], setter)(flag)
            settings[:] = [flag] * len(settings)
            return
        for module in self.hsdp_modules[index]:
            getattr(module, setter)(flag, recurse=False)
        settings[index] = flag

    def _all_reduce_controls(self, step: Any) -> None:
        """The step's set_requires_all_reduce and the reference's: after the sync setter, which sets it too (FSDP2)."""
        group, flag = step.all_reduce_group, step.all_reduce
        if flag is None:
            return
        for module in [self.hsdp_modules[-1][0]] if group is None else self.hsdp_modules[group]:
            module.set_requires_all_reduce(flag, **({} if group is None else {"recurse": False}))
        for i in range(len(self.reference.all_reduce)) if group is None else [group]:
            self.reference.all_reduce[i] = flag

    def _micro(self, step_index: int, micro: int, step: Any, syncs: bool) -> None:
        where = f"step {step_index} micro {micro}"
        self.trace.begin(where)
        root = self.hsdp_modules[-1][0]
        last = micro == len(step.micro) - 1
        if step.hold_with_last_backward:
            root.set_is_last_backward(last)
        elif step.sync_group is None:
            root.set_requires_gradient_sync(syncs)
            self.reference.all_reduce = [syncs] * len(self.config.groups)
        else:  # only this call holds back; the others reduce at every backward
            for module in self.hsdp_modules[step.sync_group]:
                module.set_requires_gradient_sync(syncs, recurse=False)
            self.reference.all_reduce[step.sync_group] = syncs
        self._all_reduce_controls(step)
        if step.all_reduce_last_only:  # HSDP accumulation, FSDP2's idiom: the last micro-batch all-reduces
            root.set_requires_all_reduce(last)
            self.reference.all_reduce = [last] * len(self.config.groups)
        args, kwargs = batch(self.config, step_index, micro, self.ctx.rank)
        self._late_switch(last, starts=True)  # the late head runs on the last micro-batch only
        self.after_forward.clear()
        self.reached.clear()
        gathers, calls = self.gathers.forward(), self.gathers.forward_calls()
        with self._creating():
            first = self._first_of_two(step, step_index, micro, where)  # (its loss term, its collectives) or None
            out, forward = self._forward(step, args, kwargs, where)
        forward.calls[:0] = first[1].calls if first is not None else []
        self._check_gathers(f"{where} forward", forward, gathers, calls)
        self.gathers.after_forward(self._resharded_after_forward(), self._rows_gather)
        self._forward_done(last)  # a late head's call that ran no forward: as it was, unknown
        taken = None
        if step.state_dict_at == "between" and last:  # loaded back after backward: torch's in-place rule
            taken = self._state_dict_check(f"{where} between forward and backward")
        ordered = self._ordered_pairs()
        self.backward_starts = []
        with record_collectives() as backward:
            self._backward_rec = backward
            loss = loss_of(out, self.loss_scale, self.model)
            loss = loss + first[0] if first is not None else loss
            mark("backward")
            with self._creating():
                loss.backward()
            self._backward_rec = None
        mark("reduction")  # what backward left: the grads, as reduced
        idle = self._idle_units()
        self._check_gathers(f"{where} backward", backward, self.gathers.backward(self.reached, self.regathers, idle))
        self._check_backward_order(where, backward, ordered)
        if self._times_backward():
            self._check_backward_starts(where)
        self.gathers.after_backward(self.reached, self.reshard_after_backward, idle)
        self._check_storage_freed(f"{where} after backward")
        rec = CollectiveRecorder()
        rec.calls = forward.calls + backward.calls
        ref_first = self._reference_first(step, step_index, micro)  # the first of two forwards' term, or 0
        ref_out = self.reference.forward(args, kwargs, step.method)
        ref_loss = loss_of(ref_out, self.loss_scale, self.reference.compute) + ref_first
        ref_loss.backward()
        held = not (syncs or step.hold_with_last_backward)  # the calls holding back (their sync off)
        reduces = [not held or step.sync_group not in (None, i) for i in range(len(self.config.groups))]
        self.reference.after_backward(reduces)
        self._note_user_hooks()
        self.ctx.close(f"{where} loss", loss, ref_loss, self.tol.loss)
        self._check_output(where, out, ref_out)
        self._check_reshard(where)
        self._check_collectives(where, rec, reduces)
        if taken is not None:  # loading reshards: after the checks of what backward left
            self.model.load_state_dict(taken)
        if step.state_dict_at == "after" and last:
            self._state_dict_round_trip(f"{where} after backward")
        self._micro_done()  # what the leaves stored is freed with the step's graph

    def _forward(self, step: Any, args: tuple, kwargs: dict, where: str) -> tuple[Any, CollectiveRecorder]:
        """The model's forward (or its registered method), its collectives recorded, prefetch timing checked."""
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
        self.stepped = None  # checked as its module's forward started (a registered method skips the root's)
        return out, forward


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
        keep(case_ctx=ctx, l4_config=config)
    return ctx.result()
