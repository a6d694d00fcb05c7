"""The space L4 explores: one configuration of the whole API, as plain JSON-serialisable
dataclasses, and the Hypothesis strategies that draw it.

A configuration names a world size and mesh, a model from the grammar (``tests.kit.explore.grammar``),
the ``fully_shard`` calls (bottom-up, each with its options and FSDP2's per-module controls), how
the model is set up (deferred init, a float64 cast), a precision policy, and a schedule of steps
(micro-batches, the controls set before each step, the root method each forward calls). Small strategies compose into
``configs(features, max_world)``; a feature the implementation does not declare is never drawn,
so any implementation behind an adapter can be explored. Dims are drawn to hit the layouts that
break sharding: 1, primes, fewer rows than ranks, exact multiples.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st

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
    force_sum: bool = False  # set_force_sum_reduction_for_comms(True)
    scaling_factor: float | None = None  # set_gradient_scaling_factor: reduced grads times it
    hook: bool = False  # set_all_reduce_hook(halving the reduced grads in place)
    unshard_in_backward: bool = True  # set_unshard_in_backward (False only where backward needs no param)
    undone: bool = False  # force-sum and unshard_in_backward set back (False / True) after being set
    unused_reduce: bool = False  # set_reduce_scatter_unused_params(True, recurse=False)
    separate_reduce: bool = False  # set_separate_reduce_scatter_group(True, recurse=False)

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
    reduce_op: str | None = None  # "sum" / "avg"
    reduce_op_group: int | None = None  # None: the root, recurse; i: group i alone (recurse=False)
    all_reduce: bool | None = None  # HSDP: set_requires_all_reduce
    all_reduce_group: int | None = None  # None: on the root, recurse; i: group i alone (recurse=False)
    reshard_after_forward: list | None = None  # [group, flag] set before the step; group -1: the root, recurse
    reshard_after_backward: list | None = None  # [group, flag]
    sync_group: int | None = None  # held back by set_requires_gradient_sync on group i alone (recurse=False)
    unshard: int | None = None  # a group unshard()-ed before the first forward, as ``unshard_how`` says
    # "async": unshard(async_op=True), waited at once; "sync": unshard(); "then reshard": unshard(),
    # reshard(); "across step": unshard(async_op=True) issued before the previous step's optimizer
    # step and waited after it (the gathered params must be the stepped ones); the first step: "async"
    unshard_how: str = "async"
    reset_iter_state: bool = False  # the root's reset_iter_state() before the step (nothing in flight)
    state_dict_at: str = ""  # "", "before" (forward), "between" (forward and backward), "after" (backward)
    zero_grad: str = "optimizer"  # "optimizer"; "module": HSDPModule.zero_grad(); "module zeros": (False)
    zero_held: bool = False  # HSDPModule.zero_grad() after the first, held-back micro-batch (drops it)
    method: str = "forward"  # "generate": the root's method registered with register_fsdp_forward_method


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
    init: str = ""  # "meta": built on the meta device, sharded, to_empty, rank 0's full state dict loaded
    cast: str = ""  # after sharding: "to" (model.to(torch.float64)) or "double" (model.double())

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
        """The plan features (``tests.kit.surface.FEATURES``) this configuration uses."""
        used = {"fully_shard"}
        if self.hsdp:
            used.add("hsdp")
        if any(g.mesh != "mesh" for g in self.groups):
            used.add("submesh")
        if checkpointed(self.body):
            used.add("activation_checkpointing")
        if self.prefetch:
            used.add("prefetch")
        if self.init == "meta":
            used.add("deferred_init")
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
            if len(g.paths) > 1:
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
            for placement in g.placements.values():
                used.add("placement_replicate" if placement == "Replicate()" else "shard_placement_fn")
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
            if s.reshard_after_forward or s.reshard_after_backward:
                used.add("reshard_controls")
            if s.unshard is not None:
                used.add("unshard_reshard")
                if s.unshard_how == "across step":
                    used.add("unshard_across_step")
            if s.reset_iter_state:
                used.add("reset_iter_state")
            if s.state_dict_at:
                used.add("dcp")
            if s.zero_grad != "optimizer" or s.zero_held:
                used.add("zero_grad")
            if s.method != "forward":
                used.add("forward_method")
        return used

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
        }


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


# -- strategies --------------------------------------------------------------------------------
def one_in(draw: Any, n: int) -> bool:
    """True one time in ``n``; False where Hypothesis shrinks to, so a shrunk configuration keeps
    only the options its failure needs."""
    return draw(st.integers(1, n)) == n


def dims(world: int, uneven: bool) -> st.SearchStrategy[int]:
    """Feature sizes that stress the layout: 1, primes, fewer rows than ranks, exact multiples
    (only multiples of the world where the implementation has no uneven sharding)."""
    if not uneven:
        return st.sampled_from(sorted({world, 2 * world}))
    return st.sampled_from(sorted({1, 2, 3, 5, 7, 8, 13, world, 2 * world, world + 1, max(1, world - 1)}))


@st.composite
def layers(draw: Any, width: st.SearchStrategy[int], features: frozenset[str], allow_frozen: bool) -> Layer:
    kind = draw(st.sampled_from(LEAVES))
    frozen = allow_frozen and one_in(draw, 4)
    buffer = one_in(draw, 4)
    if kind == "linear":
        return Layer("linear", draw(width), draw(st.booleans()), frozen, buffer)
    if kind == "conv1d":
        return Layer("conv1d", 0, draw(st.booleans()), frozen, buffer, draw(width), draw(st.sampled_from((1, 3))))
    return Layer(kind, 0, kind == "layernorm" and draw(st.booleans()), frozen, buffer)


@st.composite
def nodes(draw: Any, width: st.SearchStrategy[int], features: frozenset[str], depth: int) -> Node:
    """A module tree up to ``depth`` levels of blocks (3 at most), a few leaves in all."""
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return Node("leaf", layer=draw(layers(width, features, allow_frozen=True)))
    kind = draw(st.sampled_from(BLOCKS))
    checkpoint = ""
    if "activation_checkpointing" in features and kind != "tied" and one_in(draw, 4):
        checkpoint = draw(st.sampled_from(("reentrant", "non_reentrant")))
    if kind == "tied":
        return Node("tied", checkpoint=checkpoint)
    children = draw(st.lists(nodes(width, features, depth - 1), min_size=1, max_size=3 if kind != "res" else 1))
    return Node(kind, children, checkpoint=checkpoint)


def factorisations(world: int) -> list[list[int]]:
    """Every (R, S) with R x S = world: the 2-D HSDP meshes of a world size."""
    return [[r, world // r] for r in range(1, world + 1) if world % r == 0]


@st.composite
def meshes(draw: Any, world: int, features: frozenset[str]) -> list[int]:
    if "hsdp" in features and draw(st.booleans()):
        return draw(st.sampled_from(factorisations(world)))
    return [world]


@st.composite
def precisions(draw: Any, features: frozenset[str]) -> Precision:
    if "mixed_precision" not in features or draw(st.booleans()):
        return Precision()
    name = draw(st.sampled_from(tuple(PRECISIONS)))
    output = draw(st.sampled_from((None, "fp32")))
    cast = "cast_forward_inputs" not in features or not one_in(draw, 4)
    main = "main_grad" in features and name != "fp32" and PRECISIONS[name][1] == "fp32" and draw(st.booleans())
    return Precision(name, output, cast, main)


@st.composite
def configs(
    draw: Any,
    features: frozenset[str],
    max_world: int = 4,
    min_world: int = 1,
    avoid: tuple[frozenset[str], ...] = (),
) -> Config:
    """One configuration drawing only ``features`` (what the implementation declares), never all
    the features of one set in ``avoid`` together (an implementation's known defects)."""
    from tests.kit.explore.grammar import build, names

    world = draw(st.integers(min_world, max_world))
    mesh = draw(meshes(world, features))
    uneven = "uneven" in features
    width = dims(world, uneven)
    inputs = ["tensor", "tokens", "dict", "keyword"]
    config = Config(
        world=world,
        mesh=mesh,
        input=draw(st.sampled_from(inputs)),
        output=draw(st.sampled_from(["tensor", "tuple", "dict", "dataclass"])),
        dim=draw(width),
        body=draw(nodes(width, features, depth=3)),
        groups=[],
        precision=draw(precisions(features)),
        optimizer=draw(st.sampled_from(["sgd", "adamw"])),
        seed=draw(st.integers(0, 2**16)),
        even=not uneven,
    )
    if "deferred_init" in features and one_in(draw, 4):
        config.init = "meta"
    if "to_dtype" in features and config.precision == Precision() and one_in(draw, 5):
        config.cast = draw(st.sampled_from(("to", "double")))  # float64 training (a policy would cast it away)
    model = build(config)
    modules, params = names(model)
    config.groups = draw(groups(config, modules, params, features))
    config.prefetch = "prefetch" in features and len(config.groups) > 1 and draw(st.booleans())
    if config.prefetch and len(config.groups) > 2 and one_in(draw, 3):
        config.prefetch_depth = 2
    config.steps = draw(st.lists(steps(config, features), min_size=1, max_size=3))
    config.steps[0].reset_iter_state = False  # its use: after an iteration (torch FSDP2 raises before any)
    used = config.features()
    assume(not any(combination <= used for combination in avoid))
    return config


@st.composite
def groups(
    draw: Any, config: Config, modules: dict[str, int], params: dict[str, tuple[int, ...]], features: frozenset[str]
) -> list[Group]:
    """The fully_shard calls: a subset of the modules, bottom-up, then the root; list calls of
    unrelated modules where list input is declared."""
    candidates = sorted(path for path in modules if path)
    chosen = draw(st.lists(st.sampled_from(candidates), unique=True, max_size=4)) if candidates else []
    often = "unshard_in_backward" in features and (one_in(draw, 2) or one_in(draw, 2))  # 3 in 4; shrinks to no
    if "embed" in candidates and "embed" not in chosen and often:
        chosen.append("embed")  # a group of its own: the one set_unshard_in_backward(False) may take
    chosen.sort(key=lambda p: (-modules[p], p))  # deepest first: bottom-up
    calls: list[list[str]] = []
    for path in chosen:
        unrelated = calls and all(not _related(path, other) for other in calls[-1])
        if "list_input" in features and unrelated and modules[path] == modules[calls[-1][0]] and draw(st.booleans()):
            calls[-1].append(path)
        else:
            calls.append([path])
    calls.append([""])
    managed: set[str] = set()
    out = []
    for paths in calls:
        under = [p for p in params if any(_under(p, path) for path in paths)]
        own = [p for p in under if p not in managed]
        managed.update(own)
        below = [p for p in under if p not in own]  # managed by a call below: naming them changes nothing
        out.append(draw(group_options(config, paths, own, params, features, root=paths == [""], below=below)))
    return out


def _under(param: str, module: str) -> bool:
    return module == "" or param.startswith(module + ".")


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


@st.composite
def group_options(
    draw: Any,
    config: Config,
    paths: list[str],
    own: list[str],
    params: dict[str, tuple[int, ...]],
    features: frozenset[str],
    root: bool,
    below: list[str] = (),
) -> Group:
    """One call's options; ``own``: the params it manages, ``below``: those under its modules that
    calls below it manage (ignored or replicate params may name them too: no effect)."""
    group = Group(paths)
    if "reshard_after_forward" in features:
        group.reshard_after_forward = draw(st.sampled_from((None, True, False)))
    if "comm_fusion" in features:
        group.comm_fusion = not one_in(draw, 4)
    if "cpu_offload" in features and one_in(draw, 5):
        group.offload = True
    if "submesh" in features and not root and config.hsdp and one_in(draw, 3):
        group.mesh = draw(st.sampled_from(("shard", "flat")))
    shard = shard_size(config, group.mesh)
    if "reshard_int" in features and one_in(draw, 3):
        # a row smaller than the shard group where there is one; else 1 (means False) or the shard size (True)
        rows = [k for k in range(2, shard) if shard % k == 0] or sorted({1, shard})
        group.reshard_after_forward = draw(st.sampled_from(rows))
    draw(reduce_controls(group, features))
    if "unshard_in_backward" in features and paths == ["embed"] and (one_in(draw, 2) or one_in(draw, 2)):
        group.unshard_in_backward = False  # an embedding's backward needs its indices, not its weight
    if group.force_sum or not group.unshard_in_backward:
        group.undone = one_in(draw, 4)
    if "reduce_scatter_unused_params" in features and one_in(draw, 6):
        group.unused_reduce = True
    if "separate_reduce_scatter_group" in features and one_in(draw, 6):
        group.separate_reduce = True
    free = list(own)
    nameable = list(below)  # a call's list may name params managed below it: nothing changes for them
    if "ignored_params" in features and free and one_in(draw, 4):
        group.ignored = _named(draw, free, nameable)
        free = [p for p in free if p not in group.ignored]
    if "replicate_params" in features and free and one_in(draw, 4):
        group.replicated = _named(draw, free, [p for p in nameable if p not in group.ignored])
        free = [p for p in free if p not in group.replicated]
    for path in free:
        placement = draw(placements(params[path], shard, features))
        if placement:
            group.placements[path] = placement
    return group


def _named(draw: Any, free: list[str], below: list[str]) -> list[str]:
    """One or two of the call's own free params, and (one time in three, where there are) one
    managed by a call below."""
    named = draw(st.lists(st.sampled_from(free), unique=True, min_size=1, max_size=2))
    if below and one_in(draw, 3):
        named.append(draw(st.sampled_from(below)))
    return named


@st.composite
def reduce_controls(draw: Any, group: Group, features: frozenset[str]) -> None:
    """FSDP2's reduction controls of one call, each drawn where declared (one call in five)."""
    if "gradient_divide_factor" in features and one_in(draw, 5):
        group.divide_factor = draw(st.sampled_from((1.0, 2.0, 3.0)))
    if "force_sum_reduction" in features and one_in(draw, 5):
        group.force_sum = True
    if "gradient_scaling_factor" in features and one_in(draw, 5):
        group.scaling_factor = draw(st.sampled_from((0.5, 2.0)))
    if "all_reduce_hook" in features and one_in(draw, 5):
        group.hook = True


def shard_size(config: Config, mesh: str) -> int:
    """How many ranks a group on ``mesh`` shards over."""
    if mesh == "flat":
        return config.world
    return config.mesh[-1]


@st.composite
def placements(draw: Any, shape: tuple[int, ...], shard: int, features: frozenset[str]) -> str | None:
    """None (Shard(0)), or Shard(d) / Replicate() where declared and where the layout allows."""
    if not one_in(draw, 3):
        return None
    options = []
    if "placement_replicate" in features:
        options.append("Replicate()")
    if "shard_placement_fn" in features:
        for dim in range(1, len(shape)):
            even = shape[dim] % shard == 0
            if even or ("uneven" in features and "uneven_other_dims" in features):
                options.append(f"Shard({dim})")
    return draw(st.sampled_from(options)) if options else None


def one_group(n_groups: int) -> st.SearchStrategy[int]:
    """The call a ``recurse=False`` setter acts on: the root half the time (the calls below it are
    where recurse=False differs from recurse=True), else any."""
    return st.one_of(st.integers(0, n_groups - 1), st.just(n_groups - 1))


@st.composite
def steps(draw: Any, config: Config, features: frozenset[str]) -> Step:
    step = Step()
    count = draw(st.integers(1, 3)) if ("gradient_sync" in features or "last_backward" in features) else 1
    held = [draw(st.booleans()) for _ in range(count - 1)]
    step.micro = [not h for h in held] + [True]
    if not all(step.micro):
        styles = [s for s in ("gradient_sync", "last_backward") if s in features]
        step.hold_with_last_backward = draw(st.sampled_from(styles)) == "last_backward"
    n_groups = len(config.groups)
    if not all(step.micro) and not step.hold_with_last_backward and "recurse_false" in features and one_in(draw, 3):
        step.sync_group = draw(one_group(n_groups))  # only that call holds back
    divided = any(g.divide_factor is not None for g in config.groups)  # the factor decides the division
    if "reduce_op_type" in features and not divided and one_in(draw, 3):
        step.reduce_op = draw(st.sampled_from(("sum", "avg")))
        if "recurse_false" in features and draw(st.booleans()):
            step.reduce_op_group = draw(one_group(n_groups))
    # the all-reduce over replicas: drawn where there are replicas (over one it is no collective at all)
    if "all_reduce_control" in features and config.hsdp and config.mesh[0] > 1 and one_in(draw, 2):
        step.all_reduce = draw(st.booleans())
        if "recurse_false" in features and draw(st.booleans()):
            step.all_reduce_group = draw(one_group(n_groups))
    if "reshard_controls" in features and one_in(draw, 3):
        which = draw(st.sampled_from(("reshard_after_forward", "reshard_after_backward")))
        group = (draw(one_group(n_groups)) if draw(st.booleans()) else -1) if "recurse_false" in features else -1
        kept_rows = [i for i, g in enumerate(config.groups) if type(g.reshard_after_forward) is int]
        if kept_rows and "recurse_false" in features and one_in(draw, 2):
            # a bool replacing an int on its call: the interplay to judge (rare by chance)
            which, group = "reshard_after_forward", draw(st.sampled_from(kept_rows))
        setattr(step, which, [group, draw(st.booleans())])
    if "unshard_reshard" in features and one_in(draw, 4):
        step.unshard = draw(st.integers(0, n_groups - 1))
        hows = ["async", "sync", "then reshard"] + (["across step"] if "unshard_across_step" in features else [])
        step.unshard_how = draw(st.sampled_from(hows))
    if "reset_iter_state" in features and one_in(draw, 6):
        step.reset_iter_state = True
    if "dcp" in features and one_in(draw, 4):
        step.state_dict_at = draw(st.sampled_from(("before", "between", "after")))
    if "zero_grad" in features and one_in(draw, 3):
        step.zero_grad = draw(st.sampled_from(("module", "module zeros")))
    if "zero_grad" in features and not step.micro[0] and one_in(draw, 3):
        step.zero_held = True
    if "forward_method" in features and one_in(draw, 3):
        step.method = "generate"
    return step


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
