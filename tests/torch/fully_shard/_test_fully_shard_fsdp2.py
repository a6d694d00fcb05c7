"""Extra L0 cases L0-FSDP2-*, beyond the plan: FSDP2's usages as torch 2.13 users call them, one case
per usage (deferred init on the meta device, ``reset_parameters`` of sharded modules, an int
``reshard_after_forward``, ``module.to(dtype)``, ``register_fsdp_forward_method``, the all-reduce
hook, ``set_unshard_in_backward``, the gradient divide / scaling factors and force-sum reduction).
Each trains a small model against DDP for two steps or more, on 2 ranks (the int reshard: 4; HSDP: 2x2).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.nn import functional as F  # noqa: N812 - torch's own alias

from tests.kit.case import CaseContext, case
from tests.kit.checks import device_type, raised
from tests.kit.devices import compute_device
from tests.kit.layout import local_numels_after_forward, padded_shard_numel
from tests.kit.models import DIMS, MLP, rank_batches, rank_tokens
from tests.kit.recorder import CollectiveRecorder, record_collectives
from tests.kit.reference import ddp_of, named_params
from tests.kit.surface import impl
from tests.kit.training import (
    differs_across_ranks,
    raises_nothing,
    shard_nested,
    sharded_modules,
    shared_tmpdir,
    square_mean,
    train_against,
)

LossFn = Callable[[Any, Any], torch.Tensor]
STEPS = 2


def _batches(ctx: CaseContext, steps: int = STEPS) -> list[torch.Tensor]:
    """This rank's float batches for the MLP, required to differ between ranks (else grads agree by accident)."""
    batches = rank_batches(ctx.rank, (4, DIMS[0]), steps=steps)
    ctx.require("the ranks' batches differ", differs_across_ranks(batches[0]))
    return batches


def _refused_with(ctx: CaseContext, name: str, call: Callable[[], Any], kind: type[BaseException]) -> None:
    """Check that ``call`` raises ``kind`` (FSDP2's error for it)."""
    error = raised(call)
    ctx.true(f"{name}: refused with {kind.__name__}", isinstance(error, kind), repr(error)[:160], kind.__name__)


def _scale_grads(model: Any, factor: float) -> None:
    """Multiply every grad of ``model`` (a reference) by ``factor`` in place."""
    for param in named_params(model).values():
        if param.grad is not None:
            param.grad.mul_(factor)


def _require_factor_changes_grads(ctx: CaseContext, reference: Any, factor: float) -> None:
    """Precondition: scaling the reference's grads by ``factor`` moves some grad by more than the tolerance."""
    moved = max(float((p.grad * (factor - 1)).abs().max()) for p in named_params(reference).values())
    ctx.require(f"a factor of {factor:g} changes the grads beyond the tolerance", moved > ctx.tol.grad, f"{moved:.3g}")


def _scaled_reference(ctx: CaseContext, reference: Any, factors: Sequence[float]) -> Callable[[int], None]:
    """An ``after_backward`` that scales the reference's grads of step ``i`` by ``factors[i]`` (what the
    model's setting promises), after checking at the first step that the factor matters."""

    def scale(step: int) -> None:
        if step == 0:
            _require_factor_changes_grads(ctx, reference, factors[0])
        _scale_grads(reference, factors[step])

    return scale


class BackwardRecorder:
    """A ``model_step`` for ``train_against``: the loss, then its backward with the collectives of the
    backward alone recorded (one recorder per step in ``steps``)."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self.steps: list[CollectiveRecorder] = []

    def __call__(self, model: Any, batch: Any) -> torch.Tensor:
        loss = self.loss_fn(model, batch)
        with record_collectives() as recorder:
            loss.backward()
        self.steps.append(recorder)
        return loss


# -- deferred init -------------------------------------------------------------------------------
def _deferred_mlp(mesh: Any) -> MLP:
    """The MLP built on the meta device, sharded (nested), then materialised empty on this rank's device."""
    with torch.device("meta"):
        model = MLP(DIMS)
    shard_nested(model, model.layers, mesh=mesh)
    model.to_empty(device=compute_device())
    return model


