"""Rank bodies of the engine's control tests: collectives issued, HSDPModule methods, bad input."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from tests.kit.api import MixedPrecisionPolicy, fully_shard
from tests.kit.models import MLP, rank_batch
from tests.kit.recorder import record_collectives
from tests.kit.reference import assert_close, assert_params_close, ddp_of, full, gather_from
from tests.kit.tolerances import specific, tolerance
from tests.kit.training import case_mesh, shard_nested

FP32 = tolerance("FSDP 1D fp32")


def _nested_mlp(mesh, dims=(7, 13, 5, 3), **kwargs) -> MLP:
    model = MLP(dims)
    shard_nested(model, model.layers, mesh=mesh, **kwargs)
    return model


def _loss(model: nn.Module, step: int, dims0: int = 7) -> torch.Tensor:
    return model(rank_batch(step, dist.get_rank(), (4, dims0))).square().mean()


def collective_counts(mesh_shape: tuple[int, ...], comm_fusion: bool) -> dict[str, int]:
    """Fused: one all-gather per group per unshard and one reduce-scatter per group;
    unfused: one per param; HSDP: one all-reduce per reduce-scatter."""
    model = _nested_mlp(case_mesh(mesh_shape), comm_fusion=comm_fusion)
    layers, per_group = len(model.layers), 1 if comm_fusion else 2
    with record_collectives() as rec:
        _loss(model, 0).backward()
    counts = rec.counts()
    # children reshard after forward, so each group is gathered in forward and again in backward
    want = {
        "all_gather": 2 * layers * per_group,
        "reduce_scatter": layers * per_group,
        "all_reduce": layers * per_group if len(mesh_shape) == 2 else 0,
    }
    got = {op: counts.get(op, 0) for op in want}
    assert got == want, f"collectives {got} != expected {want} (calls: {rec.calls})"
    assert all(c.dtype == torch.float32 for c in rec.calls), f"non-fp32 collective: {rec.calls}"
    shard_size = mesh_shape[-1]
    assert all(c.group_size == shard_size for c in rec.of("all_gather")), "all-gather not over shard dim"
    if len(mesh_shape) == 2:
        assert all(c.group_size == mesh_shape[0] for c in rec.of("all_reduce")), "all-reduce not over replicas"
    return got


def unshard_reshard_lifecycle() -> None:
    """unshard (sync and async) and reshard are idempotent and expose the right tensors."""
    mesh = case_mesh((2,))
    model = _nested_mlp(mesh)
    layer = model.layers[0]
    expected = {n: full(p).clone() for n, p in layer.named_parameters()}
    with record_collectives() as rec:
        handle = layer.unshard(async_op=True)
        assert handle is not None, "unshard(async_op=True) returned no handle"
        layer.unshard(async_op=True)  # idempotent while in flight
        handle.wait()
        handle.wait()
        layer.unshard()
    assert len(rec.of("all_gather")) == 1, f"repeated unshard gathered again: {rec.calls}"
    for name, param in layer.named_parameters():
        assert not isinstance(param, DTensor), f"{name} still sharded after handle.wait()"
        assert param.numel() == expected[name].numel(), f"{name} numel {param.numel()} not full"
        assert torch.equal(param, expected[name]), f"{name} gathered data differs from the shards"
    layer.reshard()
    layer.reshard()
    for name, param in layer.named_parameters():
        assert isinstance(param, DTensor), f"{name} not sharded after reshard()"
    assert model.unshard() is None, "unshard() without async_op returns None"


def reshard_controls_match_ddp() -> None:
    """set_reshard_after_forward/backward toggle what forward/backward leave behind; training
    with params kept unsharded across an optimizer step still equals DDP (stale copies refreshed)."""
    rank = dist.get_rank()
    model = MLP((7, 13, 5, 3))
    ddp = ddp_of(model)
    mesh = case_mesh((2,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    plan = [(False, True), (True, False), (False, False), (True, True)]
    for step, (after_forward, after_backward) in enumerate(plan):
        model.set_reshard_after_forward(after_forward)
        model.set_reshard_after_backward(after_backward)
        x = rank_batch(step, rank, (4, 7))
        out = model(x)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) == after_forward, f"step {step} after forward: {name}"
        loss = out.square().mean()
        loss.backward()
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) == after_backward, f"step {step} after backward: {name}"
            if not after_backward:
                assert param.numel() == param.untyped_storage().size() // param.element_size()
        ref_loss = ddp(x).square().mean()
        ref_loss.backward()
        assert_close(f"step {step} loss", loss, ref_loss, FP32.loss)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    model.reshard()
    for layer in model.layers:
        layer.reshard()
    assert_params_close("params", model, ddp, FP32.grad)


def reduce_op_sum_is_world_times_avg() -> None:
    """set_reduce_op_type("sum") gives world_size x the averaged (DDP) grad."""
    world = dist.get_world_size()
    model = MLP((7, 13, 5, 3))
    ddp = ddp_of(model)
    mesh = case_mesh((world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_reduce_op_type("sum")
    _loss(model, 0).backward()
    _loss(ddp, 0).backward()
    ref = dict(ddp.module.named_parameters())
    for name, param in model.named_parameters():
        assert_close(f"sum grad {name}", param.grad, ref[name].grad * world, FP32.grad)


def deferred_last_backward() -> None:
    """set_is_last_backward(False) leaves reductions in flight; the next last backward lands
    both, equal to DDP's grads accumulated over the two backwards."""
    model = _nested_mlp(case_mesh((2,)), dims=(7, 13, 5, 3))
    ddp = ddp_of(MLP((7, 13, 5, 3)))
    model.set_is_last_backward(False)
    _loss(model, 0).backward()
    assert all(p.grad is None for p in model.parameters()), "grads landed despite is_last_backward=False"
    model.set_is_last_backward(True)
    _loss(model, 1).backward()
    _loss(ddp, 0).backward()
    _loss(ddp, 1).backward()
    assert_params_close("accumulated grad", model, ddp, FP32.grad, grads=True)


