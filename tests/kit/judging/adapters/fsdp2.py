"""Adapter of torch FSDP2 (``torch.distributed.fsdp.fully_shard``) to the HyperParallel API.

Translations only: the HyperParallel keywords FSDP2 does not have are refused with
``NotImplementedError`` naming them (``replicate_params``, ``comm_fusion=False``, ``device``,
``apply_grad_on_fp32_main_grad``, a ``Replicate()`` from ``shard_placement_fn``), and
``set_reduce_op_type`` maps to FSDP2's gradient divide factor (``"sum"``: 1, ``"avg"``: the
data-parallel world size, FSDP2's default) with sum-only collectives (gloo has no PREMUL_SUM).

A list passes through as FSDP2's list, one group of its modules (L4's ``list_module_called_again``
judges either grouping). Features FSDP2 lacks are left out of ``features``: independent groups from a
list input,
replicated params, switching comm fusion off, fp32 main grads, ``Replicate()`` placements,
``zero_grad`` of locally accumulated (unsynced) grads, and ``set_requires_all_reduce(False)`` as
the plan means it (HSDP grads reduce-scattered within the replica group and usable as they are:
FSDP2 instead holds the partial result back and leaves ``.grad`` unset until an all-reducing
backward, a gradient-accumulation device), uneven shards on dims other than 0 (FSDP2 refuses them),
and refusing every bad argument before any change
(FSDP2 checks some, not all: ``CPUOffloadPolicy(pin_memory="yes")`` is accepted), and
``set_gradient_scaling_factor`` (upstream HyperParallel's own), and a param a nested call
ignores left alone by the calls above it (FSDP2's ``ignored_params`` hold per call: a call above
that reaches the param through a module it shares, a tied weight, shards it). Nor does it follow
``module.to(dtype)`` / ``.double()`` after its lazy init (a first forward, or ``unshard()``): the
sharded params are cast, the all-gathers keep the dtype of the lazy init, so the module computes in
the old dtype (a plain ``nn.Linear`` raises on the mixed dtypes): a defect L4 found (replay
d618ffc6b3, which ours passes), left out as a feature FSDP2 lacks. On a gloo process group it also
lacks ``set_gradient_divide_factor`` without force-sum (see ``LACKING_ON_GLOO``). On an older torch
the adapter loads as well: what its FSDP2 lacks is found there (``NEEDS``, ``KEYWORDS``) and left
out of ``features``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import fsdp
from torch.distributed.tensor import Replicate, Shard

from tests.kit.judging.surface import FEATURES, Implementation, Spec
from tests.kit.runtime.devices import CPU_BACKEND, choose

LACKING = {
    "hooks_through_sharding",  # hooks on the param before fully_shard stay on the object it replaces
    "reregister_plain",  # its lazy init reads a DTensor's local tensor from a plain param (AttributeError)
    "list_input",
    "replicate_params",
    "comm_fusion",
    "main_grad",
    "placement_replicate",
    "zero_grad",
    "all_reduce_control",
    "argument_checks",
    "uneven_other_dims",
    "gradient_scaling_factor",
    "ignored_params_nested",
    "to_dtype_after_forward",
}
# Lacking on a gloo process group: FSDP2's set_gradient_divide_factor(f) without force-sum reduces
# with ReduceOp.PREMUL_SUM(1/f) (_fsdp_collectives._get_gradient_divide_factors, any f but the shard
# group's size), which gloo refuses: "Cannot use ReduceOp.PREMUL_SUM with Gloo". With force-sum it
# works (sum, then a division): the set_reduce_op_type shim below relies on that.
LACKING_ON_GLOO = {"gradient_divide_factor"}
# What a feature needs of the installed FSDP2, looked up there (never a table of releases): an
# older torch lacks some (share_comm_ctx before 2.13, set_gradient_divide_factor and force-sum before
# 2.9, set_reshard_after_forward before 2.8, ...); a feature whose names are missing is left out of
# ``features``, so its cases are UNSUPPORTED naming it, and an entry point the kit calls raises.
NEEDS: dict[str, tuple[str, ...]] = {
    "share_comm_ctx": ("share_comm_ctx",),
    "forward_method": ("register_fsdp_forward_method",),
    "reset_iter_state": ("FSDPModule.reset_iter_state",),
    "reshard_controls": ("FSDPModule.set_reshard_after_forward", "FSDPModule.set_reshard_after_backward"),
    "gradient_divide_factor": ("FSDPModule.set_gradient_divide_factor",),
    "force_sum_reduction": ("FSDPModule.set_force_sum_reduction_for_comms",),
    # the set_reduce_op_type shim below sets a divide factor with force-sum
    "reduce_op_type": ("FSDPModule.set_gradient_divide_factor", "FSDPModule.set_force_sum_reduction_for_comms"),
    "reduce_scatter_unused_params": ("FSDPModule.set_reduce_scatter_unused_params",),
    "separate_reduce_scatter_group": ("FSDPModule.set_separate_reduce_scatter_group",),
    "all_reduce_hook": ("FSDPModule.set_all_reduce_hook",),
    "unshard_in_backward": ("FSDPModule.set_unshard_in_backward",),
    "last_backward": ("FSDPModule.set_is_last_backward",),
    "prefetch": ("FSDPModule.set_modules_to_forward_prefetch", "FSDPModule.set_modules_to_backward_prefetch"),
}


# Keywords of fully_shard a feature needs (torch 2.6's FSDP2 has no ignored_params).
KEYWORDS: dict[str, tuple[str, ...]] = {
    "ignored_params": ("ignored_params",),
    "ignored_params_nested": ("ignored_params",),
}


def fully_shard_keywords(package: Any = fsdp) -> frozenset[str]:
    """The keywords the installed FSDP2's ``fully_shard`` takes."""
    return frozenset(inspect.signature(package.fully_shard).parameters)