def _check_materialised(ctx: CaseContext, label: str, model: nn.Module) -> None:
    """Every param is sharded and held on this rank's device, none left on the meta device."""
    device = compute_device().type
    for name, param in model.named_parameters():
        local = impl.local(param)
        ctx.true(f"{label}: {name} is sharded", impl.is_sharded(param), type(param).__name__, "sharded")
        on_device = not param.is_meta and not local.is_meta and local.device.type == device
        ctx.true(f"{label}: {name} materialised on {device}", on_device, str(local.device), device)


def _poison(model: nn.Module) -> None:
    """NaN into every param, so a load that leaves one untouched cannot pass by the memory's luck."""
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))


def _check_values(ctx: CaseContext, label: str, model: nn.Module, expected: nn.Module) -> None:
    """Every param's whole value equals ``expected``'s, bitwise (a load copies)."""
    ours = named_params(model)
    for name, param in named_params(expected).items():
        ctx.equal(f"{label}: {name} = the reference's", ours[name], param)


def _full_load(ctx: CaseContext) -> None:
    """Rank 0's full state dict broadcast into the deferred model, which then trains like DDP."""
    template = MLP(DIMS)
    ddp = ddp_of(template)
    model = _deferred_mlp(ctx.mesh)
    _check_materialised(ctx, "after to_empty", model)
    _poison(model)
    full = template.state_dict() if ctx.rank == 0 else {}  # the other ranks receive rank 0's
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    _check_materialised(ctx, "full load", model)
    _check_values(ctx, "full load", model, template)
    train_against(ctx, model, ddp, _batches(ctx), square_mean, ctx.tol, label="full load")


def _sharded_load(ctx: CaseContext) -> None:
    """A DCP checkpoint of a normally built sharded model loaded into the deferred one; trains like DDP."""
    source = MLP(DIMS, seed=5)
    ddp = ddp_of(source)
    shard_nested(source, source.layers, mesh=ctx.mesh)
    model = _deferred_mlp(ctx.mesh)
    _poison(model)
    with shared_tmpdir() as path:
        dcp.save(get_model_state_dict(source), checkpoint_id=path)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)
    _check_materialised(ctx, "sharded load", model)
    _check_values(ctx, "sharded load", model, ddp.module)
    train_against(ctx, model, ddp, _batches(ctx), square_mean, ctx.tol, label="sharded load")


@case(
    "L0-FSDP2-deferred_init",
    "test_fsdp2_deferred_init",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("deferred_init",),
)
def deferred_init(ctx: CaseContext) -> None:
    """An MLP built on the meta device, sharded, to_empty'd: every param sharded on this rank's device;
    rank 0's full state dict (set_model_state_dict, broadcast_from_rank0) and a DCP checkpoint of a
    sharded model load bitwise, and each trains like DDP."""
    _full_load(ctx)
    ctx.run_part("sharded load (dcp.save of a sharded model, dcp.load)", ("dcp",), lambda: _sharded_load(ctx))


# -- reset_parameters ----------------------------------------------------------------------------
def _init_bound(module: nn.Linear) -> float:
    """nn.Linear's init draws weight and bias from U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return 1 / math.sqrt(module.in_features)


# torch.distributed.tensor._random.is_rng_supported_mesh: DTensor's random ops keep one stream over
# the shards only on accelerators; on the CPU each rank draws its shard from its own generator
CPU_DRAWS = (
    "the ranks' shards differ: not judged on the CPU, where torch's DTensor random ops draw each shard "
    "from the rank's own generator (one seed: the same values on every rank)"
)


def _check_random_init(ctx: CaseContext, model: MLP) -> None:
    """Each param: finite, not all zero, within nn.Linear's bound, its shards not copies of each other."""
    for i, layer in enumerate(model.layers):
        for kind, param in (("weight", layer.weight), ("bias", layer.bias)):
            name, whole = f"layers.{i}.{kind}", impl.full(param).detach()
            ctx.true(f"{name}: sharded", impl.is_sharded(param), type(param).__name__, "sharded")
            ctx.true(f"{name}: finite", bool(torch.isfinite(whole).all()))
            ctx.true(f"{name}: not all zero", bool(whole.abs().max() > 0), float(whole.abs().max()), "> 0")
            ctx.at_most(f"{name}: |value| <= 1/sqrt(fan_in)", whole.abs().max(), _init_bound(layer))
            if device_type() != "cpu":
                shard = impl.local(param).detach()
                ctx.true(f"{name}: the ranks' shards differ (not one draw each)", differs_across_ranks(shard))
    if device_type() == "cpu":
        ctx.notes.append(CPU_DRAWS)


