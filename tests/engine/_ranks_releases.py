"""Rank bodies of the engine's tests of what differs between torch releases: a backend without
``ReduceOp.AVG`` (gloo before torch 2.8, HCCL) reduces with SUM and divides, and trains alike."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import hyper_parallel.platform.torch.fully_shard.mesh_info as mesh_info
from hyper_parallel.platform.torch.compat import backend_averages
from tests.kit.judging.checks import StrictChecks
from tests.kit.judging.reference import SameDtypeReference, ddp_of
from tests.kit.judging.surface import impl
from tests.kit.workloads.models import MLP, rank_batches
from tests.kit.workloads.training import shard_nested, square_mean, train_against

DIMS = (7, 13, 5, 3)
STEPS = 3
ROWS = {None: "FSDP 1D fp32", torch.bfloat16: "FSDP 1D bf16", torch.float16: "FSDP 1D fp16"}


@contextlib.contextmanager
def _reduce_ops_seen() -> Iterator[set[str]]:
    """The ops the engine's reduce-scatters name (it looks its collectives up on torch.distributed;
    the baselines never reduce-scatter: their all-reduces are not the engine's)."""
    seen: set[str] = set()
    names = ("reduce_scatter_single", "reduce_scatter_tensor")  # the first this torch has is the engine's
    real = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def spy(name: str) -> Any:
        def call(*args: Any, op: Any = dist.ReduceOp.SUM, **kwargs: Any) -> Any:
            seen.add(str(op).rpartition(".")[2])
            return real[name](*args, op=op, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for name in real:
            stack.enter_context(mock.patch.object(dist, name, spy(name)))
        yield seen


def _train(checks: StrictChecks, averages: bool, dtype: torch.dtype | None) -> tuple[dict[str, torch.Tensor], set]:
    """Train the MLP sharded as if its backend did (not) average, against its baseline; return
    its final local shards and the reduce ops it used."""
    model = MLP(DIMS)
    if dtype is None:
        reference, policy = ddp_of(model), impl.MixedPrecisionPolicy()
    else:
        reference, policy = SameDtypeReference(model, dtype, dtype), impl.MixedPrecisionPolicy(dtype, dtype)
    with mock.patch.object(mesh_info, "backend_averages", lambda group, device_type: averages):
        shard_nested(model, model.layers, mesh=checks.mesh, mp_policy=policy)
    batches = rank_batches(checks.rank, (4, DIMS[0]), steps=STEPS)
    with _reduce_ops_seen() as ops:
        train_against(checks, model, reference, batches, square_mean, checks.tol, label="avg" if averages else "sum")
    return {name: impl.local(p).detach().clone() for name, p in model.named_parameters()}, ops


def sum_only_backend_trains_alike(dtype: torch.dtype | None = None) -> None:
    """A backend without AVG: every reduction is a SUM and a division (fp16's split around it), and 3
    steps equal the baseline; where this torch's backend has AVG, the AVG run too, and both hold the
    same params bit for bit (gloo's AVG is a sum and a division too)."""
    checks = StrictChecks(ROWS[dtype])
    params, ops = _train(checks, False, dtype)
    checks.equal("sum-only backend: reduce ops", str(sorted(ops)), str(["SUM"]))
    if not backend_averages(dist.group.WORLD, "cpu"):
        return  # this torch's gloo has no AVG (torch 2.7): the sum-only run is the engine's only path
    averaged, avg_ops = _train(checks, True, dtype)
    wide = dtype in (None, torch.bfloat16)  # fp16 divides around a SUM whatever the backend (FSDP2's rule)
    checks.equal("AVG backend: reduce ops", str(sorted(avg_ops)), str(["AVG"] if wide else ["SUM"]))
    for name, value in params.items():
        checks.true(f"{name}: the same bits either way", torch.equal(value, averaged[name]), "differ")
