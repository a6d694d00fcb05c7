"""Plan cases of the plan's ``test_fully_shard_precision.py``, level L1: ignored params (L1-06), comm fusion's
numerics (L1-08), the mixed-precision policies (L1-10..13)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.layout import padded_shard_numel
from tests.kit.judging.recorder import CollectiveRecorder
from tests.kit.judging.reference import GlobalBatchReference, SameDtypeReference, ddp_of, full
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import Tolerance, specific
from tests.kit.workloads.models import DIMS, MLP, NestedInputs, rank_batches
from tests.kit.workloads.precision import dtype_names, train_under_policy
from tests.kit.workloads.training import (
    differs_across_ranks,
    named_params,
    raises_nothing,
    record_grads,
    shard_nested,
    square_mean,
    train_accumulating_against,
    train_against,
)


@case(
    "L1-06",
    "test_ignored_params",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("ignored_params",),
)
def ignored_params(ctx: CaseContext) -> None:
    """An ignored param stays the user's plain, whole tensor (not a DTensor; not moved, cast or
    changed); its grad is never communicated (each rank keeps its own local grad, and no collective
    carries it); the other params are sharded, reduce-scattered and train like DDP; the module's
    zero_grad clears the ignored param's grad as well. The baseline is DDP told to ignore the same
    param, so its grad stays rank-local too."""
    world = ctx.world_size
    ignored_name = "layers.1.weight"
    model = MLP(DIMS)
    ignored = model.layers[1].weight
    original = ignored.detach().clone()
    baseline = copy.deepcopy(model)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(baseline, [ignored_name])
    ddp = DistributedDataParallel(baseline)
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    ctx.require("ranks' batches differ (a synced grad would equal, local ones not)", differs_across_ranks(batches[0]))
    full_params = dict(model.named_parameters())
    managed = [p for name, p in full_params.items() if name != ignored_name]
    scattered_per_step = world * padded_shard_numel(managed, world)  # each managed grad reduced once
    mesh = ctx.mesh
    impl.fully_shard(model.layers[0], mesh=mesh)
    impl.fully_shard(model, mesh=mesh, ignored_params=[ignored])

    params = named_params(model)
    ctx.true("the ignored param is still the user's tensor", params[ignored_name] is ignored)
    ctx.true("the ignored param is not sharded", not impl.is_sharded(ignored), type(ignored).__name__)
    ctx.equal("the ignored param's numel == full numel", ignored.numel(), original.numel())
    ctx.equal("the ignored param's dtype", str(ignored.dtype), str(original.dtype))
    ctx.equal("the ignored param's device", str(ignored.device), str(original.device))
    ctx.equal("the ignored param's data untouched", ignored.detach(), original)
    for name, param in params.items():
        if name != ignored_name:
            ctx.true(f"{name} is sharded", impl.is_sharded(param), type(param).__name__)

    def grads(step: int) -> None:
        grad = ignored.grad
        where = f"step {step} ignored grad"
        ctx.true(f"{where}: a plain tensor", grad is not None and not impl.is_sharded(grad), type(grad).__name__)
        ctx.equal(f"{where}: numel == full numel", getattr(grad, "numel", lambda: 0)(), original.numel())
        ctx.true(f"{where}: differs across ranks (not synced)", grad is not None and differs_across_ranks(grad))
        for name, param in named_params(model).items():
            if name != ignored_name:
                ctx.true(f"step {step} grad {name} is sharded", impl.is_sharded(param.grad))

    recorders: list[CollectiveRecorder] = []
    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, recorders=recorders, after_backward=grads)
    for step, rec in enumerate(recorders):
        scattered = sum(c.numel for c in rec.of("reduce_scatter"))
        ctx.equal(f"step {step} elements reduce-scattered: the managed grads only", scattered, scattered_per_step)
        ctx.equal(f"step {step} all-reduces", len(rec.of("all_reduce")), 0)

    def zero_grad_clears_ignored() -> None:
        square_mean(model, batches[0]).backward()
        ctx.require("the ignored param has a grad before zero_grad", ignored.grad is not None)
        model.zero_grad()
        for name, param in named_params(model).items():
            ctx.true(f"after model.zero_grad(): {name}.grad is None (the ignored param's too)", param.grad is None)

    ctx.run_part("zero_grad", ("zero_grad",), zero_grad_clears_ignored)


@case(
    "L1-08",
    "test_comm_fusion_numerical_correctness",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("comm_fusion",),
)
def comm_fusion_numerical_correctness(ctx: CaseContext) -> None:
    """comm_fusion on and off train the same model on the same data to the same numbers: per step,
    losses, grad norms and grads within 1e-6 of each other, and the params after the last step;
    both within 1e-5 of DDP. The fused run sends one all-gather / reduce-scatter per group (the
    group's padded shards back to back), the unfused one one per param."""
    world = ctx.world_size
    mesh = ctx.mesh
    batches = rank_batches(ctx.rank, (4, DIMS[0]), steps=3)
    same = specific("comm fusion equivalence")
    layers = MLP(DIMS).layers
    # per step: each group (one per layer) gathered in forward and again in backward, reduced once
    units = {
        True: [padded_shard_numel(layer, world) for layer in layers],
        False: [padded_shard_numel([p], world) for p in layers.parameters()],
    }
    runs: dict[bool, dict] = {}
    for fused in (True, False):
        label = f"comm_fusion={fused}"
        model = MLP(DIMS)
        ddp = ddp_of(model)
        shard_nested(model, model.layers, mesh=mesh, comm_fusion=fused)
        run: dict = {"loss": [], "grads": [], "recorders": []}

        def loss_fn(module: nn.Module, x: torch.Tensor, model: nn.Module = model, run: dict = run) -> torch.Tensor:
            loss = square_mean(module, x)
            if module is model:
                run["loss"].append(loss.detach().clone())
            return loss

        def keep_grads(step: int, model: nn.Module = model, run: dict = run) -> None:
            run["grads"].append({n: full(p.grad).detach().clone() for n, p in named_params(model).items()})

        train_against(
            ctx,
            model,
            ddp,
            batches,
            loss_fn,
            ctx.tol,
            label=f"{label} vs DDP",
            recorders=run["recorders"],
            after_backward=keep_grads,
        )
        run["params"] = {n: full(p).detach().clone() for n, p in named_params(model).items()}
        for step, rec in enumerate(run["recorders"]):
            sent = sorted(c.numel for c in rec.of("all_gather"))
            ctx.equal(f"{label} step {step} all-gather sizes", str(sent), str(sorted(2 * units[fused])))
            scattered = sorted(c.numel for c in rec.of("reduce_scatter"))
            ctx.equal(
                f"{label} step {step} reduce-scatter sizes",
                str(scattered),
                str(sorted(world * n for n in units[fused])),
            )
        runs[fused] = run

    fused, unfused = runs[True], runs[False]
    counts = [(len(f.calls), len(u.calls)) for f, u in zip(fused["recorders"], unfused["recorders"], strict=True)]
    ctx.require("fused and unfused runs issue different collectives", all(f < u for f, u in counts), str(counts))
    for step in range(len(batches)):
        where = f"step {step} fused vs unfused"
        ctx.close(f"{where}: loss", fused["loss"][step], unfused["loss"][step], same)
        norms = [
            math.sqrt(sum(g.double().square().sum().item() for g in run["grads"][step].values()))
            for run in (fused, unfused)
        ]
        ctx.close(f"{where}: grad norm", norms[0], norms[1], same)
        for name, grad in fused["grads"][step].items():
            ctx.close(f"{where}: grad {name}", grad, unfused["grads"][step][name], same)
    for name, param in fused["params"].items():
        ctx.close(f"after {len(batches)} steps fused vs unfused: param {name}", param, unfused["params"][name], same)


@case(
    "L1-10",
    "test_mp_bf16_param_fp32_reduce",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D bf16",
    needs=("mixed_precision",),
)
def mp_bf16_param_fp32_reduce(ctx: CaseContext) -> None:
    """bf16/fp32/fp32: compute params, compute grads and all-gathers bf16, reductions fp32, fp32
    DTensor grads, fp32 output; loss, grad norm and grads within 1e-3 of the plan's single card in
    bf16 on the global batch (and, extra, of the bf16 same-dtype data-parallel reference)."""
    policy = impl.MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)
    _against_single_card_and_same_dtype(ctx, "bf16/fp32/fp32", policy)
    _nested_inputs_cast(ctx, policy)


