"""Rank bodies of the engine's tensor-parallel test: TP on one mesh dim, fully_shard on the other."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.kit.api import fully_shard
from tests.kit.models import rank_batch
from tests.kit.reference import assert_close, ddp_of, full
from tests.kit.tolerances import tolerance
from tests.kit.training import case_mesh

STEPS = 3


class FeedForward(nn.Module):
    """A Megatron-style pair: column-parallel up projection, row-parallel down projection."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.blocks = nn.ModuleList([FeedForward(), FeedForward()])
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)


def tp_fsdp_matches_ddp(comm_fusion: bool = True) -> dict[str, float]:
    """tp 2 x dp 2: TP blocks inside fully_shard over dp train 3 Adam steps like DDP.

    Both TP ranks of a dp group see the same batch (TP needs identical inputs); the dp
    groups see different ones. DDP runs over all 4 ranks on those same batches.
    """
    rank = dist.get_rank()
    mesh = case_mesh((2, 2), ("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model = TwoBlocks()
    ddp = ddp_of(model)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"], comm_fusion=comm_fusion)
    fully_shard(model, mesh=mesh["dp"], comm_fusion=comm_fusion)
    for name, param in model.blocks.named_parameters():
        assert isinstance(param, DTensor) and param.device_mesh.ndim == 2, f"{name} not on the (dp, tp) mesh"
    tol = tolerance("TP + FSDP fp32")
    # SGD, not Adam: TP adds partial matmul sums in another order than DDP's full matmul, so
    # grads differ by rounding (~1e-8); Adam divides each grad by its own magnitude, which turns
    # that rounding on a near-zero grad into an lr-sized step difference. SGD keeps the step
    # linear in the grad, so params stay as close as the grads are.
    opt = torch.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=1e-1, momentum=0.9)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    ref_params = dict(ddp.module.named_parameters())
    for step in range(STEPS):
        # DDP averages over 4 ranks; each dp group's two TP ranks hold the same batch, so the
        # DDP average equals the average over the two dp batches that fully_shard sees.
        x = rank_batch(step, dp_rank, (4, 8))
        loss = model(x).square().mean()
        loss.backward()
        ref_loss = ddp(x).square().mean()
        ref_loss.backward()
        worst["loss"] = max(worst["loss"], assert_close(f"step {step} loss", loss, ref_loss, tol.loss))
        for name, param in model.named_parameters():
            err = assert_close(f"step {step} grad {name}", param.grad, ref_params[name].grad, tol.grad)
            worst["grad"] = max(worst["grad"], err)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, param in model.named_parameters():
            err = assert_close(f"step {step} param {name}", full(param), ref_params[name], tol.grad)
            worst["param"] = max(worst["param"], err)
    assert rank in range(4)
    return worst
