"""Plan case of ``_test_fully_shard_with_pp.py``: fully_shard under ``torch.distributed.pipelining``
(L2-09), on a (pp, dp) mesh: each pipeline stage is sharded over its dp sub-mesh.

How a user drives an ``HSDPModule`` stage under a pipeline schedule
------------------------------------------------------------------
A schedule (``ScheduleGPipe``, ``Schedule1F1B``) runs several forwards and one backward per
microbatch on every rank before the optimizer step. torch's ``PipelineStage`` only steers torch's
own FSDP modules through it (it turns their gradient sync off for every microbatch and reduces in
``perform_reduce_grad``); an ``HSDPModule`` stage is just a module to it. Three ways work:

1. The recipe (fewest collectives): let the stage tell the module which backward is the last one.
   ``PipelineStage.backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)`` is where
   torch's schedules run every microbatch's backward, with ``last_backward`` true for the last
   microbatch of the step; override it (this case runs ``recipe`` below from that method)::

       class HSDPPipelineStage(PipelineStage):
           def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
               self.submod.set_requires_gradient_sync(last_backward)  # reduce the sum once
               self.submod.set_reshard_after_backward(last_backward)  # keep the gathered params
               return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

   Every backward but the last accumulates the unsharded grads locally, communicating nothing;
   the last one reduce-scatters their sum once per group and lands it in the sharded grads, and
   reshards. The flags end the step as they began (sync on, reshard on).
2. Overlap: keep sync on and call ``set_is_last_backward(last_backward)`` in the same override:
   every microbatch's reductions start at once and land by the end of the last backward.
3. Nothing at all (a plain ``PipelineStage``): every microbatch's backward reduces and lands its
   grads; correct, with one reduction per microbatch and group.

In all three the grads have landed in the sharded ``param.grad`` when the last backward ends, so
the schedule's own ``scale_grads`` (dividing by the number of microbatches, for a mean loss) sees
them, and the optimizer steps right after ``schedule.step``. The data-parallel average over dp
then gives the gradient of the mean loss over the global batch. Give ``PipelineStage`` the
microbatch shapes (``input_args`` / ``output_args``, the boundary tensors with
``requires_grad=True``) so that it does not run a shape-inference forward and backward.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.checks import device_type
from tests.kit.judging.recorder import record_collectives
from tests.kit.judging.surface import impl
from tests.kit.runtime.torch_compat import (
    every_p2p_waited,
    init_p2p_in_float32,
    scale_grads_as_newer_schedules,
)
from tests.kit.workloads.models import MLP, rank_batch
from tests.kit.workloads.training import differs_across_ranks, shard_nested, train_against

DIMS = (8, 16, 12, 16, 4)  # four Linear layers: two per stage
STAGE_LAYERS = ((0, 1), (2, 3))  # the MLP's layers held by stage 0 and stage 1
MICROBATCHES = 4
ROWS = 8  # rows of one dp rank's batch per step: MICROBATCHES microbatches of 2
STEPS = 2


def recipe(module: Any, last_backward: bool) -> None:
    """The recipe (see the module docstring): accumulate locally, reduce and reshard at the last backward."""
    module.set_requires_gradient_sync(last_backward)
    module.set_reshard_after_backward(last_backward)


def overlap(module: Any, last_backward: bool) -> None:
    """Every microbatch reduces at once; the reductions land at the end of the last backward."""
    module.set_is_last_backward(last_backward)


@dataclass(frozen=True)
class Driver:
    """How the user drives the stage module before each microbatch's backward (None: not at all),
    the features that uses, and whether our engine should then communicate (``last``: the step's
    last backward)."""

    drive: Callable[[Any, bool], None] | None
    needs: tuple[str, ...]
    reduces: Callable[[bool], bool]  # last -> does this backward issue reductions


DRIVERS = {
    "recipe": Driver(recipe, ("gradient_sync", "reshard_controls"), lambda last: last),
    "overlap": Driver(overlap, ("last_backward",), lambda last: True),
    "plain": Driver(None, (), lambda last: True),
}


@functools.cache
def _stage_class() -> type:
    """``PipelineStage`` with the recipe's hook point: ``drive(submod, last_backward)`` before every
    microbatch's backward; it records the reductions each backward issues (``reductions``).
    Built on first use: importing torch.distributed.pipelining takes seconds, and pytest
    collection imports this file."""
    from torch.distributed.pipelining import PipelineStage

    class DrivenStage(PipelineStage):
        """A PipelineStage whose ``drive`` runs where torch steers its own FSDP modules."""

        drive: Callable[[Any, bool], None] | None = None
        reductions: list[int]

        def backward_maybe_with_nosync(
            self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
        ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
            """Drive the module, then torch's own per-microbatch backward."""
            if self.drive is not None:
                self.drive(self.submod, last_backward)
            with record_collectives() as recorder:
                result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
            self.reductions.append(len(recorder.of("reduce_scatter")) + len(recorder.of("all_reduce")))
            return result

        def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
            """torch's first p2p with each neighbour, sized alike on both sides (torch 2.9's are not:
            ``init_p2p_in_float32``); torch 2.6 and 2.7 have no such p2p."""
            return init_p2p_in_float32(super()._get_init_p2p_neighbors_ops())

    return DrivenStage