def _against_single_card_and_same_dtype(ctx: CaseContext, label: str, policy: Any) -> None:
    """The plan's row: training under ``policy`` against the single card in bf16 on the global batch
    (1e-3); beyond it, the same training against the same-dtype data-parallel reference, which
    repeats the engine's arithmetic (same compute dtype per rank, reductions in the reduce dtype)."""
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    ctx.require(f"{label}: ranks' batches differ (the global batch is not a rank's)", differs_across_ranks(batches[0]))
    train_under_policy(ctx, f"{label} vs single card", policy, ctx.tol, batches, single_device=True)
    with ctx.extra("the same-dtype data-parallel reference repeats the engine's arithmetic: stricter than one card"):
        train_under_policy(ctx, f"{label} vs same-dtype DP", policy, ctx.tol, batches)


def _nested_inputs_cast(ctx: CaseContext, policy: Any) -> None:
    """Floating inputs reach the forward in param_dtype wherever they are (positional, in a dict, by
    keyword); integer token ids stay integers; forward and backward then run without a dtype
    mismatch and every grad is finite."""
    model = NestedInputs()
    impl.fully_shard(model, mesh=ctx.mesh, mp_policy=policy)
    x, y = rank_batches(ctx.rank, (4, 8), steps=2, first=60)
    tokens = torch.arange(4) % 16
    raises_nothing(
        ctx,
        "nested and keyword inputs: forward and backward raise nothing",
        lambda: model(x, {"y": y}, scale=torch.ones(()), tokens=tokens).float().square().mean().backward(),
    )
    want = {
        "x": str(policy.param_dtype),
        "extras['y']": str(policy.param_dtype),
        "scale (keyword)": str(policy.param_dtype),
        "tokens": str(tokens.dtype),
    }
    ctx.equal("nested and keyword inputs: dtypes the forward received", str(model.received), str(want))
    for name, param in named_params(model).items():  # a forward that raised left no grads: these fail
        grad = param.grad
        finite = grad is not None and bool(torch.isfinite(full(grad)).all())
        ctx.true(f"nested and keyword inputs: grad {name} finite", finite)


