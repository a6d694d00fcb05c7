"""Rank functions for tests/kit_tests/test_networks.py (they run on the engines, imported by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.kit.runtime.devices import compute_device
from tests.kit.workloads.networks import (
    MOE_SEQ,
    cross_entropy_loss,
    expert_name_map,
    moe_decoder,
    moe_modules,
    split_experts,
    token_batch,
)


def _device() -> torch.device:
    """This rank's compute device (``tests.kit.runtime.devices``)."""
    return compute_device()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max absolute element difference (shapes must agree)."""
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.detach().double() - b.detach().double()).abs().max().item()


def expert_parallel_vs_full(batch: int = 2, seq: int = MOE_SEQ, seed: int = 0) -> dict:
    """The MoE decoder with experts split over the world vs the full model on every rank's tokens.

    Normalisation: the full model's loss is the mean CE over all ranks' tokens; with equal batches that
    is the mean of the ranks' own mean losses, so each EP rank backprops ``loss / world``. Expert grads
    then come out whole on their owner (the all-to-all backward sums both ranks' contributions) and the
    other params' grads are the sum over ranks (all-reduced here).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    full = moe_decoder(seed).to(device)
    ep = split_experts(moe_decoder(seed), dist.group.WORLD, world, rank).to(device)
    batches = [token_batch(0, r, batch, seq, full.config.vocab) for r in range(world)]
    tokens, targets = (t.to(device) for t in batches[rank])
    all_tokens = torch.cat([b[0] for b in batches]).to(device)
    all_targets = torch.cat([b[1] for b in batches]).to(device)

    full_logits = full(all_tokens)
    full_loss = cross_entropy_loss(full_logits, all_targets)
    full_loss.backward()
    logits = ep(tokens)
    loss = cross_entropy_loss(logits, targets)
    (loss / world).backward()

    global_loss = (loss / world).detach().clone()
    dist.all_reduce(global_loss)
    names = expert_name_map(ep)
    reference = dict(full.named_parameters())
    expert_errs, dense_errs, expert_norms = [], [], []
    for name, param in ep.named_parameters():
        full_param = reference[names[name]]
        if ".experts." in name:
            expert_errs.append(_max_diff(param.grad, full_param.grad))
            expert_norms.append(param.grad.norm().item())
            assert torch.equal(param.detach(), full_param.detach()), name  # same weights as the full expert
        else:
            grad = param.grad.clone()
            dist.all_reduce(grad)
            dense_errs.append(_max_diff(grad, full_param.grad))
    own = slice(rank * batch, (rank + 1) * batch)
    return {
        "logits_err": _max_diff(logits, full_logits[own]),
        "loss_err": abs(global_loss.item() - full_loss.item()),
        "expert_grad_err": max(expert_errs),
        "dense_grad_err": max(dense_errs),
        "expert_grad_norm_min": min(expert_norms),
        "expert_params": len(expert_errs),
        "expert_ids": [moe.expert_ids for _, moe in moe_modules(ep)],
        "tokens_per_expert": [moe.tokens_per_expert.tolist() for _, moe in moe_modules(ep)],
        "loss": loss.item(),
    }
