"""Plan cases of the plan's ``test_fully_shard_precision.py``, level L2: fully_shard coupled with training
features (L2-01 accumulation, L2-02 frozen params, L2-07 clipping, L2-08 dynamic sequence length)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.layout import padded_shard_numel
from tests.kit.judging.recorder import CollectiveRecorder
from tests.kit.judging.reference import GlobalBatchReference, SameDtypeReference, ddp_of, full
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import Tolerance, specific, tolerance
from tests.kit.workloads.models import DIMS, MLP, rank_batches
from tests.kit.workloads.networks import Decoder, DecoderConfig, cross_entropy_loss, token_batch
from tests.kit.workloads.training import (
    differs_across_ranks,
    grad_norm,
    named_params,
    shard_nested,
    square_mean,
    train_accumulating_against,
    train_against,
)

ACCUMULATION = 3  # micro-batches per optimizer step


def _accumulated_like_large_batch(ctx: CaseContext, label: str, tol: Tolerance, dtype: Any = None, **options: Any):
    """Two optimizer steps of ``ACCUMULATION`` micro-batches each, the first ones with gradient sync
    off, against the baseline accumulating the same micro-batches (DDP under ``no_sync``: its
    large-batch grad; the same-dtype reference under mixed precision). While held back nothing is
    reduced, and the baseline's local grads differ across ranks (so a premature sync would show)."""
    model = MLP(DIMS)
    if dtype is None:
        reference: Any = ddp_of(model)
    else:
        reference = SameDtypeReference(model, dtype, torch.float32)
        options["mp_policy"] = impl.MixedPrecisionPolicy(dtype, torch.float32)
    shard_nested(model, model.layers, mesh=ctx.mesh, **options)
    step_batches = [rank_batches(ctx.rank, (4, DIMS[0]), ACCUMULATION, first=10 * step) for step in range(2)]
    # the model's (sharded) grads as the API shows them before each micro-batch: None after zero_grad
    before: dict[str, torch.Tensor | None] = dict.fromkeys(named_params(model))

    def held_back(step: int, micro: int, rec: CollectiveRecorder) -> None:
        if micro == ACCUMULATION - 1:
            before.update(dict.fromkeys(before))  # the optimizer step and its zero_grad follow
            return
        where = f"{label} step {step} micro {micro} (sync off)"
        ctx.equal(f"{where}: reduce-scatters", len(rec.of("reduce_scatter")), 0)
        ctx.equal(f"{where}: all-reduces", len(rec.of("all_reduce")), 0)
        if dtype is None:  # DDP's grads under no_sync are its ranks' own accumulations
            local = torch.cat([p.grad.flatten() for p in reference.module.parameters()])
            ctx.require(f"{where}: the ranks' accumulated local grads differ", differs_across_ranks(local))
        for name, param in named_params(model).items():
            now = None if param.grad is None else full(param.grad).detach().clone()
            was = before[name]
            same = (now is None and was is None) or (now is not None and was is not None and torch.equal(now, was))
            shown = "None" if now is None else f"tensor{tuple(now.shape)}"
            ctx.true(
                f"{where}: {name}.grad untouched while held back", same, shown, "None" if was is None else "as before"
            )
            before[name] = now

    train_accumulating_against(
        ctx,
        model,
        reference,
        step_batches,
        square_mean,
        tol,
        accumulate=lambda holding: model.set_requires_gradient_sync(not holding),
        label=label,
        after_micro=held_back,
    )


@case(
    "L2-01",
    "test_gradient_accumulation",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("gradient_sync",),
)
def gradient_accumulation(ctx: CaseContext) -> None:
    """N micro-steps with gradient sync off for all but the last accumulate to the large-batch DDP
    grad (1e-5), with params resharded after forward or kept, fused or unfused collectives, and
    under bf16 compute with an fp32 reduce (1e-3 against the same-dtype reference); while held back
    the ranks' grads differ, nothing is reduce-scattered and the model's grads, as the API shows
    them, stay as they were (None after the optimizer's zero_grad)."""
    _accumulated_like_large_batch(ctx, "fused", ctx.tol)
    ctx.run_part(
        "params kept after forward",
        ("reshard_after_forward",),
        lambda: _accumulated_like_large_batch(ctx, "kept after forward", ctx.tol, reshard_after_forward=False),
    )
    ctx.run_part(
        "unfused", ("comm_fusion",), lambda: _accumulated_like_large_batch(ctx, "unfused", ctx.tol, comm_fusion=False)
    )
    ctx.run_part(
        "bf16 / fp32 reduce",
        ("mixed_precision",),
        lambda: _accumulated_like_large_batch(ctx, "bf16", tolerance("FSDP 1D bf16"), dtype=torch.bfloat16),
    )


FROZEN = ("layers.1.weight", "layers.1.bias", "layers.2.bias")  # a whole group, and one param of another


