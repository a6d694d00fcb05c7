"""Rank side of the diagnosis: a trace of the model under test and of its baseline, tensor by tensor.

While a ``Tracer`` is active on a rank, the kit's training loops (``tests.kit.workloads.training``)
attach it to the model and its baseline. Public torch hooks record, per step:

- ``forward``: each module's output (its first tensor), in call order;
- ``backward``: the grad of that output, in the order backward reaches it;
- ``reduction``: each param's grad once the implementation has reduced it (its full value,
  assembled through the implementation surface, so any implementation can be traced);
- ``optimizer``: each param after the optimizer step.

Modules and params are matched by path. A trace run (``mode="trace"``) records both sides and
measures each tensor's error; a noise run (``mode="noise"``) runs the same case again with every
reference output and output grad moved by one rounding of the compute dtype, and measures how far
the reference itself moves: the tensor's noise. Nothing is attached while no tracer is active, so a
passing case pays nothing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.kit.judging.crash import Site, site_hooks
from tests.kit.judging.reference import SameDtypeReference, full
from tests.kit.judging.tolerances import DIAGNOSIS

PHASES = ("forward", "backward", "reduction", "optimizer")
MODES = ("trace", "noise")

_ACTIVE: Tracer | None = None


def active() -> Tracer | None:
    """The tracer of this rank's current run, or None (the training loops then attach nothing)."""
    return _ACTIVE


def mark(phase: str) -> None:
    """The training loop starts ``phase`` (or a call between phases): where a crash would be, if one came."""
    if _ACTIVE is not None:
        _ACTIVE.site.at(phase)


@contextlib.contextmanager
def tracing(tracer: Tracer) -> Iterator[Tracer]:
    """Make ``tracer`` the rank's active one for the block (never nested: one run at a time)."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a tracer is already active on this rank")
    _ACTIVE = tracer
    try:
        yield tracer
    finally:
        _ACTIVE = None
        tracer.detach()


class Untraced:
    """What ``traced`` hands a case's loop while no diagnosis runs: every call does nothing."""

    def begin(self, label: str | None) -> None:
        pass

    def grads(self, model_params: Mapping[str, Any], reference_params: Mapping[str, Any]) -> None:
        pass

    def params(self, model_params: Mapping[str, Any], reference_params: Mapping[str, Any]) -> None:
        pass


def traced(model: Any, reference: Any) -> Tracer | Untraced:
    """The active tracer attached to ``model`` and its baseline, for a training loop of its own
    (``begin(label)`` before each step's two forwards, ``begin(None)`` to pause over steps that have
    no baseline, ``grads`` and ``params`` as ``train_against`` calls them); else a do-nothing stand-in."""
    tracer = active()
    if tracer is None:
        return Untraced()
    tracer.attach(model, reference)
    return tracer


@dataclass(frozen=True)
class Key:
    """Where one traced tensor was seen: step, phase, module path, which tensor."""

    step: str
    phase: str
    module: str
    tensor: str

    def text(self) -> str:
        return f"{self.step} {self.phase} {self.module or '(root)'} {self.tensor}"


def first_tensor(value: Any) -> torch.Tensor | None:
    """The tensor a module returned, or the first tensor of a tuple or list it returned."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


def replaceable(value: Any) -> bool:
    """A forward hook can hand back ``value`` with its first tensor replaced: a plain tensor, tuple
    or list (a named tuple or another container is left as it is, and its tensor unperturbed)."""
    return type(value) in (torch.Tensor, torch.nn.Parameter, tuple, list)


def _replace_first(value: Any, tensor: torch.Tensor) -> Any:
    """``value`` with its first tensor replaced by ``tensor`` (what a forward hook returns)."""
    if isinstance(value, torch.Tensor):
        return tensor
    items = list(value)
    index = next(i for i, v in enumerate(items) if isinstance(v, torch.Tensor))
    items[index] = tensor
    return items if type(value) is list else tuple(items)


def _less_precise(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The floating dtype of the two with the larger rounding."""
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


def traced_module(reference: Any) -> nn.Module | None:
    """The ``nn.Module`` whose forward the baseline runs: DDP's module, the compute copy of a
    baseline keeping master params apart (a same-dtype reference, L4's promised one), a global-batch
    reference's copy, or the module itself."""
    compute = getattr(reference, "compute", None)
    if isinstance(compute, nn.Module):
        return compute
    if isinstance(reference, DistributedDataParallel):
        return reference.module
    if isinstance(reference, nn.Module):
        return reference
    inner = getattr(reference, "module", None)
    return inner if isinstance(inner, nn.Module) else None


