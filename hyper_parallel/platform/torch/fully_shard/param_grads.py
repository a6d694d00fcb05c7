"""The gradient side of one managed parameter: the grads autograd leaves on the unsharded param,
held until reduced, and the reduced shard accumulated into the sharded param's ``.grad`` (or its
fp32 main grad). ``HSDPParam`` (``param.py``) is this class with its layout and storage."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


class GradientSide:
    """Grad bookkeeping of an ``HSDPParam``; the attributes it reads are set by ``HSDPParam.__init__``."""

    unreduced_grad: torch.Tensor | None
    # HSDP accumulation with the replicas' all-reduce off (``set_requires_all_reduce(False)``): each such
    # micro-batch's per-replica grad lands in ``.grad`` at once and is also kept here, as its collective
    # left it (the reduction's raw output and arithmetic), so the next all-reducing backward reduces it over
    # the replicas together with its own (FSDP2's partial output, kept as FSDP2 keeps it: through
    # ``zero_grad`` and optimizer steps, until that backward or ``reset_iter_state``); ``.grad`` then drops
    # the per-replica parts it holds for that result: no part is reduced twice.
    replica_pending: tuple[torch.Tensor, object] | None = None
    # (the grad the kept parts landed in, what it held before the first of them): None once cleared
    parts_landed: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def take_unsharded_grad(self) -> None:
        """Move autograd's grad off the unsharded param into the unreduced accumulator.

        A first grad is kept in its own dtype: the reduction casts it as it copies it into its
        buffer, so a bf16 grad never has an fp32 copy beside that buffer (FSDP2's peak). A second
        one (no-sync micro-batches) is added in the reduce dtype, so bf16 compute with fp32
        reduction accumulates in fp32.
        """
        grad = self.unsharded_param.grad
        if grad is None:
            return
        self.unsharded_param.grad = None
        if isinstance(grad, DTensor):
            if tuple(grad.placements) != self.tp_placements:
                grad = grad.redistribute(self.tp_mesh, self.tp_placements)  # e.g. Partial -> Replicate
            grad = grad._local_tensor
        if self.unreduced_grad is None:
            self.unreduced_grad = grad
            return
        if self.unreduced_grad.dtype != self.reduce_dtype:
            self.unreduced_grad = self.unreduced_grad.to(self.reduce_dtype)
        self.unreduced_grad.add_(grad)

    def unreduced_in_reduce_dtype(self) -> torch.Tensor:
        """The unreduced grad in the reduce dtype (a cast copy where it is still in its own)."""
        grad = self.unreduced_grad
        return grad if grad.dtype == self.reduce_dtype else grad.to(self.reduce_dtype)

    @property
    def trainable_now(self) -> bool:
        """Whether the param needs grad as the user last set it: on the param registered now (the shard, the
        unsharded param, or the rows kept after forward), which the engine carries to the next it registers;
        the shard's own flag is stale while another is registered (frozen between steps with its rows kept)."""
        current = self.registered if self.registered is not None else self.sharded_param
        return current.requires_grad

    def give_zero_grad_if_unused(self) -> None:
        """``set_reduce_scatter_unused_params``: a param backward gave no grad on this rank reduces
        zeros, so every rank issues the same collectives whatever it used."""
        if self.unreduced_grad is None and self.trainable_now:
            self.unreduced_grad = torch.zeros(self.full_shape, dtype=self.reduce_dtype, device=self.device)

    def copy_grad_into(self, buffer: torch.Tensor, grad: torch.Tensor) -> None:
        """Write a full grad into a reduce-scatter input viewed as [world, padded numel]."""
        layout = self.layout
        if layout.rank_major:
            buffer.copy_(grad.reshape(layout.world, -1))
            return
        for rank in range(layout.world):
            rows = layout.rows[rank]
            piece = buffer[rank].view(layout.padded_shape)
            if rows:
                piece.narrow(layout.dim, 0, rows).copy_(grad.narrow(layout.dim, rank * layout.chunk, rows))
            if rows < layout.chunk:
                piece.narrow(layout.dim, rows, layout.chunk - rows).zero_()

    def shard_of_reduced(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's unpadded grad shard inside a reduce-scatter output."""
        if self.is_replicated:
            return flat.view(self.full_shape)
        rows = self.layout.rows[self.mesh_info.shard_rank]
        return flat.view(self.layout.padded_shape).narrow(self.dim, 0, rows)

    def keep_replica_part(self, raw: torch.Tensor, arithmetic: object) -> None:
        """Keep a per-replica reduction's raw output (this rank's shard of it) until an all-reducing one;
        a second part is added to the first, converted by the caller to the first one's arithmetic."""
        if self.replica_pending is None:
            self.replica_pending = (raw.clone(), arithmetic)
        else:
            self.replica_pending[0].add_(raw)

    def take_replica_pending(self) -> tuple[torch.Tensor, object] | None:
        """The kept per-replica parts (and forget them), for the all-reducing reduction to add in."""
        pending, self.replica_pending = self.replica_pending, None
        return pending

    def land_replica_part(self, reduced: torch.Tensor) -> None:
        """Land a per-replica grad in ``.grad``, remembering what the grad held before the first part
        that is still in it (a grad cleared or replaced since holds none)."""
        grad = self.sharded_param.grad
        if self.parts_landed is None or self.parts_landed[0] is not grad:
            self.parts_landed = (None, None if grad is None else grad._local_tensor.clone())
        self.apply_reduced_grad(reduced)
        self.parts_landed = (self.sharded_param.grad, self.parts_landed[1])

    def land_all_reduced(self, reduced: torch.Tensor) -> None:
        """Land an all-reduced grad that holds kept per-replica parts: where ``.grad`` still holds those
        parts, it becomes what it held before them plus ``reduced``; else ``reduced`` is added as usual."""
        landed, self.parts_landed = self.parts_landed, None
        grad = self.sharded_param.grad
        if landed is None or landed[0] is not grad or grad is None:
            self.apply_reduced_grad(reduced)
            return
        local, base = grad._local_tensor, landed[1]
        if base is None:
            local.copy_(reduced)
        else:
            local.copy_(base).add_(reduced.to(self.shard_device))

    def run_post_accumulate_grad_hooks(self) -> None:
        """The user's ``register_post_accumulate_grad_hook`` hooks on the sharded param, once its reduced
        grad has landed (autograd never sees the sharded param, so it cannot call them): FSDP2's rule."""
        param = self.sharded_param
        for hook in tuple((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values()):
            hook(param)

    def apply_reduced_grad(self, reduced: torch.Tensor, owned: bool = False) -> None:
        """Accumulate a reduced grad shard into ``param.grad`` (or the fp32 main grad). ``owned``:
        ``reduced`` is no buffer's but this param's alone, so it becomes the grad without a copy
        where dtype and device already match."""
        param = self.sharded_param
        target_dtype = torch.float32 if self.use_main_grad else self.grad_dtype
        current = param.grad
        if current is not None:
            current._local_tensor.add_(reduced.to(self.shard_device))
            return
        main = getattr(param, "main_grad", None) if self.use_main_grad else None
        if main is not None:
            main._local_tensor.copy_(reduced)
        else:
            adopt = owned and reduced.dtype == target_dtype and reduced.device == self.shard_device
            local = reduced if adopt else torch.empty(reduced.shape, dtype=target_dtype, device=self.shard_device)
            if not adopt:
                local.copy_(reduced)
            main = self.to_dtensor(local)
            if self.use_main_grad:
                param.main_grad = main
        param.grad = main

    def clear_grads(self, set_to_none: bool) -> None:
        """Drop unreduced grads and clear (or zero) the sharded grad and main grad."""
        self.unreduced_grad = None
        self.parts_landed = None  # the kept per-replica parts stay (FSDP2's rule), no longer in ``.grad``
        self.unsharded_param.grad = None
        param = self.sharded_param
        main = getattr(param, "main_grad", None)
        if main is not None:
            main._local_tensor.zero_()
        if set_to_none:
            param.grad = None
        elif param.grad is not None:
            param.grad._local_tensor.zero_()
