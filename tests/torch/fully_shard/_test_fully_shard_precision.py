"""Plan cases of ``_test_fully_shard_precision.py``: numerics of fully_shard's options (L0 part)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.kit.api import HSDPModule, MixedPrecisionPolicy, fully_shard
from tests.kit.case import CaseContext, case
from tests.kit.models import MLP, rank_batches
from tests.kit.recorder import CollectiveRecorder
from tests.kit.reference import SameDtypeReference, ddp_of
from tests.kit.tolerances import tolerance
from tests.kit.training import case_mesh, named_params, shard_nested, square_mean, train_against

DIMS = (7, 13, 5, 3)


@case(
    "L0-06",
    "test_comm_fusion_on_off",
    "_test_fully_shard_precision.py",
    world_size=2,
    mesh_shape=(2,),
    config="FSDP 1D fp32",
)
def comm_fusion_on_off(ctx: CaseContext) -> None:
    """comm_fusion=True issues one all-gather / reduce-scatter per group, False one per param; both
    train like DDP."""
    mesh = case_mesh((ctx.world_size,))
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    totals = {}
    for fused in (True, False):
        label = f"comm_fusion={fused}"
        model = MLP(DIMS)
        ddp = ddp_of(model)
        shard_nested(model, model.layers, mesh=mesh, comm_fusion=fused)
        # one group per layer, the root holds none; children reshard after forward, so each
        # group is gathered in forward and again in backward
        per_step = len(model.layers) if fused else len(list(model.parameters()))
        recorders: list[CollectiveRecorder] = []

        train_against(ctx, model, ddp, batches, square_mean, ctx.tol, label=label, recorders=recorders)
        for step, rec in enumerate(recorders):
            ctx.equal(f"{label} step {step} all-gathers", len(rec.of("all_gather")), 2 * per_step)
            ctx.equal(f"{label} step {step} reduce-scatters", len(rec.of("reduce_scatter")), per_step)
            ctx.equal(f"{label} step {step} all-reduces", len(rec.of("all_reduce")), 0)
        totals[fused] = sum(len(rec.calls) for rec in recorders)
    ctx.true("fused issues fewer collectives than unfused", totals[True] < totals[False], totals[True], totals[False])


@case(
    "L0-07",
    "test_fully_shard_list_input_precision",
    "_test_fully_shard_precision.py",
    world_size=2,
    mesh_shape=(2,),
    config="FSDP 1D fp32",
)
def list_input_precision(ctx: CaseContext) -> None:
    """Two layers sharded by one list call, as independent groups under a sharded root, train like DDP."""
    mesh = case_mesh((ctx.world_size,))
    model = MLP(DIMS)
    ddp = ddp_of(model)
    listed = [model.layers[0], model.layers[1]]
    groups = fully_shard(listed, mesh=mesh)
    ctx.require(
        "the list call returns its modules, each an HSDPModule",
        isinstance(groups, list)
        and len(groups) == len(listed)
        and all(g is m and isinstance(g, HSDPModule) for g, m in zip(groups, listed, strict=False)),
        f"{type(groups).__name__}",
    )
    fully_shard(model, mesh=mesh)

    train_against(ctx, model, ddp, rank_batches(ctx.rank, (4, DIMS[0])), square_mean, ctx.tol)


class _DtypeProbe:
    """What a module under a policy sees and emits: its inputs', compute params' and outputs' dtypes."""

    def __init__(self, first: nn.Module, root: nn.Module) -> None:
        self.inputs: set[torch.dtype] = set()
        self.params: set[torch.dtype] = set()
        self.outputs: set[torch.dtype] = set()
        # registered after fully_shard: they see what the module's forward receives and returns
        first.register_forward_pre_hook(self._pre_forward)
        root.register_forward_hook(self._post_forward)

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        self.inputs.add(args[0].dtype)
        self.params.update(p.dtype for p in module.parameters(recurse=False))

    def _post_forward(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.outputs.add(output.dtype)


def _names(dtypes: set[torch.dtype]) -> str:
    return str(sorted(str(d) for d in dtypes))


@case(
    "L0-10",
    "test_mp_defaults_and_fp16",
    "_test_fully_shard_precision.py",
    world_size=2,
    mesh_shape=(2,),
    config="FSDP 1D fp16",
)
def mp_defaults_and_fp16(ctx: CaseContext) -> None:
    """The default MixedPrecisionPolicy computes and communicates in fp32; fp16/fp32/fp32 computes and
    gathers in fp16 and reduces in fp32 into fp32 grads; both match a same-dtype reference."""
    mesh = case_mesh((ctx.world_size,))
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    configs = (
        ("default", MixedPrecisionPolicy(), tolerance("FSDP 1D fp32")),
        ("fp16/fp32/fp32", MixedPrecisionPolicy(torch.float16, torch.float32, torch.float32), ctx.tol),
    )
    for label, policy, tol in configs:
        compute = policy.param_dtype or torch.float32
        reduce = policy.reduce_dtype or compute
        output = policy.output_dtype or compute
        model = MLP(DIMS)
        reference = SameDtypeReference(model, compute, reduce, policy.output_dtype, policy.cast_forward_inputs)
        shard_nested(model, model.layers, mesh=mesh, mp_policy=policy)
        probe = _DtypeProbe(model.layers[0], model)
        recorders: list[CollectiveRecorder] = []

        def grads_fp32(step: int, label: str = label, model: nn.Module = model) -> None:
            for name, param in named_params(model).items():
                grad = param.grad
                ctx.true(
                    f"{label} step {step} grad {name} is a DTensor", isinstance(grad, DTensor), type(grad).__name__
                )
                ctx.equal(
                    f"{label} step {step} grad dtype {name}", str(getattr(grad, "dtype", None)), str(torch.float32)
                )

        train_against(
            ctx,
            model,
            reference,
            batches,
            square_mean,
            tol,
            label=label,
            recorders=recorders,
            after_backward=grads_fp32,
        )
        ctx.equal(f"{label} compute param dtype", _names(probe.params), _names({compute}))
        ctx.equal(f"{label} input dtype seen by the first layer", _names(probe.inputs), _names({compute}))
        ctx.equal(f"{label} output dtype", _names(probe.outputs), _names({output}))
        gathers = {c.dtype for rec in recorders for c in rec.of("all_gather")}
        reductions = {c.dtype for rec in recorders for c in rec.of("reduce_scatter") + rec.of("all_reduce")}
        ctx.equal(f"{label} all-gather dtype", _names(gathers), _names({compute}))
        ctx.equal(f"{label} reduction dtype", _names(reductions), _names({reduce}))
        masters = {p.dtype for p in model.parameters()}
        ctx.equal(f"{label} sharded (master) param dtype", _names(masters), _names({torch.float32}))