def _full_copy(model: MLP) -> MLP:
    """A plain MLP holding the sharded model's whole values."""
    copy_ = MLP(DIMS)
    ours = named_params(model)
    with torch.no_grad():
        for name, param in copy_.named_parameters():
            param.copy_(impl.full(ours[name]))
    return copy_


@case(
    "L0-FSDP2-reset_parameters",
    "test_fsdp2_reset_parameters",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("deferred_init", "reset_parameters"),
)
def reset_parameters(ctx: CaseContext) -> None:
    """reset_parameters() of each Linear of a meta-built, sharded, to_empty'd MLP runs on the sharded
    params: finite, not zero, within nn.Linear's bound, a different draw on each shard (judged on an
    accelerator only: on the CPU torch's DTensor draws every shard from the same seed); then it trains
    like DDP started from its whole values."""
    model = _deferred_mlp(ctx.mesh)
    _poison(model)
    reset = raises_nothing(
        ctx, "reset_parameters() of every Linear", lambda: [m.reset_parameters() for m in model.layers]
    )
    if reset is None:
        return
    _check_random_init(ctx, model)
    ddp = ddp_of(_full_copy(model))
    train_against(ctx, model, ddp, _batches(ctx), square_mean, ctx.tol)


# -- reshard_after_forward as an int -------------------------------------------------------------
def _sharded_with(ctx: CaseContext, reshard: int) -> tuple[MLP, list[dict[str, int]]]:
    """An MLP sharded (nested) with ``reshard_after_forward=reshard``, and the local numels of its params
    after each forward (filled as it runs)."""
    model = MLP(DIMS)
    shard_nested(model, model.layers, mesh=ctx.mesh, reshard_after_forward=reshard)
    return model, local_numels_after_forward(model)


