"""The invariants L4 checks at fixed points of each step (a mixin of ``oracle.Example``): the
layout (shard shapes, placements, dtypes, storage no larger than the shards), the params' numels
after forward and backward as the reshard settings say, the all-gathers each forward and backward
issue (via ``gathers.GatherLedger``), the collectives' dtypes and params, the output's structure,
grads and params against ``PromisedReference``, and state dicts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.kit.explore.gathers import GatherLedger, Unit
from tests.kit.explore.grammar import AGAIN, Out, first_tensor
from tests.kit.explore.promised import ParamPlan
from tests.kit.explore.space import PRECISIONS, checkpointed
from tests.kit.judging.layout import local_numel, shard_shape
from tests.kit.judging.recorder import CollectiveRecorder
from tests.kit.judging.reference import full
from tests.kit.judging.surface import impl
from tests.kit.judging.trace import Tracer, Untraced, mark


class Invariants:
    """The checks at fixed points of a step: layout, numels, all-gathers, collectives, numbers."""

    trace: Tracer | Untraced = Untraced()  # the diagnosis's tracer while it runs (``traced``)

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

    def _units(self) -> list[Unit]:
        return [(index, path) for index, group in enumerate(self.config.groups) for path in group.paths]

    def _ledger(self) -> GatherLedger:
        """The ledger of all-gathers as sharding leaves it: every unit sharded; those whose calls keep
        them sharded through backward; the modules called twice a forward, loose (``_called_again``)."""
        sizes, calls = self._gather_sizes()
        skipped = {unit for unit in self._units() if self.config.groups[unit[0]].skips_backward_gather}
        return GatherLedger(sizes, calls, skip_backward=skipped, loose=self._called_again(sizes))

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

    @property
    def regathers(self) -> int:
        """How many times more than once a backward may gather a module: once, under activation
        checkpointing, where the implementation says its recompute may reshard
        (``Implementation.recompute_gathers_again``; ours keeps it gathered: none)."""
        return 1 if self.recompute and impl.recompute_gathers_again else 0

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
                self._ran_numels(index),
                True if resharded else kept,  # not gathered in backward: as forward left it
            )

    def _idle_units(self) -> frozenset[Unit]:
        """Units of list calls that ran no forward this micro-batch (the late head's on a held one)."""
        return frozenset(
            (index, path)
            for index, group in enumerate(self.config.groups)
            if len(group.paths) > 1
            for path in group.paths
            if (index, path) not in self.after_forward
        )

    def _ran_numels(self, index: int) -> dict[str, int]:
        """Call ``index``'s params, but those of a list call's module that ran no forward this micro-batch
        (the late head's on a held one): each module of a list is a group of its own, left as it was."""
        paths = self.config.groups[index].paths
        if len(paths) == 1:
            return self._own_numels(index)
        ran = [path for path in paths if (index, path) in self.after_forward]
        return {param: n for path in ran for param, n in self._own_numels(index, path).items()}

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
        least, most = self._scatter(reduces), self._scatter(reduces, unused=True)
        # a trainable param no grad reached (the late head's): its zeros may be reduced, or nothing; a
        # head run twice a forward may reduce twice (once per call: the grads accumulated before it, then
        # the rest; the same sum), its params alone (a group of its own) or its whole call's (one group)
        again = [least + self._scatter(reduces, twice=whole) for whole in (False, True)]
        allowed = sorted({least, most, *(again if self.config.calls_again else ())})
        if self.config.forwards > 1:  # each call reduces once, or once per forward's graph (the same sum)
            self.ctx.true(label, least <= scattered <= 2 * max(allowed), str(scattered), f"{least}..{2 * max(allowed)}")
        elif len(allowed) == 1:
            self.ctx.equal(label, scattered, least)
        else:
            self.ctx.true(label, scattered in allowed, str(scattered), " or ".join(map(str, allowed)))
        if not any(reduces):
            self.ctx.equal(f"{where} all-reduces while held back", len(rec.of("all_reduce")), 0)

    def _scatter(self, reduces: list[bool], unused: bool = False, twice: bool | None = None) -> int:
        """What this rank puts into the reduce-scatters of one backward that reduces: each trainable
        sharded param padded to ceil(rows / ranks) rows, times the ranks of its shard group (``unused``:
        those no grad reached too, as zeros: FSDP2's set_reduce_scatter_unused_params, ours always;
        ``twice``: only the head's, whose forward runs twice, where its call is not the root's; True:
        its whole call's)."""
        total = 0
        for plan in self.plans.values():
            reached = plan.path in self.reference.got_grad or (unused and plan.trainable)
            if plan.kind != "sharded" or not reached:  # frozen, or no grad
                continue
            if twice is not None and not self._of_head_run_twice(plan, whole_call=twice):
                continue
            if not reduces[plan.group]:  # held back
                continue
            size, _ = self.meshes.shard_coordinate(plan.mesh)
            if size > 1:
                total += size * torch.Size(shard_shape(self.shapes[plan.path], size, 0, plan.dim)).numel()
        return total

    def _of_head_run_twice(self, plan: ParamPlan, whole_call: bool) -> bool:
        """Whether ``plan``'s param is the head's (``list_module_called_again``), or with ``whole_call``
        any of the head's call, where that call is not the root's."""
        head = AGAIN[-1]
        return head in self.config.groups[plan.group].paths and (whole_call or plan.path.startswith(head + "."))

    def _check_grads(self, where: str) -> None:
        params = dict(self.model.named_parameters())
        masters = dict(self.reference.master.named_parameters())
        total, ref_total = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        orders = torch.zeros((), dtype=torch.float64)
        for path in self.plans:
            grad, ref_grad = params[path].grad, masters[path].grad
            if grad is None or ref_grad is None:
                self.ctx.equal(f"{where} grad {path} present", grad is not None, ref_grad is not None)
                continue
            self._check_grad_kind(where, path, params[path], grad, ref_grad.dtype)
            whole, order = full(grad), self.reference.order.get(path)
            if order is None:
                self.ctx.close(f"{where} grad {path}", whole, ref_grad, self.tol.grad)
            else:  # reduced in half precision: the row, or the reduction order's bound where that is wider
                self.ctx.close_each(f"{where} grad {path}", whole, ref_grad, self.tol.grad, order)
                orders += order.double().square().sum()
            total += whole.double().square().sum()
            ref_total += ref_grad.double().square().sum()
        norm_tol = max(self.tol.grad, orders.sqrt().item())  # |a| - |b| <= |a - b|: the orders' norm bounds it
        self.ctx.close(f"{where} grad norm", total.sqrt(), ref_total.sqrt(), norm_tol)
        self.trace.begin(where)  # the diagnosis's, where it runs: the grads as the step is about to use them
        self.trace.grads({p: params[p] for p in self.plans}, {p: masters[p] for p in self.plans})

    def _check_params(self, where: str) -> None:
        masters = dict(self.reference.master.named_parameters())
        params = dict(self.model.named_parameters())
        for path, param in params.items():
            if path not in masters:  # a tied weight the calls untied (tied_params_split_groups): two params now
                self.ctx.true(f"{where} param {path}: one param with its tied name, as the plain model's", False)
                continue
            self.ctx.close(f"{where} param {path}", full(param), masters[path], self.tol.grad)
        self.trace.params({path: params[path] for path in masters if path in params}, masters)
        self.trace.begin(None)  # what runs before the next forward has no baseline step beside it

    def _state_dict_round_trip(self, where: str) -> None:
        """A state dict taken now holds the sharded params (the reference's values); loading it
        back raises nothing (the numbers after it show that it changed nothing)."""
        self.model.load_state_dict(self._state_dict_check(where))

    def _state_dict_check(self, where: str) -> dict[str, Any]:
        """The model's state dict, checked: every param there, sharded (but the ignored ones), with
        the reference's values."""
        mark("state_dict")
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
