"""Plan cases of ``_test_fully_shard_module.py``: the HSDPModule controls (L0-08/09, L1-01..05, L1-09)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tests.kit.judging.case import CaseContext, case
from tests.kit.judging.layout import (
    local_numel,
    local_numels,
    local_numels_after_forward,
    numels,
    padded_shard_numel,
)
from tests.kit.judging.recorder import CollectiveRecorder, record_collectives
from tests.kit.judging.reference import ddp_of, full, gather_from
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import specific
from tests.kit.workloads.models import DIMS, MLP, rank_batch, rank_batches
from tests.kit.workloads.training import (
    differs_across_ranks,
    grad_norm,
    named_params,
    raises_nothing,
    record_grads,
    record_params,
    shard_nested,
    sharded_modules,
    square_mean,
    step_optimizers,
    train_accumulating_against,
    train_against,
)

MICRO_BATCHES = 2


def _micro_batches(rank: int, steps: int = 2) -> list[list]:
    """Per optimizer step, ``MICRO_BATCHES`` batches that differ per rank, step and micro-batch."""
    return [rank_batches(rank, (4, DIMS[0]), MICRO_BATCHES, first=10 * step) for step in range(steps)]


@case(
    "L0-08",
    "test_set_requires_gradient_sync",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("gradient_sync",),
)
def requires_gradient_sync(ctx: CaseContext) -> None:
    """set_requires_gradient_sync(False) issues no reduction and accumulates locally; the next
    syncing backward reduce-scatters every group, and the result equals DDP with no_sync."""
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    step_batches = _micro_batches(ctx.rank)
    # equal rank data would hide a sync that reduced only the last micro-batch
    ctx.require("ranks' micro-batches differ", differs_across_ranks(step_batches[0][0]))

    def communication(step: int, micro: int, rec: CollectiveRecorder) -> None:
        syncing = micro == MICRO_BATCHES - 1
        where = f"step {step} micro {micro} sync {'on' if syncing else 'off'}"
        if syncing:
            issued = len(rec.of("reduce_scatter"))
            ctx.true(f"{where}: reduce-scatters issued", issued > 0, issued, "> 0")
        else:
            ctx.equal(f"{where}: reductions", len(rec.of("reduce_scatter")) + len(rec.of("all_reduce")), 0)

    train_accumulating_against(
        ctx,
        model,
        ddp,
        step_batches,
        square_mean,
        ctx.tol,
        accumulate=lambda holding: model.set_requires_gradient_sync(not holding),
        after_micro=communication,
    )


def _layer_of_gather(model: MLP, world: int) -> dict[int, int]:
    """All-gather element count -> the layer it gathers, whether an implementation gathers a layer
    in one collective (its params' padded shards back to back) or one per param."""
    owners: dict[int, set[int]] = {}
    for i, layer in enumerate(model.layers):
        per_param = [padded_shard_numel([p], world) for p in layer.parameters()]
        for numel in [padded_shard_numel(layer, world), *per_param]:
            owners.setdefault(numel, set()).add(i)
    # a size two layers share would be ambiguous: -1
    return {numel: min(layers) if len(layers) == 1 else -1 for numel, layers in owners.items()}


def _gathered_layers(rec: CollectiveRecorder, layer_of: dict[int, int]) -> list[int | None]:
    """The layers gathered, in issue order (consecutive gathers of one layer counted once)."""
    order: list[int | None] = []
    for call in rec.of("all_gather"):
        layer = layer_of.get(call.numel)
        if not order or order[-1] != layer:
            order.append(layer)
    return order


def _train_recording_gathers(
    ctx: CaseContext, mesh, label: str, lists: bool
) -> tuple[dict[int, int], list[tuple[CollectiveRecorder, CollectiveRecorder]]]:
    """Train the 3-layer MLP like DDP, each layer its own group resharded after forward, with the
    prefetch lists (forward 0, 2, 1; backward 2, 0, 1) or without; each step's forward and backward
    collectives, and the gather sizes' layers."""
    model = MLP(DIMS)
    ddp = ddp_of(model)
    layer_of = _layer_of_gather(model, ctx.world_size)
    # resharded after forward (explicitly: the default's meaning is no business of this case), so
    # backward gathers every layer again
    first, middle, last = shard_nested(model, model.layers, mesh=mesh, reshard_after_forward=True).layers
    if lists:  # natural orders: forward 0, 1, 2 and backward 2, 1, 0
        first.set_modules_to_forward_prefetch([last, middle])
        last.set_modules_to_backward_prefetch([first, middle])
    phases: list[tuple[CollectiveRecorder, CollectiveRecorder]] = []

    def forward_then_backward(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with record_collectives() as forward:
            loss = square_mean(module, batch)
        with record_collectives() as backward:
            loss.backward()
        phases.append((forward, backward))
        return loss

    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, label=label, model_step=forward_then_backward)
    return layer_of, phases


def _prefetch_lists_order_gathers(ctx: CaseContext, mesh) -> None:
    layer_of, phases = _train_recording_gathers(ctx, mesh, "prefetch", lists=True)
    ctx.require("every layer's gathers have sizes of their own", -1 not in layer_of.values(), str(layer_of))
    for step, (forward, backward) in enumerate(phases):
        where = f"prefetch step {step}"
        ctx.equal(f"{where} forward all-gather order", str(_gathered_layers(forward, layer_of)), "[0, 2, 1]")
        ctx.equal(f"{where} backward all-gather order", str(_gathered_layers(backward, layer_of)), "[2, 0, 1]")


def _default_order_gathers_each_layer_once(ctx: CaseContext, mesh) -> None:
    """Without prefetch lists, backward gathers each layer once, last layer first, and ahead of
    need: an implicit prefetch that picks a finished layer gathers nothing early (or twice)."""
    layer_of, phases = _train_recording_gathers(ctx, mesh, "no lists", lists=False)
    with ctx.extra("beyond the plan's lists: the default backward order gathers no layer twice, ahead of need"):
        for step, (_, backward) in enumerate(phases):
            order = str(_gathered_layers(backward, layer_of))
            ctx.equal(f"no lists step {step} backward all-gather order", order, "[2, 1, 0]")
            events = _backward_events(backward, layer_of, ctx.world_size)
            for layer in (1, 0):
                gathered, reduced = events.index(f"AG{layer}"), events.index(f"RS{layer + 1}")
                ctx.true(
                    f"no lists step {step}: layer {layer} gathered before layer {layer + 1}'s grads are reduced",
                    gathered < reduced,
                    " ".join(events),
                )


def _backward_events(rec: CollectiveRecorder, layer_of: dict[int, int], world: int) -> list[str]:
    """Gathers and reduce-scatters in issue order, as ``AG<layer>`` / ``RS<layer>`` (once per layer)."""
    events: list[str] = []
    for call in rec.calls:
        if call.op == "all_gather":
            event = f"AG{layer_of.get(call.numel)}"
        elif call.op == "reduce_scatter":
            event = f"RS{layer_of.get(call.numel // world)}"
        else:
            continue
        if event not in events:
            events.append(event)
    return events


def _not_last_backward_defers_reductions(ctx: CaseContext, mesh) -> None:
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=mesh)

    def deferred(step: int, micro: int, rec: CollectiveRecorder) -> None:
        if micro == MICRO_BATCHES - 1:
            return
        where = f"deferred step {step} micro {micro}"
        issued = len(rec.of("reduce_scatter"))
        ctx.true(f"{where}: reductions issued (sync is on)", issued > 0, issued, "> 0")
        with ctx.extra("our engine leaves the reductions of a non-last backward in flight"):
            ctx.equal(f"{where}: grads landed", sum(p.grad is not None for p in model.parameters()), 0)

    train_accumulating_against(
        ctx,
        model,
        ddp,
        _micro_batches(ctx.rank),
        square_mean,
        ctx.tol,
        accumulate=lambda holding: model.set_is_last_backward(not holding),
        label="deferred",
        after_micro=deferred,
    )


