"""Training under a mixed-precision policy and what it promises: a probe of the dtypes a module's
params, grads, inputs and outputs have, and a nested MLP trained under a policy against the
single-device or same-dtype reference (the precision cases of L0 and L1 share it)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch import nn

from tests.kit.judging.case import CaseContext
from tests.kit.judging.recorder import CollectiveRecorder
from tests.kit.judging.reference import SameDtypeReference
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import Tolerance
from tests.kit.workloads.models import DIMS, MLP
from tests.kit.workloads.training import (
    named_params,
    shard_nested,
    square_mean,
    train_against,
)


class DtypeProbe:
    """What a model under a policy is given and sees: the dtypes its caller passes to the root and to
    the first layer (hooks run before fully_shard's), the dtypes their forwards receive, the first
    layer's compute params and the grads autograd computes for them (hooks run after fully_shard's),
    and the root's output dtype."""

    def __init__(self, first: nn.Module, root: nn.Module) -> None:
        self.given: dict[str, set[torch.dtype]] = {"root": set(), "first layer": set()}
        self.seen: dict[str, set[torch.dtype]] = {"root": set(), "first layer": set()}
        self.params: set[torch.dtype] = set()
        self.grads: set[torch.dtype] = set()  # of the grads autograd computes for the compute params
        self._hooked: set[int] = set()
        self.outputs: set[torch.dtype] = set()
        for where, module in (("root", root), ("first layer", first)):
            # registered after fully_shard: prepended hooks run before its pre-hook, the others after
            module.register_forward_pre_hook(functools.partial(self._inputs, self.given[where]), prepend=True)
            module.register_forward_pre_hook(functools.partial(self._inputs, self.seen[where]))
        first.register_forward_pre_hook(self._pre_forward)
        root.register_forward_hook(self._post_forward)

    @property
    def inputs(self) -> set[torch.dtype]:
        """What the first layer's forward receives."""
        return self.seen["first layer"]

    @staticmethod
    def _inputs(into: set[torch.dtype], module: nn.Module, args: tuple) -> None:
        into.add(args[0].dtype)

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        for param in module.parameters(recurse=False):
            self.params.add(param.dtype)
            if param.requires_grad and id(param) not in self._hooked:  # the unsharded compute param
                self._hooked.add(id(param))
                param.register_hook(self._grad)

    def _grad(self, grad: torch.Tensor) -> None:
        self.grads.add(grad.dtype)

    def _post_forward(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.outputs.add(output.dtype)


def dtype_names(dtypes: set[torch.dtype]) -> str:
    return str(sorted(str(d) for d in dtypes))


class PolicyRun(NamedTuple):
    model: nn.Module
    probe: DtypeProbe
    recorders: list[CollectiveRecorder]


def train_under_policy(
    ctx: CaseContext,
    label: str,
    policy: Any,
    tol: Tolerance,
    batches: list[torch.Tensor],
    self_casting: bool = False,
    single_device: bool = False,
) -> PolicyRun:
    """Train a nested MLP under ``policy`` and record what the policy promises: compute params,
    inputs and outputs, compute grads, all-gathers in the compute dtype, reductions in the reduce
    dtype, DTensor grads of the sharded params' dtype (fp32), fp32 master params. The baseline:
    ``SameDtypeReference`` (same compute dtype per rank, explicit reduction in the reduce dtype), or
    with ``single_device`` the plan's single card in the compute dtype on the global batch."""
    compute = policy.param_dtype or torch.float32
    reduce = policy.reduce_dtype or compute
    output = policy.output_dtype or compute
    given = batches[0].dtype
    model = MLP(DIMS, self_casting=self_casting)
    reference = SameDtypeReference(
        model, compute, reduce, policy.output_dtype, policy.cast_forward_inputs, global_batch=single_device
    )
    shard_nested(model, model.layers, mesh=ctx.mesh, mp_policy=policy)
    probe = DtypeProbe(model.layers[0], model)
    recorders: list[CollectiveRecorder] = []

    def grads_fp32(step: int) -> None:
        for name, param in named_params(model).items():
            grad = param.grad
            ctx.true(f"{label} step {step} grad {name} is sharded", impl.is_sharded(grad), type(grad).__name__)
            ctx.equal(f"{label} step {step} grad dtype {name}", str(getattr(grad, "dtype", None)), str(torch.float32))

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
        mean_loss_over_ranks=single_device,
    )
    received = compute if policy.cast_forward_inputs else given
    ctx.equal(f"{label} compute param dtype", dtype_names(probe.params), dtype_names({compute}))
    grads = dtype_names(probe.grads)
    ctx.equal(f"{label} compute grad dtype (autograd's, before the reduction)", grads, dtype_names({compute}))
    ctx.equal(f"{label} input dtype seen by the first layer", dtype_names(probe.inputs), dtype_names({received}))
    ctx.equal(f"{label} output dtype", dtype_names(probe.outputs), dtype_names({output}))
    gathers = {c.dtype for rec in recorders for c in rec.of("all_gather")}
    reductions = {c.dtype for rec in recorders for c in rec.of("reduce_scatter") + rec.of("all_reduce")}
    ctx.equal(f"{label} all-gather dtype", dtype_names(gathers), dtype_names({compute}))
    ctx.equal(f"{label} reduction dtype", dtype_names(reductions), dtype_names({reduce}))
    masters = {p.dtype for p in model.parameters()}
    ctx.equal(f"{label} sharded (master) param dtype", dtype_names(masters), dtype_names({torch.float32}))
    return PolicyRun(model, probe, recorders)
