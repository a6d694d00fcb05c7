"""The reductions of one group: reduce-scatter / all-reduce grads (the all-gathers: ``all_gather.py``).

Fused (``comm_fusion=True``): the group's params travel in one flat buffer, so each reduction is
one reduce-scatter (plus one all-reduce for replicated params, and one over the replicate dim for
HSDP). Unfused: one collective per param. Both do the same arithmetic on the same numbers, so
they are numerically identical.

Collectives are looked up on ``torch.distributed`` at call time (never imported by name),
so a recorder that wraps them observes what this engine communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .mesh_info import MeshInfo
from .param import HSDPParam

REDUCE_OPS = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM}


def _wait(work: dist.Work | None) -> None:
    if work is not None:
        work.wait()


def _reduce_scatter_flat(
    output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup
) -> dist.Work | None:
    """Reduce ``input`` over ranks and keep this rank's contiguous slice in ``output``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=True)


def separate_group(group: ProcessGroup, made: dict[tuple[int, ...], ProcessGroup]) -> ProcessGroup:
    """A new process group over ``group``'s ranks (one per rank set in ``made``), made by those ranks
    alone (``use_local_synchronization``), for reduce-scatters apart from the all-gathers."""
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in made:
        made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return made[ranks]


# -- reductions ------------------------------------------------------------------------------
# Reduce dtypes whose range holds a sum over the ranks: the division can wait until after the SUM.
# fp16's cannot, so a division splits around the collective (FSDP2's rule, kept for the same grads).
_WIDE_RANGE = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Arithmetic:
    """How one reduction's collective turns the ranks' grads into the reduced grad: multiply by
    ``scale_before``, divide by ``divide_before``, reduce with ``op``, divide by ``divide_after``."""

    op: dist.ReduceOp
    scale_before: float | None = None
    divide_before: float | None = None
    divide_after: float | None = None

    @property
    def is_identity(self) -> bool:
        """Over one rank, whether it leaves a grad as it is (no scaling, no division but by 1)."""
        return self.scale_before is None and self.divide_before in (None, 1) and self.divide_after in (None, 1)


def split_division(divisor: float) -> tuple[float, float]:
    """(before, after) the SUM collective for a narrow-range dtype: a power of two near the square
    root of ``divisor`` before, the rest after, so neither the sum nor the quotients leave fp16's
    range (the same split as torch FSDP2's, so both give the same grads)."""
    before = 1
    while divisor % before == 0 and divisor / before > before:
        before *= 2
    return float(before), divisor / before


@dataclass(frozen=True)
class ReduceSettings:
    """How a group's gradients are reduced: its HSDPModule controls, read when a reduction starts.

    The reduced grad is the sum over the data-parallel ranks divided by the divide factor when one
    is set (FSDP2's ``set_gradient_divide_factor``), else averaged (``"avg"``) or summed
    (``"sum"``); then the all-reduce hook sees it, and the scaling factor (upstream's
    ``set_gradient_scaling_factor``) multiplies it before it lands in the grad."""

    op_type: str = "avg"
    divide_factor: float | None = None
    force_sum: bool = False  # set_force_sum_reduction_for_comms: SUM collectives, then a division
    scaling_factor: float | torch.Tensor | None = None
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_replicas: bool = True
    # each arithmetic made, by (ranks, dtype, averages): a group keeps its settings across backwards
    _made: dict[tuple[int, torch.dtype, bool], Arithmetic] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def arithmetic(self, ranks: int, dtype: torch.dtype, averages: bool = True) -> Arithmetic:
        """The arithmetic of a reduction in ``dtype`` over ``ranks`` ranks, on a backend that has
        ``ReduceOp.AVG`` (``averages``) or not (SUM, then the division, as under force-sum)."""
        key = (ranks, dtype, averages)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = self._make_arithmetic(ranks, dtype, averages)
        return made

    def _make_arithmetic(self, ranks: int, dtype: torch.dtype, averages: bool) -> Arithmetic:
        if self.divide_factor is not None:
            if self.force_sum or dtype not in _WIDE_RANGE:
                return _sum_then_divide(self.divide_factor, dtype)
            # FSDP2 multiplies inside the collective (NCCL's PreMulSum, which gloo lacks): scale, then SUM
            return Arithmetic(dist.ReduceOp.SUM, scale_before=1.0 / self.divide_factor)
        if self.op_type == "sum":
            return Arithmetic(dist.ReduceOp.SUM)
        if self.force_sum or not averages or dtype not in _WIDE_RANGE:
            return _sum_then_divide(float(ranks), dtype)
        return Arithmetic(REDUCE_OPS[self.op_type])