def _check_kept_after_forward(ctx: CaseContext, label: str, seen: dict[str, int], share: int) -> None:
    """After forward each param holds ``1/share`` of its elements (1: the whole param)."""
    for name, param in MLP(DIMS).named_parameters():
        ctx.equal(f"{label}: {name} local numel after forward = 1/{share}", seen.get(name), param.numel() // share)


def _check_backward_gathers(ctx: CaseContext, label: str, recorder: CollectiveRecorder, group: int) -> None:
    """The backward re-gathers every param over groups of ``group`` ranks, each rank giving 1/group."""
    gathers = recorder.of("all_gather")
    sizes = sorted({call.group_size for call in gathers})
    total = sum(p.numel() for p in MLP(DIMS).parameters())
    ctx.true(f"{label}: backward all-gathers run", bool(gathers), len(gathers), ">= 1")
    ctx.equal(f"{label}: backward all-gather group sizes", str(sizes), str([group]))
    ctx.equal(f"{label}: elements this rank gives in backward", sum(c.numel for c in gathers), total // group)


def _int_one_and_world(ctx: CaseContext, batch: torch.Tensor) -> None:
    """1 keeps whole params after forward with no all-gather in backward (False); the shard dim's size
    keeps 1/world and gathers over all its ranks (True): one forward and backward each."""
    world = ctx.world_size
    for reshard, share, gathers in ((1, 1, False), (world, world, True)):
        label = f"reshard_after_forward={reshard} (int, as {gathers})"
        model, seen = _sharded_with(ctx, reshard)
        step = BackwardRecorder(square_mean)
        step(model, batch)
        _check_kept_after_forward(ctx, label, seen[0], share)
        if gathers:
            _check_backward_gathers(ctx, label, step.steps[0], world)
        else:
            ctx.equal(f"{label}: no all-gather in backward", len(step.steps[0].of("all_gather")), 0)


@case(
    "L0-FSDP2-reshard_int",
    "test_fsdp2_reshard_int",
    world_size=4,
    mesh={"dp": 4},
    config="FSDP 1D fp32",
    needs=("reshard_int",),
)
def reshard_int(ctx: CaseContext) -> None:
    """reshard_after_forward=2 on 4 ranks: after forward each param keeps a 1/2 share, backward gathers
    over groups of 2 ranks, training equals DDP; 1 acts as False, 4 as True; 3 (no divisor) is a
    ValueError."""
    k = 2
    ddp = ddp_of(MLP(DIMS))
    model, seen = _sharded_with(ctx, k)
    step, batches = BackwardRecorder(square_mean), _batches(ctx)
    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, model_step=step)
    for i in range(STEPS):
        _check_kept_after_forward(ctx, f"step {i}", seen[i], k)
        _check_backward_gathers(ctx, f"step {i}", step.steps[i], k)
    _int_one_and_world(ctx, batches[0])
    _refused_with(
        ctx,
        "reshard_after_forward=3 (not a divisor of 4)",
        lambda: impl.fully_shard(MLP(DIMS), mesh=ctx.mesh, reshard_after_forward=3),
        ValueError,
    )


# -- module.to(dtype) ----------------------------------------------------------------------------
def _square_mean_as_is(model: Any, x: Any) -> torch.Tensor:
    """Mean of the squared output in the output's own dtype (float64 stays float64)."""
    return model(x).square().mean()


def _check_dtype(ctx: CaseContext, label: str, tensors: Iterable[tuple[str, torch.Tensor | None]]) -> None:
    """Each tensor is sharded and float64, as is what this rank holds of it."""
    for name, tensor in tensors:
        if tensor is None:
            ctx.true(f"{label}: {name} present", False, "None", "a tensor")
            continue
        dtypes = f"{tensor.dtype} / local {impl.local(tensor).dtype}"
        ctx.true(f"{label}: {name} sharded", impl.is_sharded(tensor), type(tensor).__name__, "sharded")
        ctx.equal(f"{label}: {name} dtype", dtypes, "torch.float64 / local torch.float64")


def _double_method(ctx: CaseContext) -> None:
    """``.double()`` of another sharded MLP: float64 sharded params holding the same values."""
    model = MLP(DIMS)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    model.double()
    _check_dtype(ctx, ".double()", model.named_parameters())
    _check_values(ctx, ".double()", model, MLP(DIMS).double())


@case(
    "L0-FSDP2-to_dtype",
    "test_fsdp2_to_dtype",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("to_dtype",),
)
def to_dtype(ctx: CaseContext) -> None:
    """model.to(torch.float64) after sharding: params and grads sharded float64, training in float64 equals
    a float64 DDP; .double() the same."""
    ddp = ddp_of(MLP(DIMS).double())
    model = MLP(DIMS)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    model.to(torch.float64)
    _check_dtype(ctx, "after .to(float64)", model.named_parameters())

    def grads_double(step: int) -> None:
        _check_dtype(ctx, f"step {step} grads", ((n, p.grad) for n, p in model.named_parameters()))

    batches = [batch.double() for batch in _batches(ctx)]
    train_against(ctx, model, ddp, batches, _square_mean_as_is, ctx.tol, after_backward=grads_double)
    _double_method(ctx)


# -- register_fsdp_forward_method ----------------------------------------------------------------
class GeneratingMLP(MLP):
    """An MLP with a second entry point: ``generate`` computes like forward, on its own params directly
    (functional linears, no child module's call), so only the root's forward hooks can unshard them."""

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = F.linear(x, layer.weight, layer.bias)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def _generate_step(model: Any, batch: torch.Tensor) -> torch.Tensor:
    """The model's step through ``generate`` instead of forward."""
    loss = model.generate(batch).square().mean()
    loss.backward()
    return loss


def _generating_ddp() -> Any:
    """DDP over a GeneratingMLP whose forward is its generate: DDP's own forward runs the same method."""
    module = GeneratingMLP(DIMS)
    module.forward = module.generate
    return ddp_of(module)


def _check_no_op_unsharded(ctx: CaseContext) -> None:
    """On a module never given to fully_shard the registration changes nothing."""
    plain = GeneratingMLP(DIMS)
    error = raised(lambda: impl.register_fsdp_forward_method(plain, "generate"))
    ctx.true("unsharded module: registration raises nothing", error is None, repr(error)[:160], "None")
    unchanged = "generate" not in vars(plain) and plain.generate.__func__ is GeneratingMLP.generate
    ctx.true("unsharded module: generate unchanged", unchanged)


@case(
    "L0-FSDP2-forward_method",
    "test_fsdp2_forward_method",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("forward_method",),
)
def forward_method(ctx: CaseContext) -> None:
    """register_fsdp_forward_method(model, "generate") on a sharded model: training through generate
    equals DDP running generate; on an unsharded module it is a no-op; a missing method is a ValueError."""
    model = GeneratingMLP(DIMS)
    ddp = _generating_ddp()
    impl.fully_shard(model, mesh=ctx.mesh)
    impl.register_fsdp_forward_method(model, "generate")
    train_against(ctx, model, ddp, _batches(ctx), square_mean, ctx.tol, model_step=_generate_step)
    _check_no_op_unsharded(ctx)
    missing = lambda: impl.register_fsdp_forward_method(model, "no_such_method")  # noqa: E731
    _refused_with(ctx, "a method the module lacks", missing, ValueError)


# -- all-reduce hook (HSDP) ----------------------------------------------------------------------
def _scaling_hook(calls: Counter, name: str, sizes: dict[str, list[int]], scale: float) -> Callable:
    """A hook counting its calls and the sizes it saw under ``name``, scaling the reduced grads in place."""

    def hook(output: torch.Tensor) -> None:
        calls[name] += 1
        sizes.setdefault(name, []).append(output.numel())
        output.mul_(scale)

    return hook


@case(
    "L0-FSDP2-all_reduce_hook",
    "test_fsdp2_all_reduce_hook",
    world_size=4,
    mesh={"replicate": 2, "shard": 2},
    config="HSDP 2D fp32",
    needs=("hsdp", "all_reduce_hook"),
)
def all_reduce_hook(ctx: CaseContext) -> None:
    """HSDP 2x2, set_all_reduce_hook on each group scaling its reduced grads by 0.5 in place: called once
    per group per backward, grads and training equal DDP's grads times 0.5."""
    scale = 0.5
    ddp = ddp_of(MLP(DIMS))
    model = MLP(DIMS)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    calls, sizes = Counter(), {}
    names = [f"layers.{i}" for i in range(len(model.layers))]
    for name, layer in zip(names, model.layers, strict=True):
        layer.set_all_reduce_hook(_scaling_hook(calls, name, sizes, scale))
    scale_reference = _scaled_reference(ctx, ddp, [scale] * STEPS)

    def after_backward(step: int) -> None:
        for name in names:
            ctx.equal(f"step {step}: {name} hook calls so far", calls[name], step + 1)
        scale_reference(step)

    train_against(ctx, model, ddp, _batches(ctx), square_mean, ctx.tol, after_backward=after_backward)
    with ctx.extra("FSDP2 hands the hook the group's flat reduced shard (one tensor per group)"):
        for name, layer in zip(names, MLP(DIMS).layers, strict=True):
            expected = padded_shard_numel(layer, ctx.case.mesh["shard"])
            ctx.equal(f"{name}: elements the hook saw", str(sizes.get(name)), str([expected] * STEPS))


# -- set_unshard_in_backward ---------------------------------------------------------------------
VOCAB = 12  # embedding rows: 6 per rank; its shard (6 x 8 = 48 elements) differs from every layer's


class EmbeddingMLP(nn.Module):
    """Token embedding, then the MLP: the embedding's weight is not needed by its own backward."""

    def __init__(self, seed: int = 9) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIMS[0])
        self.mlp = MLP(DIMS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(tokens))


