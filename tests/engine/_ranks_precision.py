"""Rank bodies of the engine's mixed-precision and offload tests.

Mixed precision is judged against ``SameDtypeReference`` (same compute dtype, explicit
all-reduce in the reduce dtype), fp32 against DDP; dtypes are observed where they matter:
compute params, module inputs and outputs, the tensors actually communicated, grads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tests.kit.api import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests.kit.models import MLP, Checkpointed, rank_batch
from tests.kit.recorder import record_collectives
from tests.kit.reference import SameDtypeReference, assert_close, assert_params_close, ddp_of
from tests.kit.tolerances import specific, tolerance
from tests.kit.training import case_mesh

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}
STEPS = 3
LR = 1e-2


def _config(param_dtype: torch.dtype, main_grad: bool) -> tuple[float, float]:
    """(loss tol, grad tol): the half-precision row, or fp32 main-grad accumulation (1e-5)."""
    if main_grad:
        return tolerance("FSDP 1D bf16").loss, specific("fp32 main grad")
    row = tolerance("FSDP 1D bf16" if param_dtype == torch.bfloat16 else "FSDP 1D fp16")
    return row.loss, row.grad


def _observe(layer: nn.Module, seen: dict[str, set]) -> None:
    def pre_hook(module, args):
        seen.setdefault("input", set()).add(args[0].dtype)
        seen.setdefault("compute param", set()).add(module.weight.dtype)

    # registered after fully_shard: it sees what the module's forward receives
    layer.register_forward_pre_hook(pre_hook)


def mixed_precision_matches_reference(
    param_dtype: str,
    reduce_dtype: str | None = None,
    output_dtype: str | None = None,
    cast_forward_inputs: bool = True,
    main_grad: bool = False,
    mesh_shape: tuple[int, ...] = (2,),
    comm_fusion: bool = True,
) -> dict[str, float]:
    """Train 3 steps under a MixedPrecisionPolicy; dtypes and numbers as the policy says."""
    rank = dist.get_rank()
    p_dtype, r_dtype, o_dtype = DTYPES[param_dtype], DTYPES[reduce_dtype], DTYPES[output_dtype]
    policy = MixedPrecisionPolicy(p_dtype, r_dtype, o_dtype, cast_forward_inputs, main_grad)
    model = MLP((7, 13, 5, 3), self_casting=not cast_forward_inputs)
    reference = SameDtypeReference(model, p_dtype, r_dtype, o_dtype, cast_forward_inputs)
    mesh = case_mesh(mesh_shape)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, comm_fusion=comm_fusion)
    fully_shard(model, mesh=mesh, mp_policy=policy, comm_fusion=comm_fusion)
    seen: dict[str, set] = {}
    _observe(model.layers[0], seen)
    loss_tol, grad_tol = _config(p_dtype, main_grad)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=LR)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(STEPS):
        x = rank_batch(step, rank, (4, 7))
        with record_collectives() as rec:
            out = model(x)
            loss = out.float().square().mean()
            loss.backward()
        want_out = o_dtype or p_dtype
        assert out.dtype == want_out, f"output dtype {out.dtype}, want {want_out}"
        _check_communicated_dtypes(rec, p_dtype, r_dtype or p_dtype)
        _check_grads(model, main_grad)
        ref_loss = reference(x).float().square().mean()
        ref_loss.backward()
        reference.reduce_grads()
        worst["loss"] = max(worst["loss"], assert_close(f"step {step} loss", loss, ref_loss, loss_tol))
        worst["grad"] = max(worst["grad"], assert_params_close(f"step {step} grad", model, reference, grad_tol, True))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    want_input = p_dtype if cast_forward_inputs else torch.float32
    assert seen["input"] == {want_input}, f"layer 0 received {seen['input']}, want {want_input}"
    assert seen["compute param"] == {p_dtype}, f"compute params {seen['compute param']}, want {p_dtype}"
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.dtype == torch.float32, f"{name}: sharded master not fp32"
    return worst


def _check_communicated_dtypes(rec, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    gathers, reductions = rec.of("all_gather"), rec.of("reduce_scatter") + rec.of("all_reduce")
    assert gathers and reductions, f"precondition: collectives recorded ({rec.calls})"
    assert {c.dtype for c in gathers} == {param_dtype}, f"all-gathers ran in {[c.dtype for c in gathers]}"
    assert {c.dtype for c in reductions} == {reduce_dtype}, f"reductions ran in {[c.dtype for c in reductions]}"


def _check_grads(model: nn.Module, main_grad: bool) -> None:
    for name, param in model.named_parameters():
        assert isinstance(param.grad, DTensor), f"{name}.grad not a DTensor"
        assert param.grad.dtype == torch.float32, f"{name}.grad dtype {param.grad.dtype}, want fp32"
        if main_grad:
            main = getattr(param, "main_grad", None)
            assert main is not None and param.grad is main, f"{name}.grad is not its fp32 main_grad"


def mixed_precision_accumulation(
    micro_steps: int = 3, main_grad: bool = False, sync_each_micro_step: bool = False
) -> dict[str, float]:
    """bf16 compute, fp32 reduce: micro-batch grads accumulate in fp32, either unreduced before
    one reduction, or (``sync_each_micro_step``) as reduced grads in ``param.grad``/main grad."""
    rank = dist.get_rank()
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, apply_grad_on_fp32_main_grad=main_grad)
    model = MLP((7, 13, 5, 3))
    reference = SameDtypeReference(model, torch.bfloat16, torch.float32)
    mesh = case_mesh((2,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    worst = 0.0
    for step in range(2):
        for micro in range(micro_steps):
            sync = sync_each_micro_step or micro == micro_steps - 1
            model.set_requires_gradient_sync(sync)
            x = rank_batch(10 * step + micro, rank, (4, 7))
            model(x).float().square().mean().backward()
            reference(x).float().square().mean().backward()
            reference.reduce_grads(sync=sync)
        _check_grads(model, main_grad)
        worst = max(worst, assert_params_close(f"step {step} grad", model, reference, specific("fp32 main grad"), True))
        model.zero_grad()
        for param in reference.parameters():
            param.grad = None
    return {"grad": worst}


def mixed_precision_with_checkpointing(use_reentrant: bool) -> dict[str, float]:
    """bf16 compute under activation checkpointing: recompute casts consistently, numbers hold."""
    rank = dist.get_rank()
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    model = MLP((7, 13, 5, 3))
    reference = SameDtypeReference(model, torch.bfloat16, torch.float32)
    mesh = case_mesh((2,))
    for i, layer in enumerate(model.layers):
        model.layers[i] = Checkpointed(fully_shard(layer, mesh=mesh, mp_policy=policy), use_reentrant)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    row = tolerance("FSDP 1D bf16")
    worst = 0.0
    for step in range(2):
        x = rank_batch(step, rank, (4, 7)).requires_grad_(use_reentrant)
        loss = model(x).float().square().mean()
        loss.backward()
        ref_loss = reference(x.detach()).float().square().mean()
        ref_loss.backward()
        reference.reduce_grads()
        assert_close(f"step {step} loss", loss, ref_loss, row.loss)
        ours = {n.replace(".inner", ""): p for n, p in model.named_parameters()}
        for name, param in reference.named_parameters():
            worst = max(worst, assert_close(f"step {step} grad {name}", ours[name].grad, param.grad, row.grad))
        model.zero_grad()
        for param in reference.parameters():
            param.grad = None
    return {"grad": worst}


class _GainedMLP(nn.Module):
    """An MLP whose fp32 output gain is meant to stay out of sharding and casting."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP((7, 13, 5, 3))
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x).float() * self.gain