def _sum_then_divide(divisor: float, dtype: torch.dtype) -> Arithmetic:
    """SUM collectives and the division around them: after the sum, or split around it (fp16)."""
    if dtype in _WIDE_RANGE:
        return Arithmetic(dist.ReduceOp.SUM, divide_after=divisor)
    before, after = split_division(divisor)
    return Arithmetic(dist.ReduceOp.SUM, divide_before=before, divide_after=after)


@dataclass
class Piece:
    """One collective of a reduction over the shard dim: its params, flat output, work and arithmetic."""

    params: list[HSDPParam]
    output: torch.Tensor
    work: dist.Work | None
    arithmetic: Arithmetic


@dataclass
class Reduction:
    """Gradient reductions in flight for some params of one group.

    ``wait`` finishes the reduce-scatter / all-reduce over the shard dim, runs the
    all-reduce over the replicate dim (HSDP), the all-reduce hook, the division and the scaling
    the settings ask for, and accumulates the results into the sharded grads.
    """

    mesh_info: MeshInfo
    settings: ReduceSettings
    params: list[HSDPParam] = field(default_factory=list)  # every param it reduces
    pieces: list[Piece] = field(default_factory=list)
    # one rank, nothing to communicate: each param's own grad, reduced where it lies (no flat buffer
    # to copy into and out of), with the arithmetic of its dtype
    alone: list[tuple[HSDPParam, torch.Tensor, Arithmetic]] = field(default_factory=list)
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        plain = self.settings.scaling_factor is None  # and no hook: ``alone`` is made only without one
        for param, grad, arithmetic in self.alone:
            if not (plain and arithmetic.is_identity):
                _before_collective(grad, arithmetic)
                self._finish(grad, arithmetic.divide_after)
            param.apply_reduced_grad(grad if grad.is_contiguous() else grad.contiguous(), owned=True)
        self.alone.clear()
        for piece in self.pieces:
            _wait(piece.work)
        held: set[int] = set()  # params whose kept per-replica parts this all-reduce carries
        if self.mesh_info.is_hsdp and self.mesh_info.replicate_size > 1:
            if self.keeps_replica_parts:
                self._keep_replica_parts()
            else:
                held = self._add_replica_parts()
                works = [
                    dist.all_reduce(
                        piece.output, op=piece.arithmetic.op, group=self.mesh_info.replicate_group, async_op=True
                    )
                    for piece in self.pieces
                ]
                for work in works:
                    _wait(work)
        for piece in self.pieces:
            self._finish(piece.output, piece.arithmetic.divide_after)
        for param, shard, _ in self._shards():
            if self.keeps_replica_parts:
                param.land_replica_part(shard)
            elif id(param) in held:
                param.land_all_reduced(shard)
            else:
                param.apply_reduced_grad(shard)
        self.pieces.clear()
        self.done = True

    @property
    def keeps_replica_parts(self) -> bool:
        """Whether what it lands is a per-replica part, kept for the next all-reducing backward (HSDP
        over several replicas, the all-reduce off), not the step's reduced grad: the user's
        post-accumulate-grad hooks run after the latter only (FSDP2's rule)."""
        return self.mesh_info.is_hsdp and self.mesh_info.replicate_size > 1 and not self.settings.all_reduce_replicas

    def _shards(self) -> Iterator[tuple[HSDPParam, torch.Tensor, Arithmetic]]:
        """Each param of the pieces, with its shard of its piece's output and the piece's arithmetic."""
        for piece in self.pieces:
            offset = 0
            for param in piece.params:
                numel = param.layout.padded_numel
                yield param, param.shard_of_reduced(piece.output[offset : offset + numel]), piece.arithmetic
                offset += numel

    def _keep_replica_parts(self) -> None:
        """The all-reduce over the replicas is off: each param keeps its raw per-replica part."""
        shard_size = self.mesh_info.shard_size
        for param, shard, arithmetic in self._shards():
            kept = param.replica_pending
            part = shard if kept is None else _converted(shard, arithmetic, kept[1], shard_size)
            param.keep_replica_part(part, arithmetic)

    def _add_replica_parts(self) -> set[int]:
        """Add each param's kept per-replica parts into its raw output before the all-reduce over the
        replicas; the ids of the params that had some."""
        held = set()
        for param, shard, arithmetic in self._shards():
            kept = param.take_replica_pending()
            if kept is not None:
                shard.add_(_converted(kept[0], kept[1], arithmetic, self.mesh_info.shard_size))
                held.add(id(param))
        return held

    def wait_collectives(self) -> None:
        """Complete the collectives in flight, landing nothing (an iteration thrown away)."""
        for piece in self.pieces:
            _wait(piece.work)

    def _finish(self, output: torch.Tensor, divide_after: float | None) -> None:
        """The user's hook on the reduced output, then the division and the scaling asked for.
        On a 2-D mesh the hook follows the all-reduce over the replicas, so with that all-reduce off
        there is none to follow and the hook does not run (FSDP2's rule)."""
        skipped_all_reduce = self.mesh_info.is_hsdp and not self.settings.all_reduce_replicas
        if self.settings.all_reduce_hook is not None and not skipped_all_reduce:
            self.settings.all_reduce_hook(output)
        if divide_after is not None and divide_after != 1:
            output.div_(divide_after)
        if self.settings.scaling_factor is not None:
            output.mul_(self.settings.scaling_factor)


