"""The collectives of one group: all-gather params, reduce-scatter / all-reduce grads.

Fused (``comm_fusion=True``): the group's params travel in one flat buffer, so each
unshard is one all-gather and each reduction one reduce-scatter (plus one all-reduce for
replicated params, and one over the replicate dim for HSDP). Unfused: one collective per
param. Both do the same arithmetic on the same numbers, so they are numerically identical.

Collectives are looked up on ``torch.distributed`` at call time (never imported by name),
so a recorder that wraps them observes what this engine communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .mesh_info import MeshInfo
from .param import HSDPParam

REDUCE_OPS = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM}


def _wait(work: dist.Work | None) -> None:
    if work is not None:
        work.wait()


def _all_gather_flat(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    """Concatenate every rank's flat ``input`` into ``output`` (rank order)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def _reduce_scatter_flat(
    output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup
) -> dist.Work | None:
    """Reduce ``input`` over ranks and keep this rank's contiguous slice in ``output``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=True)


# -- all-gather ------------------------------------------------------------------------------
@dataclass
class AllGather:
    """An all-gather in flight; ``wait`` completes it and fills the unsharded params.

    A param gathered in place (``outputs`` None) is written by the collective itself, and autograd
    counts that write as a mutation of a tensor it may have saved, when the work completes: for
    an async gather, on another thread and in ``wait``. The write refills what was there, so its
    version counter is put back, after the wait, to what it was when the gather was issued
    (``keepers``, each made at issue)."""

    params: Sequence[HSDPParam]
    works: list[dist.Work | None]
    outputs: list[torch.Tensor | None]
    fused: bool
    done: bool = False
    keepers: list[Any] = field(default_factory=list)  # version keepers of params gathered in place
    # each param's shard version when its shard was read (at issue): an optimizer step between the
    # issue and the wait leaves the gathered copy stale, and the next unshard must see that (a
    # backward prefetch of a group whose backward is done waits through the step: found by L4)
    versions: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.versions:
            self.versions = [param.shard_version() for param in self.params]

    @property
    def is_stale(self) -> bool:
        """A shard changed since this gather read it."""
        return any(param.shard_version() != version for param, version in zip(self.params, self.versions, strict=True))

    def wait(self) -> None:
        if self.done:
            return
        for work in self.works:
            _wait(work)
        for keeper in self.keepers:
            keeper.__exit__(None, None, None)
        if self.fused:
            self._copy_out_fused()
        else:
            for param, out in zip(self.params, self.outputs, strict=True):
                if out is not None:
                    param.copy_gathered_out(out.view(param.world, -1))
        for param, version in zip(self.params, self.versions, strict=True):
            param.note_gathered(version)
        self.done = True

    def _copy_out_fused(self) -> None:
        (output,) = self.outputs
        rows = output.view(self.params[0].world, -1)
        offset = 0
        for param in self.params:
            param.copy_gathered_out(rows[:, offset : offset + param.padded_shard_numel])
            offset += param.padded_shard_numel


def start_all_gather(params: Sequence[HSDPParam], mesh_info: MeshInfo, fused: bool, async_op: bool) -> AllGather:
    """Start gathering the sharded params. An unsharded param is allocated when it is filled: now
    when it is replicated or gathered in place, else when the gather is waited for (so a prefetched
    gather holds only its buffers until then)."""
    replicated = [p for p in params if p.is_replicated]
    sharded = [p for p in params if not p.is_replicated]
    for param in replicated:
        param.alloc_unsharded()
        param.copy_replicated_in()
        param.note_gathered()
    if not sharded:
        return AllGather(sharded, [], [], fused, done=True)
    group = mesh_info.shard_group
    if fused and len(sharded) > 1:
        return _start_fused_all_gather(sharded, group, async_op)
    works, outputs, keepers = [], [], []
    for param in sharded:
        send = torch.empty(param.padded_shard_numel, dtype=param.param_dtype, device=param.device)
        param.copy_shard_into(send)
        if param.rank_major:
            param.alloc_unsharded()
            keepers.append(param.hidden_writes())  # the version now, restored when waited for
            recv = param.unsharded_local.detach().view(-1)
            works.append(_all_gather_flat(recv, send, group, async_op))
            outputs.append(None)
            continue
        recv = torch.empty(param.world * param.padded_shard_numel, dtype=param.param_dtype, device=param.device)
        works.append(_all_gather_flat(recv, send, group, async_op))
        outputs.append(recv)
    return AllGather(sharded, works, outputs, fused=False, keepers=keepers)


def _start_fused_all_gather(params: Sequence[HSDPParam], group: dist.ProcessGroup, async_op: bool) -> AllGather:
    dtypes = {p.param_dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(
            f"comm_fusion needs one compute dtype per group, got {sorted(map(str, dtypes))}; "
            "use comm_fusion=False or one group per dtype"
        )
    (dtype,) = dtypes
    device = params[0].device
    total = sum(p.padded_shard_numel for p in params)
    recv = torch.empty(params[0].world * total, dtype=dtype, device=device)
    # this rank's part of the output is the input: no separate send buffer
    send = recv.narrow(0, params[0].mesh_info.shard_rank * total, total)
    offset = 0
    for param in params:
        param.copy_shard_into(send[offset : offset + param.padded_shard_numel])
        offset += param.padded_shard_numel
    work = _all_gather_flat(recv, send, group, async_op)
    return AllGather(params, [work], [recv], fused=True)


# -- reductions ------------------------------------------------------------------------------
@dataclass
class Reduction:
    """Gradient reductions in flight for some params of one group.

    ``wait`` finishes the reduce-scatter / all-reduce over the shard dim, runs the
    all-reduce over the replicate dim (HSDP) and accumulates the results into the
    sharded grads.
    """

    mesh_info: MeshInfo
    op: dist.ReduceOp
    all_reduce_replicas: bool
    # (params, flat output, work) per collective issued over the shard dim
    pieces: list[tuple[list[HSDPParam], torch.Tensor, dist.Work | None]] = field(default_factory=list)
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        for _, _, work in self.pieces:
            _wait(work)
        if self.all_reduce_replicas and self.mesh_info.is_hsdp:
            works = [
                dist.all_reduce(output, op=self.op, group=self.mesh_info.replicate_group, async_op=True)
                for _, output, _ in self.pieces
            ]
            for work in works:
                _wait(work)
        for params, output, _ in self.pieces:
            offset = 0
            for param in params:
                numel = param.padded_shard_numel
                param.apply_reduced_grad(param.shard_of_reduced(output[offset : offset + numel]))
                offset += numel
        self.pieces.clear()
        self.done = True


def start_reduction(
    params: Sequence[HSDPParam],
    mesh_info: MeshInfo,
    fused: bool,
    op_name: str,
    all_reduce_replicas: bool,
) -> Reduction:
    """Start reducing the unreduced grads of ``params`` (each must have one) over the mesh."""
    op = REDUCE_OPS[op_name]
    reduction = Reduction(mesh_info, op, all_reduce_replicas)
    sharded = [p for p in params if not p.is_replicated]
    replicated = [p for p in params if p.is_replicated]
    group = mesh_info.shard_group
    for batch in _batches(sharded, fused):
        reduction.pieces.append(_start_reduce_scatter(batch, group, op))
    for batch in _batches(replicated, fused):
        reduction.pieces.append(_start_all_reduce(batch, group, op))
    for param in params:
        param.unreduced_grad = None
    return reduction


def _batches(params: list[HSDPParam], fused: bool) -> list[list[HSDPParam]]:
    """One batch per collective: all params of one reduce dtype together when fused."""
    if not fused:
        return [[p] for p in params]
    by_dtype: dict[torch.dtype, list[HSDPParam]] = {}
    for param in params:
        by_dtype.setdefault(param.reduce_dtype, []).append(param)
    return list(by_dtype.values())


def _start_reduce_scatter(
    params: list[HSDPParam], group: dist.ProcessGroup, op: dist.ReduceOp
) -> tuple[list[HSDPParam], torch.Tensor, dist.Work | None]:
    dtype, device, world = params[0].reduce_dtype, params[0].device, params[0].world
    total = sum(p.padded_shard_numel for p in params)
    single = params[0]
    grad = single.unreduced_grad
    if len(params) == 1 and single.rank_major and grad.is_contiguous():
        send = grad.view(-1)  # already laid out rank after rank: no copy
    else:
        send = torch.empty(world, total, dtype=dtype, device=device)
        offset = 0
        for param in params:
            numel = param.padded_shard_numel
            param.copy_grad_into(send[:, offset : offset + numel], param.unreduced_grad)
            offset += numel
        send = send.view(-1)
    recv = torch.empty(total, dtype=dtype, device=device)
    work = _reduce_scatter_flat(recv, send, op, group)
    return params, recv, work


def _start_all_reduce(
    params: list[HSDPParam], group: dist.ProcessGroup, op: dist.ReduceOp
) -> tuple[list[HSDPParam], torch.Tensor, dist.Work | None]:
    if len(params) == 1:
        flat = params[0].unreduced_grad.contiguous().view(-1)
    else:
        flat = torch.cat([p.unreduced_grad.reshape(-1) for p in params])
    work = dist.all_reduce(flat, op=op, group=group, async_op=True)
    return params, flat, work
