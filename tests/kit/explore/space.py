"""The space L4 explores: one configuration of the whole API, as plain JSON-serialisable
dataclasses (the Hypothesis strategies that draw it are ``tests.kit.explore.draws``).

A configuration names a world size and mesh, a model from the grammar (``tests.kit.explore.grammar``),
the ``fully_shard`` calls (bottom-up, each with its options and FSDP2's per-module controls), how
the model is set up (deferred init, a float64 cast), a precision policy, and a schedule of steps
(micro-batches, the controls set before each step, the root method each forward calls).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

LEAVES = ("linear", "layernorm", "rmsnorm", "conv1d")
BLOCKS = ("seq", "list", "res", "tied")
PRECISIONS = {  # the precision matrix's combinations: (param, reduce)
    "fp32": ("fp32", None),
    "bf16/fp32": ("bf16", "fp32"),
    "bf16/bf16": ("bf16", "bf16"),
    "fp16/fp32": ("fp16", "fp32"),
}


@dataclass
class Layer:
    """A leaf module: ``kind`` from ``LEAVES`` (or ``embedding``, first for token inputs)."""

    kind: str
    out: int  # output features (norms and conv1d keep their input's)
    bias: bool = True
    frozen: bool = False  # requires_grad=False
    buffer: bool = False  # a buffer its output is scaled by
    channels: int = 1  # conv1d: output channels (averaged back to one)
    kernel: int = 1  # conv1d: kernel size (odd; padded to keep the length)


@dataclass
class Node:
    """A module of the grammar: a leaf, or a block of children (``seq``: nn.Sequential; ``list``: a
    custom block looping over an nn.ModuleList; ``res``: x + child(x); ``tied``: two square Linears
    sharing one weight), optionally under activation checkpointing."""

    kind: str
    children: list[Node] = field(default_factory=list)
    layer: Layer | None = None
    checkpoint: str = ""  # "", "reentrant", "non_reentrant"


@dataclass
class Group:
    """One ``fully_shard`` call: its modules (several: a list input) and its options."""

    paths: list[str]  # module paths ("" is the root); several: one list call, each its own group
    reshard_after_forward: bool | int | None = None  # an int k: kept sharded over k ranks after forward
    comm_fusion: bool = True
    placements: dict[str, str] = field(default_factory=dict)  # param path -> "Shard(d)" / "Replicate()"
    ignored: list[str] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)
    offload: bool = False
    mesh: str = "mesh"  # "mesh": the config's; "shard": its shard dim (HSDP); "flat": 1-D over all ranks
    # the HSDPModule controls of the call's own modules, set once after sharding (FSDP2's are per module)
    divide_factor: float | None = None  # set_gradient_divide_factor: reduced grads = sum / factor
    divide_alias: bool = False  # the factor set through the deprecated set_reduce_scatter_divide_factor
    force_sum: bool = False  # set_force_sum_reduction_for_comms(True)
    scaling_factor: float | None = None  # set_gradient_scaling_factor: reduced grads times it
    scaling_tensor: bool = False  # the scaling factor passed as a 1-element tensor
    hook: bool = False  # set_all_reduce_hook: records what it receives, then maps it in place as ``hook_map``
    hook_map: str = "halve"  # "halve": x / 2 (linear); "leaky": negative entries halved (not additive)
    unshard_in_backward: bool = True  # set_unshard_in_backward (False only where backward needs no param)
    undone: bool = False  # force-sum and unshard_in_backward set back (False / True) after being set
    unused_reduce: bool = False  # set_reduce_scatter_unused_params(True, recurse=False)
    separate_reduce: bool = False  # set_separate_reduce_scatter_group(True, recurse=False)
    # the call takes the first half of a tied pair, the shared weight in its ignored_params: the calls
    # above reach that weight through the other half and must leave it alone too
    tied_half: bool = False
    # the call takes the first half of a tied pair with the shared weight (not ignored): the call above the
    # other half reaches that weight again, two groups for one param (tied_params_split_groups)
    split_tie: bool = False

    @property
    def skips_backward_gather(self) -> bool:
        """Whether backward leaves this call's params sharded (set_unshard_in_backward(False), kept)."""
        return not self.unshard_in_backward and not self.undone


@dataclass
class Precision:
    """The MixedPrecisionPolicy of every call."""

    name: str = "fp32"  # a key of PRECISIONS
    output: str | None = None  # output_dtype: None or "fp32"
    cast_inputs: bool = True
    main_grad: bool = False


