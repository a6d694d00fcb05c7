"""Rank bodies of the engine tests of usage patterns from torch FSDP2's tracker (issue 52): a loss read
from a tensor the forward stored on the module (pytorch#173709), an in-place op on a view a sharded
module returned (#181832), an output inside a container the engine cannot open, params some ranks do
not use (#158719), a ``grad_dtype`` set before sharding (#170648), optimizers built after a forward or
holding a param registered again. Each trains against DDP (or the same-dtype baseline) through the
kit's checks, or is refused at the optimizer step with the param and the fix named."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.kit.judging.checks import StrictChecks, raised
from tests.kit.judging.reference import SameDtypeReference, ddp_of, full
from tests.kit.judging.surface import impl
from tests.kit.workloads.models import rank_batches
from tests.kit.workloads.training import shard_nested, square_mean, train_against

WIDTH = 8
STEPS = 2
# torch 2.6 and 2.7 do not let the engine read the saved-tensor hooks a user pushed, so it stacks none of
# its own there (docs/api.md): a backward reaching resharded params by a path the outputs' hooks do not
# see fails there as on FSDP2, with freed storage; the tests below expect that failure on those releases
SAVED_PARAMS_GATHERED = all(
    hasattr(torch._C._autograd, name)
    for name in ("_top_saved_tensors_default_hooks", "_saved_tensors_hooks_is_enabled")
)


def _trains_or_fails_as_documented(checks: StrictChecks, label: str, needs_gather: bool, train: Any) -> None:
    """``train()``; where this release cannot gather saved params again and the pattern needs it, the
    documented failure instead: autograd reading a freed storage."""
    if SAVED_PARAMS_GATHERED or not needs_gather:
        train()
        return
    error = raised(train)
    checks.true(f"{label}: fails on torch {torch.__version__} with freed storage", "storage" in str(error), str(error))


def _inner(model: Any) -> nn.Module:
    """The module a baseline runs (DDP's, the same-dtype reference's compute copy), else the model."""
    return getattr(model, "module", None) or getattr(model, "compute", None) or model


class StoresIntermediate(nn.Module):
    """Stores an intermediate on itself (``self.cached``) and returns something else: a loss read from
    ``cached`` reaches the params by a path no hook on the outputs sees."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.lin2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.lin2(torch.tanh(self.lin(x)))
        self.cached = hidden
        return hidden + 1


class AddsOnly(StoresIntermediate):
    """Stores ``x + shift``: no op of its forward saves a param, so only the param's own grad arriving
    tells the engine backward reached it."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.shift = nn.Parameter(torch.linspace(-1.0, 1.0, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cached = x + self.shift
        return self.cached + 1


class StoresUnderCheckpoint(StoresIntermediate):
    """``StoresIntermediate``'s forward under a (not re-entrant) activation checkpoint, as a block wrapped
    by ``checkpoint_wrapper`` and then sharded: the loss reads the stored tensor first, so autograd
    recomputes the block there, before any hook on the module's output has gathered its group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


class Wraps(nn.Module):
    """A root with a param of its own before ``body``, which returns what ``forward`` returns."""

    def __init__(self, body: nn.Module, post: Any = None) -> None:
        super().__init__()
        self.pre = nn.Linear(WIDTH, WIDTH)
        self.body = body
        self.post = post

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(self.pre(x))
        return self.post(out) if self.post is not None else out


def _stored_loss(model: Any, x: torch.Tensor) -> torch.Tensor:
    model(x)
    inner = _inner(model)
    stored = inner.body if isinstance(inner, Wraps) else inner
    return stored.cached.square().mean()


def _baseline(model: nn.Module, bf16: bool, **ddp: Any) -> Any:
    return SameDtypeReference(model, torch.bfloat16, torch.float32) if bf16 else ddp_of(model, **ddp)


def _policy(bf16: bool) -> Any:
    return impl.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else impl.MixedPrecisionPolicy()


