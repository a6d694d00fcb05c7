"""Plan cases of ``_test_fully_shard_with_ac.py``: fully_shard with activation checkpointing
(L2-03..06), through torch's own utilities: ``torch.utils.checkpoint`` re-entrant and not, torch's
selective checkpoint contexts for op-level recomputation, and saved-tensor hooks that swap
activations to host memory and back.

Every case trains a stack of residual feed-forward blocks, each block its own fully_shard group,
against the single-device fp32 model without checkpointing on the global batch. Checkpointing
changes when forwards run, not what they compute: loss, grads and params must agree.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from tests.kit.case import CaseContext, case
from tests.kit.checks import device_type
from tests.kit.memory import peak_memory
from tests.kit.models import Checkpointed, FeedForwardStack, rank_batches, without_checkpointing
from tests.kit.reference import GlobalBatchReference
from tests.kit.tolerances import Tolerance
from tests.kit.training import (
    ForwardLog,
    differs_across_ranks,
    grad_norm,
    named_params,
    shard_nested,
    square_mean,
    train_against,
)

DIM, HIDDEN, DEPTH = 16, 32, 6
BATCH = (8, DIM)


def _sgd(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum, not Adam: the single-device model sums a batch twice as long in another
    order than the ranks' average, so grads differ by rounding (~1e-8, checked at 1e-5); Adam
    divides each grad by its own running magnitude and turns that rounding on near-zero grads of
    ReLU units into 1e-4 param differences after two steps, a property of Adam, not of FSDP."""
    return torch.optim.SGD(params, lr=1e-1, momentum=0.9)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Op-level selective checkpointing: keep matmul outputs, recompute everything else."""
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE


SELECTIVE_OPS = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)


def _stack(kinds: dict[int, str]) -> FeedForwardStack:
    """The block stack with ``kinds[i]`` checkpointing on block i: ``reentrant``, ``non_reentrant``
    or ``ops`` (selective: torch's checkpoint contexts decide per op)."""
    model = FeedForwardStack(DIM, HIDDEN, DEPTH)
    for i, kind in kinds.items():
        context_fn = SELECTIVE_OPS if kind == "ops" else None
        model.blocks[i] = Checkpointed(model.blocks[i], use_reentrant=kind == "reentrant", context_fn=context_fn)
    return model


def _block_forwards(model: FeedForwardStack) -> ForwardLog:
    """Forward calls of each block's own module (inside its checkpoint wrapper, if any)."""
    blocks = {f"blocks.{i}": getattr(b, "inner", b) for i, b in enumerate(model.blocks)}
    return ForwardLog(blocks)


def _train_checkpointed(
    ctx: CaseContext, label: str, kinds: dict[int, str], tol: Tolerance, inside: bool = False, **options: Any
) -> ForwardLog:
    """Two Adam steps of the checkpointed stack against the single-device model without AC: loss,
    global and per-block grad norms, every grad and param; checkpointed blocks must have run their
    forward twice per step (else the case proves nothing), the others once. ``inside`` shards the
    block inside each checkpoint (``checkpoint(sharded_block, x)``, as Hugging Face models do)
    rather than the checkpoint wrapper (as torchtitan does)."""
    model = _stack(kinds)
    reference = GlobalBatchReference(without_checkpointing(model))
    forwards = _block_forwards(model)
    groups = [getattr(block, "inner", block) for block in model.blocks] if inside else model.blocks
    shard_nested(model, groups, mesh=ctx.mesh, **options)
    batches = rank_batches(ctx.rank, BATCH)
    ctx.require(f"{label}: ranks' batches differ (the global batch is not a rank's)", differs_across_ranks(batches[0]))

    def per_step(step: int) -> None:
        for i in range(DEPTH):
            runs, want = forwards.counts[f"blocks.{i}"], 2 if i in kinds else 1
            what = "checkpointed: forward and recompute" if i in kinds else "not checkpointed: forward only"
            ctx.require(f"{label} step {step} blocks.{i} forwards ({what})", runs == want, f"{runs} != {want}")
        ours, ref = named_params(model), named_params(reference)
        for i in range(DEPTH):
            prefix = f"blocks.{i}."
            block = {n: p for n, p in ours.items() if n.startswith(prefix)}
            ref_block = {n: p for n, p in ref.items() if n.startswith(prefix)}
            ctx.close(f"{label} step {step} grad norm blocks.{i}", grad_norm(block), grad_norm(ref_block), tol.grad)
        forwards.reset()

    train_against(
        ctx,
        model,
        reference,
        batches,
        square_mean,
        tol,
        make_optimizer=_sgd,
        label=label,
        after_backward=per_step,
        before_step=lambda step: forwards.reset(),
        mean_loss_over_ranks=True,
    )
    return forwards


@case(
    "L2-03",
    "test_reentrant_ac_fsdp",
    world_size=2,
    mesh={"dp": 2},
    config="AC + FSDP fp32",
    needs=("activation_checkpointing",),
)
def reentrant_ac_fsdp(ctx: CaseContext) -> None:
    """Re-entrant checkpointing (``use_reentrant=True``) of every block but the first (whose input,
    the data, needs no grad: a re-entrant checkpoint there would cut its params off the graph),
    params resharded after forward or kept, and with the blocks sharded inside the checkpoint: loss,
    per-block grad norms and every grad (the first and last blocks' too) within 1e-5 of the
    single-device model without AC."""
    every = dict.fromkeys(range(1, DEPTH), "reentrant")
    _train_checkpointed(ctx, "reshard after forward", every, ctx.tol, reshard_after_forward=True)
    ctx.run_part(
        "params kept after forward",
        ("reshard_after_forward",),
        lambda: _train_checkpointed(ctx, "kept after forward", every, ctx.tol, reshard_after_forward=False),
    )
    # the recompute runs the sharded block's forward inside backward: it must gather the params again
    _train_checkpointed(ctx, "sharded inside the checkpoint", every, ctx.tol, inside=True, reshard_after_forward=True)


@case(
    "L2-04",
    "test_nonreentrant_ac_fsdp",
    world_size=2,
    mesh={"dp": 2},
    config="AC + FSDP fp32",
    needs=("activation_checkpointing",),
)
def nonreentrant_ac_fsdp(ctx: CaseContext) -> None:
    """Non-re-entrant checkpointing of every block, fused and unfused: as L2-03; and the peak bytes
    held for backward (CUDA: allocator peak) of a forward + backward are below the same sharded
    model's without AC, both shown."""
    every = dict.fromkeys(range(DEPTH), "non_reentrant")
    _train_checkpointed(ctx, "fused", every, ctx.tol)
    ctx.run_part(
        "unfused", ("comm_fusion",), lambda: _train_checkpointed(ctx, "unfused", every, ctx.tol, comm_fusion=False)
    )
    peaks = {}
    batch = rank_batches(ctx.rank, (64, DIM), steps=1, first=40)[0]
    for label, kinds in (("without AC", {}), ("with AC", every)):
        model = _stack(kinds)
        shard_nested(model, model.blocks, mesh=ctx.mesh)
        with peak_memory(device_type()) as peak:
            square_mean(model, batch).backward()
        peaks[label] = peak
    without, with_ac = peaks["without AC"].bytes, peaks["with AC"].bytes
    ctx.require("the model without AC holds activations for backward", without > 0, str(without))
    ctx.true(
        f"peak bytes held for backward with AC < without AC ({peaks['with AC'].what})",
        with_ac < without,
        with_ac,
        without,
    )


@case(
    "L2-05",
    "test_selective_ac_fsdp",
    world_size=2,
    mesh={"dp": 2},
    config="AC + FSDP fp32",
    needs=("activation_checkpointing",),
)
def selective_ac_fsdp(ctx: CaseContext) -> None:
    """Selective checkpointing: every other block whole (blocks 1, 3: re-entrant and not), one block
    op by op with torch's selective checkpoint contexts (block 5: matmuls kept, the rest
    recomputed), blocks 0, 2, 4 not at all. Checkpointed blocks' forward hooks fire twice per step,
    the others once; loss and grads as L2-03."""
    kinds = {1: "reentrant", 3: "non_reentrant", 5: "ops"}
    _train_checkpointed(ctx, "selective", kinds, ctx.tol)


class HostSwap:
    """Saved-tensor hooks that swap what autograd saves to host memory and back to the compute
    device when backward needs it. On CUDA the host copy is pinned; on a CPU-only host it is a
    real copy into a separate buffer, and the restored tensor another copy, so no saved tensor is
    the original. Counts the bytes moved both ways and remembers the originals weakly, to show
    they were freed (autograd no longer holds them)."""

    def __init__(self) -> None:
        self.bytes_out = 0
        self.bytes_back = 0
        self.restored_on: set[str] = set()
        self.originals: list[weakref.ref] = []
        self.freed_before_backward = 0

    def pack(self, tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        host.copy_(tensor)
        self.bytes_out += tensor.numel() * tensor.element_size()
        self.originals.append(weakref.ref(tensor))
        return tensor.device, host

    def unpack(self, packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, host = packed
        back = torch.empty(host.size(), dtype=host.dtype, device=device)
        back.copy_(host)
        self.bytes_back += back.numel() * back.element_size()
        self.restored_on.add(back.device.type)
        return back

    def freed(self) -> int:
        """Originals no longer alive."""
        return sum(ref() is None for ref in self.originals)


class Swapped(nn.Module):
    """Runs ``inner`` with what autograd saves in it swapped out by ``swap`` (None: as it is). Swap
    and checkpointing take turns by block: torch's checkpoint does not recompute under outer
    saved-tensor hooks, so the swapped blocks are the ones not checkpointed."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.swap: HostSwap | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swap is None:
            return self.inner(x)
        with torch.autograd.graph.saved_tensors_hooks(self.swap.pack, self.swap.unpack):
            return self.inner(x)


def _swapping(model: nn.Module) -> list[Swapped]:
    return [m for m in model.modules() if isinstance(m, Swapped)]


@case(
    "L2-06",
    "test_ac_activation_swap_fsdp",
    world_size=2,
    mesh={"dp": 2},
    config="AC + swap + FSDP fp32",
    needs=("activation_checkpointing",),
)
def ac_activation_swap_fsdp(ctx: CaseContext) -> None:
    """Blocks 1, 3, 5 checkpointed (non-re-entrant), blocks 0, 2, 4 with every tensor autograd saves
    swapped to host memory and back: loss, grad norm and grads within 1e-5 of the single-device
    model; the restored tensors are on the compute device; the recomputation runs on the compute
    device; the bytes moved out and back are shown, and the swapped-out originals were freed
    before backward (autograd held only the host copies)."""
    model = _stack({1: "non_reentrant", 3: "non_reentrant", 5: "non_reentrant"})
    for i in (0, 2, 4):
        model.blocks[i] = Swapped(model.blocks[i])
    reference = GlobalBatchReference(without_checkpointing(model))  # its Swapped blocks never swap
    forwards = _block_forwards(model)
    shard_nested(model, model.blocks, mesh=ctx.mesh)
    compute = device_type()
    swaps: list[HostSwap] = []

    def swapped_step(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        swap = HostSwap()
        for block in _swapping(module):
            block.swap = swap
        loss = square_mean(module, batch)
        swap.freed_before_backward = swap.freed()
        forwards.reset()  # what runs from here on is the recomputation
        loss.backward()
        for block in _swapping(module):
            block.swap = None
        swaps.append(swap)
        return loss

    batches = rank_batches(ctx.rank, BATCH)
    train_against(
        ctx,
        model,
        reference,
        batches,
        square_mean,
        ctx.tol,
        make_optimizer=_sgd,
        model_step=swapped_step,
        mean_loss_over_ranks=True,
    )
    for step, swap in enumerate(swaps):
        where = f"step {step}"
        ctx.true(f"{where}: bytes swapped to host", swap.bytes_out > 0, swap.bytes_out, "> 0")
        ctx.equal(f"{where}: bytes restored == bytes swapped out", swap.bytes_back, swap.bytes_out)
        ctx.equal(f"{where}: devices of restored tensors", str(sorted(swap.restored_on)), str([compute]))
        ctx.true(
            f"{where}: originals freed before backward (of {len(swap.originals)} swapped)",
            swap.freed_before_backward > 0,
            swap.freed_before_backward,
            "> 0",
        )
    recomputed = {name for name, runs in forwards.counts.items() if runs}
    ctx.equal("blocks recomputed in the last backward", str(sorted(recomputed)), "['blocks.1', 'blocks.3', 'blocks.5']")
    ctx.equal("devices the recomputation ran on (last step)", str(sorted(forwards.devices)), str([compute]))
    ctx.keep(host_swaps=swaps)