@dataclass
class Step:
    """One optimizer step: its micro-batches and the controls set before the first of them."""

    micro: list[bool] = field(default_factory=lambda: [True])  # gradient sync per micro-batch; the last is on
    hold_with_last_backward: bool = False  # hold back with set_is_last_backward(False), not sync off
    reduce_op: str | None = None  # "sum" / "avg", or as users spell them ("SUM", "Avg")
    reduce_op_group: int | None = None  # None: the root, recurse; i: group i alone (recurse=False)
    all_reduce: bool | None = None  # HSDP: set_requires_all_reduce
    all_reduce_group: int | None = None  # None: on the root, recurse; i: group i alone (recurse=False)
    # HSDP accumulation as FSDP2's users write it: the root's set_requires_all_reduce(False) on every
    # micro-batch but the last, True on the last; the parts held since reduced over the replicas with it
    all_reduce_last_only: bool = False
    reshard_after_forward: list | None = None  # [group, flag] set before the step; group -1: the root, recurse
    reshard_after_backward: list | None = None  # [group, flag]
    sync_group: int | None = None  # held back by set_requires_gradient_sync on group i alone (recurse=False)
    unshard: int | None = None  # a group unshard()-ed before the first forward, as ``unshard_how`` says
    # "async": unshard(async_op=True), waited at once; "sync": unshard(); "then reshard": unshard(),
    # reshard(); "across step": unshard(async_op=True) issued at the end of the previous step, where
    # ``across_at`` says, and its handle waited after the optimizer step or never (``across_waited``):
    # the next forward computes with the stepped params either way; the first step: "async"
    unshard_how: str = "async"
    # where the previous step issues an "across step" unshard: "clip" (before clip_grad_norm_ and the
    # optimizer step), "step" (before the optimizer step), "zero_grad" (after the step, before zero_grad)
    across_at: str = "step"
    # the handle waited right after the optimizer step (and zero_grad), or never: then the next forward,
    # or a prefetch in it, meets the all-gather still in flight
    across_waited: bool = True
    reset_iter_state: bool = False  # the root's reset_iter_state() before the step (nothing in flight)
    # a forward (with grad) raising as call i's first module finishes, caught, then the root's
    # reset_iter_state() (FSDP2's recovery), before the step's own controls
    fail: int | None = None
    # a forward under torch.no_grad() after the step's controls: it leaves the root (and the calls
    # not resharding after forward) gathered, so a state dict "before" loads into gathered groups
    eval_forward: bool = False
    state_dict_at: str = ""  # "", "before" (forward), "between" (forward and backward), "after" (backward)
    zero_grad: str = "optimizer"  # "optimizer"; "module": HSDPModule.zero_grad(); "module zeros": (False)
    zero_held: bool = False  # HSDPModule.zero_grad() after the first, held-back micro-batch (drops it)
    method: str = "forward"  # "generate": the root's method registered with register_fsdp_forward_method
    # a module (the owner of some params; never the root) whose params flip requires_grad before the
    # step in both models: frozen, or trainable again (freeze_across_steps)
    toggle: str = ""


