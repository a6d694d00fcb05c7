"""Rank bodies of the engine's mixed-precision tests: the policy combinations no plan case trains,
judged against ``SameDtypeReference`` (same compute dtype, explicit reduction in the reduce dtype)
through the kit's checks."""

from __future__ import annotations

import torch
from torch import nn

from tests.engine._checks import check_step_collectives
from tests.kit.judging.checks import StrictChecks
from tests.kit.judging.recorder import CollectiveRecorder
from tests.kit.judging.reference import SameDtypeReference
from tests.kit.judging.surface import impl
from tests.kit.workloads.models import MLP, rank_batch, rank_batches
from tests.kit.workloads.training import (
    named_params,
    shard_nested,
    square_mean,
    train_accumulating_against,
    train_against,
)

DIMS = (7, 13, 5, 3)
STEPS = 3
BF16 = "FSDP 1D bf16"  # the half-precision compute row; the matrix has no HSDP bf16 row


def _dtypes(dtypes: set[torch.dtype]) -> str:
    return str(sorted(str(d) for d in dtypes))


def _grads_sharded_fp32(checks: StrictChecks, where: str, model: nn.Module) -> None:
    for name, param in named_params(model).items():
        grad = param.grad
        checks.true(f"{where} grad {name} sharded", grad is not None and impl.is_sharded(grad), type(grad).__name__)
        checks.equal(f"{where} grad {name} dtype", str(grad.dtype), str(torch.float32))


def mixed_precision_matches_reference(mesh: dict[str, int], comm_fusion: bool = True) -> None:
    """bf16/fp32 on ``mesh``: layer 0 computes with bf16 params on bf16 inputs, the output is bf16,
    all-gathers run in bf16 and every reduction (reduce-scatter, the replicas' all-reduce) in fp32,
    one per group or per param; grads are fp32 DTensors, masters stay fp32; 3 steps = reference."""
    checks = StrictChecks(BF16, **mesh)
    policy = impl.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    model = MLP(DIMS)
    reference = SameDtypeReference(model, torch.bfloat16, torch.float32)
    shard_nested(model, model.layers, mesh=checks.mesh, mp_policy=policy, comm_fusion=comm_fusion)
    seen: dict[str, set[torch.dtype]] = {"input": set(), "compute param": set(), "output": set()}

    def pre_forward(module: nn.Module, args: tuple) -> None:  # registered after fully_shard's
        seen["input"].add(args[0].dtype)
        seen["compute param"].add(module.weight.dtype)

    model.layers[0].register_forward_pre_hook(pre_forward)
    model.register_forward_hook(lambda module, args, out: seen["output"].add(out.dtype))
    recorders: list[CollectiveRecorder] = []
    batches = rank_batches(checks.rank, (4, DIMS[0]), steps=STEPS)
    train_against(
        checks,
        model,
        reference,
        batches,
        square_mean,
        checks.tol,
        recorders=recorders,
        after_backward=lambda step: _grads_sharded_fp32(checks, f"step {step}", model),
    )
    for what, dtypes in seen.items():
        checks.equal(f"{what} dtype", _dtypes(dtypes), _dtypes({torch.bfloat16}))
    checks.equal(
        "sharded (master) param dtype", _dtypes({p.dtype for p in model.parameters()}), _dtypes({torch.float32})
    )
    counts = [len(list(layer.parameters())) for layer in model.layers]
    check_step_collectives(checks, recorders, mesh, counts, 0, comm_fusion, torch.bfloat16, torch.float32)


MICRO_BATCHES = 3
SCALE = 4.0  # inputs scaled so the accumulated grads are large enough to tell fp32 from bf16


