"""Rank bodies of the engine's training tests: layouts, option combinations and model shapes that
no plan case trains, each trained against its baseline through the kit's checks (``StrictChecks``
raises on the first failing check)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.engine._checks import check_step_collectives
from tests.kit.judging.checks import StrictChecks
from tests.kit.judging.layout import local_numels_after_forward, shard_shape
from tests.kit.judging.recorder import CollectiveRecorder
from tests.kit.judging.reference import SameDtypeReference, ddp_of
from tests.kit.judging.surface import impl
from tests.kit.workloads.models import (
    MLP,
    BranchyNet,
    Checkpointed,
    TiedEmbeddingNet,
    rank_batch,
    rank_batches,
    rank_tokens,
)
from tests.kit.workloads.training import shard_nested, square_mean, train_against

DIMS = (7, 13, 5, 3)
STEPS = 3


def options_match_ddp(
    mesh: dict[str, int],
    dims: tuple[int, ...] = DIMS,
    nested: bool = True,
    comm_fusion: bool = True,
    dim1: bool = False,
) -> None:
    """An MLP sharded on ``mesh`` (layers then root when ``nested``, else the root alone), weights
    on ``Shard(1)`` when ``dim1``: every param holds its chunk, the root keeps its own params after
    forward and the children do not, the collectives are one per group (fused) or per param, and
    3 Adam steps equal DDP."""
    hsdp = len(mesh) == 2
    checks = StrictChecks("HSDP 2D fp32" if hsdp else "FSDP 1D fp32", **mesh)
    shard = list(mesh.values())[-1]
    shard_rank = checks.rank % shard  # ranks fill the mesh row-major: the shard dim is the last
    model = MLP(dims)
    ddp = ddp_of(model)
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    full_numel = {name: p.numel() for name, p in model.named_parameters()}
    children = list(model.layers) if nested else []
    root_own = [] if nested else list(full_numel)
    shard_nested(
        model,
        children,
        mesh=checks.mesh,
        comm_fusion=comm_fusion,
        shard_placement_fn=(lambda p: impl.Shard(1) if p.ndim == 2 else None) if dim1 else None,
    )

    for name, param in model.named_parameters():
        dim = 1 if dim1 and param.ndim == 2 else 0
        want = (impl.Replicate(),) * (len(mesh) - 1) + (impl.Shard(dim),)
        checks.equal(f"{name} placements", str(impl.placements(param)), str(want))
        local = tuple(impl.local(param).shape)
        checks.equal(f"{name} local shape", str(local), str(shard_shape(full_shapes[name], shard, shard_rank, dim)))
    after_forward = local_numels_after_forward(model)
    recorders: list[CollectiveRecorder] = []
    batches = rank_batches(checks.rank, (4, dims[0]), steps=STEPS)
    train_against(checks, model, ddp, batches, square_mean, checks.tol, recorders=recorders)

    for step, seen in enumerate(after_forward):
        for name, numel in seen.items():
            kept = name in root_own
            want = full_numel[name] if kept else impl.local(model.get_parameter(name)).numel()
            checks.equal(f"step {step} after forward: {name} {'kept' if kept else 'resharded'}", numel, want)
    counts = [len(list(layer.parameters())) for layer in children]
    check_step_collectives(checks, recorders, mesh, counts, len(root_own), comm_fusion)


def several_forwards_match_ddp(reshard_after_forward: bool) -> None:
    """Three forwards (one feeding another's output back in) before one backward, 3 steps = DDP."""
    checks = StrictChecks("FSDP 1D fp32")
    model = MLP((5, 5, 5))
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=checks.mesh, reshard_after_forward=reshard_after_forward)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(m(x)).square().mean() + m(x * 2).mean()

    train_against(checks, model, ddp, rank_batches(checks.rank, (4, 5), steps=STEPS), loss_fn, checks.tol)


def unused_module_matches_ddp() -> None:
    """A head unused in a step has no grad that step (as with DDP(find_unused_parameters=True));
    3 steps alternating heads = DDP."""
    checks = StrictChecks("FSDP 1D fp32")
    model = BranchyNet()
    ddp = ddp_of(model, find_unused_parameters=True)
    shard_nested(model, (model.trunk, model.head_a, model.head_b), mesh=checks.mesh)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, str]) -> torch.Tensor:
        x, head = batch
        return m(x, head).square().mean()

    batches = [(rank_batch(step, checks.rank, (4, 6)), head) for step, head in enumerate("aba")]
    train_against(checks, model, ddp, batches, loss_fn, checks.tol)