@case(
    "L0-09",
    "test_prefetch_and_last_backward",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("prefetch", "last_backward", "reshard_after_forward"),
)
def prefetch_and_last_backward(ctx: CaseContext) -> None:
    """Forward/backward prefetch lists decide the order of all-gathers (without lists, backward
    gathers each layer once, last first: extra); set_is_last_backward(False) issues the reductions
    but defers applying them; all train like DDP."""
    mesh = ctx.mesh
    _prefetch_lists_order_gathers(ctx, mesh)
    _default_order_gathers_each_layer_once(ctx, mesh)
    _not_last_backward_defers_reductions(ctx, mesh)


# -- L1: HSDPModule interface, one control at a time ----------------------------------------
LR = 1e-2
# (reshard_after_forward, reshard_after_backward) per step: each flag goes off and back on
RESHARD_PLAN = ((False, True), (True, False), (False, False), (True, True))
ROOT_OWN = ("layers.2.weight", "layers.2.bias")  # with layers 0 and 1 sharded on their own


def _record_numels(ctx: CaseContext, where: str, model: nn.Module, want: dict[str, int], names: Iterable[str]) -> None:
    numels = local_numels(model)
    for name in names:
        ctx.equal(f"{where}: local numel {name}", numels[name], want[name])


def _reshard_all(model: nn.Module) -> None:
    for module in sharded_modules(model):
        module.reshard()