def _converted(raw: torch.Tensor, made_by: Arithmetic, into: Arithmetic, shard_size: int) -> torch.Tensor:
    """A collective's raw output under one arithmetic as the raw output of another: each is the plain sum
    over the shard group times a factor (an averaging collective's 1 / ranks, a division or scaling before)."""

    def to_sum(arithmetic: Arithmetic) -> float:
        averaged = shard_size if arithmetic.op == dist.ReduceOp.AVG else 1
        return averaged * (arithmetic.divide_before or 1) / (arithmetic.scale_before or 1)

    ratio = to_sum(made_by) / to_sum(into)
    return raw if ratio == 1 else raw * ratio


def start_reduction(
    params: Sequence[HSDPParam],
    mesh_info: MeshInfo,
    fused: bool,
    settings: ReduceSettings,
    reduce_scatter_group: ProcessGroup | None = None,
) -> Reduction:
    """Start reducing the unreduced grads of ``params`` (each must have one) over the mesh."""
    replicas = settings.all_reduce_replicas and mesh_info.is_hsdp
    ranks = mesh_info.shard_size * (mesh_info.replicate_size if replicas else 1)
    reduction = Reduction(mesh_info, settings, params=list(params))
    if mesh_info.shard_size == 1 and mesh_info.replicate_size == 1 and settings.all_reduce_hook is None:
        # one rank, nothing that sees a flat buffer (an all-reduce over replicas or parts kept for one, a hook)
        arithmetic = {dtype: settings.arithmetic(ranks, dtype, mesh_info.averages) for dtype in _dtypes(params)}
        reduction.alone = [(p, p.unreduced_in_reduce_dtype(), arithmetic[p.reduce_dtype]) for p in params]
    else:
        _start_collectives(reduction, params, fused, ranks, reduce_scatter_group)
    for param in params:
        param.unreduced_grad = None
    return reduction