def rounding_dtype(reference: Any) -> torch.dtype | None:
    """The dtype whose rounding is all that honestly departs between the baseline and the model, where
    the baseline says so: a same-dtype data-parallel baseline runs the model's own compute-dtype
    kernels on the model's own batch, so only its reduction (in the reduce dtype) runs in another
    order. None: any arithmetic may differ (another batch shape, another mesh), at the rounding of the
    dtype the model computes in."""
    if isinstance(reference, SameDtypeReference) and not reference.global_batch:
        return reference.reduce_dtype
    return None


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of the tensor's whole value (a DTensor gathered), on the CPU."""
    return full(tensor).detach().to("cpu", copy=True)


class _Side:
    """The hooks on one side's modules (the model under test, or its baseline) and what they saw."""

    def __init__(self, tracer: Tracer, module: nn.Module, role: str) -> None:
        self.tracer, self.role = tracer, role
        self.in_backward = False
        self.calls: dict[str, int] = {}
        # the least precise dtype the side has computed in so far this step: what a tensor's
        # rounding is (an fp32 output cast from bf16 compute carries bf16's rounding)
        self.compute_dtype = torch.float32
        modules = list(module.named_modules())
        self.handles = [m.register_forward_hook(self._forward_hook(path)) for path, m in modules]
        if role == "model":  # the baseline's rounding is never asked: a tensor's is the model's
            self.handles += [m.register_forward_pre_hook(self._pre_hook) for _, m in modules]
            self.handles += site_hooks(tracer.site, modules, first_tensor)  # where a crash would be

    def begin(self) -> None:
        self.in_backward = False
        self.calls.clear()
        self.compute_dtype = torch.float32

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        """The dtypes the module computes in: its own params as its forward sees them (an
        implementation has gathered them by now, in their compute dtype) and its floating inputs."""
        if self.in_backward:
            return
        seen = [p.dtype for p in module.parameters(recurse=False)]
        seen += [a.dtype for a in args if isinstance(a, torch.Tensor)]
        for dtype in seen:
            if dtype.is_floating_point:
                self.compute_dtype = _less_precise(self.compute_dtype, dtype)

    def _forward_hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            tensor = first_tensor(output)
            if self.tracer.step_label is None:
                return None
            if tensor is None or not tensor.is_floating_point():
                return None
            if self.in_backward:  # a recomputation in backward (activation checkpointing): not recorded
                return self._recomputed(path, output, tensor)
            calls = self.calls.get(path, 0)
            self.calls[path] = calls + 1
            name = path if calls == 0 else f"{path}#{calls}"
            key = self.tracer.key("forward", name, "output")
            self.compute_dtype = _less_precise(self.compute_dtype, tensor.dtype)
            perturbed = self.tracer.seen(self.role, key, tensor, self.compute_dtype, replaceable(output))
            if tensor.requires_grad:
                grad_key = self.tracer.key("backward", name, "output grad")
                (perturbed if perturbed is not None else tensor).register_hook(self._grad_hook(grad_key))
            return None if perturbed is None else _replace_first(output, perturbed)

        return hook

    def _recomputed(self, path: str, output: Any, tensor: torch.Tensor) -> Any:
        """A noise run moves the baseline's recomputed output as it moved the original (a not re-entrant
        checkpoint must save as many tensors again, torch checks); nothing is recorded of it."""
        if self.role == "model" or self.tracer.mode != "noise" or not replaceable(output):
            return None
        key = self.tracer.key("forward", path, "output")
        return _replace_first(output, self.tracer._perturb(key, tensor))

    def _grad_hook(self, key: Key) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            self.in_backward = True
            self.compute_dtype = _less_precise(self.compute_dtype, grad.dtype)
            return self.tracer.seen(self.role, key, grad, self.compute_dtype)

        return hook

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