def stored_intermediate_loss(configs: list[tuple[str, Any, bool, bool]]) -> None:
    """Each (where, reshard_after_forward, bf16, input needs grad): the module storing the intermediate
    is the root, a child of a root (its forward under an activation checkpoint: ``checkpointed child``),
    or a root whose forward saves no param (``adds only``); ``STEPS``
    Adam steps of a loss read from the stored tensor = the baseline (DDP, or the same-dtype one under
    bf16 / fp32)."""
    for where, reshard, bf16, input_grad in configs:
        checks = StrictChecks("FSDP 1D bf16" if bf16 else "FSDP 1D fp32")
        torch.manual_seed(0)
        models = {"root": StoresIntermediate, "adds only": AddsOnly, "child": lambda: Wraps(StoresIntermediate())}
        model = models.get(where, lambda: Wraps(StoresUnderCheckpoint()))()
        reference = _baseline(model, bf16)
        options = dict(mesh=checks.mesh, mp_policy=_policy(bf16))
        if not where.endswith("child"):
            impl.fully_shard(model, reshard_after_forward=reshard, **options)
        else:
            impl.fully_shard(model.body, reshard_after_forward=reshard, **options)
            impl.fully_shard(model, **options)
        batches = [x.requires_grad_(input_grad) for x in rank_batches(checks.rank, (4, WIDTH), steps=STEPS)]
        label = f"{where} reshard_after_forward={reshard} {'bf16' if bf16 else 'fp32'} input grad={input_grad}"
        _trains_or_fails_as_documented(
            checks,
            label,
            # a recompute gathers its group by a hook of the module's own (any release)
            needs_gather=bool(reshard) and reshard != 1 and where not in ("adds only", "checkpointed child"),
            train=functools.partial(
                train_against, checks, model, reference, batches, _stored_loss, checks.tol, label=label
            ),
        )


class ReturnsView(nn.Module):
    """Returns a view of its output: the caller changes it in place, replacing the autograd node the
    engine hooked for the pre-backward gather."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(-1, WIDTH)


class InPlaceOnOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(WIDTH, WIDTH)
        self.body = ReturnsView()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(torch.tanh(self.pre(x)))
        out += 1  # in place, on the view the sharded child returned
        return torch.tanh(out)


class Box:
    """A container no engine can open (not a tuple, list, dict nor dataclass)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ReturnsBox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> Box:
        return Box(self.lin(x))


class OpensBox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(WIDTH, WIDTH)
        self.body = ReturnsBox()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(torch.tanh(self.pre(x))).tensor)


def outputs_hidden_from_hooks(configs: list[tuple[str, Any, bool]]) -> None:
    """Each (pattern, the child's reshard_after_forward, bf16): an output changed in place through a view
    (``inplace``), or returned inside a container (``box``); ``STEPS`` Adam steps = the baseline."""
    for pattern, reshard, bf16 in configs:
        checks = StrictChecks("FSDP 1D bf16" if bf16 else "FSDP 1D fp32")
        torch.manual_seed(0)
        model = InPlaceOnOutput() if pattern == "inplace" else OpensBox()
        reference = _baseline(model, bf16)
        options = dict(mesh=checks.mesh, mp_policy=_policy(bf16))
        impl.fully_shard(model.body, reshard_after_forward=reshard, **options)
        impl.fully_shard(model, **options)
        batches = rank_batches(checks.rank, (4, WIDTH), steps=STEPS)
        label = f"{pattern} reshard_after_forward={reshard} {'bf16' if bf16 else 'fp32'}"
        _trains_or_fails_as_documented(
            checks,
            label,
            needs_gather=bool(reshard),
            train=functools.partial(
                train_against, checks, model, reference, batches, square_mean, checks.tol, label=label
            ),
        )


class Gated(nn.Module):
    """``extra`` takes part on the ranks in ``users`` only: its param gets a grad on those ranks alone."""

    def __init__(self, users: set[int]) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.extra = nn.Linear(WIDTH, WIDTH)
        self.uses_extra = dist.get_rank() in users

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        return out + self.extra(x) if self.uses_extra else out


def params_some_ranks_skip(comm_fusion: bool, opt_in: bool) -> None:
    """A sharded module whose ``extra`` layer runs on rank 0 only (under a root with a layer of its own):
    no collective mismatch, and ``STEPS`` Adam steps = DDP(find_unused_parameters=True). ``opt_in``:
    with ``set_reduce_scatter_unused_params(True)`` as well."""
    checks = StrictChecks("FSDP 1D fp32")
    torch.manual_seed(0)
    model = Wraps(Gated(users={0}))
    reference = ddp_of(model, find_unused_parameters=True)
    shard_nested(model, [model.body], mesh=checks.mesh, comm_fusion=comm_fusion)
    if opt_in:
        model.set_reduce_scatter_unused_params(True)
    batches = rank_batches(checks.rank, (4, WIDTH), steps=STEPS)
    train_against(checks, model, reference, batches, square_mean, checks.tol, label=f"fusion={comm_fusion}")


