"""The Hypothesis strategies that draw L4's configurations (``tests.kit.explore.space``).

Small strategies compose into ``configs(features, max_world)``; a feature the implementation does
not declare is never drawn, so any implementation behind an adapter can be explored. Dims are drawn
to hit the layouts that break sharding: 1, primes, fewer rows than ranks, exact multiples. The
model's param names come from the grammar (``tests.kit.explore.grammar``), which builds it.
"""

from __future__ import annotations

from typing import Any

from hypothesis import assume
from hypothesis import strategies as st

from tests.kit.explore.grammar import AGAIN, build, names, tied_halves
from tests.kit.explore.pattern_draws import mostly, one_in, patterns, toggles
from tests.kit.explore.space import BLOCKS, LEAVES, PRECISIONS, Config, Group, Layer, Node, Precision, Step, shard_size


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
        config.init = "meta assign" if "state_dict_assign" in features and draw(st.booleans()) else "meta"
    if "to_dtype" in features and config.precision == Precision() and one_in(draw, 5):
        config.cast = draw(st.sampled_from(("to", "double")))  # float64 training (a policy would cast it away)
        if "to_dtype_after_forward" in features:  # the cast may meet gathered groups
            hows = ("", "eval", "unshard") if "unshard_reshard" in features else ("", "eval")
            config.cast_gathered = draw(st.sampled_from(hows))
    draw(patterns(config, features))
    model = build(config)
    modules, params = names(model)
    config.groups = draw(groups(config, modules, params, features, tuple(tied_halves(model))))
    config.prefetch = "prefetch" in features and len(config.groups) > 1 and draw(st.booleans())
    if config.prefetch and len(config.groups) > 2 and one_in(draw, 3):
        config.prefetch_depth = 2
    config.steps = draw(st.lists(steps(config, features), min_size=1, max_size=3))
    config.steps[0].reset_iter_state = False  # its use: after an iteration (torch FSDP2 raises before any)
    across = {"unshard_reshard", "unshard_across_step"}
    if across <= features and len(config.steps) > 1 and not any(c <= across for c in avoid) and one_in(draw, 4):
        # an unshard issued at the end of one step, met by the next: rare by chance (one step's
        # unshard, one way of four, never the first step's), so drawn on its own too
        later = draw(st.sampled_from(config.steps[1:]))
        later.unshard = draw(st.integers(0, len(config.groups) - 1))
        draw(across_step(config, later))
    if "freeze_across_steps" in features and one_in(draw, 5):
        draw(toggles(config, sorted({path.rpartition(".")[0] for path in params if "." in path})))
    if "reset_iter_state" in features and mostly(draw):
        # a forward failing at a drawn call (the root half the time: every call's forward done, so the
        # next backward's implicit prefetch meets all they left), then reset_iter_state(), before a drawn step
        draw(st.sampled_from(config.steps)).fail = draw(one_group(len(config.groups)))
    used = config.features()
    assume(not any(combination <= used for combination in avoid))
    return config


