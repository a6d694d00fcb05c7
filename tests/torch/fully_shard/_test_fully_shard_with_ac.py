"""Plan cases of ``_test_fully_shard_with_ac.py``: fully_shard with activation checkpointing
(L2-03..06), through torch's own utilities: ``torch.utils.checkpoint`` re-entrant and not, torch's
selective checkpoint contexts for op-level recomputation, and ``torch.autograd.graph.save_on_cpu``
holding what autograd saves (checkpoints' inputs too) on the host until backward.

Every case trains a stack of residual feed-forward blocks, each block its own fully_shard group,
against the single-device fp32 model without checkpointing on the global batch. Checkpointing
changes when forwards run, not what they compute: loss, grads and params must agree.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.checks import device_type
from tests.kit.judging.memory import peak_memory
from tests.kit.judging.reference import GlobalBatchReference
from tests.kit.judging.tolerances import Tolerance
from tests.kit.workloads.models import Checkpointed, FeedForwardStack, rank_batches, without_checkpointing
from tests.kit.workloads.training import (
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
    """Non-re-entrant checkpointing of every block, fused and unfused: as L2-03; and the peak memory
    of a forward + backward (live storages on the CPU, params and grads included; the allocator's
    peak on an accelerator) is below the same sharded model's without AC, both drawn."""
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
        with peak_memory(device_type(), holding=[model]) as peak:
            square_mean(model, batch).backward()
        peaks[label] = peak
        ctx.bar("peak memory of a forward + backward (bytes, rank 0)", label, peak=peak.bytes, saved=peak.saved_bytes)
    without, with_ac = peaks["without AC"], peaks["with AC"]
    ctx.require(
        "the model without AC holds activations for backward", without.saved_bytes > 0, str(without.saved_bytes)
    )
    ctx.true(
        f"peak memory with AC < without AC ({with_ac.what})",
        with_ac.bytes < without.bytes,
        with_ac.bytes,
        without.bytes,
    )
    with ctx.extra("what the peak is made of: AC lowers the bytes autograd keeps for backward"):
        ctx.true(
            "bytes saved for backward with AC < without AC",
            with_ac.saved_bytes < without.saved_bytes,
            with_ac.saved_bytes,
            without.saved_bytes,
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


class WatchedOffload(torch.autograd.graph.save_on_cpu):
    """torch's ``save_on_cpu``, watched: what each tensor autograd saves was packed from and into
    (the devices of the tensors in what torch's pack hook returns), inside which block, and what
    its unpack hook handed back in backward. The packing itself is torch's."""

    def __init__(self, compute: str) -> None:
        accelerator = compute != "cpu"
        if accelerator:
            super().__init__(pin_memory=True, device_type=compute)
        else:  # pinning needs an accelerator; on the host itself the copy is the tensor itself
            super().__init__(pin_memory=False)
        self.block: str | None = None  # the checkpointed block whose forward is running
        self.packed: list[tuple[str | None, str, set[str], bool]] = []  # (block, from, into, pinned)
        self.restored: list[tuple[str, int]] = []  # (device, data_ptr) of what unpack handed back
        pack, unpack = self.pack_hook, self.unpack_hook

        def watched_pack(tensor: torch.Tensor) -> Any:
            packed = pack(tensor)
            held = [t for t in tree_leaves(packed) if isinstance(t, torch.Tensor)]
            pinned = all(t.is_pinned() for t in held) if accelerator else False
            self.packed.append((self.block, tensor.device.type, {t.device.type for t in held}, pinned))
            return packed

        def watched_unpack(packed: Any) -> torch.Tensor:
            tensor = unpack(packed)
            self.restored.append((tensor.device.type, tensor.data_ptr()))
            return tensor

        self.pack_hook, self.unpack_hook = watched_pack, watched_unpack

    def watch(self, blocks: dict[str, nn.Module]) -> list[Any]:
        """Mark the packs made while each named block's forward runs; returns the hook handles."""
        handles = []
        for name, block in blocks.items():

            def enter(module: nn.Module, args: tuple, name: str = name) -> None:
                self.block = name

            def leave(module: nn.Module, args: tuple, output: Any) -> None:
                self.block = None

            handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
        return handles


class RecomputeInputs:
    """The devices and storages of the inputs the checkpointed blocks' recomputation runs on."""

    def __init__(self, blocks: dict[str, nn.Module]) -> None:
        self.recording = False
        self.devices: set[str] = set()
        self.pointers: dict[str, int] = {}
        for name, block in blocks.items():
            block.register_forward_pre_hook(functools.partial(self._seen, name))

    def _seen(self, name: str, module: nn.Module, args: tuple) -> None:
        if self.recording:
            self.devices.update(a.device.type for a in args if isinstance(a, torch.Tensor))
            self.pointers[name] = args[0].data_ptr()


# checkpointed blocks, re-entrant and not; both save the checkpoint's inputs through the hooks
# that are active in forward, here torch's save_on_cpu
CHECKPOINTED_AND_OFFLOADED = {1: "reentrant", 3: "non_reentrant", 5: "reentrant"}


@case(
    "L2-06",
    "test_ac_activation_swap_fsdp",
    world_size=2,
    mesh={"dp": 2},
    config="AC + swap + FSDP fp32",
    needs=("activation_checkpointing",),
)
def ac_activation_swap_fsdp(ctx: CaseContext) -> None:
    """Activation checkpointing and activation offload together, through torch's own mechanisms:
    blocks 1, 3, 5 checkpointed (re-entrant, not, re-entrant), the whole forward under ``save_on_cpu``, so what
    autograd keeps (the other blocks' activations, and the checkpoints' saved inputs) lives on the
    host and comes back for backward, and the recomputation runs on what came back. Loss, grad norm
    and grads within 1e-5 of the single-device model without either. On an accelerator: the saved
    tensors were on the (pinned) host, came back on the compute device, and the recomputation ran
    there (no device mismatch); on a CPU-only host that device part is noted as not run."""
    model = _stack(CHECKPOINTED_AND_OFFLOADED)
    reference = GlobalBatchReference(without_checkpointing(model))
    checkpointed = {f"blocks.{i}": model.blocks[i] for i in CHECKPOINTED_AND_OFFLOADED}
    forwards = _block_forwards(model)
    recompute = RecomputeInputs({name: block.inner for name, block in checkpointed.items()})
    shard_nested(model, model.blocks, mesh=ctx.mesh)
    compute = device_type()
    offloads: list[WatchedOffload] = []

    def offloaded_step(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        offload = WatchedOffload(compute)
        handles = offload.watch(checkpointed)
        with offload:
            loss = square_mean(module, batch)
        for handle in handles:
            handle.remove()
        forwards.reset()  # what runs from here on is the recomputation
        recompute.recording = True
        loss.backward()
        recompute.recording = False
        offloads.append(offload)
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
        model_step=offloaded_step,
        mean_loss_over_ranks=True,
    )
    recomputed = {name for name, runs in forwards.counts.items() if runs}
    ctx.equal("blocks recomputed in the last backward", str(sorted(recomputed)), str(sorted(checkpointed)))
    for step, offload in enumerate(offloads):
        where = f"step {step}"
        in_checkpoints = {block for block, *_ in offload.packed if block is not None}
        ctx.equal(
            f"{where}: checkpointed blocks whose saved inputs went through save_on_cpu",
            str(sorted(in_checkpoints)),
            str(sorted(checkpointed)),
        )
        # how many tensors autograd saves is torch's (2.9 saves one more than 2.13): the count is no verdict
        handed_back = len(offload.restored) == len(offload.packed)
        ctx.true(f"{where}: saved tensors handed back in backward", handed_back, len(offload.restored), "all packed")
    restored = {pointer for _, pointer in offloads[-1].restored}
    consumed = sorted(name for name, pointer in recompute.pointers.items() if pointer in restored)
    ctx.equal(
        "checkpointed blocks recomputed from what save_on_cpu handed back (last step)",
        str(consumed),
        str(sorted(checkpointed)),
    )
    if compute == "cpu":
        ctx.notes.append(
            "device part: not run (no accelerator: the compute device is the host, so offloaded tensors never "
            "leave it and a device mismatch cannot occur)"
        )
        return
    for step, offload in enumerate(offloads):
        where = f"step {step}"
        held = sorted({d for *_, into, _ in offload.packed for d in into})
        ctx.equal(f"{where}: devices the saved tensors were held on", str(held), "['cpu']")
        ctx.true(f"{where}: host copies pinned", all(pinned for *_, pinned in offload.packed))
        back = sorted({device for device, _ in offload.restored})
        ctx.equal(f"{where}: devices the saved tensors came back on", str(back), str([compute]))
    ctx.equal("devices the recomputation ran on (last step)", str(sorted(recompute.devices)), str([compute]))
