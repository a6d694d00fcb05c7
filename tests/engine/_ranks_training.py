"""Rank bodies of the engine's training tests: every option trained against torch DDP.

Each function runs on every rank of a fresh process group (see ``tests.kit.cluster``),
raises ``AssertionError`` on the first mismatch and returns its worst errors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests.kit.api import fully_shard
from tests.kit.case import StrictChecks
from tests.kit.models import MLP, BranchyNet, Checkpointed, TiedEmbeddingNet, rank_batch, rank_tokens
from tests.kit.reference import assert_close, assert_params_close, ddp_of
from tests.kit.tolerances import tolerance
from tests.kit.training import case_mesh, train_against

STEPS = 3
LR = 1e-2


def _mesh(shape: tuple[int, ...]):
    return case_mesh(shape, ("replicate", "shard") if len(shape) == 2 else ("shard",))


def _config(shape: tuple[int, ...]) -> str:
    return "HSDP 2D fp32" if len(shape) == 2 else "FSDP 1D fp32"


def _placement_fn(kind: str):
    if kind == "dim1":
        return lambda p: Shard(1) if p.ndim == 2 else Shard(0)
    if kind == "replicate_bias":
        return lambda p: Replicate() if p.ndim == 1 else None
    return None


def _expected_local_numel(param_full_shape: torch.Size, dim: int, world: int, rank: int) -> int:
    rows = param_full_shape[dim]
    chunk = -(-rows // world)
    held = max(0, min(rows, (rank + 1) * chunk) - rank * chunk)
    other = param_full_shape.numel() // rows if rows else 0
    return held * other


def _check_sharded(model: nn.Module, shard_size: int, shard_rank: int, dims: dict[str, int]) -> None:
    """Every managed param is a DTensor whose local numel is this rank's chunk."""
    for name, param in model.named_parameters():
        if name not in dims:
            continue
        assert isinstance(param, DTensor), f"{name} should be sharded (DTensor), is {type(param).__name__}"
        dim = dims[name]
        want = param.numel() if dim < 0 else _expected_local_numel(param.shape, dim, shard_size, shard_rank)
        got = param.to_local().numel()
        assert got == want, f"{name}: local numel {got}, expected {want}"


def _check_unsharded(module: nn.Module, recurse: bool = False) -> None:
    for name, param in module.named_parameters(recurse=recurse):
        assert not isinstance(param, DTensor), f"{name} should be unsharded after forward"
        assert param.untyped_storage().size() > 0, f"{name} unsharded storage is freed"


def fsdp_matches_ddp(
    mesh_shape: tuple[int, ...] = (2,),
    nested: bool = True,
    comm_fusion: bool = True,
    reshard_after_forward: bool | None = None,
    placement: str = "dim0",
    replicate_first_bias: bool = False,
    dims: tuple[int, ...] = (7, 13, 5, 3),
    use_default_mesh: bool = False,
) -> dict[str, float]:
    """Train MLP with ``fully_shard`` and with DDP for 3 Adam steps; losses, grads, params agree."""
    rank = dist.get_rank()
    tol = tolerance(_config(mesh_shape))
    model = MLP(dims)
    ddp = ddp_of(model)
    mesh = None if use_default_mesh else _mesh(mesh_shape)
    kwargs = dict(
        mesh=mesh,
        comm_fusion=comm_fusion,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=_placement_fn(placement),
    )
    replicated = [model.layers[0].bias] if replicate_first_bias else None
    if nested:
        for layer in model.layers:
            fully_shard(layer, replicate_params=replicated if layer is model.layers[0] else None, **kwargs)
    fully_shard(model, replicate_params=None if nested else replicated, **kwargs)
    shard_size = mesh_shape[-1]
    shard_rank = rank % shard_size
    shard_dims = {}
    for name, param in model.named_parameters():
        if (replicate_first_bias and name == "layers.0.bias") or (placement == "replicate_bias" and param.ndim == 1):
            shard_dims[name] = -1
        else:
            shard_dims[name] = 1 if placement == "dim1" and param.ndim == 2 else 0
    _check_sharded(model, shard_size, shard_rank, shard_dims)

    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=LR)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(STEPS):
        x = rank_batch(step, rank, (4, dims[0]))
        ref_loss = ddp(x).square().mean()
        ref_loss.backward()
        out = model(x)
        root_keeps = reshard_after_forward is False or (reshard_after_forward is None and not nested)
        if root_keeps:
            _check_unsharded(model, recurse=not nested)
        elif reshard_after_forward is True:
            _check_sharded(model, shard_size, shard_rank, shard_dims)
        loss = out.square().mean()
        loss.backward()
        _check_sharded(model, shard_size, shard_rank, shard_dims)
        for name, param in model.named_parameters():
            assert isinstance(param.grad, DTensor), f"{name}.grad should be a DTensor"
            assert param.grad.to_local().shape == param.to_local().shape, f"{name} grad/param shard shapes"
        worst["loss"] = max(worst["loss"], assert_close(f"step {step} loss", loss, ref_loss, tol.loss))
        worst["grad"] = max(worst["grad"], assert_params_close(f"step {step} grad", model, ddp, tol.grad, True))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        worst["param"] = max(worst["param"], assert_params_close(f"step {step} param", model, ddp, tol.grad))
    return worst


def _train_pair(model: nn.Module, ddp: nn.Module, batches, loss_fn, tol) -> dict[str, float]:
    """The kit's training comparison (loss, grad norm, grads, params per Adam step), strict."""
    checks = StrictChecks()
    train_against(checks, model, ddp, batches, loss_fn, tol)
    return {word: checks.worst_error(word) for word in ("loss", "grad", "param")}