@st.composite
def groups(
    draw: Any,
    config: Config,
    modules: dict[str, int],
    params: dict[str, tuple[int, ...]],
    features: frozenset[str],
    halves: tuple[str, ...] = (),
) -> list[Group]:
    """The fully_shard calls: a subset of the modules, bottom-up, then the root; list calls of
    unrelated modules where list input is declared; at times a call of its own on the first half of
    a tied pair (``halves``) ignoring the shared weight, which the calls above reach too."""
    candidates = sorted(path for path in modules if path and path not in AGAIN)
    if config.late_ranks or (config.late and "unit_skips_nosync_microbatches" not in features):
        candidates.remove("late")  # the late head stays in the root's call (with the root's own param)
    chosen = draw(st.lists(st.sampled_from(candidates), unique=True, max_size=4)) if candidates else []
    alone = config.late and "first_grad_on_synced_microbatch" not in features and not config.late_ranks
    if alone and "late" not in chosen:
        chosen.append("late")  # the late head in a call of its own
    nested = {"ignored_params", "ignored_params_nested"} <= features and halves
    split = "tied_params_split_groups" in features and halves and one_in(draw, 4)  # the shared weight kept: F10
    split_half = draw(st.sampled_from(halves)) if split else ""
    if split_half or (nested and one_in(draw, 3)):
        half = split_half or draw(st.sampled_from(halves))
        chosen.append(half)
        modules = {**modules, half: half.count(".") + 1}
    often = "unshard_in_backward" in features and (one_in(draw, 2) or one_in(draw, 2))  # 3 in 4; shrinks to no
    if "embed" in candidates and "embed" not in chosen and often:
        chosen.append("embed")  # a group of its own: the one set_unshard_in_backward(False) may take
    chosen.sort(key=lambda p: (-modules[p], p))  # deepest first: bottom-up
    calls: list[list[str]] = []
    for path in chosen:
        unrelated = calls and all(not _related(path, other) for other in calls[-1]) and calls[-1][0] not in halves
        unrelated = unrelated and path not in halves  # a tied half's call stays a call of its own
        if "list_input" in features and unrelated and modules[path] == modules[calls[-1][0]] and draw(st.booleans()):
            calls[-1].append(path)
        else:
            calls.append([path])
    if config.calls_again:  # the block and the head it calls: one list call (3 in 4), calls of their own, or the root's
        how = draw(st.sampled_from(("list", "list", "list", "own", "root")))
        calls += [list(AGAIN)] if how == "list" else [[path] for path in AGAIN] if how == "own" else []
    calls.append([""])
    managed: set[str] = set()
    out = []
    for paths in calls:
        under = [p for p in params if any(_under(p, path) for path in paths)]
        own = [p for p in under if p not in managed]
        managed.update(own)
        below = [p for p in under if p not in own]  # managed by a call below: naming them changes nothing
        if paths[0] in halves:
            out.append(draw(_tied_half_options(config, paths[0], own, params, features, below, split_half == paths[0])))
            continue
        out.append(draw(group_options(config, paths, own, params, features, root=paths == [""], below=below)))
    return out


@st.composite
def _tied_half_options(
    draw: Any,
    config: Config,
    half: str,
    own: list[str],
    params: dict[str, tuple[int, ...]],
    features: frozenset[str],
    below: list[str],
    split: bool = False,
) -> Group:
    """The options of a call on a tied half: drawn as any call's for its other params, the shared
    weight in its ignored_params; or, ``split``, the weight its own too (a tied embedding and head in
    two calls, which the call above the other half meets again: FSDP2's F10)."""
    weight = f"{half}.weight"
    others = [p for p in own if p != weight]
    group = draw(group_options(config, [half], others, params, features, root=False, below=below))
    if not split:
        group.ignored.append(weight)
    group.tied_half, group.split_tie = not split, split
    return group


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
    if config.calls_again or config.forwards > 1:  # a call may reduce twice in one backward, each part hooked
        group.hook_map = "halve"  # (0b7a812c8f): a non-additive hook has no one promised result there
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
    # a head on some ranks only: the root's own param stays managed, so the root's call gets a grad on every rank
    ignorable = [p for p in free if not (root and config.late_ranks and p == "gain")]
    if "ignored_params" in features and ignorable and one_in(draw, 4):
        group.ignored = _named(draw, ignorable, nameable)
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
        group.divide_alias = one_in(draw, 3)  # FSDP2's deprecated spelling, the same promise
    if "force_sum_reduction" in features and one_in(draw, 5):
        group.force_sum = True
    if "gradient_scaling_factor" in features and one_in(draw, 5):
        group.scaling_factor = draw(st.sampled_from((0.5, 2.0)))
        group.scaling_tensor = one_in(draw, 2)  # a number or a 1-element tensor, both accepted
    if "all_reduce_hook" in features and one_in(draw, 5):
        group.hook = True
        # halving is linear: it cannot tell a hook called before the HSDP all-reduce from one after it
        group.hook_map = draw(st.sampled_from(("halve", "leaky")))