def mixed_precision_accumulation() -> None:
    """bf16/fp32 without main grad: micro-batch grads held back unreduced (set_requires_gradient_sync
    False) accumulate, then one fp32 reduction: grads and params of 2 steps = the reference that
    accumulates its unreduced grads in fp32. The accumulated grads are not bf16-representable
    within the tolerance, so holding them in bf16 would fail."""
    checks = StrictChecks(BF16)
    policy = impl.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    model = MLP(DIMS)
    reference = SameDtypeReference(model, torch.bfloat16, torch.float32)
    shard_nested(model, model.layers, mesh=checks.mesh, mp_policy=policy)

    def after_micro(step: int, micro: int, rec: CollectiveRecorder) -> None:
        where = f"step {step} micro {micro}"
        if micro < MICRO_BATCHES - 1:
            checks.equal(f"{where} reductions (held back)", len(rec.of("reduce_scatter") + rec.of("all_reduce")), 0)
            return
        reductions = {c.dtype for c in rec.of("reduce_scatter")}
        checks.equal(f"{where} reduce-scatter dtype", _dtypes(reductions), _dtypes({torch.float32}))
        _grads_sharded_fp32(checks, where, model)
        grads = [p.grad for p in reference.parameters()]
        off_bf16 = max((g - g.bfloat16().float()).abs().max().item() for g in grads)
        checks.require(
            f"{where}: the accumulated grads are off the bf16 grid by more than the tolerance",
            off_bf16 > checks.tol.grad,
            f"{off_bf16:.2e}",
        )

    step_batches = [
        [x * SCALE for x in rank_batches(checks.rank, (4, DIMS[0]), MICRO_BATCHES, first=10 * step)]
        for step in range(2)
    ]
    train_accumulating_against(
        checks,
        model,
        reference,
        step_batches,
        square_mean,
        checks.tol,
        accumulate=lambda holding: model.set_requires_gradient_sync(not holding),
        after_micro=after_micro,
    )


class _GainedMLP(nn.Module):
    """An MLP whose fp32 output gain stays out of sharding and casting (ignored)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(DIMS)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, DIMS[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x).float() * self.gain


def ignored_params_never_cast() -> None:
    """Under a bf16 policy an ignored param stays the user's plain fp32 tensor during forward, and
    its grad is a plain fp32 tensor; the other params are sharded and compute in bf16."""
    checks = StrictChecks(BF16)
    model = _GainedMLP()
    gain = model.gain
    impl.fully_shard(
        model,
        mesh=checks.mesh,
        mp_policy=impl.MixedPrecisionPolicy(torch.bfloat16, torch.float32),
        ignored_params=[gain],
    )
    seen: list[tuple[torch.dtype, torch.dtype]] = []  # (ignored, managed) param dtypes inside the forward
    model.mlp.register_forward_hook(lambda m, a, out: seen.append((model.gain.dtype, model.mlp.layers[0].weight.dtype)))
    square_mean(model, rank_batch(0, checks.rank, (4, DIMS[0]))).backward()

    checks.equal("param dtypes in forward (ignored, managed)", str(seen), str([(torch.float32, torch.bfloat16)]))
    checks.true("the ignored param is still the user's", model.gain is gain and type(gain) is nn.Parameter)
    checks.true("the ignored param is not sharded", not impl.is_sharded(gain))
    grad = gain.grad
    checks.true("its grad is a plain tensor", grad is not None and not impl.is_sharded(grad), type(grad).__name__)
    checks.equal("its grad dtype", str(grad.dtype), str(torch.float32))
    for name, param in named_params(model.mlp).items():
        checks.true(f"mlp.{name} sharded", impl.is_sharded(param))


def first_grad_kept_in_compute_dtype() -> None:
    """bf16 compute, fp32 reduce: a grad held back unreduced stays bf16 until a second one is added
    (then fp32, the reduce dtype); the reduction casts it as it copies it into its fp32 buffer, so
    no fp32 copy of a bf16 grad lives beside that buffer."""
    from hyper_parallel.platform.torch.fully_shard.state import state_of

    checks = StrictChecks(BF16)
    model = MLP(DIMS)
    policy = impl.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    shard_nested(model, model.layers, mesh=checks.mesh, mp_policy=policy)
    groups = [state.param_group for m in model.modules() if (state := state_of(m)) is not None and state.param_group]
    params = [param for group in groups for param in group.params]
    model.set_requires_gradient_sync(False)
    for micro, want in enumerate((torch.bfloat16, torch.float32)):
        model(rank_batch(micro, checks.rank, (4, DIMS[0]))).sum().backward()
        held = sorted({str(p.unreduced_grad.dtype) for p in params if p.unreduced_grad is not None})
        checks.equal(f"micro-batch {micro}: dtypes of the grads held back", str(held), str([str(want)]))