def _square_mean(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def checkpointed_matches_ddp(use_reentrant: bool) -> dict[str, float]:
    """Layers re-run forward inside backward (torch checkpoint); still equal to DDP without AC."""
    rank = dist.get_rank()
    model = MLP((7, 13, 5, 3))
    for i, layer in enumerate(model.layers):
        model.layers[i] = Checkpointed(layer, use_reentrant)
    ddp = ddp_of(model)
    for wrapper in ddp.module.layers:
        wrapper.enabled = False  # the reference runs without activation checkpointing
    mesh = _mesh((2,))
    for wrapper in model.layers:
        fully_shard(wrapper.inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    recomputed = _count_forwards(model.layers[1].inner)
    batches = [rank_batch(s, rank, (4, 7)).requires_grad_(use_reentrant) for s in range(STEPS)]
    worst = _train_pair(model, ddp, batches, _square_mean, tolerance("AC + FSDP fp32"))
    assert recomputed[0] == 2 * STEPS, f"checkpointed layer ran forward {recomputed[0]}x, not 2x per step"
    return worst


def _count_forwards(module: nn.Module) -> list[int]:
    count = [0]
    module.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def multi_forward_matches_ddp(reshard_after_forward: bool) -> dict[str, float]:
    """Two forwards (one nesting the other's output) before one backward."""
    rank = dist.get_rank()
    model = MLP((5, 5, 5))
    ddp = ddp_of(model)
    mesh = _mesh((2,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(m(x)).square().mean() + m(x * 2).mean()

    batches = [rank_batch(s, rank, (4, 5)) for s in range(STEPS)]
    return _train_pair(model, ddp, batches, loss_fn, tolerance("FSDP 1D fp32"))


def unused_module_matches_ddp() -> dict[str, float]:
    """A head unused in some steps keeps no grad that step, as with DDP(find_unused_parameters)."""
    rank = dist.get_rank()
    model = BranchyNet()
    ddp = ddp_of(model, find_unused_parameters=True)
    mesh = _mesh((2,))
    for sub in (model.trunk, model.head_a, model.head_b):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    heads = ["a", "b", "a"]

    def loss_fn(m: nn.Module, batch) -> torch.Tensor:
        x, head = batch
        return m(x, head).square().mean()

    batches = [(rank_batch(s, rank, (4, 6)), heads[s]) for s in range(STEPS)]
    return _train_pair(model, ddp, batches, loss_fn, tolerance("FSDP 1D fp32"))


def tied_weights_match_ddp() -> dict[str, float]:
    """Embedding and output projection share one weight inside the root group."""
    rank = dist.get_rank()
    model = TiedEmbeddingNet()
    ddp = ddp_of(model)
    mesh = _mesh((2,))
    fully_shard(model.mid, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert model.out.weight is model.embed.weight, "tie broken by sharding"

    def loss_fn(m: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten())

    batches = [rank_tokens(s, rank, (3, 5), vocab=11) for s in range(STEPS)]
    worst = _train_pair(model, ddp, batches, loss_fn, tolerance("FSDP 1D fp32"))
    assert model.out.weight is model.embed.weight, "tie broken by training"
    return worst


def list_input_matches_ddp() -> dict[str, float]:
    """``fully_shard([a, b])`` returns both as independent groups and trains like DDP."""
    rank = dist.get_rank()
    model = MLP((7, 13, 5, 3))
    ddp = ddp_of(model)
    mesh = _mesh((2,))
    result = fully_shard([model.layers[0], model.layers[1]], mesh=mesh)
    assert isinstance(result, list) and len(result) == 2, f"list input returned {type(result)}"
    assert result[0] is model.layers[0] and result[1] is model.layers[1]
    fully_shard(model, mesh=mesh)
    batches = [rank_batch(s, rank, (4, 7)) for s in range(STEPS)]
    return _train_pair(model, ddp, batches, _square_mean, tolerance("FSDP 1D fp32"))


def gradient_accumulation_matches_ddp(micro_steps: int = 3) -> dict[str, float]:
    """``set_requires_gradient_sync(False)`` accumulates locally, like DDP's ``no_sync``."""
    from tests.kit.recorder import record_collectives

    rank = dist.get_rank()
    model = MLP((7, 13, 5, 3))
    ddp = ddp_of(model)
    mesh = _mesh((2,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tol = tolerance("FSDP 1D fp32")
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=LR)
    worst = {"grad": 0.0, "param": 0.0}
    for step in range(2):
        for micro in range(micro_steps):
            x = rank_batch(10 * step + micro, rank, (4, 7))
            last = micro == micro_steps - 1
            model.set_requires_gradient_sync(last)
            with record_collectives() as rec:
                _square_mean(model, x).backward()
            if last:
                _square_mean(ddp, x).backward()
                assert rec.of("reduce_scatter"), "the syncing backward issued no reduce-scatter"
            else:
                with ddp.no_sync():
                    _square_mean(ddp, x).backward()
                assert not rec.of("reduce_scatter"), f"no-sync backward reduced: {rec.calls}"
                grads = [p.grad for p in model.parameters()]
                assert all(g is None for g in grads), "no-sync backward set sharded grads"
        worst["grad"] = max(worst["grad"], assert_params_close(f"step {step} grad", model, ddp, tol.grad, True))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        worst["param"] = max(worst["param"], assert_params_close(f"step {step} param", model, ddp, tol.grad))
    return worst