@case(
    "L1-11",
    "test_mp_bf16_all_bf16",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D bf16",
    needs=("mixed_precision",),
)
def mp_bf16_all_bf16(ctx: CaseContext) -> None:
    """bf16/bf16/bf16: compute, compute grads, all-gathers, reductions and the output in bf16;
    param.grad keeps the sharded param's dtype (fp32); loss, grad norm and grads within 1e-3 of the
    plan's single card in bf16 on the global batch (and, extra, of the same-dtype reference)."""
    policy = impl.MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    _against_single_card_and_same_dtype(ctx, "bf16/bf16/bf16", policy)


@case(
    "L1-12",
    "test_mp_cast_forward_inputs_false",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp16",
    needs=("mixed_precision", "cast_forward_inputs"),
)
def mp_cast_forward_inputs_false(ctx: CaseContext) -> None:
    """fp16/fp32 with cast_forward_inputs=False: the root's and the first layer's forwards receive
    their inputs in the dtype their caller passed (fp32 into the root and layer 0); a model that
    casts what it needs itself trains without a dtype mismatch, finite losses, within 1e-3 of the
    fp16 reference that does not cast inputs either."""
    label = "fp16/fp32 no input cast"
    policy = impl.MixedPrecisionPolicy(torch.float16, torch.float32, cast_forward_inputs=False)
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    ctx.require(
        "the inputs' dtype differs from param_dtype (a cast would show)", batches[0].dtype != policy.param_dtype
    )
    run = raises_nothing(
        ctx,
        "training raises nothing (no dtype mismatch)",
        lambda: train_under_policy(ctx, label, policy, ctx.tol, batches, self_casting=True),
    )
    for step, loss in enumerate(ctx.series.get(f"{label} loss", {}).get("ours", [])):
        ctx.true(f"{label} step {step} loss finite", math.isfinite(loss), loss)
    if run is None:
        return
    for where in ("root", "first layer"):
        given, seen = run.probe.given[where], run.probe.seen[where]
        received, passed = dtype_names(seen), dtype_names(given)
        ctx.equal(f"{label} {where}: dtype its forward receives == dtype passed in", received, passed)
    ctx.equal(f"{label} root: dtype passed in", dtype_names(run.probe.given["root"]), dtype_names({batches[0].dtype}))


# per micro-batch of a step: held back unreduced, then two reductions that accumulate in the main grad
MAIN_GRAD_SYNCS = (False, True, True)