def missing_names(feature: str, package: Any = fsdp) -> list[str]:
    """The names ``feature`` needs that the installed FSDP2 (``package``) lacks."""
    missing = [
        f"torch.distributed.fsdp.fully_shard({keyword}=)"
        for keyword in KEYWORDS.get(feature, ())
        if keyword not in fully_shard_keywords(package)
    ]
    for name in NEEDS.get(feature, ()):
        owner, _, attribute = name.rpartition(".")
        where = getattr(package, owner) if owner else package
        if not hasattr(where, attribute):
            missing.append(f"torch.distributed.fsdp.{name}")
    return missing


def lacking_in_installed(package: Any = fsdp) -> dict[str, list[str]]:
    """Feature -> the FSDP2 names it needs that this torch lacks (only features that lack some)."""
    return {feature: names for feature in {**NEEDS, **KEYWORDS} if (names := missing_names(feature, package))}


def _absent(name: str) -> Callable[..., Any]:
    """Stands in for an FSDP2 entry point this torch lacks: calling it is a refusal naming it."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name}: torch {torch.__version__}'s FSDP2 lacks it")

    return refuse


# Defects of torch FSDP2 2.13 that L4 found (its replays are in tests/kit/explore/regressions/, where
# ours passes them): L4 leaves these combinations out, so a run judges the rest.
KNOWN_DEFECTS = {
    frozenset({"reshard_int", "shard_placement_fn"}): "reshard_after_forward=k (1 < k < shard size) on a "
    "param placed Shard(d>0): backward raises IndexError in foreach_all_gather_copy_out "
    "(_fsdp_collectives.py: post_param_size[shard_dim] on the post-forward shard) (replay aabae36b93)",
    frozenset({"last_backward"}): "after a backward under set_is_last_backward(False) the post-forward order "
    "is kept, so the next backward's implicit prefetch follows a stale entry and all-gathers a module "
    "it has just resharded: a wasted all-gather, and that module left unsharded (replay b65534cf62)",
    frozenset({"unshard_across_step"}): "an async unshard issued before the optimizer step copies the shards at "
    "issue: waited after the step, or never waited (the next forward meets it in flight), the module computes "
    "with the params before the step (no guard; L1-01's extra check; replays 2649083d4e, waited, and "
    "8936449209, in flight)",
    # usage patterns of its users (L4's tests/kit/explore/patterns.py), each found by L4's draws on 2 ranks
    frozenset({"freeze_through_lazy_init"}): "every param frozen through the first forward (its lazy init), "
    "then unfrozen: under a bf16/fp32 policy backward raises 'attempting to assign a gradient with dtype "
    "BFloat16 to a tensor with grad_dtype Float' (pytorch#186998; replay 0e3f6123b7); in fp32, unfrozen where "
    "the model registers them with the root left gathered, its sharded params stay frozen and the next forward "
    "builds no graph (replay ccaca52f2b)",
    frozenset({"freeze_across_steps", "mixed_precision"}): "a module frozen through the first forward (its "
    "group's lazy init fixes the reduce dtype from the trainable params only), made trainable before a later "
    "step: under a bf16/fp32 policy backward raises 'attempting to assign a gradient with dtype BFloat16 to a "
    "tensor with grad_dtype Float' (pytorch#186998's cause, reached by progressive unfreezing; replay 49d7482bf9)",
    frozenset({"two_forwards_one_backward", "activation_checkpointing"}): "two forwards before one backward "
    "(DPO's chosen and rejected) through a sharded module under a re-entrant checkpoint: the module's grads "
    "hold one forward's part, half the grad silently lost (2.9.1 raised 'got mixed torch.Tensor and DTensor' "
    "there instead: pytorch#187437; replay a19f86b4fb, one rank)",
    frozenset({"first_grad_on_synced_microbatch", "gradient_sync", "mixed_precision"}): "a param whose first grad "
    "comes on the synced micro-batch after no-sync ones, reduce dtype other than the param dtype: 'FSDP "
    "reduce-scatter expects uniform gradient dtype' (pytorch#160279; replay 43581d53a7)",
    frozenset({"unit_skips_nosync_microbatches", "gradient_sync", "mixed_precision"}): "a call that runs no "
    "forward on a no-sync micro-batch under mixed precision: its post-backward reads a param never unsharded, "
    "\"'FSDPParam' object has no attribute '_unsharded_param'\" (pytorch#194058; replay 30e947c334)",
    frozenset({"grad_dtype"}): "param.grad_dtype = float32 set on bf16 params before fully_shard: the sharded "
    "params it makes drop it, grads come (and are reduced) in bf16 (pytorch#170648; replay 665a326093, one "
    "rank; 2.9.1 raises assigning the fp32 grad instead)",
    frozenset({"ranks_skip_params"}): "a param of a group used on some ranks and not others in one step (a routed "
    "expert): the ranks that gave it no grad leave it out of their reduce-scatter, the collectives differ in "
    "size and gloo aborts the rank (pytorch#158719; replay 7a4b6ef1aa, 2 ranks; with the group's "
    "set_reduce_scatter_unused_params(True) it trains right, but a known defect is keyed by features, so L4 "
    "leaves that case out too)",
    frozenset({"inplace_on_output_view"}): "a sharded module's output view modified in place above it: the "
    "pre-backward hook on that output never runs, backward reads the freed unsharded weight ('setStorage: "
    "... storage of size 0'; replay 5f8ad6e19c)",
    frozenset({"stored_intermediate_loss"}): "a module stores a term of its input and weight after its output "
    "and the loss adds it: resharded after forward, backward reaches the freed unsharded weight through that "
    "term before the module's pre-backward hook ('setStorage: ... storage of size 0'; replay 0c4ada958a)",
    frozenset({"list_module_called_again"}): "fully_shard([block, head]) is one group whose forward ends when "
    "each module has run once: the block calls the head and stores what it returned, the group reshards as the "
    "block ends, and the head's own call later starts a group forward the root completes; backward reaches the "
    "freed weight through the stored term ('setStorage: ... storage of size 0'; pytorch#183702; replays "
    "491b984d5b, 1 rank, and e46014d8fa, 2 ranks)",
    frozenset({"reshard_int", "reset_iter_state"}): "FSDPParam.to_sharded() from the rows an int "
    "reshard_after_forward keeps leaves _sharded_post_forward_param and its data set: reset_iter_state() after "
    "a forward that failed past the post-forward reshard holds 1/k of the group's params (DTensors on the rows "
    "mesh) until the next post-forward reshard, for good once reshard_after_forward is off (replay 7b1fd1db2c)",
    frozenset({"reshard_int", "dcp"}): "the same rows left set by to_sharded(): a state_dict() taken between "
    "forward and backward reshards a group held in rows and keeps them (replay 69e4e861d3)",
    frozenset({"activation_checkpointing", "prefetch"}): "a module's set_modules_to_forward_prefetch list "
    "fires again when a re-entrant checkpoint recomputes the module inside backward: it all-gathers a module "
    "whose backward has already run and resharded it, a wasted all-gather held to the end of backward "
    "(NVIDIA-NeMo/Automodel #3373 on 2.13.0; keyed by both features, as L4's features do not tell a re-entrant "
    "checkpoint from a non-re-entrant one; replay ea194c227a)",
    frozenset({"optimizer_after_forward"}): "the optimizer built after a warm-up forward, a call that kept its "
    "params gathered (the root by default): model.parameters() lists the unsharded copies, the optimizer steps "
    "them and the sharded params never change, silently (pytorch#149205; replay 49fd566fb8, the 3rd draw)",
}


def _backend() -> str:
    """The backend of this process group, or the one the kit would choose here before there is one."""
    return dist.get_backend() if dist.is_initialized() else choose(None, 1)[1]


def MixedPrecisionPolicy(  # noqa: N802 - the API's class name
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
    cast_forward_inputs: bool = True,
    apply_grad_on_fp32_main_grad: bool = False,
) -> fsdp.MixedPrecisionPolicy:
    """FSDP2's policy; the fp32 main grad is HyperParallel's own, refused."""
    if apply_grad_on_fp32_main_grad:
        raise NotImplementedError("MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True): FSDP2 has no main grad")
    return fsdp.MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)


def _refuse_replicate(fn: Callable[[nn.Parameter], Any] | None) -> Callable[[nn.Parameter], Any] | None:
    """The user's placement fn, refusing ``Replicate()`` (FSDP2 places every param with Shard)."""
    if fn is None:
        return None

    def placement(param: nn.Parameter) -> Any:
        chosen = fn(param)
        if isinstance(chosen, Replicate):
            raise NotImplementedError("shard_placement_fn returning Replicate(): FSDP2 shards every param")
        return chosen

    return placement


