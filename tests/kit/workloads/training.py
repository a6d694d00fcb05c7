"""Shared training loops of the cases: train the model under test beside its baseline and record
dual metrics per step (loss, global grad norm, element-wise grads, params after the step), plainly
or over accumulated micro-batches, over the whole model or a named part of it; plus the small
helpers every case needs (nested sharding, rank-data preconditions)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.kit.judging.checks import CaseContext
from tests.kit.judging.crash import StructureDiffers, structure_record
from tests.kit.judging.layout import local_numels
from tests.kit.judging.recorder import CollectiveRecorder, record_collectives
from tests.kit.judging.reference import SameDtypeReference, full, gather_from, named_params
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import Tolerance
from tests.kit.judging.trace import Tracer, Untraced, active, mark, traced
from tests.kit.workloads.models import DIMS, rank_batches


def square_mean(model: Any, x: Any) -> torch.Tensor:
    """The cases' default loss: mean of the squared (fp32) output."""
    return model(x).float().square().mean()


def shard_nested(model: nn.Module, children: Iterable[nn.Module], **kwargs: Any) -> Any:
    """``fully_shard`` each child (bottom-up), then the root with the same arguments; the root's
    group holds whatever params the children do not."""
    for child in children:
        impl.fully_shard(child, **kwargs)
    return impl.fully_shard(model, **kwargs)