@case(
    "L1-13",
    "test_mp_apply_grad_on_fp32_main_grad",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp16",
    needs=("mixed_precision", "main_grad", "gradient_sync"),
)
def mp_apply_grad_on_fp32_main_grad(ctx: CaseContext) -> None:
    """fp16/fp32 with apply_grad_on_fp32_main_grad: per step a held-back micro-batch then two reduced
    ones accumulate in param.main_grad, one persistent fp32 DTensor that param.grad is; after each
    reduction and after 2 optimizer steps, loss, grads and params within 1e-5 of SameDtypeReference
    (same fp16 compute, fp32 accumulation and reduction); zero_grad clears the main grads."""
    policy = impl.MixedPrecisionPolicy(torch.float16, torch.float32, apply_grad_on_fp32_main_grad=True)
    main = specific("fp32 main grad")
    tol = Tolerance(loss=main, grad=main)
    model = MLP(DIMS)
    reference = SameDtypeReference(model, torch.float16, torch.float32)
    shard_nested(model, model.layers, mesh=ctx.mesh, mp_policy=policy)
    buffers: dict[str, int] = {}

    def main_grads(step: int, micro: int, rec: CollectiveRecorder) -> None:
        where = f"step {step} micro {micro}"
        gathers = {c.dtype for c in rec.of("all_gather")}
        reductions = rec.of("reduce_scatter") + rec.of("all_reduce")
        ctx.equal(f"{where} all-gather dtype", dtype_names(gathers), dtype_names({torch.float16}))
        if not MAIN_GRAD_SYNCS[micro]:
            ctx.equal(f"{where} reductions (held back)", len(reductions), 0)
            return
        ctx.equal(f"{where} reduction dtype", dtype_names({c.dtype for c in reductions}), dtype_names({torch.float32}))
        for name, param in named_params(model).items():
            buffer = getattr(param, "main_grad", None)
            ctx.true(f"{where} {name}.grad is its main_grad", buffer is not None and param.grad is buffer)
            ctx.true(f"{where} {name}.main_grad sharded", impl.is_sharded(buffer), type(buffer).__name__)
            ctx.equal(f"{where} {name}.main_grad dtype", str(getattr(buffer, "dtype", None)), str(torch.float32))
            first = buffers.setdefault(name, id(buffer))
            ctx.true(f"{where} {name}.main_grad is one persistent buffer", id(buffer) == first)
        record_grads(ctx, f"{where} accumulated", model, reference, tol.grad)

    train_accumulating_against(
        ctx,
        model,
        reference,
        [rank_batches(ctx.rank, (4, DIMS[0]), len(MAIN_GRAD_SYNCS), first=10 * step) for step in range(2)],
        square_mean,
        tol,
        accumulate=lambda holding: model.set_requires_gradient_sync(not holding),
        after_micro=main_grads,
        sync_micro=lambda micro: MAIN_GRAD_SYNCS[micro],
    )

    def zero_grad_clears_main_grads() -> None:
        square_mean(model, rank_batches(ctx.rank, (4, DIMS[0]), first=90)[0]).backward()
        held = [getattr(p, "main_grad", None) for p in model.parameters()]
        ctx.require(
            "main grads hold a reduced grad before zero_grad",
            all(b is not None and bool(full(b).any()) for b in held),
        )
        model.zero_grad()
        for name, param in named_params(model).items():
            ctx.true(f"after zero_grad: {name}.grad is None", param.grad is None)
            buffer = getattr(param, "main_grad", None)
            zeros = buffer is not None and not bool(full(buffer).any())
            ctx.true(f"after zero_grad: {name}.main_grad zeros", zeros)

    ctx.run_part("zero_grad", ("zero_grad",), zero_grad_clears_main_grads)
    _gap_to_the_fp32_single_card(ctx, policy)


def _gap_to_the_fp32_single_card(ctx: CaseContext, policy: Any) -> None:
    """The plan's own baseline for L1-13, drawn, not judged: one step's grads (the fp32 main grads)
    against the fp32 single card on the global batch, beside what fp16 compute alone moves them
    (the same-fp16 reference against that card) and the plan's 1e-5. fp16 compute cannot meet 1e-5
    of fp32 (its unit roundoff is 4.9e-4), so the case judges against the same-fp16 reference;
    docs/plan_fidelity.md gives the reading."""
    model = MLP(DIMS)
    single_card = GlobalBatchReference(model)
    fp16_alone = SameDtypeReference(model, torch.float16, torch.float32)
    shard_nested(model, model.layers, mesh=ctx.mesh, mp_policy=policy)
    batch = rank_batches(ctx.rank, (4, DIMS[0]), steps=1, first=95)[0]
    square_mean(model, batch).backward()
    square_mean(single_card, batch).backward()
    square_mean(fp16_alone, batch).backward()
    fp16_alone.reduce_grads()
    ours, card, alone = named_params(model), named_params(single_card), named_params(fp16_alone)
    for name, param in ours.items():
        exact = card[name].grad.double()
        ctx.bar(
            "L1-13: grads against the plan's fp32 single card (max abs error, log scale)",
            name,
            ours=(full(param.grad).double() - exact).abs().max(),
            **{"fp16 compute alone": (alone[name].grad.double() - exact).abs().max(), "plan's tol": 1e-5},
        )


# -- L2: feature coupling ------------------------------------------------------------------------