@case(
    "L1-01",
    "test_dynamic_reshard_control",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("reshard_controls",),
)
def dynamic_reshard_control(ctx: CaseContext) -> None:
    """set_reshard_after_forward / set_reshard_after_backward, toggled off and back on between
    steps, decide whether forward / backward leave every managed param unsharded (full numel) or
    sharded (shard numel); toggling raises nothing and every step trains like DDP. Params kept
    unsharded after backward are resharded by the user (``reshard()``) before the optimizer steps
    the shards. Beyond the plan (extra): our engine also notices an optimizer step made kept
    unsharded params stale, without that reshard."""
    model = MLP(DIMS)
    ddp = ddp_of(model)
    full_numel, shard_numel = numels(model, ctx.world_size, ctx.rank)
    ctx.require("every param splits over the ranks", all(shard_numel[n] < full_numel[n] for n in full_numel))
    # layers 0 and 1 get groups of their own; the root's group holds layer 2
    shard_nested(model, model.layers[:2], mesh=ctx.mesh)
    after_forward = local_numels_after_forward(model)

    def toggle(step: int) -> None:
        forward, backward = RESHARD_PLAN[step]
        raises_nothing(
            ctx,
            f"step {step}: set_reshard_after_forward({forward}), set_reshard_after_backward({backward}) raise nothing",
            lambda: (model.set_reshard_after_forward(forward), model.set_reshard_after_backward(backward)),
        )

    def layouts(step: int) -> None:
        forward, backward = RESHARD_PLAN[step]
        want = shard_numel if forward else full_numel
        where = f"step {step} reshard_after_forward={forward}: after forward"
        for name, numel in after_forward[step].items():
            ctx.equal(f"{where}: local numel {name}", numel, want[name])
        want = shard_numel if backward else full_numel
        where = f"step {step} reshard_after_backward={backward}: after backward"
        _record_numels(ctx, where, model, want, full_numel)
        if not backward:  # the optimizer steps the shards: drop the unsharded copies first
            _reshard_all(model)

    batches = rank_batches(ctx.rank, (4, DIMS[0]), steps=len(RESHARD_PLAN))
    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, before_step=toggle, after_backward=layouts)
    with ctx.extra("a forward after an optimizer step regathers params kept unsharded through it"):
        _stale_copies_noticed(ctx)


def _stale_copies_noticed(ctx: CaseContext) -> None:
    """Backward keeps the params unsharded, the optimizer steps the shards, and the next step
    (resharding again) still trains like DDP: the stale unsharded copies were not used."""
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers[:2], mesh=ctx.mesh)

    def keep_then_reshard(step: int) -> None:
        model.set_reshard_after_backward(step != 0)

    batches = rank_batches(ctx.rank, (4, DIMS[0]), steps=2, first=70)
    train_against(ctx, model, ddp, batches, square_mean, ctx.tol, label="stale copies", before_step=keep_then_reshard)


