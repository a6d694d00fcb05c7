"""Params that autograd saved in a module's forward are gathered again before backward reads them.

A module that reshards after forward frees its unsharded params' storage; the hooks on its outputs
gather them again before backward reaches the module. Backward can reach what the forward saved by
other paths: a loss read from an intermediate the forward stored on the module, an output changed in
place through a view (its hooked autograd node is replaced), a tensor returned inside a container the
engine cannot open. Autograd then reads a freed storage ("storage of size 0", as torch FSDP2 fails in
pytorch#173709 and #181832).

So while a sharded module's forward runs, saved-tensor hooks note each saved tensor that is one of
its group's unsharded params (or a view of one); unpacking such a tensor in backward first gathers the
group (what its pre-backward would have done). Every other tensor goes to the hooks the engine's pair
covers (``save_on_cpu``, activation checkpointing) exactly as it would have without them; with none
below, a detached alias is kept (never the tensor itself: a saved output would then hold its own
autograd node, a reference cycle torch cannot collect).

A checkpoint inside the module (``checkpoint(self.inner, x)``, not re-entrant, as ``checkpoint_wrapper``
then ``fully_shard`` builds it) packs with hooks of its own, above these: its recompute in backward
runs where autograd first reads what it saved, which a stored term reaches before any hook on the
module's outputs. ``gather_before_recompute`` gathers the group as a recompute enters a submodule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..compat import saved_tensors_hooks_on_top
from .param_group import HSDPParamGroup


class _SavedParam:
    """What the pack hook keeps for a param: the gatherer to call before it is read, and the param as
    the hooks below packed it."""

    __slots__ = ("owner", "packed")

    def __init__(self, owner: SavedParamHooks, packed: Any) -> None:
        self.owner = owner
        self.packed = packed


class SavedParamHooks:
    """The saved-tensor hooks of one module's forward: entered by its forward pre-hook, left by its
    forward hook (or, when the forward raised, by a hook torch calls anyway)."""

    def __init__(self, group: HSDPParamGroup, unshard: Callable[[], None]) -> None:
        self._group = group
        self._unshard = unshard
        self._context: torch.autograd.graph.saved_tensors_hooks | None = None

    def enter(self) -> None:
        usable, below = saved_tensors_hooks_on_top()
        if not usable or self._context is not None:
            return
        pack_below, unpack_below = below if below is not None else (None, None)
        # the unsharded params now (``nn.Module._apply`` may have rebuilt them since the last forward)
        param_ids = {id(param.unsharded_param) for param in self._group.params}
        unshard = self._unshard

        def pack(tensor: torch.Tensor) -> Any:
            base = tensor._base
            is_param = id(tensor) in param_ids or (base is not None and id(base) in param_ids)
            if pack_below is not None:
                packed = pack_below(tensor)
            else:
                packed = tensor if is_param and base is None else tensor.detach()
            return _SavedParam(self, packed) if is_param else packed

        def unpack(packed: Any) -> torch.Tensor:
            if type(packed) is _SavedParam and packed.owner is self:
                unshard()
                packed = packed.packed
            return unpack_below(packed) if unpack_below is not None else packed

        self._context = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._context.__enter__()

    def leave(self, *_: Any) -> None:
        """Pop the hooks (idempotent; also a forward hook that torch calls when the forward raised)."""
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(None, None, None)


def gather_before_recompute(module: torch.nn.Module, group: HSDPParamGroup, gather: Callable[[], None]) -> list[Any]:
    """A forward pre-hook on each submodule of ``module`` holding a param of ``group``: ``gather()``
    (which acts inside backward only) while the group is sharded. The hooks' handles."""
    own = {id(param.sharded_param) for param in group.params}

    def before(submodule: torch.nn.Module, args: Any) -> None:
        if not group.is_unsharded:
            gather()

    holders = [sub for sub in module.modules() if any(id(p) in own for p in sub.parameters(recurse=False))]
    return [sub.register_forward_pre_hook(before) for sub in holders if sub is not module]
