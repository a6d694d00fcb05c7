"""Plan cases of ``_test_fully_shard_with_vit.py``: vision structures at the plan's sizes (L3-04
ViT, L3-06 multimodal DeepStack), each also on its other mesh shape as a case of its own.

As the LLM cases: 2 AdamW steps with dual metrics against DDP, then a bitwise rerun. The parts
the plan keeps whole (the ViT's patch embedding and head, the multimodal projector) are given to
``replicate_params``: whole on every rank, bitwise equal across ranks, equal to DDP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.kit.judging.case import HSDP_2X2, CaseContext, case
from tests.kit.judging.determinism import Run, rerun_bitwise
from tests.kit.judging.reference import ddp_of
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import Tolerance
from tests.kit.workloads.networks import token_batch
from tests.kit.workloads.training import (
    differs_across_ranks,
    grad_norm,
    named_params,
    shard_nested,
    train_against,
    train_alone,
)
from tests.kit.workloads.vision import Multimodal, image_batch, vit
from tests.torch.fully_shard._test_fully_shard_with_llm import STEPS, Trajectory, adamw

IMAGES = 2  # images per rank
TEXT = 32  # text tokens per sample (L3-06)


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross entropy of the class logits."""
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def _kept_whole(ctx: CaseContext, where: str, model: nn.Module, ddp: Any, prefixes: tuple[str, ...], tol: float):
    """Params under ``prefixes`` (given to replicate_params): whole on this rank, their grads bitwise
    equal on every rank and equal to DDP's."""
    ours, ref = named_params(model), named_params(ddp)
    for name, param in ours.items():
        if not name.startswith(prefixes):
            continue
        local, reference = tuple(impl.local(param).shape), tuple(ref[name].shape)
        ctx.equal(f"{where} {name}: whole on every rank", str(local), str(reference))
        grad = impl.local(param.grad)
        ctx.true(f"{where} {name} grad: bitwise equal on all ranks", not differs_across_ranks(grad))
        ctx.close(f"{where} {name} grad (kept whole) vs DDP", grad, ref[name].grad, tol)


def _vit_trains_like_ddp(mesh: Any, tol: Tolerance) -> Run:
    """The L3-04 body: every encoder block its own group; the root holds the CLS token, positions and
    final norm sharded, the patch embedding and the head whole (replicate_params)."""
    whole = ("patch_embed.", "head.")

    def run(ctx: CaseContext, compare: bool) -> Trajectory:
        model = vit()
        ddp = ddp_of(model) if compare else None
        kept = [p for name, p in model.named_parameters() if name.startswith(whole)]
        for block in model.blocks:
            impl.fully_shard(block, mesh=mesh)
        impl.fully_shard(model, mesh=mesh, replicate_params=kept)
        batches = [image_batch(step, ctx.rank, IMAGES) for step in range(STEPS)]
        trajectory: Trajectory = {}
        if not compare:
            train_alone(model, batches, classification_loss, adamw, trajectory)
            return trajectory
        ctx.require("ranks' images differ", differs_across_ranks(batches[0][0]))
        train_against(
            ctx,
            model,
            ddp,
            batches,
            classification_loss,
            tol,
            make_optimizer=adamw,
            params=False,
            after_backward=lambda step: _kept_whole(ctx, f"step {step}", model, ddp, whole, tol.grad),
            trajectory=trajectory,
        )
        return trajectory

    return run


@case(
    "L3-04",
    "test_vit_fsdp_vs_ddp",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("replicate_params",),
    layouts=(dataclasses.replace(HSDP_2X2, needs=("replicate_params", "hsdp")),),
)
def vit_fsdp_vs_ddp(ctx: CaseContext) -> None:
    """ViT (patch embedding, CLS token, 6 pre-norm encoder blocks, head; hidden 256, image 224) under
    1-D FSDP with the patch embedding and head kept whole: loss, grad norm and every grad (the last
    MLP weight among them) within 1e-5 of DDP at steps 0 and 1; the whole parts' grads bitwise
    equal on all ranks and equal to DDP; bitwise rerun."""
    rerun_bitwise(ctx, _vit_trains_like_ddp(ctx.mesh, ctx.tol))


def multimodal_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross entropy over the text positions."""
    images, tokens, targets = batch
    logits = model(images, tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _multimodal_trains_like_ddp(mesh: Any, tol: Tolerance) -> Run:
    """The L3-06 body: the ViT (each block, then the ViT) and the decoder (each layer, then the
    decoder) sharded as independent sub-models; the projector kept whole by the root's group."""

    def run(ctx: CaseContext, compare: bool) -> Trajectory:
        model = Multimodal()
        ddp = ddp_of(model) if compare else None
        shard_nested(model.vision, model.vision.blocks, mesh=mesh)
        shard_nested(model.language, model.language.layers, mesh=mesh)
        impl.fully_shard(model, mesh=mesh, replicate_params=list(model.projector.parameters()))
        vocab = model.language.config.vocab
        batches = [
            (image_batch(step, ctx.rank, IMAGES)[0], *token_batch(step, ctx.rank, IMAGES, TEXT, vocab))
            for step in range(STEPS)
        ]
        trajectory: Trajectory = {}
        if not compare:
            train_alone(model, batches, multimodal_loss, adamw, trajectory)
            return trajectory

        def sub_models(step: int) -> None:
            ours, ref = named_params(model), named_params(ddp)
            for part in ("vision", "language", "projector"):
                mine = {n: p for n, p in ours.items() if n.startswith(f"{part}.")}
                theirs = {n: p for n, p in ref.items() if n.startswith(f"{part}.")}
                ctx.close(f"step {step} {part} grad norm", grad_norm(mine), grad_norm(theirs), tol.grad)
            projected = float(grad_norm({n: p for n, p in ours.items() if n.startswith("projector.")}))
            ctx.true(f"step {step} projector grad norm > 0 (the gradient crosses into it)", projected > 0, projected)
            _kept_whole(ctx, f"step {step}", model, ddp, ("projector.",), tol.grad)

        train_against(
            ctx,
            model,
            ddp,
            batches,
            multimodal_loss,
            tol,
            make_optimizer=adamw,
            params=False,
            after_backward=sub_models,
            trajectory=trajectory,
        )
        return trajectory

    return run


@case(
    "L3-06",
    "test_multimodal_deepstack_fsdp",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("replicate_params",),
    layouts=(dataclasses.replace(HSDP_2X2, needs=("replicate_params", "hsdp")),),
)
def multimodal_deepstack_fsdp(ctx: CaseContext) -> None:
    """4-block ViT (hidden 128) -> 2-layer projection MLP (kept whole) -> 2-layer decoder (hidden 256),
    DeepStack (a middle ViT block's tokens added into the decoder): end-to-end loss, the ViT's, the
    decoder's and the projector's grad norms and every grad within 1e-5 of DDP; the projector's grad
    is non-zero (the gradient crosses the sub-model boundary); bitwise rerun."""
    rerun_bitwise(ctx, _multimodal_trains_like_ddp(ctx.mesh, ctx.tol))