@functools.cache
def _takes_none_for_reshard() -> bool:
    """Whether the installed FSDP2 takes ``reshard_after_forward=None`` (True except the root): torch
    2.7's takes bools and ints only, defaults to True and never reshards the root after forward, which
    is what None asks for."""
    return inspect.signature(fsdp.fully_shard).parameters["reshard_after_forward"].default is None


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: fsdp.MixedPrecisionPolicy | None = None,
    offload_policy: fsdp.OffloadPolicy | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    replicate_params: Iterable[nn.Parameter] | None = None,
    comm_fusion: bool = True,
    device: Any = None,
) -> Any:
    """HyperParallel's signature onto FSDP2's ``fully_shard``."""
    if replicate_params:
        raise NotImplementedError("fully_shard(replicate_params=...): FSDP2 has no replicated params")
    if comm_fusion is not True:
        raise NotImplementedError("fully_shard(comm_fusion=False): FSDP2 always fuses a group's collectives")
    if device is not None:
        raise NotImplementedError("fully_shard(device=...): FSDP2 takes the device from the mesh")
    if isinstance(module, tuple):
        module = list(module)  # FSDP2 takes a list: one group of its modules (the kit's list_input wants
        # independent groups: left out of ``features``; L4's list_module_called_again takes either)
    if reshard_after_forward is None and not _takes_none_for_reshard():
        reshard_after_forward = True  # that FSDP2's root never reshards after forward: None's meaning
    ignored = {} if ignored_params is None else {"ignored_params": set(ignored_params)}
    if ignored and "ignored_params" not in fully_shard_keywords():
        raise NotImplementedError(f"fully_shard(ignored_params=...): torch {torch.__version__}'s FSDP2 lacks it")
    return fsdp.fully_shard(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=_refuse_replicate(shard_placement_fn),
        mp_policy=mp_policy or fsdp.MixedPrecisionPolicy(),
        offload_policy=offload_policy or fsdp.OffloadPolicy(),
        **ignored,
    )


