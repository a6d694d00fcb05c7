"""Plan cases of the plan's ``test_fully_shard_module.py``, level L1: the HSDPModule controls (L1-01..05,
L1-09)."""

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
)
from tests.kit.judging.recorder import CollectiveRecorder, record_collectives
from tests.kit.judging.reference import ddp_of, full, gather_from
from tests.kit.judging.surface import impl
from tests.kit.judging.tolerances import specific
from tests.kit.judging.trace import traced
from tests.kit.workloads.models import DIMS, MLP, rank_batch, rank_batches
from tests.kit.workloads.training import (
    differs_across_ranks,
    grad_norm,
    named_params,
    raises_nothing,
    record_grads,
    record_numels,
    record_params,
    reshard_all,
    shard_nested,
    square_mean,
    step_optimizers,
    train_against,
)

LR = 1e-2
# (reshard_after_forward, reshard_after_backward) per step: each flag goes off and back on
RESHARD_PLAN = ((False, True), (True, False), (False, False), (True, True))
ROOT_OWN = ("layers.2.weight", "layers.2.bias")  # with layers 0 and 1 sharded on their own


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
        record_numels(ctx, where, model, want, full_numel)
        if not backward:  # the optimizer steps the shards: drop the unsharded copies first
            reshard_all(model)

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
        trace = traced(model, ddp)  # the diagnosis's: the root's own grads are traced against replica_ddp's
        trace.begin(label)
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
        ours = named_params(model)
        trace.grads(ours, {n: p for n, p in named_params(ddp).items() if n in children})
        trace.grads(ours, {n: p for n, p in named_params(replica_ddp).items() if n in ROOT_OWN})
        trace.begin(None)

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
    trace = traced(model, ddp)  # the diagnosis's, when it runs the case
    for step, op in enumerate(REDUCE_OP_PLAN):
        where = f"step {step} {op or 'default'}"
        if op is not None:
            model.set_reduce_op_type(op)
        scale = world if op == "sum" else 1
        batch = rank_batch(step, ctx.rank, (4, DIMS[0]))
        trace.begin(where)
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
        trace.grads(named_params(model), refs)
        step_optimizers((opt, ref_opt))
        trace.params(named_params(model), refs)
        for name, param in named_params(model).items():
            state, ref_state = opt.state[param], ref_opt.state[refs[name]]
            for key in ("exp_avg", "exp_avg_sq"):
                whole = impl.full_like(state[key], param)
                ctx.close(f"{where} optimizer {key} {name}", whole, ref_state[key], tol.grad)
        record_params(ctx, where, model, ddp, tol.grad)
    trace.begin(None)


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
    trace = traced(model, ddp)  # the diagnosis's: the steps with a baseline step beside them
    for round_, set_to_none in enumerate((True, False)):
        where = f"round {round_} zero_grad(set_to_none={set_to_none})"
        trace.begin(None)
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
        trace.begin(f"round {round_} next step")
        ref_loss = square_mean(ddp, fresh)
        ref_loss.backward()
        loss = square_mean(model, fresh)
        loss.backward()
        ctx.close(f"{where} next step loss", loss, ref_loss, tol.loss)
        ctx.close(f"{where} next step grad norm", grad_norm(model), grad_norm(ddp), tol.grad)
        record_grads(ctx, f"{where} next step (fresh, = one-step DDP)", model, ddp, tol.grad)
        trace.grads(named_params(model), named_params(ddp))
        step_optimizers((opt, ref_opt))
        trace.params(named_params(model), named_params(ddp))
        record_params(ctx, f"{where} after the step", model, ddp, tol.grad)
    trace.begin(None)


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
                record_numels(ctx, f"{where} {when}", model, want, full_numel)
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
            record_numels(ctx, f"{where} resharded", model, shard_numel, full_numel)
            params = named_params(model)
            for name in own:
                ctx.true(f"{where} resharded: {name} sharded", impl.is_sharded(params[name]))
                ctx.equal(
                    f"{where} resharded: the unsharded {name} freed (elements held)", local_numel(unsharded[name]), 0
                )

    lifecycle("initial", None)
    train_against(ctx, model, ddp, rank_batches(rank, (4, DIMS[0])), square_mean, ctx.tol)
    lifecycle("after 2 steps", ctx.tol.grad)