def _gathered(recorder: CollectiveRecorder, numel: int) -> int:
    """All-gathers of ``numel`` elements from this rank (one group's, told apart by its shard size)."""
    return sum(1 for call in recorder.of("all_gather") if call.numel == numel)


@case(
    "L0-FSDP2-unshard_in_backward",
    "test_fsdp2_unshard_in_backward",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("unshard_in_backward",),
)
def unshard_in_backward(ctx: CaseContext) -> None:
    """An embedding sharded as its own group: by default it is all-gathered again in backward; after
    set_unshard_in_backward(False) it is not (the other groups still are), and training equals DDP."""
    model = EmbeddingMLP()
    ddp = ddp_of(model)
    impl.fully_shard(model.embed, mesh=ctx.mesh)
    shard_nested(model, model.mlp.layers, mesh=ctx.mesh)
    embed_numel = padded_shard_numel(model.embed, ctx.world_size)
    batches = [rank_tokens(step, ctx.rank, (6,), VOCAB) for step in range(3)]
    ctx.require("the ranks' tokens differ", differs_across_ranks(batches[0]))
    step = BackwardRecorder(square_mean)

    def before_step(i: int) -> None:
        model.embed.set_unshard_in_backward(i == 0)  # step 0: the default, the control

    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, model_step=step, before_step=before_step)
    ctx.require("by default the embedding is all-gathered in backward", _gathered(step.steps[0], embed_numel) == 1)
    layers = [padded_shard_numel(layer, ctx.world_size) for layer in model.mlp.layers]
    for i in (1, 2):
        ctx.equal(f"step {i}: embedding all-gathers in backward", _gathered(step.steps[i], embed_numel), 0)
        others = [_gathered(step.steps[i], numel) for numel in layers]
        ctx.true(f"step {i}: the other groups are all-gathered in backward", all(others), str(others), "each >= 1")


