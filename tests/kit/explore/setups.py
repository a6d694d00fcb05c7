"""L4's set-up paths that meet the implementation mid-run (a mixin of ``oracle.Example``): deferred
init (built on the meta device, sharded, ``to_empty``, rank 0's full state dict loaded), a nested
call's ignored params checked at every call above, groups left gathered before a cast or a load (an
evaluation forward under ``no_grad``, ``unshard()``), and a forward that fails part-way, then
``reset_iter_state()``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import distribute_tensor

from tests.kit.explore.grammar import Tied, batch, build, loss_of
from tests.kit.explore.promised import bf16_with_fp32_grads
from tests.kit.judging.surface import impl
from tests.kit.runtime.devices import compute_device


class SetUps:
    """Methods of ``Example`` (its attributes: config, ctx, model, reference, plans, gathers, ...)."""

    config: Any
    ctx: Any
    model: Any
    reference: Any
    plans: Any
    registered: Any
    ignored_objects: Any
    gathers: Any
    hsdp_modules: Any
    loss_scale: Any
    tol: Any

    def _check_ignored_below(self, index: int) -> None:
        """Right after call ``index``: every param a call below it ignored is, under each name it is
        registered by within the call's modules, still the plain tensor its own call left (the call
        above neither shards, moves nor casts it; its grads stay local: the grads checks)."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        paths = self.config.groups[index].paths
        for path, plan in self.plans.items():
            if plan.kind != "ignored" or plan.group > index:
                continue
            if plan.group == index:
                self.ignored_objects[path] = named[path]
                continue
            for name in self.registered[path]:
                if not any(p == "" or name.startswith(p + ".") for p in paths):
                    continue
                param = named.get(name)
                label = f"call {index}, above call {plan.group} that ignored {path}: {name} is that plain tensor"
                kept = param is self.ignored_objects.get(path) and not impl.is_sharded(param)
                self.ctx.true(label, kept, type(param).__name__)

    def _grad_dtype_before_sharding(self) -> None:
        """``grad_dtype``: the model cast to bf16 and its params given fp32 grads before the calls, as a user
        of pure bf16 training does (the reference is set up the same way)."""
        if self.config.grad_dtype:
            bf16_with_fp32_grads(self.model)

    def _materialise(self) -> None:
        """Deferred init: the meta-built, sharded model's storage made on this rank's device, then
        filled from rank 0's full state dict (broadcast; the other ranks pass none), as FSDP2
        users load a checkpoint into a model too big for one device; or, ``"meta assign"``, its tensors
        assigned from a sharded state dict (``_assign_sharded_state``)."""
        how = "load_state_dict(assign=True)" if self.config.init == "meta assign" else "to_empty"
        if self.config.init == "meta assign":
            self._assign_sharded_state()
        else:
            self.model.to_empty(device=compute_device())
        for path, param in self.model.named_parameters():
            self.ctx.true(
                f"after {how} {path}: materialised (not on the meta device)", not impl.local(param).is_meta
            )
        if self._layout_broken() or self.config.init == "meta assign":
            return  # a load into meta shards could only raise, and hide this
        self._tie()
        full_state = build(self.config).state_dict() if self.ctx.rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, full_state, options=options)

    def _assign_sharded_state(self) -> None:
        """Deferred init as torchtune loads a checkpoint: each rank makes the sharded state dict from the
        full one (``distribute_tensor`` on each sharded tensor's mesh and placements, plain tensors whole) and
        the meta-built sharded model takes its tensors by ``load_state_dict(assign=True)``: what it loaded is
        what its next forward gathers and its optimizer steps (a copy of the old meta params would not train)."""
        full, device = build(self.config).state_dict(), compute_device()
        sharded = {}
        for name, meta in self.model.state_dict().items():
            whole = full[name].to(device, meta.dtype)
            if impl.is_sharded(meta):
                whole = distribute_tensor(whole, impl.mesh_of(meta), list(impl.placements(meta)))
            sharded[name] = whole
        self.model.load_state_dict(sharded, assign=True)
        self._tie()

    def _tie(self) -> None:
        for module in self.model.modules():
            if isinstance(module, Tied):
                module.tie()

    def _leave_gathered(self, how: str) -> None:
        """Before the cast: ``"eval"`` a forward under no_grad (the root and the calls not resharding
        after forward stay gathered), ``"unshard"`` every call's modules unshard()-ed, "" nothing."""
        if how == "eval":
            self._eval_forward(0, "before the cast")
        elif how == "unshard":
            for modules in self.hsdp_modules:
                for module in modules:
                    module.unshard()
            self.gathers.mark(self._units(), True)

    def _eval_forward(self, step_index: int, where: str) -> None:
        """A forward under torch.no_grad() (an evaluation) on the step's first micro-batch: its loss as
        promised; the ledger then holds what it left gathered (what a cast or a load meets next)."""
        args, kwargs = batch(self.config, step_index, 0, self.ctx.rank)
        with torch.no_grad():
            out = self.model(*args, **kwargs)
            ref_out = self.reference.forward(args, kwargs)
        loss, ref_loss = loss_of(out, self.loss_scale), loss_of(ref_out, self.loss_scale)
        self.ctx.close(f"{where}: eval forward under no_grad, loss", loss.double(), ref_loss.double(), self.tol.loss)
        self.gathers.after_forward(self._resharded_after_forward(), self._rows_gather)

    def _failed_forward(self, step_index: int, index: int) -> None:
        """A forward (with grad) raising as call ``index``'s first module finishes (after the
        implementation's post-forward), caught; then the root's reset_iter_state(), FSDP2's recovery:
        every group resharded and its storage freed, and the step then judged as usual (its gathers,
        prefetch timing and order follow this step's forward only)."""
        module = self.hsdp_modules[index][0]
        handle = module.register_forward_hook(_raise_drawn_failure)
        args, kwargs = batch(self.config, step_index, 0, self.ctx.rank)
        raised = False
        try:
            self.model(*args, **kwargs)
        except DrawnFailure:
            raised = True
        finally:
            handle.remove()
        self.ctx.true(f"step {step_index}: the forward failing at call {index} raised", raised)
        self.hsdp_modules[-1][0].reset_iter_state()
        self.reference.reset_iter_state()
        self.gathers.all_resharded()
        self._check_storage_freed(f"step {step_index} after a failed forward and reset_iter_state()")


class DrawnFailure(RuntimeError):
    """What a drawn failing forward raises (a bad batch, an out-of-memory): L4 catches it."""


def _raise_drawn_failure(module: nn.Module, args: tuple, output: Any) -> None:
    """A forward hook raising part-way through the model's forward."""
    raise DrawnFailure(f"drawn failure in the forward of {type(module).__name__}")


def registrations(model: nn.Module) -> dict[str, list[str]]:
    """Each param (by its first name) -> every name it is registered under."""
    first: dict[int, str] = {}
    names: dict[str, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(first.setdefault(id(param), name), []).append(name)
    return names