def grad_dtype_kept(reshard: Any, frozen_then: bool = False) -> None:
    """bf16 params given ``grad_dtype = float32`` before ``fully_shard``: the sharded params' grads are
    fp32 and equal the fp32 mean of every rank's fp32 grads (a plain bf16 model with the same grad_dtype,
    each rank's grads all-reduced), over two backwards accumulated into ``.grad``: terms below bf16's
    resolution survive. ``frozen_then``: every param frozen while sharded, unfrozen after (torch keeps a
    frozen param's grad_dtype; L4's find, 690dd2680a)."""
    checks = StrictChecks("FSDP 1D bf16")
    if not hasattr(torch.Tensor, "grad_dtype"):  # torch before 2.9: no grad_dtype for a user to set
        checks.true(f"torch {torch.__version__} has no grad_dtype", not hasattr(torch.Tensor, "grad_dtype"))
        return
    torch.manual_seed(0)
    model = Wraps(nn.Linear(WIDTH, WIDTH)).to(torch.bfloat16)
    plain = Wraps(nn.Linear(WIDTH, WIDTH)).to(torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    for param in [*model.parameters(), *plain.parameters()]:
        param.grad_dtype = torch.float32
        param.requires_grad_(not frozen_then)
    shard_nested(model, [model.body], mesh=checks.mesh, reshard_after_forward=reshard)
    for param in model.parameters() if frozen_then else ():
        param.requires_grad_(True)
    plain.requires_grad_(True)
    batches = [x.to(torch.bfloat16) for x in rank_batches(checks.rank, (4, WIDTH), steps=2)]
    for x in batches:  # two backwards accumulate into .grad: in fp32 on both
        square_mean(model, x).backward()
        square_mean(plain, x).backward()
    for name, param in plain.named_parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad.div_(dist.get_world_size())
        got = model.get_parameter(name).grad
        checks.equal(f"{name} grad dtype", str(None if got is None else got.dtype), str(torch.float32))
        checks.close(f"{name} grad", full(got), param.grad, checks.tol.grad)


def optimizer_after_a_forward(rows: bool = False) -> None:
    """An optimizer built after a first forward (a warm-up forward) holds what the model registered then:
    the unsharded copies a root keeps gathered, or (``rows``: the child's ``reshard_after_forward=2`` at 4
    ranks) the rows the child keeps. Its step is refused, naming a param and the fix; built after
    ``reshard()`` instead, training = DDP."""
    checks = StrictChecks("FSDP 1D fp32")
    torch.manual_seed(0)
    model = Wraps(StoresIntermediate())
    reference = ddp_of(model)
    impl.fully_shard(model.body, mesh=checks.mesh, reshard_after_forward=2 if rows else True)
    impl.fully_shard(model, mesh=checks.mesh)
    x = rank_batches(checks.rank, (4, WIDTH), steps=1)[0]
    with torch.no_grad():
        model(x)  # warm-up: the root keeps its own params gathered, the child its rows (``rows``)
    early = torch.optim.Adam(model.body.parameters() if rows else model.parameters())
    square_mean(model, x).backward()
    error = raised(early.step)
    checks.equal("optimizer over the gathered copies or the rows: refused", type(error).__name__, "RuntimeError")
    message = str(error)
    checks.true("the refusal names the param and the fix", "'weight'" in message and "reshard()" in message, message)
    model.zero_grad()
    model.reshard()
    batches = rank_batches(checks.rank, (4, WIDTH), steps=STEPS)
    train_against(checks, model, reference, batches, square_mean, checks.tol)


def param_registered_again(built: str) -> None:
    """A plain full-shape param registered in a sharded param's place: an optimizer built over the
    plain param (before the forward that shards it) is refused at its step, naming the param and the fix;
    one built after that forward (and a ``reshard()``) trains it = DDP with the same new values. Registered
    again between steps, the next forward computes with the new values, as the plain model does."""
    checks = StrictChecks("FSDP 1D fp32")
    torch.manual_seed(0)
    model = Wraps(nn.Linear(WIDTH, WIDTH))
    new_weight = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(5))
    shard_nested(model, [model.body], mesh=checks.mesh)
    x = rank_batches(checks.rank, (4, WIDTH), steps=1)[0]
    if built == "between steps":
        model(x).square().mean().backward()
        model.zero_grad()
    model.body.weight = nn.Parameter(new_weight.clone())
    plain = Wraps(nn.Linear(WIDTH, WIDTH))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name != "body.weight":
                plain.get_parameter(name).copy_(full(param))
    plain.body.weight = nn.Parameter(new_weight.clone())
    early = torch.optim.Adam(model.parameters())
    checks.close("forward with the param registered again", full(model(x)), plain(x), checks.tol.loss)
    square_mean(model, x).backward()
    error = raised(early.step)
    checks.equal("optimizer over the replaced plain param: refused", type(error).__name__, "RuntimeError")
    message = str(error)
    checks.true(
        "the refusal names the param and the fix", "'weight'" in message and "after that forward" in message, message
    )
    model.zero_grad()
    model.reshard()
    reference = ddp_of(plain)
    batches = rank_batches(checks.rank, (4, WIDTH), steps=STEPS)
    train_against(checks, model, reference, batches, square_mean, checks.tol)