@case(
    "L2-02",
    "test_frozen_params_mixed_training",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
)
def frozen_params_mixed_training(ctx: CaseContext) -> None:
    """Frozen params (``requires_grad=False``: one layer's group whole, and a bias in a group that
    trains) get no grad and keep their data bitwise; the trainable ones' grads, params and the loss
    equal the single-device model's on the global batch (1e-5); and the reduce-scatters of each
    step carry the trainable params only (their element count; the precondition: there were some)."""
    world = ctx.world_size
    model = MLP(DIMS)
    params = dict(model.named_parameters())
    for name in FROZEN:
        params[name].requires_grad_(False)
    snapshot = {name: params[name].detach().clone() for name in FROZEN}
    trainable = [p for name, p in params.items() if name not in FROZEN]
    scattered_per_step = world * padded_shard_numel(trainable, world)
    reference = GlobalBatchReference(model)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    ctx.require("ranks' batches differ (the global batch is not a rank's)", differs_across_ranks(batches[0]))

    def frozen_untouched(step: int) -> None:
        ours = named_params(model)
        for name in FROZEN:
            ctx.true(f"step {step} frozen {name}: no grad", ours[name].grad is None, type(ours[name].grad).__name__)

    recorders: list[CollectiveRecorder] = []
    train_against(
        ctx,
        model,
        reference,
        batches,
        square_mean,
        ctx.tol,
        recorders=recorders,
        after_backward=frozen_untouched,
        mean_loss_over_ranks=True,
    )
    for step, rec in enumerate(recorders):
        scattered = sum(c.numel for c in rec.of("reduce_scatter"))
        ctx.require(f"step {step}: the trainable params were reduce-scattered", scattered > 0, str(scattered))
        ctx.equal(f"step {step} elements reduce-scattered: the trainable params only", scattered, scattered_per_step)
    ours = named_params(model)
    for name in FROZEN:
        ctx.equal(f"after training: frozen {name} data unchanged", full(ours[name]), snapshot[name])


@case(
    "L2-07",
    "test_grad_clip_with_dtensor_grads",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("clip_grad_norm",),
)
def grad_clip_with_dtensor_grads(ctx: CaseContext) -> None:
    """``torch.nn.utils.clip_grad_norm_`` on the sharded grads, at half the unclipped global norm
    (precondition: it does clip): the total norm it returns is the global one (= the single-device
    model's, 1e-5; a per-shard norm would be smaller), the clipped global norm is at most max_norm
    + 1e-6, and the clipped grads, the loss and the params after each step equal the single-device
    model's on the global batch, clipped the same way (1e-5). Where declared, the same with the biases
    replicated."""
    model = MLP(DIMS)
    reference = GlobalBatchReference(model)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    _clipped_training(ctx, model, reference, "")
    ctx.run_part("replicated biases", ("replicate_params",), lambda: _replicated_biases_clipped(ctx))


def _clipped_training(ctx: CaseContext, model: nn.Module, reference: Any, label: str) -> None:
    """Train ``model`` against ``reference``, both clipped at half the reference's unclipped norm."""
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    prefix = f"{label}: " if label else ""

    def clip(step: int) -> None:
        unclipped = float(grad_norm(reference))
        max_norm = unclipped / 2
        ctx.require(
            f"{prefix}step {step}: the unclipped norm exceeds max_norm", unclipped > max_norm, f"{unclipped:.4g}"
        )
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        where = f"{prefix}step {step} total norm clip_grad_norm_ returns (global, not per shard)"
        ctx.close(where, total, ref_total, ctx.tol.grad)
        after = f"{prefix}step {step} global grad norm after clipping"
        ctx.at_most(after, grad_norm(model), max_norm, specific("clip bound"))

    train_against(
        ctx,
        model,
        reference,
        batches,
        square_mean,
        ctx.tol,
        after_backward=clip,
        mean_loss_over_ranks=True,
        label=label,
    )


def _replicated_biases_clipped(ctx: CaseContext) -> None:
    """The same with every bias replicated (HyperParallel's ``replicate_params``): a replicated grad
    counts once in the global norm, not once per rank (upstream's #279, #735)."""
    model = MLP(DIMS)
    reference = GlobalBatchReference(model)
    for layer in model.layers:
        impl.fully_shard(layer, mesh=ctx.mesh, replicate_params=[layer.bias])
    impl.fully_shard(model, mesh=ctx.mesh)
    _clipped_training(ctx, model, reference, "replicated biases")


SEQ_LENS = (16, 7, 32, 5, 24)  # one step each


@case(
    "L2-08",
    "test_dynamic_sequence_length",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    timeout=60,
)
def dynamic_sequence_length(ctx: CaseContext) -> None:
    """A small decoder (causal attention, SwiGLU, tied embedding) trains 5 steps on sequences of a
    different length each, within the 60 s timeout (a hang fails with every rank's stack): every
    loss and grad norm finite, the params' local and full shapes unchanged, and each step equal to
    DDP (1e-5)."""
    config = DecoderConfig(vocab=64, hidden=32, layers=2, heads=2, ffn_inner=64, seed=3)
    model = Decoder(config)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    shapes = {name: (tuple(impl.local(p).shape), tuple(full(p).shape)) for name, p in named_params(model).items()}
    batches = [token_batch(step, ctx.rank, 2, seq, config.vocab) for step, seq in enumerate(SEQ_LENS)]

    def loss_of(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return cross_entropy_loss(module(tokens), targets)

    def finite_and_same_shapes(step: int) -> None:
        where = f"step {step} (seq {SEQ_LENS[step]})"
        ctx.true(f"{where}: grad norm finite", math.isfinite(float(grad_norm(model))))
        for name, param in named_params(model).items():
            now = (tuple(impl.local(param).shape), tuple(full(param).shape))
            ctx.equal(f"{where}: {name} local and full shapes unchanged", str(now), str(shapes[name]))

    train_against(ctx, model, ddp, batches, loss_of, ctx.tol, after_backward=finite_and_same_shapes)
    for step, loss in enumerate(ctx.series["loss"]["ours"]):
        ctx.true(f"step {step} (seq {SEQ_LENS[step]}): loss finite", math.isfinite(loss), loss)
