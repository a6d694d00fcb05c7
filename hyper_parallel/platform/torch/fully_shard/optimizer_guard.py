"""An optimizer never steps a tensor the model does not train: it is refused at its step, naming the fix.

Two kinds of tensor look like the model's params to ``model.parameters()`` at some moment and are not
what training updates:

- the unsharded compute copy of a param: a root keeps its params gathered from its forward until its
  backward, so an optimizer built between them (after a warm-up or shape-inference forward) holds the
  copies, which every gather overwrites (torch FSDP2 trains silently wrong there);
- a plain full-shape param the user registered in a sharded param's place: the engine shards it at the
  next forward into a new DTensor param (torch swaps no plain tensor with a DTensor), so an optimizer
  built before that holds the tensor the model no longer uses.

Both are noted here as the engine makes or replaces them; torch's global optimizer step pre-hook
refuses an optimizer holding one. Each optimizer is looked at once until a new tensor is noted or its
param groups change, so a step pays a dictionary look-up.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# id(tensor) -> (a weak reference to it, why an optimizer must not step it)
_NOT_TO_STEP: dict[int, tuple[weakref.ref, str]] = {}
_generation = 0  # bumped at each tensor noted: optimizers looked at before are looked at again
_looked_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (generation, params)
_hook_handle = None


def note_not_to_step(tensor: torch.Tensor, why: str) -> None:
    """Refuse any optimizer step that would update ``tensor`` (for as long as it lives)."""
    global _generation, _hook_handle
    key = id(tensor)
    _NOT_TO_STEP[key] = (weakref.ref(tensor, lambda _, key=key: _NOT_TO_STEP.pop(key, None)), why)
    _generation += 1
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_pre_hook(_refuse_tensors_not_trained)


def _refuse_tensors_not_trained(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    params = [param for group in optimizer.param_groups for param in group["params"]]
    seen = (_generation, len(params))
    if _looked_at.get(optimizer) == seen:
        return
    for param in params:
        entry = _NOT_TO_STEP.get(id(param))
        if entry is not None and entry[0]() is param:
            raise RuntimeError(entry[1])
    _looked_at[optimizer] = seen