@case(
    "L1-02",
    "test_set_requires_all_reduce",
    world_size=4,
    mesh={"replicate": 2, "shard": 2},
    config="HSDP 2D fp32",
    needs=("hsdp", "all_reduce_control"),
)
def set_requires_all_reduce(ctx: CaseContext) -> None:
    """HSDP on a (replicate 2, shard 2) mesh. All-reduce on: the two replica groups' grads agree
    within 1e-6 and equal DDP over all 4 ranks. Off: no all-reduce, each replica group's grads are
    its own average (= DDP over its 2 ranks) and differ from the other's. recurse=False on the root:
    only the root's own group skips the all-reduce."""
    mesh = ctx.mesh
    # replicas: my rank and the one holding my shard in the other replica group; shards: my replica group
    replicas, shards = impl.process_group(mesh, "replicate"), impl.process_group(mesh, "shard")
    me = impl.local_rank(mesh, "replicate")
    agree, tol = specific("replica agreement"), ctx.tol
    batches = rank_batches(ctx.rank, (4, DIMS[0]))
    ctx.require("the replica groups' batches differ", differs_across_ranks(batches[0], replicas))

    def mine_and_peers(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """My local grad shard and the other replica group's grad of the same shard."""
        gathered = gather_from(impl.local(grad), replicas)
        return gathered[me], gathered[1 - me]

    def grads_present(label: str, model: nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The grads of ``names``; a missing one is a failed check (every rank misses the same ones)."""
        params = named_params(model)
        present = {name: params[name].grad for name in names if params[name].grad is not None}
        for name in names:
            if name not in present:
                ctx.true(f"{label} grad {name} present after backward", False, "None", "a grad")
        return present

    def replicas_agree(label: str, model: nn.Module, names: Iterable[str]) -> None:
        for name, grad in grads_present(label, model, names).items():
            mine, theirs = mine_and_peers(grad)
            ctx.close(f"{label} grad {name}: replica groups agree", mine, theirs, agree)

    def replicas_differ(label: str, model: nn.Module, names: Iterable[str]) -> None:
        for name, grad in grads_present(label, model, names).items():
            mine, theirs = mine_and_peers(grad)
            gap = (mine - theirs).abs().max().item()
            ctx.true(f"{label} grad {name}: replica groups differ", gap > agree, gap, f"> {agree}")

    def build() -> nn.Module:
        model = MLP(DIMS)
        shard_nested(model, model.layers[:2], mesh=mesh)
        return model

    # on (the default, set explicitly)
    template = MLP(DIMS)
    model, ddp = build(), ddp_of(template)
    model.set_requires_all_reduce(True)
    names = list(named_params(template))
    recorders: list[CollectiveRecorder] = []
    train_against(
        ctx,
        model,
        ddp,
        batches,
        square_mean,
        tol,
        label="all-reduce on",
        recorders=recorders,
        after_backward=lambda step: replicas_agree(f"all-reduce on step {step}", model, names),
    )
    for step, rec in enumerate(recorders):
        _reductions(ctx, f"all-reduce on step {step}", rec, all_reduces=True)

    # off: each replica group trains as FSDP over its own 2 ranks
    model, replica_ddp = build(), ddp_of(template, process_group=shards)
    model.set_requires_all_reduce(False)
    recorders = []
    train_against(
        ctx,
        model,
        replica_ddp,
        batches,
        square_mean,
        tol,
        label="all-reduce off (vs DDP over the replica group)",
        recorders=recorders,
        after_backward=lambda step: replicas_differ(f"all-reduce off step {step}", model, names),
    )
    for step, rec in enumerate(recorders):
        _reductions(ctx, f"all-reduce off step {step}", rec, all_reduces=False)

    def root_only() -> None:
        """recurse=False on the root: its own group (layer 2) off, the children's on."""
        model, ddp, replica_ddp = build(), ddp_of(template), ddp_of(template, process_group=shards)
        model.set_requires_all_reduce(False, recurse=False)
        label = "root recurse=False"
        with record_collectives() as rec:
            square_mean(model, batches[0]).backward()
        for reference in (ddp, replica_ddp):
            square_mean(reference, batches[0]).backward()
        _reductions(ctx, f"{label} (the children's groups)", rec, all_reduces=True)
        children = [n for n in names if n not in ROOT_OWN]
        replicas_differ(label, model, ROOT_OWN)
        replicas_agree(label, model, children)
        record_grads(ctx, f"{label} root's own vs DDP over the replica group", model, replica_ddp, tol.grad, ROOT_OWN)
        record_grads(ctx, f"{label} children's vs DDP over all ranks", model, ddp, tol.grad, children)

    ctx.run_part("recurse=False", ("recurse_false",), root_only)


def _reductions(ctx: CaseContext, where: str, rec: CollectiveRecorder, all_reduces: bool) -> None:
    """Reduce-scatters over the shard dim ran; all-reduces over the replicate dim (2 ranks) ran or not."""
    scatters, reduces = rec.of("reduce_scatter"), rec.of("all_reduce")
    ctx.true(f"{where}: reduce-scatters over the shard dim", len(scatters) > 0, len(scatters), "> 0")
    if all_reduces:
        ctx.true(f"{where}: all-reduces", len(reduces) > 0, len(reduces), "> 0")
        sizes = sorted({c.group_size for c in reduces})
        ctx.equal(f"{where}: all-reduce group sizes (the replicate dim)", str(sizes), "[2]")
    else:
        ctx.equal(f"{where}: all-reduces", len(reduces), 0)


# step -> reduce op set before it; None: the default ("avg") before any call
REDUCE_OP_PLAN = (None, "sum", "sum", "avg")


@case(
    "L1-03",
    "test_set_reduce_op_type",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("reduce_op_type",),
)
def set_reduce_op_type(ctx: CaseContext) -> None:
    """set_reduce_op_type: "sum" grads are world_size x DDP's, "avg" (and the default) DDP's; after
    switching sum -> avg mid-training, the optimizer state equals a baseline Adam fed the same
    grads (DDP's, times world_size in the "sum" steps), and so do the params."""
    world, tol = ctx.world_size, ctx.tol
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=LR)
    for step, op in enumerate(REDUCE_OP_PLAN):
        where = f"step {step} {op or 'default'}"
        if op is not None:
            model.set_reduce_op_type(op)
        scale = world if op == "sum" else 1
        batch = rank_batch(step, ctx.rank, (4, DIMS[0]))
        ref_loss = square_mean(ddp, batch)
        ref_loss.backward()
        loss = square_mean(model, batch)
        loss.backward()
        refs = named_params(ddp)
        biggest = max(p.grad.abs().max().item() for p in refs.values())
        ctx.require(f"{where}: sum and avg grads differ by more than the tolerance", biggest * (world - 1) > tol.grad)
        ctx.close(f"{where} loss", loss, ref_loss, tol.loss)
        ctx.close(f"{where} grad norm (x{scale})", grad_norm(model), grad_norm(ddp) * scale, tol.grad)
        for name, param in named_params(model).items():
            ctx.close(f"{where} grad {name} (x{scale})", param.grad, refs[name].grad * scale, tol.grad)
        with torch.no_grad():
            for param in refs.values():
                param.grad.mul_(scale)  # the baseline optimizer is fed the same grads
        step_optimizers((opt, ref_opt))
        for name, param in named_params(model).items():
            state, ref_state = opt.state[param], ref_opt.state[refs[name]]
            for key in ("exp_avg", "exp_avg_sq"):
                whole = impl.full_like(state[key], param)
                ctx.close(f"{where} optimizer {key} {name}", whole, ref_state[key], tol.grad)
        record_params(ctx, where, model, ddp, tol.grad)


ACCUMULATED = 3  # backwards accumulated before zero_grad: two reduced, the last held back unreduced


@case(
    "L1-04",
    "test_zero_grad",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("zero_grad", "gradient_sync"),
)
def zero_grad(ctx: CaseContext) -> None:
    """After accumulating reduced grads and one locally held (unsynced) grad, zero_grad() clears
    every grad (None; zeros with set_to_none=False) and leaves the params as they were; the next
    backward gives fresh grads equal to DDP's one-step grads, and training goes on like DDP."""
    model = MLP(DIMS)
    ddp = ddp_of(model)
    shard_nested(model, model.layers, mesh=ctx.mesh)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=LR)
    tol = ctx.tol
    for round_, set_to_none in enumerate((True, False)):
        where = f"round {round_} zero_grad(set_to_none={set_to_none})"
        micro = [rank_batch(10 * round_ + i, ctx.rank, (4, DIMS[0])) for i in range(ACCUMULATED + 1)]
        for i, batch in enumerate(micro[:ACCUMULATED]):
            model.set_requires_gradient_sync(i < ACCUMULATED - 1)  # the last one stays unreduced
            square_mean(model, batch).backward()
        model.set_requires_gradient_sync(True)
        ctx.require(f"{where}: every param has a grad before", all(p.grad is not None for p in model.parameters()))
        # had the held-back grad survived, the next grads would be off by DDP's grad of its batch
        square_mean(ddp, micro[ACCUMULATED - 1]).backward()
        held = max(p.grad.abs().max().item() for p in ddp.parameters())
        ctx.require(f"{where}: the held-back grad exceeds the tolerance", held > tol.grad, f"{held:.3e}")
        ddp.zero_grad()
        snapshot = {name: full(p).detach().clone() for name, p in named_params(model).items()}

        raises_nothing(ctx, f"{where} raises nothing", lambda set_to_none=set_to_none: model.zero_grad(set_to_none))
        for name, param in named_params(model).items():
            grad = param.grad
            if set_to_none:
                ctx.true(f"{where}: {name}.grad is None", grad is None, type(grad).__name__, "NoneType")
            elif grad is None:
                ctx.true(f"{where}: {name}.grad zeros", False, "None", "zeros")
            else:
                ctx.equal(f"{where}: {name}.grad zeros", full(grad), torch.zeros(param.shape))
            ctx.equal(f"{where}: {name} data unchanged", full(param), snapshot[name])

        fresh = micro[ACCUMULATED]
        ref_loss = square_mean(ddp, fresh)
        ref_loss.backward()
        loss = square_mean(model, fresh)
        loss.backward()
        ctx.close(f"{where} next step loss", loss, ref_loss, tol.loss)
        ctx.close(f"{where} next step grad norm", grad_norm(model), grad_norm(ddp), tol.grad)
        record_grads(ctx, f"{where} next step (fresh, = one-step DDP)", model, ddp, tol.grad)
        step_optimizers((opt, ref_opt))
        record_params(ctx, f"{where} after the step", model, ddp, tol.grad)


