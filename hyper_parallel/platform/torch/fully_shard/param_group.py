"""The params of one ``fully_shard`` call, unsharded and reduced together.

Sharded-ness is a small state machine::

    SHARDED --unshard()--> UNSHARDING --wait--> UNSHARDED --reshard()--> SHARDED
                                                   UNSHARDED --reshard_to(k)--> SHARDED_POST_FORWARD
    SHARDED_POST_FORWARD --unshard()--> UNSHARDING (within groups of k ranks) / --reshard()--> SHARDED

The module's registered params follow it: the sharded DTensors while SHARDED, the
unsharded compute tensors once UNSHARDED, and after ``reshard_after_forward=k`` (an int) the
rows each rank keeps among k ranks, so backward gathers within that smaller group. Gradient reductions are started in
post-backward and finished (applied to the sharded grads) by ``finish_reductions``, which
the end of the last backward calls; ``set_is_last_backward(False)`` defers that.
"""

from __future__ import annotations

from enum import Enum, auto

import torch

from .all_gather import AllGather, start_all_gather
from .collectives import ReduceSettings, Reduction, start_reduction
from .mesh_info import MeshInfo, PostForwardMesh
from .param import HSDPParam
from .policy import Precision


class ShardedState(Enum):
    SHARDED = auto()
    SHARDED_POST_FORWARD = auto()
    UNSHARDING = auto()
    UNSHARDED = auto()


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` makes the full params usable."""

    def __init__(self, group: HSDPParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()


class HSDPParamGroup:
    """Communication and sharded/unsharded state of one group's params."""

    def __init__(self, params: list[HSDPParam], mesh_info: MeshInfo, comm_fusion: bool) -> None:
        self.params = params
        self.mesh_info = mesh_info
        self.comm_fusion = comm_fusion
        self.state = ShardedState.SHARDED
        self._all_gather: AllGather | None = None
        self._reductions: list[Reduction] = []
        # True from a forward until the post-backward that consumes it.
        self.used_since_post_backward = False
        # Controls (HSDPModule setters); take effect at the next forward / backward.
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.reduce_op = "avg"
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.gradient_scaling_factor: float | torch.Tensor | None = None
        self.all_reduce_hook = None
        self.unshard_in_backward = True
        self.reduce_scatter_unused_params = False
        self.reduce_scatter_group = None  # set_separate_reduce_scatter_group: its own process group
        self._post_forward: PostForwardMesh | None = None  # where the last reshard_to kept its rows
        self._reduce_settings: tuple[tuple, ReduceSettings] | None = None  # (the controls read, what they made)

    # -- unshard / reshard --------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Start gathering the full params; idempotent while unsharding or unsharded, unless the
        shards changed since they were read (an optimizer step): then the copy is gathered again."""
        if self.state is ShardedState.UNSHARDING and self._all_gather.is_stale:
            self.wait_for_unshard()  # issued before the shards changed: finish it, then redo it
        if self.state in (ShardedState.UNSHARDED, ShardedState.SHARDED_POST_FORWARD) and self.is_stale:
            self.reshard()
        if self.state is ShardedState.SHARDED_POST_FORWARD:  # within the rows of ranks kept after forward
            self._all_gather = start_all_gather(
                self.params, self.mesh_info, self.comm_fusion, async_op, self._post_forward
            )
        elif self.state is ShardedState.SHARDED:
            self._all_gather = start_all_gather(self.params, self.mesh_info, self.comm_fusion, async_op=async_op)
        else:
            return
        self.state = ShardedState.UNSHARDING
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        if self.state is not ShardedState.UNSHARDING:
            return
        self._all_gather.wait()
        self._all_gather = None
        for param in self.params:
            if param.post_forward_shard is not None:
                param.drop_post_forward_shard()
            param.use_unsharded()
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded params and register the sharded ones; idempotent."""
        if self.state is ShardedState.UNSHARDING:
            self.wait_for_unshard()
        if self.state is ShardedState.SHARDED:
            return
        for param in self.params:
            if param.post_forward_shard is not None:
                param.drop_post_forward_shard()
            param.use_sharded()
            param.free_unsharded()
        self.state = ShardedState.SHARDED

    def reshard_to(self, post_forward: PostForwardMesh) -> None:
        """After forward with ``reshard_after_forward=k``: keep each param's rows cut over k ranks and
        free the rest, so backward gathers within the smaller group."""
        if self.state is not ShardedState.UNSHARDED:
            self.reshard()
            return
        self._post_forward = post_forward
        for param in self.params:
            if not param.is_replicated:
                param.keep_post_forward_shard(post_forward.size)
            param.use_post_forward(post_forward.mesh)
            param.free_unsharded()
        self.state = ShardedState.SHARDED_POST_FORWARD

    @property
    def is_unsharded(self) -> bool:
        return self.state is ShardedState.UNSHARDED

    @property
    def is_stale(self) -> bool:
        """An optimizer step (or load) changed the shards since they were gathered."""
        return any(p.is_stale for p in self.params)

    # -- gradients ------------------------------------------------------------------------
    @property
    def has_unreduced_grads(self) -> bool:
        return any(p.unsharded_param.grad is not None for p in self.params)

    def post_backward(self) -> None:
        """Take this backward's grads, start reducing them if syncing, and reshard."""
        self.used_since_post_backward = False
        for param in self.params:
            param.take_unsharded_grad()
        if self.requires_gradient_sync:
            ready = [p for p in self.params if p.unreduced_grad is not None]
            if self.reduce_scatter_unused_params or (ready and len(ready) < len(self.params)):
                # a param that got a grad on another rank gets zeros here, so every rank reduces the
                # same params in the same collectives (DDP's unused-parameter rule; FSDP2 mismatches)
                for param in self.params:
                    param.give_zero_grad_if_unused()
                ready = [p for p in self.params if p.unreduced_grad is not None]
            if ready:
                # Keep per-group order of accumulation: the previous reduction lands first.
                self.finish_reductions()
                self._reductions.append(
                    start_reduction(
                        ready, self.mesh_info, self.comm_fusion, self.reduce_settings, self.reduce_scatter_group
                    )
                )
        if self.reshard_after_backward:
            self.reshard()

    @property
    def reduce_settings(self) -> ReduceSettings:
        """The controls that decide the arithmetic of the next reduction: made again only when one of
        them is another object than last time (every backward reads them, the setters seldom change them)."""
        controls = (
            self.reduce_op,
            self.gradient_divide_factor,
            self.force_sum_reduction,
            self.gradient_scaling_factor,
            self.all_reduce_hook,
            self.requires_all_reduce,
        )
        cached = self._reduce_settings
        if cached is None or any(now is not then for now, then in zip(controls, cached[0], strict=True)):
            settings = ReduceSettings(
                op_type=self.reduce_op,
                divide_factor=self.gradient_divide_factor,
                force_sum=self.force_sum_reduction,
                scaling_factor=self.gradient_scaling_factor,
                all_reduce_hook=self.all_reduce_hook,
                all_reduce_replicas=self.requires_all_reduce,
            )
            cached = self._reduce_settings = (controls, settings)
        return cached[1]

    def discard_iteration(self) -> None:
        """``reset_iter_state``: finish in-flight gathers, reshard, drop in-flight and unreduced grads."""
        self.reshard()
        reductions, self._reductions = self._reductions, []
        for reduction in reductions:
            reduction.wait_collectives()
        self.used_since_post_backward = False
        for param in self.params:
            param.unreduced_grad = None
            param.unsharded_param.grad = None
            param.replica_pending = param.parts_landed = None

    def adopt_registered_params(self, policy: Precision) -> None:
        """Shard params the user registered in the managed ones' place since the engine last registered
        them (before any forward, or between two), under the module's mixed-precision ``policy``: the
        group is resharded first, so the next unshard gathers what the user registered."""
        registered = [(param, param.registered_in_place()) for param in self.params]
        registered = [(param, current) for param, current in registered if current is not None]
        if not registered:
            return
        self.reshard()
        for param, current in registered:
            param.adopt_registered(policy, current)

    def refresh_after_apply(self, policy: Precision) -> None:
        """After ``nn.Module._apply`` changed the sharded params' dtype or device: the dtypes the
        module's ``policy`` gives them again, and their unsharded copies rebuilt."""
        for param in self.params:
            param.refresh_after_apply(policy)

    def finish_reductions(self) -> None:
        """Wait for started reductions and accumulate them into the sharded grads."""
        reductions, self._reductions = self._reductions, []
        for reduction in reductions:
            reduction.wait()
            if not reduction.keeps_replica_parts:
                for param in reduction.params:
                    param.run_post_accumulate_grad_hooks()

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop pending and unreduced grads and clear the sharded grads."""
        self.finish_reductions()
        for param in self.params:
            param.clear_grads(set_to_none)
