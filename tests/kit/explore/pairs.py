"""Pairwise coverage of L4's space, and the covering phase that reaches it before the random draws.

Random draws reach rare pairs of options late: 20 configurations meet about two thirds of the pairs
of features a configuration can use together. The covering phase draws a pool of configurations
(``POOL``, from a fixed seed, so every machine gets the same ones; drawing runs nothing), keeps the
pairs the pool shows can occur together, and picks from it greedily the fewest configurations that
hold every such pair of features and every rare interplay (``interplays``: what no pair of features
names, as a ``recurse=False`` setter on the root above other calls); ties go to the configuration
adding the most pairs of option values.
``explore`` runs them first, then its random draws. A pair is "possible" when the pool holds it:
the grammar's own constraints (a policy's main grad only with an fp32 reduce, ...) rule the others out.
An interplay is possible when the declared features and world sizes allow it (``INTERPLAY_NEEDS``),
whether or not the pool holds it: pools from the next seeds are drawn while one is missing, and one
still missing shows as not covered.

Three measures, each as "covered / possible": pairs of features used together (the plan's features a
configuration uses, ``Config.features``), pairs of option values (world size, mesh kind, precision,
input, output, optimizer and each feature in use), and the interplays.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from tests.kit.explore import draws, grammar, pattern_draws, space
from tests.kit.explore.draws import configs
from tests.kit.explore.space import Config

POOL = 400  # configurations drawn to choose the covering ones from (about 10 s of drawing)
COVER_SEED = 0  # the pool's seed: the same covering configurations whatever the exploration's seed
CACHE = Path(__file__).resolve().parents[3] / "runs" / "l4" / "cover"
SHIPPED = Path(__file__).with_name("cover")  # a default run's covering, committed (``--ship-cover``)

Pair = tuple[str, str]
ACROSS = frozenset({"unshard_reshard", "unshard_across_step"})
IN_FLIGHT = "an unshard issued before the optimizer step, never waited: the next forward meets it in flight"
IN_FLIGHT_PREFETCHED = "an unshard issued before the optimizer step, never waited, met by a forward prefetch"
ACROSS_CLIP = "an unshard issued before clip_grad_norm_ and the optimizer step"
EXTRA_POOLS = 4  # more pools of POOL // 4 drawn (from the next seeds) while an allowed interplay is missing
# what each interplay needs declared (and the fewest ranks): the possible ones are counted whether or
# not a pool happens to hold them, so a change of the draws cannot hide one
INTERPLAY_NEEDS: dict[str, tuple[frozenset[str], int]] = {
    "set_requires_gradient_sync on the root alone": (frozenset({"recurse_false", "gradient_sync"}), 1),
    "set_reduce_op_type on the root alone": (frozenset({"recurse_false", "reduce_op_type"}), 2),
    "set_requires_all_reduce(False) on the root alone": (
        frozenset({"recurse_false", "all_reduce_control", "hsdp"}),
        2,
    ),
    "set_reshard_after_forward on the root alone": (frozenset({"recurse_false", "reshard_controls"}), 2),
    "set_reshard_after_backward on the root alone": (frozenset({"recurse_false", "reshard_controls"}), 2),
    "an int reshard_after_forward replaced by a bool": (frozenset({"reshard_int", "reshard_controls"}), 1),
    "a main grad cleared by HSDPModule.zero_grad before another step": (
        frozenset({"main_grad", "mixed_precision", "zero_grad"}),
        1,
    ),
    "a failed forward and reset_iter_state() before a backward whose implicit prefetch is judged": (
        frozenset({"reset_iter_state"}),
        2,
    ),
    IN_FLIGHT: (ACROSS, 2),
    IN_FLIGHT_PREFETCHED: (ACROSS | {"prefetch"}, 2),
    ACROSS_CLIP: (ACROSS, 2),
}


def possible_interplays(features: frozenset[str], max_world: int, avoid: tuple[frozenset[str], ...] = ()) -> set[str]:
    """The interplays the declared features (less the combinations avoided) and world sizes allow."""
    return {
        name
        for name, (needs, world) in INTERPLAY_NEEDS.items()
        if needs <= features and world <= max_world and not any(combo <= needs for combo in avoid)
    }


def feature_pairs(config: Config) -> set[Pair]:
    """The pairs of plan features the configuration uses together."""
    used = sorted(config.features() - {"fully_shard"})
    return set(itertools.combinations(used, 2))


def interplays(config: Config) -> set[str]:
    """The rare interplays the configuration holds, that a pair of features does not name: a
    ``recurse=False`` setter on the root above other calls (where it differs from ``recurse=True``),
    an int ``reshard_after_forward`` replaced by a bool, a main grad cleared by ``HSDPModule.zero_grad``
    before another step, a failed forward before a backward whose implicit prefetch is judged, an
    unshard across the optimizer step in flight at the next forward or before ``clip_grad_norm_``."""
    found = set()
    n = len(config.groups)
    for step in config.steps:
        for name, group in _root_alone_setters(config, step):
            if n > 1 and group == n - 1:
                found.add(f"{name} on the root alone")
        control = step.reshard_after_forward
        if control and control[0] >= 0 and type(config.groups[control[0]].reshard_after_forward) is int:
            found.add("an int reshard_after_forward replaced by a bool")
    cleared = any(step.zero_grad != "optimizer" for step in config.steps[:-1])
    if config.precision.main_grad and cleared:
        found.add("a main grad cleared by HSDPModule.zero_grad before another step")
    if _failure_before_timed_backward(config):
        found.add("a failed forward and reset_iter_state() before a backward whose implicit prefetch is judged")
    return found | _across_step(config)


def _root_alone_setters(config: Config, step: Any) -> list[tuple[str, int | None]]:
    """Each ``recurse=False`` setter of ``step`` and the call it acts on, where the calls below would
    show it ignoring ``recurse=False``: a value other than their default (reduce op "sum", a reshard
    setting False, the all-reduce off; a held-back micro-batch's sync) over more than one rank (the
    shard group's, for the reshard settings: over one rank resharding frees nothing). A setter that
    cannot show it is not the interplay (a True reshard, over a one-rank shard group, caught nothing)."""
    shards = config.mesh[-1] > 1

    def shown(control: list | None) -> int | None:
        return control[0] if control and control[1] is False and shards else None

    return [
        ("set_requires_gradient_sync", step.sync_group),
        ("set_reduce_op_type", step.reduce_op_group if step.reduce_op == "sum" and config.world > 1 else None),
        ("set_requires_all_reduce(False)", step.all_reduce_group if step.all_reduce is False else None),
        ("set_reshard_after_forward", shown(step.reshard_after_forward)),
        ("set_reshard_after_backward", shown(step.reshard_after_backward)),
    ]


def _across_step(config: Config) -> set[str]:
    """The orders of an unshard across the optimizer step that its stale gather meets: in flight at
    the next forward (at a prefetch of it, where the unit is not the first forward reaches: the root),
    or issued before ``clip_grad_norm_``'s collectives."""
    found: set[str] = set()
    if config.world < 2:
        return found  # one rank's gather is a copy: counted where there is a collective in flight
    root = len(config.groups) - 1
    for step in config.steps[1:]:
        if step.unshard is None or step.unshard_how != "across step" or step.across_at == "zero_grad":
            continue  # issued after the optimizer step: nothing stale
        if not step.across_waited:
            found.add(IN_FLIGHT)
            if config.prefetch and step.unshard != root:
                found.add(IN_FLIGHT_PREFETCHED)
        if step.across_at == "clip":
            found.add(ACROSS_CLIP)
    return found


def _reshards_after_forward(flag: bool | int | None) -> bool:
    """Whether a non-root call's ``reshard_after_forward`` reshards it (None: yes; an int 1: no)."""
    return not (flag is False or (type(flag) is int and flag == 1))


def _failure_before_timed_backward(config: Config) -> bool:
    """A forward failing as a call's module finishes, then reset_iter_state(), before a backward whose
    implicit prefetch is judged (no prefetch lists, the timing judged, shards over more than one
    rank, an output whose backward start the root's module hooks show: a tensor or a tuple) and
    meets what that forward left: the failing call resharded after forward, or the root failing
    above one that was (the module the next backward prefetches first)."""
    root = len(config.groups) - 1
    resharding = {i for i, g in enumerate(config.groups[:root]) if _reshards_after_forward(g.reshard_after_forward)}
    failed = any(step.fail in resharding or (step.fail == root and resharding) for step in config.steps)
    implicit = root > 0 and not config.prefetch and config.times_backward() and config.output in ("tensor", "tuple")
    return failed and implicit and config.mesh[-1] > 1


def option_values(config: Config) -> list[str]:
    """The configuration's option values, ``option=value``: the coverage table's, without the counts
    and the module kinds, the mesh as its kind."""
    values = {k: v for k, v in config.coverage().items() if k not in ("modules", "groups", "steps", "mesh")}
    values["mesh"] = "HSDP" if config.hsdp else "FSDP"
    return sorted(f"{k}={v}" for k, v in values.items())


def value_pairs(config: Config) -> set[Pair]:
    """The pairs of option values the configuration holds."""
    return set(itertools.combinations(option_values(config), 2))


@dataclass
class Covering:
    """The covering configurations and the pairs the pool showed possible."""

    configs: list[Config]
    feature_pairs: set[Pair] = field(default_factory=set)  # possible
    value_pairs: set[Pair] = field(default_factory=set)  # possible
    interplays: set[str] = field(default_factory=set)  # possible
    pool: int = POOL

    def measure(self, run: Iterable[Config]) -> dict[str, tuple[int, int]]:
        """(covered, possible) pairs of features and of option values among ``run``."""
        features: set[Pair] = set()
        values: set[Pair] = set()
        rare: set[str] = set()
        for config in run:
            features |= feature_pairs(config)
            values |= value_pairs(config)
            rare |= interplays(config)
        return {
            "feature pairs": (len(features & self.feature_pairs), len(self.feature_pairs)),
            "option-value pairs": (len(values & self.value_pairs), len(self.value_pairs)),
            "interplays": (len(rare & self.interplays), len(self.interplays)),
        }


def pairs_text(measured: dict[str, tuple[int, int]]) -> str:
    """``pairs covered: features 631/631, option values 1150/1656``."""
    return "pairs covered / possible: " + ", ".join(f"{name} {a}/{b}" for name, (a, b) in measured.items())


def covering(
    features: frozenset[str], max_world: int, min_world: int = 1, avoid: tuple[frozenset[str], ...] = ()
) -> Covering:
    """The covering configurations of ``features``: shipped with the kit (``SHIPPED``) for a default
    run of ours, else cached under ``runs/l4/cover/``; both keyed by the arguments and the grammar's
    source, so a changed space draws a new pool."""
    key = _key(features, max_world, min_world, avoid)
    for folder in (SHIPPED, CACHE):
        if (folder / f"{key}.json").exists():
            return _load(folder / f"{key}.json")
    found = _draw_covering(features, max_world, min_world, avoid)
    _save(found, CACHE / f"{key}.json")
    return found


def ship_covering(features: frozenset[str], max_world: int) -> Path:
    """Write the covering of a default run (``features`` up to ``max_world`` ranks, nothing avoided)
    into ``SHIPPED``, in place of what was there: a fresh clone then draws no pool (``--ship-cover``)."""
    found = covering(features, max_world)
    SHIPPED.mkdir(parents=True, exist_ok=True)
    for old in SHIPPED.glob("*.json"):
        old.unlink()
    path = SHIPPED / f"{shipped_key(features, max_world)}.json"
    _save(found, path)
    return path


def shipped_key(features: frozenset[str], max_world: int) -> str:
    """The key a default run's covering is shipped under."""
    return _key(features, max_world, 1, ())


def _draw_covering(
    features: frozenset[str], max_world: int, min_world: int, avoid: tuple[frozenset[str], ...]
) -> Covering:
    """Draw the pool (and extra pools while an allowed interplay is missing) and choose from it."""
    possible = possible_interplays(features, max_world, avoid)
    pool = _pool(features, max_world, min_world, avoid, COVER_SEED)
    for extra in range(1, EXTRA_POOLS + 1):
        if possible <= set().union(*map(interplays, pool)):
            break
        pool += _pool(features, max_world, min_world, avoid, COVER_SEED + extra, POOL // 4)
    return Covering(
        _greedy(pool),
        set().union(*map(feature_pairs, pool)),
        set().union(*map(value_pairs, pool)),
        possible | set().union(*map(interplays, pool)),
    )


def _save(found: Covering, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "configs": [json.loads(c.to_json()) for c in found.configs],
                "feature_pairs": sorted(found.feature_pairs),
                "value_pairs": sorted(found.value_pairs),
                "interplays": sorted(found.interplays),
            },
            indent=0,
        )
        + "\n"
    )