# -- gradient divide factor, force-sum reduction, gradient scaling factor ------------------------
def _train_with(
    ctx: CaseContext, label: str, setting: Callable[[nn.Module, int], None], factors: Sequence[float]
) -> None:
    """An MLP sharded (nested), ``setting(module, step)`` applied to every sharded module before each
    step, trained against DDP whose grads of step ``i`` are scaled by ``factors[i]``."""
    model, ddp = MLP(DIMS), ddp_of(MLP(DIMS))
    shard_nested(model, model.layers, mesh=ctx.mesh)

    def before_step(step: int) -> None:
        for module in sharded_modules(model):
            setting(module, step)

    after = _scaled_reference(ctx, ddp, factors) if any(f != 1 for f in factors) else None
    batches = _batches(ctx, steps=len(factors))
    train_against(
        ctx, model, ddp, batches, square_mean, ctx.tol, label=label, before_step=before_step, after_backward=after
    )


def _divide_factor(ctx: CaseContext, factor: float, force_sum: bool | None) -> None:
    """set_gradient_divide_factor(factor) (and force-sum if given): grads = DDP's x world / factor."""

    def setting(module: nn.Module, step: int) -> None:
        if factor:
            module.set_gradient_divide_factor(factor)
        if force_sum is not None:
            module.set_force_sum_reduction_for_comms(force_sum)

    label = f"divide factor {factor:g}" if factor else "no divide factor"
    label += ", force-sum" if force_sum else ""
    _train_with(ctx, label, setting, [ctx.world_size / factor if factor else 1.0] * STEPS)


SCALES: list[Any] = [0.5, torch.tensor(0.25), None]  # a float, a one-element tensor, then off


def _scaling_factor(ctx: CaseContext) -> None:
    """set_gradient_scaling_factor: grads = DDP's x s per step (None: unscaled); a bool, a string or a
    tensor of two elements is a ValueError."""

    def setting(module: nn.Module, step: int) -> None:
        module.set_gradient_scaling_factor(SCALES[step])

    factors = [1.0 if s is None else float(s) for s in SCALES]
    _train_with(ctx, "scaling factor 0.5, tensor(0.25), None", setting, factors)
    model = MLP(DIMS)
    impl.fully_shard(model, mesh=ctx.mesh)
    for bad in (True, "2", torch.ones(2)):
        name = f"set_gradient_scaling_factor({bad!r})"
        _refused_with(ctx, name, lambda bad=bad: model.set_gradient_scaling_factor(bad), ValueError)


@case(
    "L0-FSDP2-divide_factor",
    "test_fsdp2_divide_factor",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
)
def divide_factor(ctx: CaseContext) -> None:
    """Gradient factors, each part needing its own feature: set_gradient_divide_factor(8) gives DDP's grads
    x 2/8, force-sum alone DDP's grads, force-sum with the factor DDP's x 2/8, set_gradient_scaling_factor(s)
    DDP's x s (None: off; bad values a ValueError); each trains like its scaled DDP."""
    factor = 8.0
    ctx.run_part(
        "set_gradient_divide_factor(8)", ("gradient_divide_factor",), lambda: _divide_factor(ctx, factor, None)
    )
    ctx.run_part("force-sum reduction", ("force_sum_reduction",), lambda: _divide_factor(ctx, 0.0, True))
    ctx.run_part(
        "force-sum with set_gradient_divide_factor(8)",
        ("force_sum_reduction", "gradient_divide_factor"),
        lambda: _divide_factor(ctx, factor, True),
    )
    ctx.run_part("set_gradient_scaling_factor", ("gradient_scaling_factor",), lambda: _scaling_factor(ctx))