def _start_collectives(
    reduction: Reduction,
    params: Sequence[HSDPParam],
    fused: bool,
    ranks: int,
    reduce_scatter_group: ProcessGroup | None,
) -> None:
    """The reduce-scatters (and all-reduces of replicated params) of ``params``, into ``reduction``."""
    mesh_info, settings = reduction.mesh_info, reduction.settings
    sharded = [p for p in params if not p.is_replicated]
    replicated = [p for p in params if p.is_replicated]
    group = mesh_info.shard_group
    for batch in _batches(sharded, fused):
        arithmetic = settings.arithmetic(ranks, batch[0].reduce_dtype, mesh_info.averages)
        reduction.pieces.append(_start_reduce_scatter(batch, reduce_scatter_group or group, arithmetic))
    for batch in _batches(replicated, fused):
        arithmetic = settings.arithmetic(ranks, batch[0].reduce_dtype, mesh_info.averages)
        reduction.pieces.append(_start_all_reduce(batch, group, arithmetic))


def _before_collective(flat: torch.Tensor, arithmetic: Arithmetic) -> None:
    """What the arithmetic does to a rank's grads before they are reduced."""
    if arithmetic.scale_before is not None:
        flat.mul_(arithmetic.scale_before)
    if arithmetic.divide_before is not None and arithmetic.divide_before != 1:
        flat.div_(arithmetic.divide_before)


def _dtypes(params: Sequence[HSDPParam]) -> set[torch.dtype]:
    return {param.reduce_dtype for param in params}


def _batches(params: list[HSDPParam], fused: bool) -> list[list[HSDPParam]]:
    """One batch per collective: all params of one reduce dtype together when fused."""
    if not fused:
        return [[p] for p in params]
    by_dtype: dict[torch.dtype, list[HSDPParam]] = {}
    for param in params:
        by_dtype.setdefault(param.reduce_dtype, []).append(param)
    return list(by_dtype.values())


def _start_reduce_scatter(params: list[HSDPParam], group: ProcessGroup, arithmetic: Arithmetic) -> Piece:
    dtype, device, world = params[0].reduce_dtype, params[0].device, params[0].layout.world
    total = sum(p.layout.padded_numel for p in params)
    single = params[0]
    grad = single.unreduced_grad
    if len(params) == 1 and single.layout.rank_major and grad.is_contiguous() and grad.dtype == dtype:
        send = grad.view(-1)  # already laid out rank after rank, in the reduce dtype: no copy
    else:
        send = torch.empty(world, total, dtype=dtype, device=device)
        offset = 0
        for param in params:  # the copy casts a grad still in its own dtype
            numel = param.layout.padded_numel
            param.copy_grad_into(send[:, offset : offset + numel], param.unreduced_grad)
            offset += numel
        send = send.view(-1)
    _before_collective(send, arithmetic)
    if world == 1:  # one rank: its grad is the reduced grad, no collective
        return Piece(params, send, None, arithmetic)
    recv = torch.empty(total, dtype=dtype, device=device)
    work = _reduce_scatter_flat(recv, send, arithmetic.op, group)
    return Piece(params, recv, work, arithmetic)


def _start_all_reduce(params: list[HSDPParam], group: ProcessGroup, arithmetic: Arithmetic) -> Piece:
    if len(params) == 1:
        flat = params[0].unreduced_in_reduce_dtype().contiguous().view(-1)
    else:
        flat = torch.cat([p.unreduced_in_reduce_dtype().reshape(-1) for p in params])
    _before_collective(flat, arithmetic)
    if group.size() == 1:
        return Piece(params, flat, None, arithmetic)
    work = dist.all_reduce(flat, op=arithmetic.op, group=group, async_op=True)
    return Piece(params, flat, work, arithmetic)