def _key(features: frozenset[str], max_world: int, min_world: int, avoid: tuple[frozenset[str], ...]) -> str:
    # the draws, and what counts as covered (this module's interplays)
    modules = (space, draws, pattern_draws, grammar)
    source = "".join(inspect.getsource(module) for module in modules) + Path(__file__).read_text()
    text = json.dumps(
        [
            sorted(features),
            max_world,
            min_world,
            sorted(map(sorted, avoid)),
            POOL,
            COVER_SEED,
            EXTRA_POOLS,
            POOL // 4,
            sorted((name, sorted(needs), world) for name, (needs, world) in INTERPLAY_NEEDS.items()),
            source,
        ]
    )
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _load(path: Path) -> Covering:
    data = json.loads(path.read_text())
    return Covering(
        [Config.from_json(c) for c in data["configs"]],
        {tuple(p) for p in data["feature_pairs"]},
        {tuple(p) for p in data["value_pairs"]},
        set(data["interplays"]),
    )


def _pool(
    features: frozenset[str],
    max_world: int,
    min_world: int,
    avoid: tuple[frozenset[str], ...],
    seed: int,
    size: int | None = None,
) -> list[Config]:
    """``size`` configurations (``POOL`` by default) drawn from ``seed`` (none run)."""
    pool: list[Config] = []

    @settings(
        max_examples=size or POOL,
        database=None,
        deadline=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis_seed(seed)
    @given(configs(features, max_world, min_world, avoid))
    def draw(config: Config) -> None:
        pool.append(config)

    draw()
    return pool


def _greedy(pool: list[Config]) -> list[Config]:
    """The fewest configurations found greedily that hold every pair of features and every interplay
    the pool holds: each pick adds the most missing of them (then the most missing option-value pairs,
    then the smallest configuration)."""
    features = [feature_pairs(c) | {("interplay", name) for name in interplays(c)} for c in pool]
    values = [value_pairs(c) for c in pool]
    wanted = set().union(*features)
    have_features: set[Pair] = set()
    have_values: set[Pair] = set()
    chosen: list[Config] = []
    while have_features != wanted:
        best = max(
            range(len(pool)),
            key=lambda i: (
                len(features[i] - have_features),
                len(values[i] - have_values),
                -sum(pool[i].size().values()),
            ),
        )
        chosen.append(pool[best])
        have_features |= features[best]
        have_values |= values[best]
    return chosen