def differs_across_ranks(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """True if some rank of ``group`` holds a different ``tensor`` (collective: all ranks call)."""
    gathered = gather_from(tensor, group)
    return any(not torch.equal(gathered[0], other) for other in gathered[1:])


@contextlib.contextmanager
def shared_tmpdir(prefix: str = "hpkit_dcp_") -> Iterator[str]:
    """A fresh directory made by rank 0, its path known to every rank (a checkpoint's place);
    removed by rank 0 once every rank has left the block (collective)."""
    path = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    try:
        yield path[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def distinct_batches(ctx: CaseContext, steps: int = 2) -> list[torch.Tensor]:
    """This rank's float batches for the kit's MLP, required to differ between ranks (else synced and
    unsynced grads agree by accident)."""
    batches = rank_batches(ctx.rank, (4, DIMS[0]), steps=steps)
    ctx.require("the ranks' batches differ", differs_across_ranks(batches[0]))
    return batches


class BackwardRecorder:
    """A ``model_step`` for ``train_against``: the loss, then its backward with the collectives of the
    backward alone recorded (one recorder per step in ``steps``)."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.steps: list[CollectiveRecorder] = []

    def __call__(self, model: Any, batch: Any) -> torch.Tensor:
        loss = self.loss_fn(model, batch)
        with record_collectives() as recorder:
            loss.backward()
        self.steps.append(recorder)
        return loss


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a (scalar) tensor over all ranks, in float64 (collective)."""
    total = full(value).detach().double().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def sharded_modules(model: nn.Module) -> list[Any]:
    """The modules of ``model`` given to fully_shard, outermost first."""
    return [m for m in model.modules() if isinstance(m, impl.HSDPModule)]


def reshard_all(model: nn.Module) -> None:
    """``reshard()`` on every module of ``model`` given to fully_shard."""
    for module in sharded_modules(model):
        module.reshard()


def record_numels(
    ctx: CaseContext, where: str, model: nn.Module, want: Mapping[str, int], names: Iterable[str]
) -> None:
    """Record, per param of ``names``, that its local numel now is ``want``'s."""
    numels = local_numels(model)
    for name in names:
        ctx.equal(f"{where}: local numel {name}", numels[name], want[name])


def raises_nothing(ctx: CaseContext, name: str, action: Callable[[], Any]) -> Any:
    """Run ``action`` and record the check ``name``: it raised nothing (else what it raised is the
    measured value, and the result is None)."""
    try:
        result = action()
    except Exception as exc:  # the check reports it; the checks that follow show what it broke
        ctx.true(name, False, repr(exc), "no exception")
        return None
    ctx.true(name, True, "no exception", "no exception")
    return result


class ForwardLog:
    """Forward calls of named modules (activation checkpointing runs a checkpointed module's forward
    again in backward) and the devices their inputs were on; ``reset()`` between steps. Counted by
    forward pre-hooks: a non-re-entrant recomputation stops early, before the forward returns."""

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        self.counts: Counter[str] = Counter()
        self.devices: set[str] = set()
        self._handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in modules.items()]

    def _hook(self, name: str) -> Callable[..., None]:
        def seen(module: nn.Module, args: tuple) -> None:
            self.counts[name] += 1
            self.devices.update(a.device.type for a in args if isinstance(a, torch.Tensor))

        return seen

    def reset(self) -> None:
        self.counts.clear()
        self.devices.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def grad_norm(model: Any) -> torch.Tensor:
    """Global L2 norm of all grads, computed on full tensors (float64)."""
    total = torch.zeros((), dtype=torch.float64)
    for param in named_params(model).values():
        if param.grad is not None:
            total += full(param.grad).double().square().sum()
    return total.sqrt()


def record_grads(
    ctx: CaseContext, label: str, model: Any, reference: Any, tol: float, names: Iterable[str] | None = None
) -> None:
    """Element-wise grad checks, one per param (or the ``names`` given). A param without a grad
    must lack it on both sides (a module unused in the step), else the check fails."""
    ours, ref = named_params(model), named_params(reference)
    for name in names if names is not None else ref:
        if ours[name].grad is None or ref[name].grad is None:
            ctx.equal(f"{label} grad {name} present", ours[name].grad is not None, ref[name].grad is not None)
            continue
        ctx.close(f"{label} grad {name}", ours[name].grad, ref[name].grad, tol)


def record_params(ctx: CaseContext, label: str, model: Any, reference: Any, tol: float) -> None:
    ours, ref = named_params(model), named_params(reference)
    for name, param in ref.items():
        ctx.close(f"{label} param {name}", ours[name], param, tol)


Optimizers = tuple[torch.optim.Optimizer, torch.optim.Optimizer]


def _adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def step_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """One step and zero_grad of each optimizer, inside what the implementation's step needs."""
    with impl.optimizer_step():
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def compared_params(model: Any, names: Mapping[str, str] | None = None) -> dict[str, nn.Parameter]:
    """The params of ``model`` to compare, keyed by the reference's names: all of them, or (a
    pipeline stage, an expert-parallel rank) those of ``names`` (ours -> the reference's name)."""
    ours = named_params(model)
    if names is None:
        return ours
    return {ref_name: ours[our_name] for our_name, ref_name in names.items()}


def _aligned(
    reference: Any, compared: Mapping[str, nn.Parameter]
) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """The compared params of the model and the reference's params they stand for, by name. Where one
    side has params the other lacks (a tie come untied, a param registered again), an untraced run
    raises ``StructureDiffers``; a traced one (the diagnosis) records the difference as its first
    divergence and goes on with the params both have, so what follows is still traced."""
    every = named_params(reference)
    missing = [name for name in compared if name not in every]
    if missing:
        difference = StructureDiffers(missing, sorted(set(every) - set(compared)))
        tracer = active()
        if tracer is None:
            raise difference
        tracer.structure = tracer.structure or structure_record(tracer.step_label, difference)
    both = {name: param for name, param in compared.items() if name in every}
    return both, {name: every[name] for name in both}


def _forward_backward(loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """A model step: the loss of the batch, then its backward; returns the loss."""

    def step(model: Any, batch: Any) -> torch.Tensor:
        loss = loss_fn(model, batch)
        mark("backward")
        loss.backward()
        return loss

    return step


def _reference_step(
    reference: Any, loss_fn: Callable[[Any, Any], torch.Tensor], batch: Any, sync: bool = True
) -> torch.Tensor:
    """Forward and backward of the baseline; unless ``sync``, DDP skips its all-reduce (forward and
    backward under ``no_sync``: DDP decides in forward) and a ``SameDtypeReference`` keeps its grads
    unreduced. Returns the loss."""
    accumulating = not sync and isinstance(reference, DistributedDataParallel)
    with reference.no_sync() if accumulating else contextlib.nullcontext():
        loss = loss_fn(reference, batch)
        loss.backward()
    if isinstance(reference, SameDtypeReference):
        reference.reduce_grads(sync=sync)
    return loss


GradNorms = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def _check_grads_and_step(
    ctx: CaseContext,
    prefix: str,
    model: Any,
    reference: Any,
    opts: Optimizers,
    tol: Tolerance,
    params: bool,
    global_norms: GradNorms | None = None,
    part: bool = False,
    tracer: Tracer | Untraced | None = None,
) -> None:
    """Grad norm and element-wise grads against the reference, one optimizer step on both, params.
    ``model``: the model, or its params by name (``part``: a part of the model, whose norm is not the
    model's: named so, and ``global_norms()`` gives the model's and the reference's global norms)."""
    if global_norms is not None:
        ctx.close(f"{prefix} global grad norm", *global_norms(), tol.grad)
    label = "grad norm of this rank's part" if part else "grad norm"
    mark("reduction")  # the grads as the implementation reduced them, read
    ctx.close(f"{prefix} {label}", grad_norm(model), grad_norm(reference), tol.grad)
    record_grads(ctx, prefix, model, reference, tol.grad)
    tracer = tracer or Untraced()
    tracer.grads(named_params(model), named_params(reference))
    mark("optimizer")
    step_optimizers(opts)
    tracer.params(named_params(model), named_params(reference))
    if params:
        record_params(ctx, prefix, model, reference, tol.grad)


def train_against(
    ctx: CaseContext,
    model: nn.Module,
    reference: Any,
    batches: Sequence[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    tol: Tolerance,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    params: bool = True,
    label: str = "",
    recorders: list[CollectiveRecorder] | None = None,
    after_backward: Callable[[int], None] | None = None,
    before_step: Callable[[int], None] | None = None,
    mean_loss_over_ranks: bool = False,
    model_step: Callable[[Any, Any], torch.Tensor] | None = None,
    names: Mapping[str, str] | None = None,
    trajectory: dict[str, torch.Tensor] | None = None,
    global_norms: GradNorms | None = None,
) -> Optimizers:
    """One optimizer step per batch on both; record loss, grad norm, grads and params per step.

    ``label`` prefixes the check names (several trainings in one case). A ``SameDtypeReference``
    has its grads reduced after its backward. With ``recorders``, the collectives of the model's
    forward + backward of each step are recorded and appended to it (the reference's are not).
    ``before_step(step)`` runs before the model's forward (to change its controls);
    ``after_backward(step)`` runs after both backwards, before the optimizer step (to inspect
    the grads). ``mean_loss_over_ranks`` compares the mean of the model's per-rank losses (what a
    ``GlobalBatchReference`` computes). ``model_step(model, batch)`` runs the model's forward
    and backward itself and returns its loss (a pipeline schedule); by default ``loss_fn`` then
    ``backward``. ``names`` (ours -> the reference's) compares a part of the model only (a
    pipeline stage, an expert-parallel rank's experts); the reference is always the whole model, and
    the grad norm of such a part is named so; ``global_norms()`` (collective) returns the model's
    global grad norm and the reference's, checked as the step's global grad norm.
    Returns both optimizers, to continue training or to checkpoint them.
    """
    make_optimizer = make_optimizer or _adam
    opts = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    # the params the optimizer steps: the module may hold other (unsharded) ones between steps
    stepped = compared_params(model, names)
    stepped, references = _aligned(reference, stepped)
    model_step = model_step or _forward_backward(loss_fn)
    prefix = f"{label} " if label else ""
    tracer = traced(model, reference)  # the diagnosis's (tests.kit.judging.divergence); else does nothing
    for step, batch in enumerate(batches):
        tracer.begin(f"{prefix}step {step}")
        ref_loss = _reference_step(reference, loss_fn, batch)
        if before_step is not None:
            before_step(step)
        with record_collectives() if recorders is not None else contextlib.nullcontext() as recorder:
            loss = model_step(model, batch)
        if recorders is not None:
            recorders.append(recorder)
        if after_backward is not None:
            after_backward(step)
        if trajectory is not None:
            _keep(trajectory, f"step {step}", loss, stepped, grads=True)
        if mean_loss_over_ranks:
            loss = mean_over_ranks(loss)
        ctx.step(f"{prefix}loss", loss, ref_loss)
        ctx.close(f"{prefix}step {step} loss", loss, ref_loss, tol.loss)
        where = f"{prefix}step {step}"
        _check_grads_and_step(
            ctx, where, stepped, references, opts, tol, params, global_norms, names is not None, tracer
        )
        if trajectory is not None:
            _keep(trajectory, f"step {step} after the optimizer", None, stepped, grads=False)
    tracer.begin(None)  # what the case does with the model afterwards has no baseline step beside it
    return opts


def _keep(
    trajectory: dict[str, torch.Tensor], where: str, loss: Any, params: Mapping[str, nn.Parameter], grads: bool
) -> None:
    """Copies of what this rank holds: the loss, and each param's grad (or the param itself)."""
    if loss is not None:
        trajectory[f"{where} loss"] = loss.detach().clone()
    for name, param in params.items():
        tensor = param.grad if grads else param
        if tensor is not None:
            trajectory[f"{where} {'grad' if grads else 'param'} {name}"] = impl.local(tensor).detach().clone()


def train_alone(
    model: nn.Module,
    batches: Sequence[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    trajectory: dict[str, torch.Tensor] | None = None,
    model_step: Callable[[Any, Any], torch.Tensor] | None = None,
    names: Mapping[str, str] | None = None,
) -> torch.optim.Optimizer:
    """``train_against`` without a baseline or checks: the same steps of the model alone, keeping its
    trajectory by the same names (a bitwise rerun of a run the baseline already judged)."""
    optimizer = (make_optimizer or _adam)(model.parameters())
    stepped = compared_params(model, names)
    model_step = model_step or _forward_backward(loss_fn)
    for step, batch in enumerate(batches):
        loss = model_step(model, batch)
        if trajectory is not None:
            _keep(trajectory, f"step {step}", loss, stepped, grads=True)
        step_optimizers([optimizer])
        if trajectory is not None:
            _keep(trajectory, f"step {step} after the optimizer", None, stepped, grads=False)
    return optimizer


def train_accumulating_against(
    ctx: CaseContext,
    model: nn.Module,
    reference: Any,
    step_batches: Sequence[Sequence[Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    tol: Tolerance,
    accumulate: Callable[[bool], None],
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    label: str = "",
    after_micro: Callable[[int, int, CollectiveRecorder], None] | None = None,
    sync_micro: Callable[[int], bool] | None = None,
) -> Optimizers:
    """One optimizer step per list of micro-batches, grads accumulated over them.

    Every micro-batch but the last runs after ``accumulate(True)`` (the model's way of holding
    back its reduction), the last after ``accumulate(False)``; the reference accumulates with
    DDP's ``no_sync`` (or unreduced ``SameDtypeReference`` grads). ``sync_micro(micro)`` chooses
    other micro-batches that reduce too (reduced grads then accumulate in the sharded grads);
    the last one always does. Records each micro-batch's loss, then the accumulated grad norm and
    grads, and the params after the step. ``after_micro(step, micro, recorder)`` runs right after
    each micro-batch's backward, with the collectives of the model's forward + backward.
    """
    make_optimizer = make_optimizer or _adam
    opts = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    stepped = named_params(model)  # the params the optimizer steps
    stepped, references = _aligned(reference, stepped)
    prefix = f"{label} " if label else ""
    tracer = traced(model, reference)
    for step, micro_batches in enumerate(step_batches):
        for micro, batch in enumerate(micro_batches):
            tracer.begin(f"{prefix}step {step} micro {micro}")
            last = micro == len(micro_batches) - 1
            sync = last or (sync_micro is not None and sync_micro(micro))
            ref_loss = _reference_step(reference, loss_fn, batch, sync=sync)
            accumulate(not sync)
            with record_collectives() as recorder:
                loss = loss_fn(model, batch)
                loss.backward()
            ctx.step(f"{prefix}loss", loss, ref_loss)
            ctx.close(f"{prefix}step {step} micro {micro} loss", loss, ref_loss, tol.loss)
            if after_micro is not None:
                after_micro(step, micro, recorder)
        _check_grads_and_step(ctx, f"{prefix}step {step}", stepped, references, opts, tol, True, tracer=tracer)
    tracer.begin(None)
    return opts