def prefetch_follows_lists() -> None:
    """Explicit prefetch lists decide the order of all-gathers, and results stay equal to DDP."""
    mesh = case_mesh((2,))
    model = MLP((7, 13, 5, 3))
    ddp = ddp_of(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    l0, l1, l2 = model.layers
    numel_of = {_padded_numel(layer, 2): i for i, layer in enumerate(model.layers)}
    assert len(numel_of) == 3, "layers must differ in size to tell their gathers apart"
    l0.set_modules_to_forward_prefetch([l2, l1])
    l2.set_modules_to_backward_prefetch([l0, l1])
    with record_collectives() as rec:
        out = model(rank_batch(0, dist.get_rank(), (4, 7)))
        forward_order = [numel_of.get(c.numel) for c in rec.of("all_gather")]
        out.square().mean().backward()
    order = [numel_of.get(c.numel) for c in rec.of("all_gather")]
    assert forward_order[:3] == [0, 2, 1], f"forward gathers in order {forward_order}, want [0, 2, 1]"
    assert order[3:6] == [2, 0, 1], f"backward gathers in order {order[3:]}, want [2, 0, 1] first"
    _loss(ddp, 0).backward()
    assert_params_close("grad", model, ddp, FP32.grad, grads=True)


def _padded_numel(layer: nn.Module, world: int) -> int:
    """What one rank sends in a fused all-gather of ``layer``: every shard padded to equal rows."""
    return sum(-(-p.shape[0] // world) * (p.numel() // p.shape[0]) for p in layer.parameters())


def zero_grad_clears_everything() -> None:
    """zero_grad drops sharded grads and locally accumulated unsharded grads."""
    model = _nested_mlp(case_mesh((2,)))
    ddp = ddp_of(MLP((7, 13, 5, 3)))
    snapshot = {n: full(p).clone() for n, p in model.named_parameters()}
    model.set_requires_gradient_sync(False)
    _loss(model, 0).backward()
    _loss(model, 1).backward()
    model.set_requires_gradient_sync(True)
    _loss(model, 2).backward()
    assert all(p.grad is not None for p in model.parameters()), "precondition: grads exist"
    model.set_requires_gradient_sync(False)
    _loss(model, 3).backward()  # leaves unreduced local grads behind
    model.zero_grad()
    for name, param in model.named_parameters():
        assert param.grad is None, f"{name}.grad not cleared"
        assert torch.equal(full(param), snapshot[name]), f"{name} data changed by zero_grad"
    model.set_requires_gradient_sync(True)
    _loss(model, 4).backward()
    _loss(ddp, 4).backward()
    assert_params_close("fresh grad after zero_grad", model, ddp, FP32.grad, grads=True)


def recurse_false_touches_own_group_only() -> None:
    """root.set_requires_gradient_sync(False, recurse=False): children still reduce."""
    mesh = case_mesh((2,))
    model = MLP((7, 13, 5, 3))
    fully_shard(model.layers[0], mesh=mesh)
    fully_shard(model.layers[1], mesh=mesh)
    fully_shard(model, mesh=mesh)  # root group owns layers[2]
    model.set_requires_gradient_sync(False, recurse=False)
    with record_collectives() as rec:
        _loss(model, 0).backward()
    assert len(rec.of("reduce_scatter")) == 2, f"want the 2 child reductions only: {rec.calls}"
    assert model.layers[2].weight.grad is None and model.layers[0].weight.grad is not None


def requires_all_reduce_hsdp() -> None:
    """HSDP 2x2: without the replicate all-reduce the replica groups' grads differ; with it
    they agree and equal DDP's."""
    mesh = case_mesh((2, 2))
    model = _nested_mlp(mesh)
    ddp = ddp_of(MLP((7, 13, 5, 3)))
    replicas = mesh.get_group(0)

    def replica_gap() -> float:
        gap = 0.0
        for param in model.parameters():
            local = param.grad.to_local()
            both = gather_from(local, replicas)
            gap = max(gap, (both[0] - both[1]).abs().max().item() if local.numel() else 0.0)
        return gap

    model.set_requires_all_reduce(False)
    with record_collectives() as rec:
        _loss(model, 0).backward()
    assert not rec.of("all_reduce"), "all-reduce ran with requires_all_reduce=False"
    assert replica_gap() > 1e-3, "replica groups' grads agree without all-reduce: data not distinct?"
    model.zero_grad()
    model.set_requires_all_reduce(True)
    _loss(model, 0).backward()
    assert replica_gap() <= specific("replica agreement"), "replica groups' grads differ with all-reduce"
    _loss(ddp, 0).backward()
    assert_params_close("grad", model, ddp, tolerance("HSDP 2D fp32").grad, grads=True)


def ignored_params_untouched() -> None:
    """Ignored params stay plain full tensors, their grads local; the others equal DDP."""
    rank = dist.get_rank()
    model = MLP((7, 13, 5, 3))
    ignored = model.layers[1].weight
    ddp_local = ddp_of(model)  # its grads are never synced: we read rank-local grads from it
    # DDP reads the ignore list at construction (the deep copy carries the attribute)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["layers.1.weight"])
    ddp = ddp_of(model)
    fully_shard(model, mesh=case_mesh((2,)), ignored_params=[ignored])
    assert type(ignored) is nn.Parameter and ignored is model.layers[1].weight
    x = rank_batch(0, rank, (4, 7))
    model(x).square().mean().backward()
    with ddp_local.no_sync():
        ddp_local(x).square().mean().backward()
    assert not isinstance(ignored.grad, DTensor) and ignored.grad.numel() == ignored.numel()
    assert_close("ignored grad == local grad", ignored.grad, ddp_local.module.layers[1].weight.grad, FP32.grad)
    ddp(x).square().mean().backward()
    ref = dict(ddp.module.named_parameters())
    for name, param in model.named_parameters():
        if param is not ignored:
            assert isinstance(param, DTensor), f"{name} not sharded"
            assert_close(f"grad {name}", param.grad, ref[name].grad, FP32.grad)
    others = gather_from(ignored.grad)
    assert (others[0] - others[1]).abs().max() > 1e-4, "ignored grads equal across ranks: synced?"


def _rejects(what: str, fn, exc: type[Exception], needle: str) -> None:
    try:
        fn()
    except exc as err:
        assert needle in str(err), f"{what}: {exc.__name__} does not name {needle!r}: {err}"
        return
    except Exception as err:  # noqa: BLE001 - report the wrong type
        raise AssertionError(f"{what}: raised {type(err).__name__}: {err}, want {exc.__name__}") from err
    raise AssertionError(f"{what}: accepted, want {exc.__name__}")


def _assert_untouched(model: nn.Module, what: str) -> None:
    assert type(model) is MLP, f"{what}: module class changed to {type(model).__name__}"
    assert "_hsdp_state" not in model.__dict__, f"{what}: state attached despite the error"
    assert not any(isinstance(p, DTensor) for p in model.parameters()), f"{what}: params sharded"


def bad_input_is_refused_before_any_change() -> None:
    """Every argument and setter is checked, naming it, before anything changes."""
    mesh = case_mesh((2,))
    mesh3d = case_mesh((1, 1, 2))
    stray = nn.Parameter(torch.ones(1))
    cases = [
        ("non-module", lambda m: fully_shard("layer", mesh=mesh), TypeError, "module"),
        ("empty list", lambda m: fully_shard([], mesh=mesh), ValueError, "module"),
        ("mesh type", lambda m: fully_shard(m, mesh="cpu"), TypeError, "mesh"),
        ("3-D mesh", lambda m: fully_shard(m, mesh=mesh3d), ValueError, "mesh"),
        (
            "int reshard",
            lambda m: fully_shard(m, mesh=mesh, reshard_after_forward=2),
            TypeError,
            "reshard_after_forward",
        ),
        (
            "placement fn",
            lambda m: fully_shard(m, mesh=mesh, shard_placement_fn=3),
            TypeError,
            "shard_placement_fn",
        ),
        (
            "placement dim",
            lambda m: fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: Shard(5)),
            ValueError,
            "shard_placement_fn",
        ),
        (
            "placement kind",
            lambda m: fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: "x"),
            ValueError,
            "shard_placement_fn",
        ),
        ("mp type", lambda m: fully_shard(m, mesh=mesh, mp_policy="bf16"), TypeError, "mp_policy"),
        ("mp field", lambda m: MixedPrecisionPolicy(param_dtype="bf16"), TypeError, "param_dtype"),
        (
            "mp int dtype",
            lambda m: MixedPrecisionPolicy(reduce_dtype=torch.int32),
            ValueError,
            "reduce_dtype",
        ),
        ("offload type", lambda m: fully_shard(m, mesh=mesh, offload_policy=1), TypeError, "offload_policy"),
        (
            "ignored stray",
            lambda m: fully_shard(m, mesh=mesh, ignored_params=[stray]),
            ValueError,
            "ignored_params",
        ),
        (
            "replicate type",
            lambda m: fully_shard(m, mesh=mesh, replicate_params=5),
            TypeError,
            "replicate_params",
        ),
        (
            "ignored and replicated",
            lambda m: fully_shard(m, mesh=mesh, ignored_params=[m.layers[0].bias], replicate_params=[m.layers[0].bias]),
            ValueError,
            "ignored_params",
        ),
        ("comm_fusion", lambda m: fully_shard(m, mesh=mesh, comm_fusion="yes"), TypeError, "comm_fusion"),
        ("device", lambda m: fully_shard(m, mesh=mesh, device="meta"), ValueError, "device"),
        ("shared in list", lambda m: _shared_list(m, mesh), ValueError, "share"),
    ]
    for what, call, exc, needle in cases:
        model = MLP((7, 13, 5, 3))
        _rejects(what, lambda call=call, model=model: call(model), exc, needle)
        _assert_untouched(model, what)
    model = fully_shard(MLP((7, 13, 5, 3)), mesh=mesh)
    _rejects("twice", lambda: fully_shard(model, mesh=mesh), ValueError, "already")
    _rejects("reduce op", lambda: model.set_reduce_op_type("max"), ValueError, "reduce_op_type")
    _rejects("sync flag", lambda: model.set_requires_gradient_sync(1), TypeError, "requires_gradient_sync")
    _rejects("recurse", lambda: model.set_reshard_after_forward(True, recurse="no"), TypeError, "recurse")
    _rejects("prefetch", lambda: model.set_modules_to_forward_prefetch([nn.Linear(1, 1)]), TypeError, "modules")
    _rejects("async flag", lambda: model.unshard(async_op="y"), TypeError, "async_op")
    _rejects("last backward", lambda: model.set_is_last_backward(None), TypeError, "is_last_backward")


def _shared_list(model: MLP, mesh) -> None:
    shared = nn.Sequential(model.layers[0], model.layers[1])
    fully_shard([shared, nn.Sequential(model.layers[1])], mesh=mesh)


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("deliberate failure in backward")


def recovers_after_failed_iterations() -> None:
    """A forward or a backward that raises leaves the engine usable: the next step equals DDP."""
    model = _nested_mlp(case_mesh((2,)))
    ddp = ddp_of(MLP((7, 13, 5, 3)))
    x = rank_batch(0, dist.get_rank(), (4, 7))
    # fail between layers, after the later layers' backward already started
    hook = model.layers[0].register_forward_hook(lambda m, a, out: _FailingBackward.apply(out))
    try:
        model(x).sum().backward()
    except RuntimeError as err:
        assert "deliberate" in str(err)
    else:
        raise AssertionError("precondition: the failing backward did not fail")
    hook.remove()
    try:
        model(x[:, :3])  # wrong width: the first layer raises mid-forward
    except RuntimeError:
        pass
    else:
        raise AssertionError("precondition: the failing forward did not fail")
    model.zero_grad()
    _loss(model, 1).backward()
    _loss(ddp, 1).backward()
    assert_params_close("grad after failures", model, ddp, FP32.grad, grads=True)