@dataclass
class Tracer:
    """One rank's trace of one run. ``mode``: "trace" records both sides; "noise" records the
    baseline alone, perturbed, and compares it with ``earlier`` (the same rank's trace run)."""

    mode: str = "trace"
    earlier: Tracer | None = None
    seed: int = 0
    model: dict[Key, torch.Tensor] = field(default_factory=dict)
    reference: dict[Key, torch.Tensor] = field(default_factory=dict)
    order: list[Key] = field(default_factory=list)  # the model's keys in execution order
    dtypes: dict[Key, torch.dtype] = field(default_factory=dict)  # the model's dtype of each key
    noise: dict[Key, float] = field(default_factory=dict)
    missing: set[Key] = field(default_factory=set)  # grads the baseline has and the model lacks
    step_label: str | None = None  # None: paused
    rounding: torch.dtype | None = None  # the baseline's own word on what departs (``rounding_dtype``)
    site: Site = field(default_factory=Site)  # where the run is: a crash's place (``tests.kit.judging.crash``)
    structure: dict[str, Any] | None = None  # the first difference of params the two sides showed (``crash``)
    _sides: list[_Side] = field(default_factory=list, repr=False)
    _generator: torch.Generator | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "noise" and self.earlier is None:
            raise ValueError("a noise run needs the earlier trace run of this rank (earlier=)")
        # the perturbation's own generator: the global RNG (dropout, data) stays as the case seeds it
        self._generator = torch.Generator().manual_seed(self.seed)

    # -- attaching -----------------------------------------------------------------------------
    def attach(self, model: nn.Module, reference: Any) -> None:
        """Hook the model under test (trace runs) and the baseline's module (both runs)."""
        self.rounding = rounding_dtype(reference)
        if self.mode == "trace" and isinstance(model, nn.Module):
            self._sides.append(_Side(self, model, "model"))
        baseline = traced_module(reference)
        if baseline is not None:
            self._sides.append(_Side(self, baseline, "reference"))

    def detach(self) -> None:
        for side in self._sides:
            side.detach()
        self._sides.clear()

    def begin(self, label: str | None) -> None:
        """A new step (or micro-batch) starts: forward call counts restart; None pauses the trace
        (steps the baseline does not take alike)."""
        self.step_label = self.site.step = label
        self.site.at("forward")
        for side in self._sides:
            side.begin()

    def key(self, phase: str, module: str, tensor: str) -> Key:
        return Key(self.step_label or "", phase, module, tensor)

    # -- recording -----------------------------------------------------------------------------
    def seen(
        self, role: str, key: Key, tensor: torch.Tensor, compute_dtype: torch.dtype, replace: bool = True
    ) -> torch.Tensor | None:
        """Record what one side saw at ``key``, computed in ``compute_dtype``; in a noise run, return
        the baseline's tensor moved by one rounding of the model's compute dtype there (None: leave
        it as it is, and where it cannot be ``replace``d)."""
        if role == "model":
            if key not in self.model:
                self.order.append(key)
            self.dtypes[key] = self.rounding or compute_dtype
            self.model[key] = _snapshot(tensor)
            return None
        if self.mode == "trace":
            self.reference[key] = _snapshot(tensor)
            return None
        perturbed = self._perturb(key, tensor) if replace else tensor
        self._measure_noise(key, perturbed)
        return perturbed if replace else None

    def _perturb(self, key: Key, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` with every element moved by ``DIAGNOSIS.perturbation`` roundings of the model's
        compute dtype at ``key`` (of the tensor's own dtype where the trace run has no such key), sign
        at random."""
        dtype = self.earlier.dtypes.get(key, tensor.dtype) if self.earlier else tensor.dtype
        eps = torch.finfo(dtype).eps * DIAGNOSIS.perturbation
        signs = torch.randint(0, 2, tensor.shape, generator=self._generator).to(tensor.device) * 2 - 1
        return tensor * (1 + eps * signs.to(tensor.dtype))

    def _measure_noise(self, key: Key, tensor: torch.Tensor) -> None:
        if self.earlier is not None and key in self.earlier.reference:
            self.noise[key] = relative_error(_snapshot(tensor), self.earlier.reference[key])

    def grads(self, model_params: Mapping[str, Any], reference_params: Mapping[str, Any]) -> None:
        """The reduction phase: every param's grad as the implementation left it, beside the
        baseline's (collective: every rank calls, in one order)."""
        self._params("reduction", model_params, reference_params, grads=True)

    def params(self, model_params: Mapping[str, Any], reference_params: Mapping[str, Any]) -> None:
        """The optimizer phase: every param after the step (collective)."""
        self._params("optimizer", model_params, reference_params, grads=False)

    def _params(self, phase: str, ours: Mapping[str, Any], refs: Mapping[str, Any], grads: bool) -> None:
        if self.step_label is None:
            return
        for name in sorted(refs):
            module, _, leaf = name.rpartition(".")
            key = self.key(phase, module, f"{leaf}.grad" if grads else leaf)
            ref = refs[name].grad if grads else refs[name]
            if self.mode == "trace" and name in ours:
                mine = ours[name].grad if grads else ours[name]
                if mine is not None:
                    self.seen("model", key, mine, self._step_compute_dtype(mine.dtype))
                elif ref is not None:  # a grad that never landed: a divergence, not a gap in the trace
                    self.missing.add(key)
                    self.seen("model", key, torch.zeros(()), self._step_compute_dtype(ref.dtype))
            if ref is not None:
                if self.mode == "trace":
                    self.reference[key] = _snapshot(ref)
                else:
                    self._measure_noise(key, ref)

    def _step_compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """A grad's or param's rounding: its own dtype's, or the model's compute dtype of the step."""
        for side in self._sides:
            if side.role == "model":
                dtype = _less_precise(dtype, side.compute_dtype)
        return dtype

    # -- handing a trace run to a noise run on other engines ------------------------------------
    def state(self) -> dict[str, Any]:
        """What a noise run reads of this trace run: the baseline's tensors and the model's order and
        dtypes (small for the plan's models; only shipped where engines are renewed between runs)."""
        return {"reference": dict(self.reference), "order": list(self.order), "dtypes": dict(self.dtypes)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Tracer:
        earlier = cls("trace")
        earlier.reference, earlier.order, earlier.dtypes = state["reference"], state["order"], state["dtypes"]
        return earlier

    # -- what a run reports --------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """One row per key the model recorded, in execution order: its error against the baseline
        (trace runs) or the baseline's noise (noise runs); None where the two sides cannot be compared."""
        if self.mode == "noise":
            keys = self.earlier.order if self.earlier else []
            return [_row(k, noise=self.noise.get(k)) for k in keys]
        rank, world = _rank_and_world()
        rows, scales = [], {}
        for key in self.order:
            ref = self.reference.get(key)
            mine = self.model[key]
            if key in self.missing:  # the baseline's grad is there, the model's never landed
                rows.append(_row(key, error=math.inf, dtype=str(self.dtypes[key]).removeprefix("torch.")))
                continue
            ref = None if ref is None else aligned(mine, ref, rank, world)
            if ref is not None and key.phase == "backward" and ref is not self.reference[key]:
                # the baseline saw the whole batch: its output grads carry the loss's scale over the
                # whole batch, which the loss function decides, not the implementation; fitted once
                # a step, at the first output grad backward reaches (the loss's own input)
                ref = ref * scales.setdefault(key.step, _fitted_scale(mine, ref))
            error = None if ref is None else relative_error(mine, ref)
            rows.append(_row(key, error=error, dtype=str(self.dtypes[key]).removeprefix("torch.")))
        return rows

    def tensor(self, text: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the model's, the baseline's) tensor at a key, by its text (``Key.text``): for ``%%px``."""
        for key in self.order:
            if key.text() == text:
                return self.model.get(key), self.reference.get(key)
        raise KeyError(f"no traced tensor {text!r}; e.g. {[k.text() for k in self.order[:3]]}")


def _row(key: Key, **values: Any) -> dict[str, Any]:
    return {"step": key.step, "phase": key.phase, "module": key.module, "tensor": key.tensor, **values}


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def aligned(mine: torch.Tensor, ref: torch.Tensor, rank: int, world: int) -> torch.Tensor | None:
    """The baseline's tensor as the model's rank sees it: itself where shapes match; where the
    baseline saw the whole batch (every rank's rows, in rank order), this rank's rows; None where
    nothing lines up."""
    if mine.shape == ref.shape:
        return ref
    if mine.dim() == 0 or mine.shape[1:] != ref.shape[1:] or ref.shape[0] != mine.shape[0] * world:
        return None
    return ref[rank * mine.shape[0] : (rank + 1) * mine.shape[0]]


def _fitted_scale(mine: torch.Tensor, ref: torch.Tensor) -> float:
    """The factor that takes ``ref`` nearest to ``mine`` (least squares); 1 where ``ref`` is zero."""
    a, b = mine.double(), ref.double()
    norm = float((b * b).sum())
    return float((a * b).sum()) / norm if norm > 0 else 1.0


def relative_error(measured: torch.Tensor, reference: torch.Tensor) -> float:
    """``|measured - reference| / |reference|`` in the Frobenius norm, in float64 (an exact zero
    reference: the measured tensor's own norm; inf where either side is not finite)."""
    a, b = measured.detach().double().cpu(), reference.detach().double().cpu()
    if a.shape != b.shape:
        return math.inf
    difference = torch.linalg.vector_norm(a - b).item()
    scale = torch.linalg.vector_norm(b).item()
    if not math.isfinite(difference) or not math.isfinite(scale):
        return math.inf
    if difference == 0.0:
        return 0.0
    return difference / scale if scale > 0 else math.inf