def ignored_params_never_cast() -> None:
    """An ignored param stays an fp32 plain tensor under a bf16 policy; its grad is local fp32."""
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    model = _GainedMLP()
    fully_shard(model, mesh=case_mesh((2,)), mp_policy=policy, ignored_params=[model.gain])
    seen = []
    model.mlp.register_forward_hook(lambda m, a, out: seen.append(model.gain.dtype))
    model(rank_batch(0, dist.get_rank(), (4, 7))).square().mean().backward()
    assert seen == [torch.float32], f"ignored param dtype during forward: {seen}"
    assert type(model.gain) is nn.Parameter and model.gain.grad.dtype == torch.float32
    assert isinstance(model.mlp.layers[0].weight, DTensor)


def cpu_offload_matches_ddp(pin_memory: bool) -> dict[str, float]:
    """CPUOffloadPolicy: shards, grads and Adam state on the CPU; training equals DDP."""
    rank = dist.get_rank()
    model = MLP((7, 13, 5, 3))
    ddp = ddp_of(model)
    mesh = case_mesh((2,))
    policy = CPUOffloadPolicy(pin_memory=pin_memory)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    tol = tolerance("FSDP 1D fp32")
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=LR)
    worst = 0.0
    for step in range(STEPS):
        x = rank_batch(step, rank, (4, 7))
        model(x).square().mean().backward()
        ddp(x).square().mean().backward()
        for name, param in model.named_parameters():
            assert param.to_local().device.type == "cpu", f"{name} shard not on CPU"
            assert param.grad.to_local().device.type == "cpu", f"{name} grad not on CPU"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        worst = max(worst, assert_params_close(f"step {step} param", model, ddp, tol.grad))
    for state in opt.state.values():
        assert all(v.device.type == "cpu" for v in state.values() if isinstance(v, torch.Tensor))
    return {"param": worst}