@st.composite
def across_step(draw: Any, config: Config, step: Step) -> None:
    """``step``'s unshard issued at the end of the step before it, as a user orders it: before
    ``clip_grad_norm_`` (where every param is a DTensor on the one mesh, as it needs), before the
    optimizer step, or after it before ``zero_grad``; its handle waited after the step, or never (the
    forward, or a prefetch in it, meets the all-gather in flight)."""
    step.unshard_how = "across step"
    one_mesh = all(g.mesh == "mesh" and not g.ignored for g in config.groups)
    step.across_at = draw(st.sampled_from(("step", "zero_grad", "clip") if one_mesh else ("step", "zero_grad")))
    step.across_waited = draw(st.booleans())


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
        if one_in(draw, 3):  # as users write it: accepted as its lower case, or refused naming the argument
            step.reduce_op = draw(st.sampled_from((step.reduce_op.upper(), step.reduce_op.capitalize())))
        if "recurse_false" in features and draw(st.booleans()):
            step.reduce_op_group = draw(one_group(n_groups))
    # the all-reduce over replicas: drawn where there are replicas (over one it is no collective at all)
    replica_controls = {"all_reduce_control", "all_reduce_accumulation"} & features
    if replica_controls and config.hsdp and config.mesh[0] > 1 and one_in(draw, 2):
        # accumulation: every micro-batch but the last keeps its per-replica part for the last
        if len(step.micro) > 1 and "all_reduce_accumulation" in features and one_in(draw, 2):
            step.all_reduce_last_only = True
        elif "all_reduce_control" in features:
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
        if step.unshard_how == "across step":
            draw(across_step(config, step))
    if "reset_iter_state" in features and one_in(draw, 6):
        step.reset_iter_state = True
    step.eval_forward = one_in(draw, 6)
    if "dcp" in features and one_in(draw, 4):
        step.state_dict_at = draw(st.sampled_from(("before", "between", "after")))
    if "zero_grad" in features and one_in(draw, 3):
        step.zero_grad = draw(st.sampled_from(("module", "module zeros")))
    if "zero_grad" in features and not step.micro[0] and one_in(draw, 3):
        step.zero_held = True
    if "forward_method" in features and one_in(draw, 3):
        step.method = "generate"
    if "recurse_false" in features and n_groups > 1 and one_in(draw, 4):
        root_alone(draw, config, features, step)
    return step


def root_alone(draw: Any, config: Config, features: frozenset[str], step: Step) -> None:
    """One setter with ``recurse=False`` on the root above other calls, set to what differs from the
    calls' default (a reduce op "sum", a reshard setting False, the all-reduce off, a held micro-batch's
    sync off), so that ignoring ``recurse=False`` would change the calls below: each setter drawn so,
    not left to the rare chance of all its draws at once (a True setting, or one rank, shows nothing)."""
    root = len(config.groups) - 1
    setters = []
    if "reshard_controls" in features:
        setters += ["reshard_after_forward", "reshard_after_backward"]
    if "reduce_op_type" in features and not any(g.divide_factor is not None for g in config.groups):
        setters.append("reduce_op")
    if "all_reduce_control" in features and config.hsdp and config.mesh[0] > 1 and not step.all_reduce_last_only:
        setters.append("all_reduce")
    if not all(step.micro) and not step.hold_with_last_backward:
        setters.append("sync")
    if not setters:
        return
    which = draw(st.sampled_from(setters))
    if which in ("reshard_after_forward", "reshard_after_backward"):
        step.reshard_after_forward = step.reshard_after_backward = None  # one reshard setter a step
        setattr(step, which, [root, False])
    elif which == "reduce_op":
        step.reduce_op, step.reduce_op_group = "sum", root
    elif which == "all_reduce":
        step.all_reduce, step.all_reduce_group = False, root
    else:
        step.sync_group = root