def _set_reduce_op_type(self: fsdp.FSDPModule, reduce_op_type: str, *, recurse: bool = True) -> None:
    """``"avg"``: FSDP2's own averaging (its default, no divide factor); ``"sum"``: a divide factor
    of 1 with sum-only collectives (gloo has no PREMUL_SUM), on every group below (or this one).

    Not a factor of the world size for "avg": torch 2.13's FSDP2 divides by a custom factor twice on
    an HSDP mesh whose shard dim has one rank (the copy that stands in for the reduce-scatter divides,
    and so does the post-divide after the all-reduce): found by L4, see docs/judging.md."""
    if reduce_op_type not in ("sum", "avg"):
        raise ValueError(f"reduce_op_type must be 'sum' or 'avg', got {reduce_op_type!r}")
    modules = self.modules() if recurse else [self]
    for module in modules:
        if isinstance(module, fsdp.FSDPModule):
            module.set_gradient_divide_factor(1.0 if reduce_op_type == "sum" else None)
            module.set_force_sum_reduction_for_comms(reduce_op_type == "sum")


class TorchFSDP2(Implementation):
    """torch FSDP2 behind the HyperParallel names; torch's mesh and tensor types."""

    name = "torch-fsdp2"
    known_defects = KNOWN_DEFECTS
    Shard = Shard
    Replicate = Replicate

    def __init__(self, spec: Spec) -> None:
        super().__init__(spec, fsdp)
        self.fully_shard = fully_shard
        self.HSDPModule = fsdp.FSDPModule
        self.MixedPrecisionPolicy = MixedPrecisionPolicy
        self.OffloadPolicy = fsdp.OffloadPolicy
        self.CPUOffloadPolicy = fsdp.CPUOffloadPolicy
        for name in ("register_fsdp_forward_method", "share_comm_ctx"):
            setattr(self, name, getattr(fsdp, name, None) or _absent(f"torch.distributed.fsdp.{name}"))
        if not hasattr(fsdp.FSDPModule, "set_reduce_op_type") and "reduce_op_type" not in lacking_in_installed():
            fsdp.FSDPModule.set_reduce_op_type = _set_reduce_op_type

    @property
    def features(self) -> frozenset[str]:
        """All but ``LACKING``, those whose FSDP2 names this torch lacks, and on gloo but
        ``LACKING_ON_GLOO`` too."""
        lacking = LACKING | set(lacking_in_installed()) | (LACKING_ON_GLOO if _backend() == CPU_BACKEND else set())
        return frozenset(FEATURES) - lacking


def load(spec: Spec) -> TorchFSDP2:
    """torch FSDP2 of the installed torch."""
    return TorchFSDP2(spec)
