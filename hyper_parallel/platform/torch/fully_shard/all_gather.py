"""The all-gathers of one group: a group's sharded params gathered into their unsharded compute params.

Fused (``comm_fusion=True``): the group's params travel in one flat buffer, one all-gather per unshard;
unfused: one per param. Both copy the same numbers. Collectives are looked up on ``torch.distributed`` at
call time (never imported by name), so a recorder that wraps them observes what this engine communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .layout import RowLayout
from .mesh_info import MeshInfo, PostForwardMesh
from .param import HSDPParam


def _wait(work: dist.Work | None) -> None:
    if work is not None:
        work.wait()


def _all_gather_flat(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    """Concatenate every rank's flat ``input`` into ``output`` (rank order)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


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
    post_forward: PostForwardMesh | None = None  # gathering the pieces kept after forward (an int reshard)
    keepers: list[Any] = field(default_factory=list)  # version keepers of params gathered in place
    # each param's shard version when its shard was read (at issue): an optimizer step between the
    # issue and the wait leaves the gathered copy stale, and the next unshard must see that (a
    # backward prefetch of a group whose backward is done waits through the step: found by L4)
    versions: list[tuple[int, int]] = field(default_factory=list)
    # whole params copied at issue (replicated, or a one-rank shard group), with their versions then:
    # they go stale across a step as the gathered ones do (found by L4, replay dd53022501)
    copied: list[tuple[HSDPParam, tuple[int, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.versions:
            self.versions = [param.shard_version() for param in self.params]

    @property
    def is_stale(self) -> bool:
        """A shard changed since this gather read it (or copied it whole)."""
        read = [*zip(self.params, self.versions, strict=True), *self.copied]
        return any(param.shard_version() != version for param, version in read)

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
                    layout = self._layout(param)
                    param.copy_gathered_out(out.view(layout.world, -1), layout)
        for param, version in zip(self.params, self.versions, strict=True):
            param.note_gathered(version)
        self.done = True

    def _layout(self, param: HSDPParam) -> RowLayout:
        return param.gather_source(self.post_forward)[0]

    def _copy_out_fused(self) -> None:
        (output,) = self.outputs
        rows = output.view(self._layout(self.params[0]).world, -1)
        offset = 0
        for param in self.params:
            layout = self._layout(param)
            param.copy_gathered_out(rows[:, offset : offset + layout.padded_numel], layout)
            offset += layout.padded_numel


def start_all_gather(
    params: Sequence[HSDPParam],
    mesh_info: MeshInfo,
    fused: bool,
    async_op: bool,
    post_forward: PostForwardMesh | None = None,
) -> AllGather:
    """Start gathering the sharded params (with ``post_forward``, the pieces kept after forward,
    within that smaller group). An unsharded param is allocated when it is filled: now when it is
    replicated, gathered in place or its group has one rank, else when the gather is waited for (so
    a prefetched gather holds only its buffers until then)."""
    # whole on every rank (replicated, or a one-rank shard group): a copy, or the shard itself
    sharded, copied = [], []
    for param in params:
        if not param.is_whole:
            sharded.append(param)
        elif not param.aliases_shard:  # else the shard is its own compute param: nothing to fill or go stale
            param.alloc_unsharded()
            param.copy_replicated_in()
            param.note_gathered()
            copied.append((param, param.shard_version()))
    gather = _start_gather(sharded, mesh_info, fused, async_op, post_forward)
    gather.copied = copied
    return gather


def _start_gather(
    sharded: Sequence[HSDPParam],
    mesh_info: MeshInfo,
    fused: bool,
    async_op: bool,
    post_forward: PostForwardMesh | None,
) -> AllGather:
    """The collectives for the params cut over ranks (none: nothing to wait for)."""
    if not sharded:
        return AllGather([], [], [], fused=False, done=True)
    group = mesh_info.shard_group if post_forward is None else post_forward.group
    if fused and len(sharded) > 1:
        return _start_fused_all_gather(sharded, group, async_op, post_forward)
    works, outputs, keepers = [], [], []
    for param in sharded:
        layout = param.gather_source(post_forward)[0]
        send = torch.empty(layout.padded_numel, dtype=param.param_dtype, device=param.device)
        param.copy_shard_into(send, post_forward)
        if layout.rank_major:
            param.alloc_unsharded()
            keepers.append(param.hidden_writes())  # the version now, restored when waited for
            recv = param.unsharded_local.detach().view(-1)
            works.append(_all_gather_flat(recv, send, group, async_op))
            outputs.append(None)
            continue
        recv = torch.empty(layout.world * layout.padded_numel, dtype=param.param_dtype, device=param.device)
        works.append(_all_gather_flat(recv, send, group, async_op))
        outputs.append(recv)
    return AllGather(sharded, works, outputs, fused=False, keepers=keepers, post_forward=post_forward)


def _start_fused_all_gather(
    params: Sequence[HSDPParam], group: ProcessGroup, async_op: bool, post_forward: PostForwardMesh | None
) -> AllGather:
    dtypes = {p.param_dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(
            f"comm_fusion needs one compute dtype per group, got {sorted(map(str, dtypes))}; "
            "use comm_fusion=False or one group per dtype"
        )
    (dtype,) = dtypes
    device = params[0].device
    sources = [p.gather_source(post_forward) for p in params]
    total = sum(layout.padded_numel for layout, _, _ in sources)
    world, rank = sources[0][0].world, sources[0][2]
    recv = torch.empty(world * total, dtype=dtype, device=device)
    # this rank's part of the output is the input: no separate send buffer
    send = recv.narrow(0, rank * total, total)
    offset = 0
    for param, (layout, _, _) in zip(params, sources, strict=True):
        param.copy_shard_into(send[offset : offset + layout.padded_numel], post_forward)
        offset += layout.padded_numel
    work = _all_gather_flat(recv, send, group, async_op)
    return AllGather(params, [work], [recv], fused=True, post_forward=post_forward)
