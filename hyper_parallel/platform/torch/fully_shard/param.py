"""One managed parameter: its sharded DTensor, its unsharded compute tensor, and its grads.

Layout. Its rows are cut over the shard group as ``layout.py``'s ``RowLayout`` says (``torch.chunk``,
DTensor's ``Shard(d)``), so the sharded param is a real DTensor that optimizers, ``clip_grad_norm_``
and checkpointing understand.

Unsharded storage. The compute param is one ``nn.Parameter`` of full shape that lives for
the module's lifetime; resharding frees its storage (resize to 0) and unsharding refills it.
Keeping the same tensor object lets autograd's saved tensors (and activation checkpoint
recomputation) see the refilled data without re-registering anything.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .layout import RowLayout, contiguous_stride
from .mesh_info import MeshInfo, PostForwardMesh, with_tensor_parallel
from .optimizer_guard import note_not_to_step
from .param_grads import GradientSide
from .param_identity import (
    ModuleSlot,
    carry_user_hooks,
    original_id,
    register_in_slots,
    user_grad_dtype,
    user_grad_hooks,
)
from .policy import CPUOffload, Precision


def _alloc_storage(tensor: torch.Tensor) -> None:
    size = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.size() != size:
        storage.resize_(size)


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


class HSDPParam(GradientSide):
    """A param of one group, placed ``Shard(dim)`` or ``Replicate()`` on the shard mesh dim."""

    def __init__(
        self,
        param: nn.Parameter,
        slots: list[ModuleSlot],
        placement: Shard | Replicate,
        mesh_info: MeshInfo,
        device: torch.device,
        mp_policy: Precision,
        offload_to_cpu: CPUOffload | None,
    ) -> None:
        self.slots = slots
        self.original_id = original_id(param)  # the object sharded: two groups must not share it
        self.mesh_info = mesh_info
        self.device = device
        self.offload_to_cpu = offload_to_cpu
        self._init_tensor_parallel(param)
        # What this engine shards and gathers: the param itself, or its TP-local tensor.
        self.full_shape = self._tp_local(param).shape
        self.user_grad_dtype = user_grad_dtype(param)
        self._follow_dtype(param.dtype, mp_policy)
        self.use_main_grad = mp_policy.apply_grad_on_fp32_main_grad and param.is_floating_point()
        self.shard_device = torch.device("cpu") if offload_to_cpu is not None else device
        self.pin_memory = offload_to_cpu is not None and offload_to_cpu.pin_memory and device.type != "cpu"
        self.is_replicated = isinstance(placement, Replicate) or param.ndim == 0
        self.dim = 0 if self.is_replicated else placement.dim % param.ndim
        # the one description of this param's rows, read by the all-gather and the reduction alike
        self.layout = RowLayout.cut(self.full_shape, self.dim, 1 if self.is_replicated else mesh_info.shard_size)
        # every rank holds the whole param (replicated, or sharded over one rank): nothing to gather
        self.is_whole = self.is_replicated or self.layout.world == 1
        # reshard_after_forward=int: the rows this rank keeps after forward, cut over that many ranks
        self.post_forward_layout: RowLayout | None = None
        self.post_forward_shard: torch.Tensor | None = None
        # called as autograd accumulates a grad into the unsharded param (set by the module's state)
        self.on_grad: Callable[[], None] | None = None
        self.registered: torch.Tensor | None = None  # what the engine last registered in the slots
        self._init_sharded(param)
        self.user_grad_hooks = getattr(param, "_backward_hooks", None)  # ``register_hook`` before fully_shard
        self._init_unsharded(param)
        # Grads taken off the unsharded param and not yet reduced (accumulation without sync).
        self.unreduced_grad: torch.Tensor | None = None
        self._gathered_version = (-1, -1)

    def _follow_dtype(self, dtype: torch.dtype, policy: Precision) -> None:
        """The sharded param's dtype, and the compute and reduce dtypes the policy gives it (a
        policy casts floating params only). The policy is its module's state's, passed in."""
        floating = dtype.is_floating_point
        self.orig_dtype = dtype
        self.param_dtype = (policy.param_dtype if floating else None) or dtype
        # a grad_dtype the user set on the param: its grads have it; the policy's reduce_dtype, where set,
        # still decides the reduction's dtype (the collective's), the grad_dtype what lands in ``.grad``
        self.grad_dtype = self.user_grad_dtype or dtype
        self.reduce_dtype = (policy.reduce_dtype if floating else None) or self.user_grad_dtype or self.param_dtype

    # -- tensor parallel -------------------------------------------------------------------
    def _init_tensor_parallel(self, param: nn.Parameter) -> None:
        """A DTensor param (tensor parallel on another mesh dim) is sharded by its TP-local
        tensor; its sharded DTensor lives on the dp dims and the TP dim of their common mesh
        (``(dp, tp)``, or ``(replicate, shard, tp)`` under HSDP), and its compute param is a
        DTensor on the TP mesh again, as the TP module expects."""
        self.tp_mesh: DeviceMesh | None = None
        self.tp_placements: tuple[Placement, ...] = ()
        self.global_shape = param.shape
        if isinstance(param, DTensor):
            self.tp_mesh = param.device_mesh
            self.tp_placements = tuple(param.placements)

    @staticmethod
    def _tp_local(param: torch.Tensor) -> torch.Tensor:
        return param._local_tensor if isinstance(param, DTensor) else param

    def _sharded_layout(self, placement: Placement) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        if self.tp_mesh is None:
            return self.mesh_info.mesh, self.mesh_info.placements(placement)
        if isinstance(placement, Shard) and any(
            isinstance(p, Shard) and p.dim == placement.dim for p in self.tp_placements
        ):
            # dp splits rows that TP already split: dp's chunk lies inside TP's chunk
            placement = _StridedShard(placement.dim, split_factor=self.tp_mesh.size())
        mesh = with_tensor_parallel(self.mesh_info.mesh, self.tp_mesh)
        return mesh, (*self.mesh_info.placements(placement), *self.tp_placements)

    # -- sharded side ---------------------------------------------------------------------
    def _init_sharded(self, param: nn.Parameter) -> None:
        with torch.no_grad():
            src = self._this_ranks_rows(self._tp_local(param).detach())
            if src.is_meta:  # deferred init: the shard stays on meta until to_empty() materialises it
                local = torch.empty(src.shape, dtype=src.dtype, device="meta")
            else:
                local = torch.empty(src.shape, dtype=src.dtype, device=self.shard_device)
                if self.pin_memory:
                    local = local.pin_memory()
                local.copy_(src)
            placement = Replicate() if self.is_replicated else Shard(self.dim)
            self.sharded_mesh, self.placements = self._sharded_layout(placement)
            dtensor = self.to_dtensor(local)
        self.sharded_param = nn.Parameter(dtensor, requires_grad=param.requires_grad)
        self._keep_grad_dtype(self.sharded_param)
        carry_user_hooks(param, self.sharded_param)

    def _this_ranks_rows(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor of the param's whole (TP-local) shape: its ``torch.chunk``
        piece, a view (the last ranks' pieces may be empty)."""
        if self.is_replicated:
            return whole
        return self.layout.narrow(whole, self.mesh_info.shard_rank)

    @property
    def local_shard(self) -> torch.Tensor:
        """This rank's shard: the tensor optimizers update in place."""
        return self.sharded_param._local_tensor

    def to_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap a local tensor laid out like this param's shard as a DTensor like the param."""
        if local.dtype == self.orig_dtype and hasattr(self, "sharded_param"):
            # hot path (every new grad): reuse the param's spec, skip from_local's checks; ``__new__``
            # alone, as DTensor's own ops wrap their results (its ``__init__`` does nothing but cost
            # two wrappers a call)
            return DTensor.__new__(DTensor, local, self.sharded_param._spec, requires_grad=False)
        return self._global_view(local, self.sharded_mesh, self.placements)

    def _global_view(self, local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
        """``local`` as this rank's piece of the global param under ``placements`` on ``mesh``."""
        return DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=self.global_shape,
            stride=contiguous_stride(self.global_shape),
        )

    def use_sharded(self) -> None:
        self._register(self.sharded_param)

    def use_post_forward(self, mesh: DeviceMesh) -> None:
        """Register the rows kept after forward (``reshard_after_forward=int``) as a DTensor on the
        post-forward mesh (replicated over its groups, sharded within one), as FSDP2 registers them."""
        if self.tp_mesh is not None or self.post_forward_shard is None:
            self.use_sharded()  # a TP param stays registered as its dp shard
            return
        view = DTensor.from_local(
            self.post_forward_shard,
            mesh,
            (Replicate(), Shard(self.dim)),
            run_check=False,
            shape=self.global_shape,
            stride=contiguous_stride(self.global_shape),
        )
        param = nn.Parameter(view, requires_grad=self.sharded_param.requires_grad)
        module, name = self.slots[0]
        note_not_to_step(
            param,
            f"optimizer: it holds the rows of parameter {name!r} of {type(module).__name__} that "
            "reshard_after_forward=<int> keeps registered after forward, not the sharded parameter training "
            "updates (the next gather replaces them); build the optimizer from model.parameters() before the "
            "first forward, after a backward, or after model.reshard()",
        )
        self._register(param)

    def refresh_after_apply(self, policy: Precision) -> None:
        """Follow what ``nn.Module._apply`` (``to``, ``to_empty``, ``double``, ...) did to the sharded
        param: it swaps the DTensor's contents in place, so its dtype and device are read back here,
        the offload policy is applied again, and the unsharded copy is rebuilt to match."""
        local = self.local_shard
        if self.offload_to_cpu is not None and not local.is_meta and local.device.type != "cpu":
            local = local.cpu()
            if self.pin_memory:
                local = local.pin_memory()
            self.sharded_param._local_tensor = local
        self._follow_dtype(local.dtype, policy)
        if not local.is_meta:
            self.shard_device = local.device
        if self.use_main_grad:  # _apply swapped the grad too; the main grad is that tensor again
            self.sharded_param.main_grad = self.sharded_param.grad
        if self.unreduced_grad is not None:  # grads accumulated without sync are kept, in the new dtype
            self.unreduced_grad = self.unreduced_grad.to(self.reduce_dtype)
        self._init_unsharded(self.sharded_param)
        self._gathered_version = (-1, -1)

    def registered_in_place(self) -> torch.Tensor | None:
        """A param the user registered in this param's place since the engine last registered one, else None."""
        module, name = self.slots[0]
        current = module._parameters.get(name)
        return None if current is None or current is self.registered else current

    def adopt_registered(self, policy: Precision, current: torch.Tensor) -> None:
        """A param registered in this param's place after ``fully_shard`` (a weight computed from others
        once they are materialised, say) becomes this param's sharded param, as in FSDP2's lazy init.
        A DTensor laid out as this param's shard is taken as it is: the user's object is what the module,
        its state dict and an optimizer built after the assignment hold. A plain tensor of the param's
        full shape (which FSDP2 refuses) is cut to this rank's shard, a new sharded param registered in
        its place: an optimizer must be built after the root's first forward."""
        module, name = self.slots[0]
        if isinstance(current, DTensor) and (
            current.device_mesh != self.sharded_mesh or tuple(current.placements) != tuple(self.placements)
        ):
            return  # not laid out as this param's shard (tensor parallel's, or another mesh's): left alone
        if current.shape != self.global_shape:
            raise ValueError(
                f"parameter {name!r} of {type(module).__name__} was registered again with shape "
                f"{tuple(current.shape)}; fully_shard sharded it with shape {tuple(self.global_shape)}"
            )
        if not isinstance(current, DTensor):
            # torch swaps no plain tensor with a DTensor (their slots differ): a new sharded param takes
            # its place, with the user's hooks on it
            with torch.no_grad():
                src = self._this_ranks_rows(current.detach())
                local = src.to(self.shard_device, memory_format=torch.contiguous_format, copy=True)
            fresh = nn.Parameter(self._global_view(local, self.sharded_mesh, self.placements), current.requires_grad)
            carry_user_hooks(current, fresh)
            note_not_to_step(
                current,
                f"optimizer: it holds parameter {name!r} of {type(module).__name__} as registered again, a plain "
                "tensor of full shape: fully_shard sharded it into a new DTensor parameter at the next forward, "
                "and the model no longer uses the tensor the optimizer holds; build the optimizer from "
                "model.parameters() after that forward, or register a DTensor laid out as the shard "
                "(torch.distributed.tensor.distribute_tensor on the param's mesh and placements) in its place",
            )
            current = fresh
        self.sharded_param = current
        self.registered = None  # what the user registered holds, its requires_grad too
        self.refresh_after_apply(policy)  # the offload policy, dtypes and the unsharded copy follow it
        self.use_sharded()

    # -- unsharded side -------------------------------------------------------------------
    def _init_unsharded(self, param: nn.Parameter) -> None:
        # A replicated param that needs no cast nor move is its own compute param: no copy.
        self.aliases_shard = (
            self.is_whole
            and self.param_dtype == self.orig_dtype
            and self.local_shard.device == self.device
            and not self.local_shard.is_meta
        )
        if self.aliases_shard:
            data = self.local_shard
        elif self.local_shard.is_meta:
            data = torch.empty(self.full_shape, dtype=self.param_dtype, device="meta")
        else:
            data = torch.empty(self.full_shape, dtype=self.param_dtype, device=self.device)
            _free_storage(data)
        if self.tp_mesh is not None:
            data = self._global_view(data, self.tp_mesh, self.tp_placements)
        self.unsharded_param = nn.Parameter(data, requires_grad=param.requires_grad)
        module, name = self.slots[0]
        note_not_to_step(
            self.unsharded_param,
            f"optimizer: it holds the unsharded compute copy of parameter {name!r} of {type(module).__name__}, "
            "not the sharded parameter training updates (a root keeps its params gathered from its forward to "
            "its backward, and model.parameters() lists the copies then); build the optimizer from "
            "model.parameters() before the first forward, after a backward, or after model.reshard()",
        )
        self._grad_accumulator = None
        self._hook_unsharded()
        # The plain tensor this engine fills and frees (shares storage with the param).
        self.unsharded_local = self._tp_local(self.unsharded_param)

    def _hook_unsharded(self) -> None:
        """Once the unsharded param needs grad: the user's ``grad_dtype`` and ``register_hook`` hooks on it,
        and the engine's hook telling that a grad arrived, on the param's grad accumulator, not the param
        (the user's hooks on the registered params never count it; held here, so autograd reuses the node for
        every graph the param enters)."""
        param = self.unsharded_param
        if not param.requires_grad or self._grad_accumulator is not None:
            return
        self._keep_grad_dtype(param)  # autograd accumulates in it
        with torch.enable_grad():
            self._grad_accumulator = param.view_as(param).grad_fn.next_functions[0][0]
        self._grad_accumulator.register_hook(self._grad_accumulated)
        if self.user_grad_hooks:
            param.register_hook(user_grad_hooks(self.user_grad_hooks))

    def _register(self, param: nn.Parameter) -> None:
        """Register ``param`` in the slots, needing grad as the one it replaces does: a user may freeze or
        unfreeze the registered params at any time (all of them through the first forward, say), sharded,
        gathered or kept after forward, and that holds for the next ones."""
        previous = self.registered
        if previous is not None and previous is not param and param.requires_grad != previous.requires_grad:
            param.requires_grad_(previous.requires_grad)
        register_in_slots(self.slots, param)
        self.registered = param

    def _grad_accumulated(self, *_: object) -> None:
        if self.on_grad is not None:
            self.on_grad()

    def _keep_grad_dtype(self, param: nn.Parameter) -> None:
        """The user's ``grad_dtype`` on a param the engine made in place of theirs (frozen or not)."""
        if self.user_grad_dtype is not None:
            param.grad_dtype = self.user_grad_dtype

    def use_unsharded(self) -> None:
        self._register(self.unsharded_param)
        self._hook_unsharded()

    def alloc_unsharded(self) -> None:
        if not self.aliases_shard:
            _alloc_storage(self.unsharded_local)

    def free_unsharded(self) -> None:
        if not self.aliases_shard:
            _free_storage(self.unsharded_local)

    def shard_version(self) -> tuple[int, int]:
        """The shard's version now. In-place ops through the DTensor (optimizers, loads) bump the
        DTensor's counter only; ops on the local tensor bump the local one: watch both."""
        return self.sharded_param._version, self.local_shard._version

    def note_gathered(self, version: tuple[int, int] | None = None) -> None:
        """Remember the shard's version the unsharded copy was made from (``version``: when its
        shard was read; default now), to notice an optimizer step made the copy stale."""
        self._gathered_version = self.shard_version() if version is None else version

    @property
    def is_stale(self) -> bool:
        return not self.aliases_shard and self.shard_version() != self._gathered_version

    def hidden_writes(self) -> torch.autograd._unsafe_preserve_version_counter:
        """Refilling the unsharded param restores data autograd saved, it is not a mutation:
        keep its version counter so saved-tensor checks still hold in backward."""
        return torch.autograd._unsafe_preserve_version_counter(self.unsharded_local)

    def copy_replicated_in(self) -> None:
        """Unshard a whole param (replicated, or one rank's): a cast/move copy of the local tensor."""
        if not self.aliases_shard:
            with torch.no_grad(), self.hidden_writes():
                self.unsharded_local.copy_(self.local_shard)

    def gather_source(self, post_forward: PostForwardMesh | None) -> tuple[RowLayout, torch.Tensor, int]:
        """What an all-gather sends: the layout, this rank's piece and its index in the gather's group
        (the shard over the shard group; after an int ``reshard_after_forward``, the piece kept)."""
        if post_forward is not None:
            layout = self.post_forward_layout
            return layout, self.post_forward_shard, self.mesh_info.shard_rank % layout.world
        return self.layout, self.local_shard, self.mesh_info.shard_rank

    def copy_shard_into(self, flat: torch.Tensor, post_forward: PostForwardMesh | None = None) -> None:
        """Write this rank's shard, cast to the compute dtype, into an all-gather input."""
        layout, piece, rank = self.gather_source(post_forward)
        rows = layout.rows[rank]
        if rows:
            view = flat.view(layout.padded_shape).narrow(layout.dim, 0, rows)
            view.copy_(piece)

    def copy_gathered_out(self, gathered: torch.Tensor, layout: RowLayout | None = None) -> None:
        """Allocate and fill the unsharded param from an all-gather output viewed as [world, padded numel]."""
        layout = layout or self.layout
        self.alloc_unsharded()
        with torch.no_grad(), self.hidden_writes():
            if layout.rank_major:
                self.unsharded_local.view(layout.world, -1).copy_(gathered)
                return
            for rank in range(layout.world):
                rows = layout.rows[rank]
                if rows:
                    src = gathered[rank].view(layout.padded_shape).narrow(layout.dim, 0, rows)
                    dst = self.unsharded_local.narrow(layout.dim, rank * layout.chunk, rows)
                    dst.copy_(src)

    # -- reshard_after_forward=int ----------------------------------------------------------
    def keep_post_forward_shard(self, world: int) -> None:
        """Keep this rank's rows of the unsharded param cut over ``world`` ranks (a divisor of the
        shard group), so backward gathers within that smaller group."""
        if self.post_forward_layout is None or self.post_forward_layout.world != world:
            self.post_forward_layout = RowLayout.cut(self.full_shape, self.dim, world)
        rank = self.mesh_info.shard_rank % world
        with torch.no_grad():
            self.post_forward_shard = self.post_forward_layout.narrow(self.unsharded_local, rank).clone()

    def drop_post_forward_shard(self) -> None:
        self.post_forward_shard = None