# (schedule: torch.distributed.pipelining.Schedule<name>, reshard_after_forward, driver): the recipe
# on both schedules and both reshard modes
PARTS = (
    ("GPipe", True, "recipe"),
    ("GPipe", False, "recipe"),
    ("1F1B", True, "recipe"),
    ("1F1B", False, "recipe"),
    ("1F1B", True, "overlap"),
    ("GPipe", False, "plain"),
)


class PipelinePart(nn.Module):
    """Some consecutive layers of the kit's ``MLP``, with its ReLU after every layer but the whole
    model's last: stage modules that compose to exactly ``MLP.forward``."""

    def __init__(self, model: MLP, indices: tuple[int, ...]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(model.layers[i] for i in indices)
        self.relu_after = [i < len(model.layers) - 1 for i in indices]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, relu in zip(self.layers, self.relu_after, strict=True):
            x = layer(x)
            if relu:
                x = torch.relu(x)
        return x


def _device() -> torch.device:
    """This rank's compute device (its GPU under nccl)."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")


def _names(part: nn.Module, model: nn.Module) -> dict[str, str]:
    """The part's param names -> the whole model's (by identity: call before sharding)."""
    whole = {id(p): name for name, p in model.named_parameters()}
    return {name: whole[id(p)] for name, p in part.named_parameters()}


@dataclass
class Batch:
    """One step's data: this dp rank's batch (the pipeline's) and the global batch (the reference's)."""

    x: torch.Tensor
    y: torch.Tensor
    global_x: torch.Tensor
    global_y: torch.Tensor


def _batches(dp_rank: int, dp_size: int, device: torch.device) -> list[Batch]:
    """Per step: inputs and targets that differ per dp rank and step; the same on the pp peers."""
    batches = []
    for step in range(STEPS):
        xs = [rank_batch(step, d, (ROWS, DIMS[0])) for d in range(dp_size)]
        ys = [rank_batch(step, d, (ROWS, DIMS[-1]), seed=5000) for d in range(dp_size)]
        batches.append(Batch(xs[dp_rank], ys[dp_rank], torch.cat(xs), torch.cat(ys)))
    return [Batch(*(t.to(device) for t in (b.x, b.y, b.global_x, b.global_y))) for b in batches]


def _capture_once(tensor: torch.Tensor, into: list[torch.Tensor]) -> None:
    """Append the grad ``tensor`` receives in the next backward, once: the pipeline receives
    activations into the same buffers every step, and a hook left on one would fire again."""

    def capture(grad: torch.Tensor) -> None:
        into.append(grad)
        handle.remove()

    handle = tensor.register_hook(capture)


@dataclass
class BoundaryGrads:
    """The grads at the stage boundary, per microbatch in backward order: on stage 0 the grad its
    output receives, on stage 1 the grad its input sends back; in the reference the grad of the
    global-batch loss w.r.t. the same activation (the input of layer 2)."""

    ours: list[torch.Tensor] = field(default_factory=list)
    reference: list[torch.Tensor] = field(default_factory=list)

    def watch(self, stage_module: nn.Module, stage_index: int, reference: MLP) -> None:
        """Hook stage ``stage_index``'s side of the boundary and the reference's."""
        if stage_index == 0:

            def on_output(module: nn.Module, args: Any, output: torch.Tensor) -> None:
                _capture_once(output, self.ours)

            stage_module.register_forward_hook(on_output)
        else:

            def on_input(module: nn.Module, args: tuple) -> None:
                _capture_once(args[0], self.ours)

            stage_module.register_forward_pre_hook(on_input)

        def on_reference_input(module: nn.Module, args: tuple) -> None:
            if args[0].requires_grad:
                _capture_once(args[0], self.reference)

        reference.layers[STAGE_LAYERS[1][0]].register_forward_pre_hook(on_reference_input)

    def clear(self) -> None:
        self.ours.clear()
        self.reference.clear()


def _run_part(ctx: CaseContext, schedule_name: str, reshard_after_forward: bool, driver_name: str) -> None:
    """Train one pipeline (2 steps) against the single-device model on the global batch."""
    label = f"{schedule_name} reshard_after_forward={reshard_after_forward} {driver_name}"
    driver = DRIVERS[driver_name]
    device = _device()
    pp_rank, dp_rank = impl.local_rank(ctx.mesh, "pp"), impl.local_rank(ctx.mesh, "dp")
    dp_size = impl.mesh_shape(ctx.mesh)[1]
    pp_group, dp_group = impl.process_group(ctx.mesh, "pp"), impl.process_group(ctx.mesh, "dp")
    last_stage = pp_rank == len(STAGE_LAYERS) - 1

    model = MLP(DIMS)
    reference = copy.deepcopy(model).to(device)
    stage_module = PipelinePart(model, STAGE_LAYERS[pp_rank])
    names = _names(stage_module, model)
    shard_nested(stage_module, stage_module.layers, mesh=ctx.submesh("dp"), reshard_after_forward=reshard_after_forward)
    boundary = BoundaryGrads()
    boundary.watch(stage_module, pp_rank, reference)

    rows = ROWS // MICROBATCHES
    pipelining = importlib.import_module("torch.distributed.pipelining")
    stage = _stage_class()(
        stage_module,
        pp_rank,
        len(STAGE_LAYERS),
        device,
        # the microbatch shapes: no shape-inference forward/backward; boundary tensors need grad
        input_args=torch.empty(rows, DIMS[0] if pp_rank == 0 else DIMS[2], device=device, requires_grad=pp_rank > 0),
        output_args=torch.empty(rows, DIMS[2] if pp_rank == 0 else DIMS[-1], device=device, requires_grad=True),
        group=pp_group,
    )
    stage.drive, stage.reductions = driver.drive, []
    # scale_grads (the default) divides the grads by the microbatches: their losses are means
    schedule = getattr(pipelining, f"Schedule{schedule_name}")(stage, MICROBATCHES, loss_fn=F.mse_loss)

    batches = _batches(dp_rank, dp_size, device)
    ctx.require(f"{label}: dp ranks' batches differ", differs_across_ranks(batches[0].x, dp_group))

    def pipeline_step(module: nn.Module, batch: Batch) -> torch.Tensor:
        """One schedule step; returns the mean loss over the global batch, on every rank."""
        losses: list[torch.Tensor] = []
        with every_p2p_waited():  # torch 2.6 and 2.7's schedules: see torch_compat
            if last_stage:
                schedule.step(target=batch.y, losses=losses)
            else:
                schedule.step(batch.x)
        scale_grads_as_newer_schedules(schedule, module, MICROBATCHES)  # torch 2.6's schedules do not
        # each microbatch loss is its mean; equal microbatches: their mean is the rank's mean
        loss = torch.stack(losses).mean().detach() if last_stage else torch.zeros((), device=device)
        dist.all_reduce(loss, group=pp_group)  # the last stage's loss on both stages
        dist.all_reduce(loss, group=dp_group)
        return loss / dp_size

    def reference_loss(ref: nn.Module, batch: Batch) -> torch.Tensor:
        return F.mse_loss(ref(batch.global_x), batch.global_y)

    def after_backward(step: int) -> None:
        _check_boundary(ctx, f"{label} step {step}", boundary, dp_rank, dp_size)
        with ctx.extra("our engine's collectives per microbatch backward follow the driver"):
            for micro, issued in enumerate(stage.reductions):
                last = micro == MICROBATCHES - 1
                if driver.reduces(last):
                    ctx.true(f"{label} step {step} micro {micro}: reductions issued", issued > 0, issued, "> 0")
                else:
                    ctx.equal(f"{label} step {step} micro {micro}: reductions", issued, 0)
        stage.reductions.clear()
        boundary.clear()

    train_against(
        ctx,
        stage_module,
        reference,
        batches,
        reference_loss,
        ctx.tol,
        label=label,
        model_step=pipeline_step,
        names=names,
        after_backward=after_backward,
    )


def _check_boundary(ctx: CaseContext, where: str, boundary: BoundaryGrads, dp_rank: int, dp_size: int) -> None:
    """Each microbatch's boundary grad against the reference's rows of that microbatch. A
    microbatch's loss is its own mean, the reference's the global batch's: the pipeline's grad is
    the reference's times (global rows / microbatch rows)."""
    # not a precondition: stopping one stage would leave the other waiting on it
    ctx.equal(f"{where}: boundary grads (one per microbatch)", len(boundary.ours), MICROBATCHES)
    (reference,) = boundary.reference
    rows = ROWS // MICROBATCHES
    scale = rows / (ROWS * dp_size)
    for micro, grad in enumerate(boundary.ours):
        start = dp_rank * ROWS + micro * rows
        ctx.close(f"{where} boundary grad micro {micro}", grad * scale, reference[start : start + rows], ctx.tol.grad)


@case(
    "L2-09",
    "test_pp_fsdp_coupling",
    world_size=4,
    mesh={"pp": 2, "dp": 2},
    config="PP + FSDP fp32",
    needs=("pipeline", "submesh"),
    timeout=60,
)
def pp_fsdp_coupling(ctx: CaseContext) -> None:
    """Two pipeline stages (two Linear layers each, every layer its own fully_shard group over the
    stage's dp sub-mesh) run by torch's ScheduleGPipe and Schedule1F1B with 4 microbatches per
    step; 2 Adam steps against the single-device model on the global batch (both dp ranks' data):
    loss, each stage's grads and params by name, and every microbatch's stage-boundary grad.
    Parts: the recipe (see the module docstring) on both schedules with reshard_after_forward True
    and False; overlapping reductions (set_is_last_backward); a plain PipelineStage."""
    for schedule_name, reshard_after_forward, driver_name in PARTS:
        ctx.run_part(
            f"{schedule_name} {driver_name}",
            DRIVERS[driver_name].needs,
            lambda s=schedule_name, r=reshard_after_forward, d=driver_name: _run_part(ctx, s, r, d),
        )
