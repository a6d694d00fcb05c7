"""Plan case of ``_test_fully_shard_with_ep.py``: fully_shard with expert parallelism (L2-10), on an
(ep, dp) mesh of 4 ranks.

Layout. A small MoE decoder (``tests.kit.workloads.networks``: 2 blocks, block 1's FFN a mixture of 4 top-2
experts) has its experts split over the ep dim (``split_experts``: ep rank r keeps experts 2r and
2r + 1 and dispatches tokens to their owners by a differentiable all-to-all); every kept expert is
its own fully_shard group over the dp sub-mesh (the 2 ranks holding the same experts). Everything
else (embedding and tied head, attention, norms, router) is dense: each block and the root are
fully_shard groups over a 1-D mesh of all 4 ranks.

Gradient normalisation. Every rank's loss is the sum of its tokens' cross entropies divided by the
global token count, so the global-batch mean loss is the sum of the ranks' losses, and its gradient
the sum of their gradients. Every group reduces with ``set_reduce_op_type("sum")``: a dense grad is
the sum over the 4 ranks; an expert's local grad already sums its ep group's tokens (the all-to-all
backward brings them home), and the sum over dp adds the other ep group's. Both are then the
gradient of the global-batch mean loss, the single-device baseline's. (With the default ``"avg"``
and per-rank mean losses, dense grads come out right but expert grads ep_size times too large.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.checks import device_type
from tests.kit.judging.recorder import record_collectives
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import specific
from tests.kit.workloads.networks import (
    Decoder,
    DecoderConfig,
    expert_name_map,
    expert_params,
    global_token_batch,
    moe_modules,
    split_experts,
    summed_cross_entropy,
)
from tests.kit.workloads.training import differs_across_ranks, grad_norm, train_against

# a small moe_decoder: every sharded dim divides by 4 (the dense mesh) and 2 (the dp sub-mesh)
CONFIG = DecoderConfig(
    vocab=64, hidden=16, layers=2, heads=2, ffn_inner=32, moe_layers=(1,), experts=4, top_k=2, expert_inner=32
)
BATCH, SEQ = 2, 8  # sequences and tokens per sequence on every rank
STEPS = 2

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # tokens, targets, global ones


def _device() -> torch.device:
    """This rank's compute device (its GPU under nccl)."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")


def _batches(rank: int, world: int, device: torch.device) -> list[Batch]:
    """Per step: this rank's tokens and targets (they differ per rank and step) and the global batch."""
    return [
        tuple(t.to(device) for t in global_token_batch(step, rank, world, BATCH, SEQ, CONFIG.vocab))
        for step in range(STEPS)
    ]


@case(
    "L2-10",
    "test_ep_fsdp_coupling",
    world_size=4,
    mesh={"ep": 2, "dp": 2},
    config="EP + FSDP fp32",
    needs=("expert_parallel", "submesh", "reduce_op_type"),
)
def ep_fsdp_coupling(ctx: CaseContext) -> None:
    """Experts split over ep and sharded over dp, dense params sharded over all 4 ranks, every
    group reducing by sum of per-rank losses normalised by the global token count; 2 Adam steps
    against the single-device model (all experts) on the global batch: loss, every held param's grad
    (dense and expert) element-wise and the grad norm, each held expert's grad norm, params after each
    step; the all-to-all dispatch really ran, with uneven token counts per expert."""
    device = _device()
    ep_rank = impl.local_rank(ctx.mesh, "ep")
    ep_size = impl.mesh_shape(ctx.mesh)[0]
    ep_group = impl.process_group(ctx.mesh, "ep")

    model = Decoder(CONFIG).to(device)
    reference = Decoder(CONFIG).to(device)  # same seed: the same weights, all experts
    split_experts(model, ep_group, ep_size, ep_rank)
    names = expert_name_map(model)
    moes = [moe for _, moe in moe_modules(model)]
    for moe in moes:
        for expert in moe.experts:
            impl.fully_shard(expert, mesh=ctx.submesh("dp"))
    dense_mesh = ctx.mesh_of(dp=ctx.world_size)
    for block in model.layers:
        impl.fully_shard(block, mesh=dense_mesh)
    impl.fully_shard(model, mesh=dense_mesh)
    model.set_reduce_op_type("sum")  # every group below too

    batches = _batches(ctx.rank, ctx.world_size, device)
    ctx.require("ranks' tokens differ", differs_across_ranks(batches[0][0]))
    tokens = torch.tensor(batches[0][0].numel(), device=device)
    dist.all_reduce(tokens)
    global_tokens = int(tokens.item())
    experts = expert_params(model, names)
    ctx.require("this rank holds its ep share of the experts", len(experts) == CONFIG.experts // ep_size)
    dispatches: list[int] = []

    def model_step(module: nn.Module, batch: Batch) -> torch.Tensor:
        """This rank's share of the global mean loss, backward; returns the global loss (all ranks)."""
        tokens, targets = batch[0], batch[1]
        with record_collectives() as recorder:
            loss = summed_cross_entropy(module(tokens), targets) / global_tokens
            loss.backward()
        dispatches.append(len([c for c in recorder.of("all_to_all") if c.group_size == ep_size]))
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total

    def reference_loss(ref: nn.Module, batch: Batch) -> torch.Tensor:
        return summed_cross_entropy(ref(batch[2]), batch[3]) / global_tokens

    def per_expert(step: int) -> None:
        where = f"step {step}"
        ctx.true(f"{where}: all-to-all dispatches over the ep group", dispatches[-1] > 0, dispatches[-1], "> 0")
        for index, moe in enumerate(moes):
            counts = moe.tokens_per_expert.clone()
            ctx.require(
                f"{where} MoE {index}: this rank's tokens per expert are uneven",
                len(set(counts.tolist())) > 1,
                str(counts.tolist()),
            )
            dist.all_reduce(counts)
            ctx.require(
                f"{where} MoE {index}: every expert gets tokens (its grad is not trivially 0)",
                bool((counts > 0).all()),
                str(counts.tolist()),
            )
        every = dict(reference.named_parameters())
        for expert, params in experts.items():
            ref_params = {name: every[name] for name in params}
            ctx.close(f"{where} grad norm {expert}", grad_norm(params), grad_norm(ref_params), specific("per expert"))
        dense = {full: p for ours, p in model.named_parameters() if ".experts." not in (full := names[ours])}
        ref_dense = {name: every[name] for name in dense}
        ctx.close(f"{where} dense grad norm", grad_norm(dense), grad_norm(ref_dense), ctx.tol.grad)

    train_against(
        ctx,
        model,
        reference,
        batches,
        reference_loss,
        ctx.tol,
        model_step=model_step,
        names=names,
        after_backward=per_expert,
    )
