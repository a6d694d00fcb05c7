"""Per-module hooks of one ``fully_shard`` group and the per-backward bookkeeping.

A module's forward pre-hook casts inputs, unshards its group and attaches a post-backward trigger to the inputs that
need grad; its forward hook reshards (unless it is a root -- the first sharded module whose forward ran -- or
``reshard_after_forward`` is off), casts outputs and hooks the outputs so the group is unsharded again before its
backward runs; that pre-backward hook also starts the all-gather of the group backward reaches next (the one whose
forward finished just before), unless explicit backward-prefetch lists are set. The post-backward trigger fires when
the grads w.r.t. the module's inputs are done, which is after its params' grads; modules whose inputs need no grad
(the first layer) are finished by a callback at the end of backward.

Training state of a module, per iteration::

    IDLE --pre_forward--> FORWARD --post_forward--> IDLE --pre_backward--> PRE_BACKWARD
         --post_backward--> POST_BACKWARD --end of backward--> IDLE

While PRE_BACKWARD, a forward of the module is a recomputation (activation checkpointing):
the group is kept unsharded for the backward that follows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from enum import Enum, auto
from typing import Any

import torch
from torch.autograd import Variable

from .mesh_info import PostForwardMesh
from .param import HSDPParam
from .param_group import HSDPParamGroup
from .policy import Precision
from .saved_params import SavedParamHooks, gather_before_recompute


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class IterationContext:
    """What one root's current forward/backward iteration has touched. Shared by the root's state
    and every state below it (set when the root's first forward runs), never by the process:
    two roots (a model and its EMA copy, pipeline stages, ranks hosted as threads of one
    process) iterate independently, as in FSDP2."""

    def __init__(self) -> None:
        # States whose forward ran with grad enabled since the last end of backward (ordered).
        self.states_in_iteration: dict[HSDPState, None] = {}
        # States whose forward with grad finished since the last end of backward, in that order,
        # with how many times: backward reaches them in reverse (implicit backward prefetch).
        self.forward_order: dict[HSDPState, int] = {}
        self.final_callback_queued = False

    def recover_if_abandoned(self) -> None:
        """A forward outside backward while the end-of-backward callback is still queued means
        the last backward raised before its end: forget that iteration rather than inherit it."""
        if self.final_callback_queued and not _inside_backward():
            self.forget()

    def next_in_backward(self, state: HSDPState) -> list[HSDPState]:
        """The group backward reaches after ``state``'s (the one whose forward finished just before),
        to prefetch: only when both ran forward once since the last backward and the target is
        still to be finished this backward (its post-backward, or the end of backward, reshards it)."""
        if self.forward_order.get(state) != 1:
            return []
        order = list(self.forward_order)
        index = order.index(state)
        if index == 0:
            return []
        target = order[index - 1]
        group = target.param_group
        if self.forward_order[target] != 1 or group is None or not group.used_since_post_backward:
            return []
        return [target]

    def forget(self) -> None:
        """Forget the iteration an exception aborted (by itself at the next forward, or ``reset_iter_state``)."""
        for state in self.states_in_iteration:
            state.training_state = TrainingState.IDLE
        self.states_in_iteration.clear()
        self.forward_order.clear()
        self.final_callback_queued = False

    def queue_final_callback(self) -> None:
        if self.final_callback_queued:
            return
        self.final_callback_queued = True
        Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Finish groups the autograd graph did not reach, then land the reductions."""
        states = list(reversed(self.states_in_iteration))
        for state in states:
            group = state.param_group
            if group is not None and (group.used_since_post_backward or group.has_unreduced_grads):
                state.post_backward()
            state.training_state = TrainingState.IDLE
        for state in states:
            if state.param_group is not None and state.is_last_backward:
                state.param_group.finish_reductions()
        self.states_in_iteration.clear()
        self.forward_order.clear()
        self.final_callback_queued = False


STATE_ATTR = "_hsdp_state"  # where a sharded module keeps its HSDPState


def state_of(module: torch.nn.Module) -> HSDPState | None:
    """The HSDPState of a module given to fully_shard, else None."""
    return module.__dict__.get(STATE_ATTR)


def _inside_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _wait_on_event(event: Any) -> None:
    """The current stream waits for ``event`` (recorded after the optimizer step). On the CPU there
    are no streams: the step has finished when forward starts."""
    if torch.accelerator.is_available() and event.device.type != "cpu":
        torch.accelerator.current_stream(event.device).wait_event(event)


def _map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it: inside tuples (named ones too), lists,
    dicts and dataclass instances, the containers a forward's inputs and outputs come in. torch's
    pytree alone does not open a dataclass, and a tensor missed there would miss its cast and its
    pre-backward hook (found by L4: a model returning a dataclass got no grads)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(fn, item) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(fn, item) for item in obj)
    if isinstance(obj, dict):
        return type(obj)((key, _map_tensors(fn, value)) for key, value in obj.items())
    return obj


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, in the order ``_map_tensors`` visits them."""
    found: list[torch.Tensor] = []
    _map_tensors(lambda t: found.append(t) or t, obj)
    return found


def _cast_floating(obj: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return obj

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return _map_tensors(cast, obj)


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward marks the module's grads complete."""

    @staticmethod
    def forward(ctx, state: HSDPState, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[Any, ...]:
        # the outputs' hooks may never have run (a loss read from a tensor the forward stored): the
        # end-of-backward callback that lands this reduction is queued here too
        ctx.state.iteration.queue_final_callback()
        ctx.state.post_backward()
        return (None, *grads)


class HSDPState:
    """Hooks and controls of one module given to ``fully_shard``."""

    def __init__(
        self,
        module: torch.nn.Module,
        param_group: HSDPParamGroup | None,
        mp_policy: Precision,
        reshard_after_forward: bool | None,
        ignored_param_ids: set[int],
        post_forward: PostForwardMesh | None = None,
    ) -> None:
        self.module = module
        # reshard_after_forward=int: the smaller mesh params are kept on after forward
        self.post_forward = post_forward
        self.post_optim_event: Any = None  # set_post_optim_event: the root's next forward waits on it
        self.ignored_param_ids = ignored_param_ids  # nested fully_shard calls skip these too
        self.param_group = param_group
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.is_last_backward = True
        self.training_state = TrainingState.IDLE
        # Root of its forwards: decided at its first forward (True unless a sharded ancestor ran
        # first); the root keeps its params after forward when reshard_after_forward is None.
        self.is_root: bool | None = None
        # The iteration this state takes part in: its own until a root's first forward shares
        # the root's with it (``_become_root``).
        self.iteration = IterationContext()
        self.forward_prefetch: list[HSDPState] = []
        self.backward_prefetch: list[HSDPState] = []
        # params autograd saves in forward are gathered again when backward reads them, by any path
        self._saved_params = None if param_group is None else SavedParamHooks(param_group, self._unshard_for_saved)
        self._hook_handles = [
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
            module.register_forward_hook(self._post_forward, prepend=False),
            # torch tags public state-dict hooks with an attribute: give it a function, not a method
            module.register_state_dict_post_hook(functools.partial(HSDPState._sharded_state_dict, self)),
            module.register_load_state_dict_pre_hook(functools.partial(HSDPState._reshard_before_load, self)),
            module.register_load_state_dict_post_hook(functools.partial(HSDPState._adopt_registered, self)),
        ]
        if param_group is not None:
            # a forward that raised leaves no saved-tensor hooks pushed
            self._hook_handles.append(module.register_forward_hook(self._saved_params.leave, always_call=True))
            for param in param_group.params:
                param.on_grad = self._param_got_grad
            # a recompute a stored term reaches first finds the group gathered (saved_params.py)
            self._hook_handles += gather_before_recompute(module, param_group, self._unshard_for_saved)
        # Names (relative to module, tied names included) of each managed param, for state dicts; the
        # HSDPParam, not its sharded param, which a param registered again before the first forward replaces.
        self._names_of_params: list[tuple[HSDPParam, list[str]]] = []
        if param_group is not None:
            by_id = {id(p.sharded_param): p for p in param_group.params}
            names: dict[int, list[str]] = {}
            for name, param in module.named_parameters(remove_duplicate=False):
                if id(param) in by_id:
                    names.setdefault(id(param), []).append(name)
            self._names_of_params = [(by_id[i], n) for i, n in names.items()]

    # -- state dicts ------------------------------------------------------------------------
    def _sharded_state_dict(self, module: torch.nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        """State dicts hold the sharded DTensors, even while unsharded; what the user registered since, adopted."""
        if self.training_state is TrainingState.IDLE:
            self._adopt_registered(module)
        for param, names in self._names_of_params:
            for name in names:
                if prefix + name in state_dict:
                    state_dict[prefix + name] = param.sharded_param.detach()

    def _adopt_registered(self, module: torch.nn.Module, *args: Any) -> None:
        """A load with ``assign=True`` registered the loaded tensors: they are the sharded params from now on."""
        if self.param_group is not None:
            self.param_group.adopt_registered_params(self.mp_policy)

    def _reshard_before_load(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        """Loading writes into the sharded params, so they must be the registered ones."""
        if self.param_group is not None:
            self.param_group.reshard()

    # -- forward ----------------------------------------------------------------------------
    def _pre_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        inside_backward = _inside_backward()
        recomputing = self.training_state is TrainingState.PRE_BACKWARD or inside_backward
        if not recomputing and self.is_root is None:
            self._become_root()
        if not inside_backward:
            # first: a backward that raised left its states (PRE_BACKWARD ones too) to forget, and
            # forgetting after registering this forward would drop this group from the iteration
            self.iteration.recover_if_abandoned()
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self.iteration.states_in_iteration[self] = None
        if not recomputing:
            if self.post_optim_event is not None:
                _wait_on_event(self.post_optim_event)
                self.post_optim_event = None
            self.training_state = TrainingState.FORWARD
        if self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), self.mp_policy.param_dtype)
        if self.param_group is not None:
            if not recomputing:
                self.param_group.adopt_registered_params(self.mp_policy)  # a param the user registered since
            self.param_group.unshard()
            self.param_group.wait_for_unshard()
            if grad_enabled:
                self.param_group.used_since_post_backward = True
        if not recomputing:
            for target in self.forward_prefetch:
                target.prefetch()
        if grad_enabled:
            args, kwargs = self._attach_post_backward((args, kwargs))
            if self._saved_params is not None:
                self._saved_params.enter()
        return args, kwargs

    def _attach_post_backward(self, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        args, kwargs = inputs
        if not kwargs and all(type(arg) is torch.Tensor for arg in args):
            # the usual call, ``block(x)``: plain tensors only, no containers to walk and rebuild
            needs_grad = [arg for arg in args if arg.requires_grad]
            if not needs_grad:
                return inputs
            wrapped = iter(_PostBackward.apply(self, *needs_grad))
            return tuple(next(wrapped) if arg.requires_grad else arg for arg in args), kwargs
        needs_grad = [t for t in _tensors_in(inputs) if t.requires_grad]
        if not needs_grad:
            return inputs
        wrapped = iter(_PostBackward.apply(self, *needs_grad))  # one node: it fires once all are done
        return _map_tensors(lambda t: next(wrapped) if t.requires_grad else t, inputs)

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self._saved_params is not None:
            self._saved_params.leave()
        recomputing = self.training_state is TrainingState.PRE_BACKWARD or _inside_backward()
        grad_enabled = torch.is_grad_enabled()
        if not recomputing:
            if self.param_group is not None and self._reshards_after_forward():
                if self.post_forward is not None:
                    self.param_group.reshard_to(self.post_forward)
                else:
                    self.param_group.reshard()
            self.training_state = TrainingState.IDLE
            if grad_enabled and self.param_group is not None:
                # only groups with params take part, as in FSDP2: a call managing none is no target
                order = self.iteration.forward_order
                order[self] = order.get(self, 0) + 1
        output = _cast_floating(output, self.mp_policy.output_dtype)
        if grad_enabled:
            for tensor in (output,) if type(output) is torch.Tensor else _tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward)
        return output

    def _reshards_after_forward(self) -> bool:
        if self.reshard_after_forward is None:
            return not self.is_root  # the root's params are needed first in backward anyway
        return bool(self.reshard_after_forward)  # an int (its post-forward mesh) reshards too

    def _become_root(self) -> None:
        """First forward of a module no sharded ancestor has run: it is a root, its sharded
        descendants are not, and they take part in its iterations."""
        self._refuse_params_in_two_groups()
        self.is_root = True
        for sub in self.module.modules():
            state = state_of(sub)
            if state is None:
                continue
            if state is not self:
                state.is_root = False
                state.iteration = self.iteration
            if state.param_group is not None:
                state.param_group.adopt_registered_params(state.mp_policy)

    def _refuse_params_in_two_groups(self) -> None:
        """A param object that two separate ``fully_shard`` calls under this root sharded would train as
        two untied copies: refuse it (FSDP2's ValueError at its lazy init), before any state changes."""
        seen: dict[int, str] = {}
        for name, param in self._managed_params():
            if param.original_id in seen:
                raise ValueError(
                    f"module: parameter {name!r} is {seen[param.original_id]!r}, a parameter already managed "
                    "by another fully_shard group (separate fully_shard calls shard a tied param into two "
                    "untied copies); shard the modules that share it in one call on their common parent"
                )
            seen[param.original_id] = name

    def _managed_params(self) -> Iterator[tuple[str, HSDPParam]]:
        """Every param the groups under this module manage, named from this module (its first slot)."""
        prefixes = {id(sub): prefix for prefix, sub in self.module.named_modules()}
        for sub in self.module.modules():
            state = state_of(sub)
            if state is None or state.param_group is None:
                continue
            for param in state.param_group.params:
                module, attr = param.slots[0]
                yield f"{prefixes[id(module)]}.{attr}".lstrip("."), param

    def prefetch(self) -> None:
        """Start this group's all-gather early (explicit prefetch by another module); in backward, not
        for a group that backward does not unshard (``set_unshard_in_backward(False)``)."""
        if self.param_group is None:
            return
        if _inside_backward() and not self.param_group.unshard_in_backward:
            return
        self.param_group.unshard(async_op=True)

    # -- backward ---------------------------------------------------------------------------
    def _pre_backward(self, grad: torch.Tensor) -> None:
        # Register again: a pipeline schedule runs several forwards, then one backward per
        # microbatch, and the end of the first backward forgets the states of the iteration;
        # a group whose inputs need no grad (the first stage) is finished only by the
        # end-of-backward callback, so every backward that reaches it must list it.
        self.iteration.states_in_iteration[self] = None
        self.iteration.queue_final_callback()
        self.training_state = TrainingState.PRE_BACKWARD
        if self.param_group is not None and self.param_group.unshard_in_backward:
            self.param_group.unshard()
            self.param_group.wait_for_unshard()
        # explicit lists replace the implicit prefetch of the next group backward reaches
        for target in self.backward_prefetch or self.iteration.next_in_backward(self):
            target.prefetch()

    def _unshard_for_saved(self) -> None:
        """Backward reads a param this module's forward saved: gather the group first where no hook on
        the outputs did (the pre-backward's work), and have the end of backward finish it."""
        if not _inside_backward():
            return
        self.iteration.states_in_iteration[self] = None
        self.iteration.queue_final_callback()
        group = self.param_group
        if group.is_unsharded:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        group.unshard()
        group.wait_for_unshard()
        group.used_since_post_backward = True

    def _param_got_grad(self) -> None:
        """Autograd accumulated a grad into one of the group's unsharded params: whatever path backward
        took to get there, the end-of-backward callback that reduces and lands it is queued."""
        self.iteration.states_in_iteration[self] = None
        self.iteration.queue_final_callback()

    def post_backward(self) -> None:
        # A forward run under no_grad (reentrant checkpoint) registers the state only here.
        self.iteration.states_in_iteration[self] = None
        self.training_state = TrainingState.POST_BACKWARD
        if self.param_group is not None:
            self.param_group.post_backward()


def forward_method(state: HSDPState, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) run between the module's forward hooks, as ``forward`` is: cast and gather
    before, reshard and hook the outputs for backward after (``register_fsdp_forward_method``)."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(state.module, args, kwargs)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            if state._saved_params is not None:
                state._saved_params.leave()
            raise
        return state._post_forward(state.module, args, output)

    return run