@dataclass
class Config:
    """One configuration of the whole API."""

    world: int
    mesh: list[int]  # [W] (FSDP) or [R, S] (HSDP)
    input: str  # "tensor", "tokens" (an embedding first), "dict" ({"x": ...}), "keyword" (x=..., scale=...)
    output: str  # "tensor", "tuple", "dict", "dataclass"
    dim: int  # input features (tokens: the vocabulary)
    body: Node
    groups: list[Group]  # bottom-up; the last one is the root
    precision: Precision = field(default_factory=Precision)
    prefetch: bool = False  # each group prefetches the next one forward and the previous one backward
    prefetch_depth: int = 1  # how many following modules each prefetch list names (in their order)
    steps: list[Step] = field(default_factory=lambda: [Step()])
    optimizer: str = "sgd"
    seed: int = 0
    even: bool = False  # every sharded dim a multiple of the ranks (an implementation without uneven shards)
    # "meta": built on the meta device, sharded, to_empty, rank 0's full state dict loaded; "meta assign": built
    # on the meta device, sharded, a sharded state dict (made from the full one) loaded with assign=True
    init: str = ""
    cast: str = ""  # after sharding: "to" (model.to(torch.float64)) or "double" (model.double())
    # what is gathered when the cast comes: "" nothing; "eval": a forward under torch.no_grad() just
    # before (the root and the calls not resharding after forward stay gathered); "unshard": every call unshard()-ed
    cast_gathered: str = ""
    # usage patterns of FSDP2's users (``tests.kit.explore.patterns``): every param frozen through the
    # first forward (the lazy init), unfrozen before the first step
    freeze_first: bool = False
    # a head (module ``late``) run only on each step's last micro-batch: its params first get a grad on
    # the synced micro-batch (in the root's call), or its own call runs no forward on the held ones
    late: bool = False
    # the ranks the ``late`` head runs on (every rank where empty): on the others its params get no grad
    # in a step where the root's call reduces (a routed expert, a conditional branch: ranks_skip_params)
    late_ranks: list[int] = field(default_factory=list)
    # every leaf returns a view of its output, and the root scales the body's output in place
    inplace_view: bool = False
    # every Linear leaf stores an intermediate on itself (``stored``) after its output; the loss adds it
    stored_loss: bool = False
    # the optimizer built after a first forward without backward (a warm-up, a shape inference)
    optimizer_late: bool = False
    # a block (module ``mtp``) calls the model's head (module ``head``) inside its forward and stores its
    # output for the loss; the head runs again after it (in one list call: list_module_called_again; or, as
    # controls that use no feature, in calls of their own or the root's)
    calls_again: bool = False
    # forwards per micro-batch before its one backward: 2, a forward of another batch first and the loss
    # the sum of both (DPO's chosen and rejected, a contrastive pair: two_forwards_one_backward)
    forwards: int = 1
    # pure bf16 training with fp32 grads: the model cast to bf16 before sharding (no policy), each trainable
    # param given grad_dtype = float32 then: its grads computed, reduced and accumulated in fp32 (grad_dtype)
    grad_dtype: bool = False
    # model.state_dict() taken right after sharding, before the first forward; its tensors read after training
    early_state_dict: bool = False

    # -- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str | dict) -> Config:
        data = json.loads(text) if isinstance(text, str) else text
        return Config(
            **{
                **data,
                "body": _node(data["body"]),
                "groups": [Group(**g) for g in data["groups"]],
                "precision": Precision(**data["precision"]),
                "steps": [Step(**s) for s in data["steps"]],
            }
        )

    # -- what it asks for -------------------------------------------------------------------------
    @property
    def hsdp(self) -> bool:
        return len(self.mesh) == 2

    @property
    def has_late(self) -> bool:
        """Whether the model has the ``late`` head (run on the last micro-batch only, or on some ranks)."""
        return self.late or bool(self.late_ranks)

    def size(self) -> dict[str, int]:
        """How big the configuration is: groups (fully_shard'ed modules), steps, leaves, world."""
        return {
            "groups": sum(len(g.paths) for g in self.groups),
            "steps": len(self.steps),
            "micro-batches": sum(len(s.micro) for s in self.steps),
            "leaves": _leaves(self.body),
            "world": self.world,
        }

    def features(self) -> set[str]:
        """The plan features (``tests.kit.judging.surface.FEATURES``) this configuration uses."""
        used = {"fully_shard"}
        if self.hsdp:
            used.add("hsdp")
        if any(g.mesh != "mesh" for g in self.groups):
            used.add("submesh")
        if checkpointed(self.body):
            used.add("activation_checkpointing")
        if self.prefetch:
            used.add("prefetch")
        if self.init.startswith("meta"):
            used.add("deferred_init")
        if self.init == "meta assign":
            used.add("state_dict_assign")
        if self.grad_dtype:
            used.add("grad_dtype")
        if self.early_state_dict:
            used.add("state_dict_before_forward")
        if self.cast:
            used.add("to_dtype")
        p = self.precision
        if p.name != "fp32" or p.output:
            used.add("mixed_precision")
        if not p.cast_inputs:
            used.add("cast_forward_inputs")
        if p.main_grad:
            used.add("main_grad")
        for g in self.groups:
            if len(g.paths) > 1 and not (self.calls_again and "mtp" in g.paths):
                used.add("list_input")
            if type(g.reshard_after_forward) is int:
                used.add("reshard_int")
            elif g.reshard_after_forward is not None:
                used.add("reshard_after_forward")
            for flag, feature in (
                (g.divide_factor is not None, "gradient_divide_factor"),
                (g.force_sum, "force_sum_reduction"),
                (g.scaling_factor is not None, "gradient_scaling_factor"),
                (g.hook, "all_reduce_hook"),
                (not g.unshard_in_backward, "unshard_in_backward"),
            ):
                if flag:
                    used.add(feature)
            if not g.comm_fusion:
                used.add("comm_fusion")
            if g.unused_reduce:
                used.add("reduce_scatter_unused_params")
            if g.separate_reduce:
                used.add("separate_reduce_scatter_group")
            if g.ignored:
                used.add("ignored_params")
            if g.replicated:
                used.add("replicate_params")
            if g.offload:
                used.add("cpu_offload")
            if g.split_tie:
                used.add("tied_params_split_groups")
            for placement in g.placements.values():
                used.add("placement_replicate" if placement == "Replicate()" else "shard_placement_fn")
        if self.freeze_first:
            used.add("freeze_through_lazy_init")
        if self.late:  # its own call skips the held micro-batches' forwards; in the root's, a late first grad
            own = any("late" in g.paths for g in self.groups)
            used.add("unit_skips_nosync_microbatches" if own else "first_grad_on_synced_microbatch")
        if self.late_ranks:
            used.add("ranks_skip_params")
        if self.inplace_view:
            used.add("inplace_on_output_view")
        if self.stored_loss:
            used.add("stored_intermediate_loss")
        if self.optimizer_late:
            used.add("optimizer_after_forward")
        if self.calls_again and any(len(g.paths) > 1 and "mtp" in g.paths for g in self.groups):
            used.add("list_module_called_again")  # in calls of their own, or the root's: no feature (a control)
        if self.forwards > 1:
            used.add("two_forwards_one_backward")
        for s in self.steps:
            if not all(s.micro):
                used.add("last_backward" if s.hold_with_last_backward else "gradient_sync")
            if s.reduce_op:
                used.add("reduce_op_type")
            one_group = [s.reduce_op_group, s.all_reduce_group, s.sync_group]
            one_group += [c[0] if c[0] >= 0 else None for c in (s.reshard_after_forward, s.reshard_after_backward) if c]
            if any(g is not None for g in one_group):
                used.add("recurse_false")
            if s.all_reduce is not None:
                used.add("all_reduce_control")
            if s.all_reduce_last_only:
                used.add("all_reduce_accumulation")
            if s.reshard_after_forward or s.reshard_after_backward:
                used.add("reshard_controls")
            if s.unshard is not None:
                used.add("unshard_reshard")
                if s.unshard_how == "across step":
                    used.add("unshard_across_step")
            if s.reset_iter_state or s.fail is not None:
                used.add("reset_iter_state")
            if s.state_dict_at:
                used.add("dcp")
            if s.zero_grad != "optimizer" or s.zero_held:
                used.add("zero_grad")
            if s.method != "forward":
                used.add("forward_method")
            if s.toggle:
                used.add("freeze_across_steps")
        return used

    def times_backward(self) -> bool:
        """Whether L4 judges backward prefetch timing: each module's backward starts once, in the
        reverse of the order forwards finish (no recompute, no list call, no module called twice, one forward
        a backward, one
        param group per call, every call gathered in backward, no registered method skipping the root's
        hooks, no output modified in place: the backward hooks that time it wrap the modules' outputs)."""
        return not (
            checkpointed(self.body)
            or self.inplace_view
            or self.calls_again
            or self.forwards > 1
            or any(len(g.paths) > 1 or g.placements or g.skips_backward_gather for g in self.groups)
            or any(step.method != "forward" for step in self.steps)
        )

    def coverage(self) -> dict[str, str]:
        """What was drawn, one value per option (the explorer's table of what came up)."""
        kinds = sorted(_kinds(self.body))
        return {
            "world size": str(self.world),
            "mesh": "x".join(map(str, self.mesh)),
            "input": self.input,
            "output": self.output,
            "precision": self.precision.name + (" main grad" if self.precision.main_grad else ""),
            "modules": ",".join(kinds),
            "groups": str(self.size()["groups"]),
            "steps": str(len(self.steps)),
            "optimizer": self.optimizer,
            **{f"uses {name}": "yes" for name in sorted(self.features() - {"fully_shard"})},
        } | self._extra_options()

    def _extra_options(self) -> dict[str, str]:
        """The options drawn that are no feature of their own: the maps of the all-reduce hooks, a reduce
        op spelled as users write it (``"SUM"``), and a call on a tied half (``ignored_params_nested``:
        counted here, not as a feature, whose pairs would cost the covering phase six more configurations)."""
        extra = {"ignored params": "nested"} if any(g.tied_half for g in self.groups) else {}
        if any(s.reduce_op and s.reduce_op != s.reduce_op.lower() for s in self.steps):
            extra["reduce op spelling"] = "as users write it"  # "SUM", "Avg": accepted alike, or refused
        hooks = {g.hook_map for g in self.groups if g.hook}
        if hooks:
            extra["all-reduce hook"] = ",".join(sorted(hooks))
        return extra


def _node(data: dict) -> Node:
    layer = Layer(**data["layer"]) if data.get("layer") else None
    return Node(data["kind"], [_node(c) for c in data.get("children", [])], layer, data.get("checkpoint", ""))


def _leaves(node: Node) -> int:
    return 1 if node.kind == "leaf" else 2 if node.kind == "tied" else sum(_leaves(c) for c in node.children)


def _kinds(node: Node) -> set[str]:
    own = {node.layer.kind} if node.layer else {node.kind}
    return own.union(*(_kinds(c) for c in node.children)) if node.children else own


def checkpointed(node: Node) -> bool:
    """Whether any block of the tree runs under activation checkpointing."""
    return bool(node.checkpoint) or any(checkpointed(c) for c in node.children)


def shard_size(config: Config, mesh: str) -> int:
    """How many ranks a group on ``mesh`` shards over."""
    if mesh == "flat":
        return config.world
    return config.mesh[-1]


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
