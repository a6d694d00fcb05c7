"""Plan cases of ``_test_fully_shard.py``: the L0 coverage the plan takes as existing."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.kit.api import fully_shard
from tests.kit.case import CaseContext, case
from tests.kit.models import MLP, rank_batch
from tests.kit.reference import ddp_of
from tests.kit.training import train_against


def _square_mean(model, x):
    return model(x).square().mean()


@case(
    "L0-01", "test_fully_shard_none_mesh", "_test_fully_shard.py", world_size=2, mesh_shape=(2,), config="FSDP 1D fp32"
)
def none_mesh(ctx: CaseContext) -> None:
    """mesh=None builds a 1-D mesh over the world; 2 steps equal DDP."""
    model = MLP((7, 13, 5, 3))
    ddp = ddp_of(model)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    mesh = model.layers[0].weight.device_mesh
    ctx.true("default mesh is 1-D", isinstance(model.layers[0].weight, DTensor) and mesh.ndim == 1, mesh.ndim, 1)
    ctx.equal("default mesh spans the world", mesh.size(), dist.get_world_size())
    batches = [rank_batch(step, ctx.rank, (4, 7)) for step in range(2)]
    train_against(ctx, model, ddp, batches, _square_mean, ctx.tol)