def frozen_through_first_forward(bf16: bool, gathered: bool) -> None:
    """Every param frozen (``requires_grad_(False)``) through the first forward, then unfrozen
    (pytorch#186998: FSDP2 raises under a bf16 / fp32 policy); with ``gathered``, frozen while the root
    keeps its params gathered after an evaluation forward, then resharded and unfrozen. ``STEPS`` Adam
    steps = the baseline, and a param frozen again after training gets no grad."""
    checks = StrictChecks("FSDP 1D bf16" if bf16 else "FSDP 1D fp32")
    torch.manual_seed(0)
    model = Wraps(StoresIntermediate())
    reference = _baseline(model, bf16)
    options = dict(mesh=checks.mesh, mp_policy=_policy(bf16))
    impl.fully_shard(model.body, **options)
    impl.fully_shard(model, **options)
    x = rank_batches(checks.rank, (4, WIDTH), steps=1)[0]
    if gathered:
        with torch.no_grad():
            model(x)  # the root keeps its params gathered: the user freezes those
    model.requires_grad_(False)
    if not gathered:
        model(x)  # the first forward, every param frozen
    model.reshard()
    model.requires_grad_(True)
    batches = rank_batches(checks.rank, (4, WIDTH), steps=STEPS)
    train_against(checks, model, reference, batches, square_mean, checks.tol)
    model.zero_grad()
    model.pre.requires_grad_(False)
    square_mean(model, x).backward()
    frozen = [name for name, param in model.named_parameters() if name.startswith("pre.") and param.grad is not None]
    checks.equal("params frozen after training: no grad", str(frozen), str([]))


class MultiTokenHead(nn.Module):
    """A multi-token-prediction block that calls the model's shared head inside its own forward and keeps
    the auxiliary logits on itself (``aux``), read by the loss after the head runs again outside it."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        object.__setattr__(self, "shared_head", head)  # the model's head, called here, registered there
        self.aux: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.lin(h)
        self.aux = self.shared_head(y)
        return y


class Tail(nn.Module):
    """body, then norm, the multi-token block (which calls the head) and the head again: pytorch#183702's
    model, whose loss adds the block's stored logits to the output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)
        self.mtp = MultiTokenHead(self.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.body(x))
        y = self.mtp(h)
        return self.head(h) + y


def _tail_loss(model: Any, x: torch.Tensor) -> torch.Tensor:
    """The square mean of the output plus that of the logits the multi-token block stored."""
    out = model(x)
    inner = model.module if hasattr(model, "module") else model
    return out.pow(2).mean() + inner.mtp.aux.pow(2).mean()


def list_member_called_again(reshard: Any) -> None:
    """``fully_shard([norm, mtp, head])`` where ``mtp`` calls ``head`` inside its forward and stores the
    logits, and ``head`` runs again outside (pytorch#183702: FSDP2's one group frees the head's params
    under autograd, storage of size 0): ``STEPS`` Adam steps = DDP."""
    checks = StrictChecks("FSDP 1D fp32")
    torch.manual_seed(0)
    model = Tail()
    reference = ddp_of(model)
    impl.fully_shard(model.body, mesh=checks.mesh, reshard_after_forward=reshard)
    impl.fully_shard([model.norm, model.mtp, model.head], mesh=checks.mesh, reshard_after_forward=reshard)
    impl.fully_shard(model, mesh=checks.mesh, reshard_after_forward=reshard)
    batches = rank_batches(checks.rank, (4, WIDTH), steps=STEPS)
    train_against(checks, model, reference, batches, _tail_loss, checks.tol, label=f"reshard={reshard}")


def frozen_while_rows_kept() -> None:
    """A module frozen while its call keeps its rows after forward (``reshard_after_forward=2``, 4 ranks),
    ``set_reduce_scatter_unused_params(True)`` on it: its params get no grad, as the plain model's (L4's
    1d8f230b59: the engine read the shard's stale flag and reduced zeros into them, which the optimizer
    then stepped)."""
    checks = StrictChecks("FSDP 1D fp32")
    torch.manual_seed(0)
    model = Wraps(nn.Linear(WIDTH, WIDTH))
    impl.fully_shard(model.body, mesh=checks.mesh, reshard_after_forward=2)
    impl.fully_shard(model, mesh=checks.mesh)
    model.body.set_reduce_scatter_unused_params(True)
    x = rank_batches(checks.rank, (4, WIDTH), steps=1)[0]
    model(x)  # a forward no backward follows: the body keeps its rows registered
    for param in model.body.parameters():
        param.requires_grad_(False)
    square_mean(model, x).backward()
    grads = [param.grad is None for param in model.body.parameters()]
    checks.equal("the frozen module's params: no grad", str(grads), str([True] * len(grads)))
    checks.true("the root's params: grads", all(p.grad is not None for p in model.pre.parameters()))