@case(
    "L1-05",
    "test_manual_reshard_unshard_lifecycle",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("unshard_reshard",),
)
def manual_reshard_unshard_lifecycle(ctx: CaseContext) -> None:
    """unshard(async_op=True) twice, then the first handle's wait(): right then the group's own
    params are full and readable (equal to the reference weights: the initial ones, then DDP's after
    2 optimizer steps), the other groups' still sharded; more waits and a synchronous unshard():
    nothing raised, no further all-gather, the same params; reshard() twice: nothing communicated,
    every param back to its shard, the unsharded tensors freed."""
    world, rank = ctx.world_size, ctx.rank
    model = MLP(DIMS)
    ddp = ddp_of(model)
    full_numel, shard_numel = numels(model, world, rank)
    ctx.require("every param splits over the ranks", all(shard_numel[n] < full_numel[n] for n in full_numel))
    shard_nested(model, model.layers[:2], mesh=ctx.mesh)
    targets = (("layers.0", model.layers[0], ("layers.0.weight", "layers.0.bias")), ("root", model, ROOT_OWN))

    def lifecycle(label: str, tol: float | None) -> None:
        """``tol`` None: the full params must equal the reference bitwise."""
        ctx.require(f"{label}: every param sharded before", local_numels(model) == shard_numel)
        refs = named_params(ddp)
        for target_name, target, own in targets:
            where = f"{label} {target_name}"
            handles: list = []
            recorded: list[CollectiveRecorder] = []
            want = {name: full_numel[name] if name in own else shard_numel[name] for name in full_numel}

            def readable(when: str, where: str = where, own: tuple = own, want: dict = want) -> None:
                """The group's own params full and equal to the reference, the others still sharded."""
                _record_numels(ctx, f"{where} {when}", model, want, full_numel)
                params = named_params(model)
                for name in own:
                    param = params[name]
                    ctx.true(f"{where} {when}: {name} a plain tensor", not impl.is_sharded(param), type(param).__name__)
                    if tol is None:
                        ctx.equal(f"{where} {when}: {name} == reference weights", param, refs[name])
                    else:
                        ctx.close(f"{where} {when}: {name} vs reference weights", param, refs[name], tol)

            def unshard_async_then_wait(target: nn.Module = target, handles: list = handles, recorded: list = recorded):
                with record_collectives() as first:
                    handles.append(target.unshard(async_op=True))
                with record_collectives() as repeated:
                    handles.append(target.unshard(async_op=True))  # again while in flight
                handles[0].wait()
                recorded.extend((first, repeated))

            raises_nothing(ctx, f"{where}: unshard(async_op=True) x2, wait()", unshard_async_then_wait)
            readable("right after the first handle's wait()")  # nothing but wait() ran since the unshard

            def repeat(target: nn.Module = target, handles: list = handles, recorded: list = recorded) -> None:
                with record_collectives() as more:
                    for handle in handles + handles:
                        handle.wait()
                    handles.append(target.unshard())
                recorded.append(more)

            raises_nothing(ctx, f"{where}: wait() x4 more, unshard()", repeat)
            ctx.true(
                f"{where}: unshard(async_op=True) returns a handle",
                len(handles) == 3 and all(hasattr(h, "wait") for h in handles[:2]),
                str([type(h).__name__ for h in handles[:2]]),
            )
            ctx.true(f"{where}: unshard() returns None", len(handles) == 3 and handles[2] is None)
            if len(recorded) == 3:
                gathered = len(recorded[0].of("all_gather"))
                ctx.true(f"{where}: the first unshard all-gathers", gathered > 0, gathered, "> 0")
                again = len(recorded[1].of("all_gather")) + len(recorded[2].of("all_gather"))
                ctx.equal(f"{where}: all-gathers of the repeated unshards and waits", again, 0)
            readable("unsharded")
            params = named_params(model)
            unsharded = {name: params[name] for name in own}
            with record_collectives() as rec:
                raises_nothing(ctx, f"{where}: reshard() x2", lambda t=target: (t.reshard(), t.reshard()))
            ctx.equal(f"{where}: collectives issued by reshard", len(rec.calls), 0)
            _record_numels(ctx, f"{where} resharded", model, shard_numel, full_numel)
            params = named_params(model)
            for name in own:
                ctx.true(f"{where} resharded: {name} sharded", impl.is_sharded(params[name]))
                ctx.equal(
                    f"{where} resharded: the unsharded {name} freed (elements held)", local_numel(unsharded[name]), 0
                )

    lifecycle("initial", None)
    train_against(ctx, model, ddp, rank_batches(rank, (4, DIMS[0])), square_mean, ctx.tol)
    lifecycle("after 2 steps", ctx.tol.grad)


