"""What a managed param keeps of the user's tensor it replaces, and how it takes its slots: the module
slots it is registered in, the user's hooks and ``grad_dtype``, and a number naming the object sharded
(``HSDPParam``, ``param.py``, is the rest)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

ModuleSlot = tuple[nn.Module, str]


def register_in_slots(slots: list[ModuleSlot], param: torch.Tensor) -> None:
    """Register ``param`` in each slot without ``nn.Module.__setattr__``'s checks (hot path: every param,
    every unshard and reshard). The type's ``__setattr__`` is what assignment runs; a module overriding
    it sees the swap."""
    for module, name in slots:
        if type(module).__setattr__ is nn.Module.__setattr__:
            module._parameters[name] = param
        else:
            setattr(module, name, param)


def user_grad_hooks(hooks: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """One hook for the unsharded param that runs the ``register_hook`` hooks a user put on the param
    before ``fully_shard`` (read from their dict at each call: a handle removing one still works), each on
    the grad the one before returned: the unsharded param is the tensor autograd computes grads for."""

    def run(grad: torch.Tensor) -> torch.Tensor:
        for hook in tuple(hooks.values()):
            changed = hook(grad)
            if changed is not None:
                grad = changed
        return grad

    return run


def carry_user_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """The post-accumulate-grad hooks a user put on ``old`` go with ``new``, the param that replaces it
    (the same dict: their handles still remove them); the engine calls them as reduced grads land."""
    hooks = getattr(old, "_post_accumulate_grad_hooks", None)
    if hooks:
        new._post_accumulate_grad_hooks = hooks


def user_grad_dtype(param: torch.Tensor) -> torch.dtype | None:
    """The ``grad_dtype`` a user set on ``param`` where it differs from the param's dtype (torch 2.9 on;
    earlier releases have none), else None; a frozen param's too, which torch keeps for when it is unfrozen."""
    dtype = getattr(param, "grad_dtype", None) if param.is_leaf else None
    return dtype if dtype is not None and dtype != param.dtype else None


_ORIGINAL_IDS = itertools.count()
_ORIGINAL_ID_ATTR = "_hsdp_original_id"


def original_id(param: torch.Tensor) -> int:
    """A number naming the param object given to ``fully_shard``, kept on that object: two calls that
    shard one object get the same number, where ``id()`` could be reused once a sharded-away param is freed."""
    if not hasattr(param, _ORIGINAL_ID_ATTR):
        setattr(param, _ORIGINAL_ID_ATTR, next(_ORIGINAL_IDS))
    return getattr(param, _ORIGINAL_ID_ATTR)