def tied_weights_match_ddp() -> None:
    """Embedding and output projection share one weight in the root's group; the tie survives
    sharding and training, and 3 steps = DDP."""
    checks = StrictChecks("FSDP 1D fp32")
    model = TiedEmbeddingNet()
    ddp = ddp_of(model)
    shard_nested(model, [model.mid], mesh=checks.mesh)
    checks.true("tied after sharding", model.out.weight is model.embed.weight)

    def loss_fn(m: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten())

    batches = [rank_tokens(step, checks.rank, (3, 5), vocab=11) for step in range(STEPS)]
    train_against(checks, model, ddp, batches, loss_fn, checks.tol)
    checks.true("tied after training", model.out.weight is model.embed.weight)


def checkpointed_matches_reference(use_reentrant: bool, bf16: bool) -> None:
    """Each sharded layer runs under torch's activation checkpoint, so its forward (unshard, cast)
    runs again inside backward; 3 steps equal the baseline without AC: DDP in fp32, the same-dtype
    reference under a bf16/fp32 policy. The recompute sees the compute-dtype params."""
    # no precision-matrix row for AC with bf16: the bf16 compute row decides
    checks = StrictChecks("FSDP 1D bf16" if bf16 else "AC + FSDP fp32")
    compute = torch.bfloat16 if bf16 else torch.float32
    model = MLP(DIMS)
    for i, layer in enumerate(model.layers):
        model.layers[i] = Checkpointed(layer, use_reentrant)
    if bf16:
        reference = SameDtypeReference(model, torch.bfloat16, torch.float32)
        unchecked = reference.compute.layers
    else:
        reference = ddp_of(model)
        unchecked = reference.module.layers
    for wrapper in unchecked:
        wrapper.enabled = False  # the baseline runs without activation checkpointing
    policy = impl.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else impl.MixedPrecisionPolicy()
    shard_nested(model, [wrapper.inner for wrapper in model.layers], mesh=checks.mesh, mp_policy=policy)
    seen: list[torch.dtype] = []  # the middle layer's weight dtype at each of its forwards
    model.layers[1].inner.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))

    batches = [x.requires_grad_(use_reentrant) for x in rank_batches(checks.rank, (4, DIMS[0]), steps=STEPS)]
    train_against(checks, model, reference, batches, square_mean, checks.tol)
    checks.equal("checkpointed layer forwards (forward and recompute per step)", len(seen), 2 * STEPS)
    checks.equal("param dtype in forward and recompute", str(sorted({str(d) for d in seen})), str([str(compute)]))


class _ByKeyword(nn.Module):
    """A layer its parent calls with the input by keyword: the forward's inputs are walked, not taken
    as plain positional tensors."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class _Chain(nn.Module):
    """Blocks in a row, each called positionally or by keyword."""

    def __init__(self, by_keyword: bool) -> None:
        super().__init__()
        layers = MLP(DIMS).layers
        self.blocks = nn.ModuleList(_ByKeyword(layer) for layer in layers) if by_keyword else layers
        self.by_keyword = by_keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x=x) if self.by_keyword else block(x))
        return x


def each_group_reshards_when_its_backward_is_done(by_keyword: bool) -> None:
    """A group's post-backward runs once autograd is done with its module (its inputs' grads made),
    not at the end of backward: while the first block's backward runs, every block after it is
    resharded already (its params registered as DTensors again), as in FSDP2, which frees them early."""
    checks = StrictChecks("FSDP 1D fp32")
    model = _Chain(by_keyword)
    shard_nested(model, model.blocks, mesh=checks.mesh)
    resharded: list[bool] = []

    def probe(grad: torch.Tensor) -> None:  # the grad of the first block's output: the later blocks are done
        resharded.extend(all(isinstance(p, DTensor) for p in block.parameters()) for block in model.blocks[1:])

    def hook_output(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.register_hook(probe)

    model.blocks[0].register_forward_hook(hook_output)
    model(rank_batch(0, checks.rank, (4, DIMS[0]))).square().mean().backward()
    checks.equal("later blocks probed during the first block's backward", len(resharded), len(DIMS) - 2)
    checks.true("each later block resharded by then", all(resharded))