@case(
    "L1-09",
    "test_fully_shard_list_input",
    world_size=2,
    mesh={"dp": 2},
    config="FSDP 1D fp32",
    needs=("list_input", "reshard_controls", "gradient_sync", "unshard_reshard"),
)
def fully_shard_list_input(ctx: CaseContext) -> None:
    """fully_shard([layer0, layer1]) returns a list of the two modules, each an HSDPModule with its
    own group. Controlling one (reshard flags, gradient sync, unshard/reshard, a step using it
    alone) leaves the other's params and grads as they would be; the whole model trains like DDP
    with finite grads."""
    world, rank, tol = ctx.world_size, ctx.rank, ctx.tol
    mesh = ctx.mesh
    model = MLP(DIMS)
    ddp = ddp_of(model)
    full_numel, shard_numel = numels(model, world, rank)
    listed = [model.layers[0], model.layers[1]]
    returned = impl.fully_shard(listed, mesh=mesh)
    ctx.true("returns a list", isinstance(returned, list), type(returned).__name__, "list")
    ctx.require("one element per listed module", isinstance(returned, list) and len(returned) == len(listed))
    for i, (element, module) in enumerate(zip(returned, listed, strict=True)):
        ctx.true(f"element {i} is an HSDPModule", isinstance(element, impl.HSDPModule), type(element).__name__)
        ctx.true(f"element {i} is listed module {i}", element is module)
    impl.fully_shard(model, mesh=mesh)  # the root's group holds layer 2
    own = {i: (f"layers.{i}.weight", f"layers.{i}.bias") for i in range(len(listed))}

    def grads_finite(label: str) -> None:
        for name, param in named_params(model).items():
            finite = param.grad is not None and bool(torch.isfinite(full(param.grad)).all())
            ctx.true(f"{label} grad {name} finite", finite)

    batches = rank_batches(rank, (4, DIMS[0]))
    train_against(ctx, model, ddp, batches, square_mean, tol, after_backward=lambda step: grads_finite(f"step {step}"))

    for mine, other in ((0, 1), (1, 0)):
        controlled, label = returned[mine], f"controlling layers.{mine}:"

        def layout(where: str, unsharded: bool, mine: int = mine, other: int = other) -> None:
            want = {n: full_numel[n] if unsharded and n in own[mine] else shard_numel[n] for n in full_numel}
            _record_numels(ctx, where, model, want, own[mine] + own[other])

        # reshard flags: only the controlled group stays unsharded after forward and backward
        batch = rank_batch(20 + mine, rank, (4, DIMS[0]))
        controlled.set_reshard_after_forward(False)
        controlled.set_reshard_after_backward(False)
        out = model(batch)
        layout(f"{label} reshard flags off, after forward", unsharded=True)
        out.float().square().mean().backward()
        layout(f"{label} reshard flags off, after backward", unsharded=True)
        controlled.set_reshard_after_forward(True)
        controlled.set_reshard_after_backward(True)
        _reshard_all(model)
        square_mean(ddp, batch).backward()
        record_grads(ctx, f"{label} reshard flags off", model, ddp, tol.grad)
        model.zero_grad()
        ddp.zero_grad()

        # gradient sync off for the controlled group: the others still reduce, like DDP
        batch = rank_batch(30 + mine, rank, (4, DIMS[0]))
        controlled.set_requires_gradient_sync(False)
        with record_collectives() as rec:
            square_mean(model, batch).backward()
        controlled.set_requires_gradient_sync(True)
        square_mean(ddp, batch).backward()
        others_reduced = len(rec.of("reduce_scatter"))
        ctx.true(f"{label} sync off: the other groups reduce-scatter", others_reduced > 0, others_reduced, "> 0")
        params = named_params(model)
        for name in own[mine]:
            ctx.true(f"{label} sync off: {name} has no grad yet", params[name].grad is None)
        others = [n for n in full_numel if n not in own[mine]]
        record_grads(ctx, f"{label} sync off, the others'", model, ddp, tol.grad, others)
        model.zero_grad()
        ddp.zero_grad()

        # unshard / reshard of the controlled group only
        controlled.unshard()
        layout(f"{label} unshard()", unsharded=True)
        controlled.reshard()
        layout(f"{label} reshard()", unsharded=False)

        # a step using the controlled layer alone: its grads equal DDP's of a copy, no other grads
        layer = listed[mine]
        twin = nn.Linear(layer.in_features, layer.out_features)
        with torch.no_grad():
            twin.weight.copy_(full(layer.weight))
            twin.bias.copy_(full(layer.bias))
        alone = ddp_of(twin)
        batch = rank_batch(40 + mine, rank, (4, layer.in_features))
        loss = square_mean(layer, batch)
        loss.backward()
        ref_loss = square_mean(alone, batch)
        ref_loss.backward()
        ctx.close(f"{label} used alone: loss", loss, ref_loss, tol.loss)
        record_grads(ctx, f"{label} used alone", layer, alone, tol.grad)
        params = named_params(model)
        for name in others:
            ctx.true(f"{label} used alone: {name} has no grad", params[name].grad is None)
        layout(f"{label} used alone, after backward", unsharded=False)
        model.zero_grad()

    train_against(
        ctx,
        model,
        ddp,
        rank_batches(rank, (4, DIMS[0]), first=50),
        square_mean,
        tol,
        label="after the controls",
        after_backward=lambda step: grads_finite(f"after the controls step {step}"),
    )
