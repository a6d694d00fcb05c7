"""The defects upstream HyperParallel's own history fixed in ``fully_shard``, as data.

Each entry names a fix commit of github mindspore-ai/hyper-parallel and how the defect is rebuilt
from upstream's git history at run time (nothing of upstream is kept here):

- ``revert``: the fix's changes to ``paths`` reverted onto upstream's head (a three-way apply), so
  the defect is judged beside today's code and the head itself is the tree without it;
- ``parent``: where the revert does not apply cleanly, the fix's parent commit is the defect and
  the fix commit is the tree without it; ``also`` names later fixes applied to both trees (a defect
  that would hide this one: before ``e0c4227`` a ``fully_shard`` call without ``mp_policy`` and
  ``offload_policy`` fails outright, so older trees get that fix's defaults).

A commit that fixed several things is split by ``paths`` where each part reverts on its own. The
descriptions are ours, read from the fixes' diffs.
"""

from __future__ import annotations

from dataclasses import dataclass

# the plan cases judging every defect: the interface (L0) and the feature cases (L1), on a CPU
INTERFACE_CASES = ("L0", "L1")
# e0c4227 gave fully_shard's mp_policy / offload_policy their defaults (before it, None crashed)
POLICY_DEFAULTS = (("e0c4227", ("hyper_parallel/core/fully_shard/api.py",)),)


@dataclass(frozen=True)
class Defect:
    """One defect of upstream's history and how to rebuild it."""

    id: str
    fix: str  # the fix commit (a prefix of its sha)
    subject: str  # the fix commit's subject line
    what: str  # what the defect does, in a line
    build: str  # "revert" (the fix's changes under ``paths`` undone on the head) or "parent"
    paths: tuple[str, ...] = ("hyper_parallel",)
    levels: tuple[str, ...] = INTERFACE_CASES
    also: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (later fix, its paths) applied to both trees
    # where the kit cannot be expected to find it: why, in a line (shown only if it is not found)
    beyond: str = ""


DEFECTS: tuple[Defect, ...] = (
    Defect(
        "D0",
        "e0c4227",
        "fix_main_grad",
        "fully_shard's mp_policy and offload_policy default to None, which it cannot use: a call without them fails",
        "revert",
        ("hyper_parallel/core/fully_shard/api.py",),
    ),
    Defect(
        "D1",
        "e0c4227",
        "fix_main_grad",
        "a param's local shard is a slice (a view) of the whole tensor, so sharding frees nothing",
        "revert",
        ("hyper_parallel/core/layout.py",),
        beyond="unreachable through the API at upstream's head: torch's fully_shard chunks and clones its shards "
        "itself (param.py); the fixed helper only slices for distribute_tensor, which fully_shard reaches only "
        "when HSDPModule.load_state_dict fills meta shards, and to_empty on a sharded meta model raises first "
        "('_has_compatible_shallow_copy_type dose not contain parallel layout infer func'); L4's storage check "
        "(layout: bytes under the local shards) finds the same bug in ours (mutant 64)",
    ),
    Defect(
        "D2",
        "9594cc2",
        "fix_fully_shard_bug",
        "HSDPModule.reshard() and unshard() act on the scheduler's state, not the params': reshard() keeps "
        "the unsharded params and an async unshard's handle waits on the wrong object",
        "revert",
        ("hyper_parallel/core/fully_shard/api.py",),
    ),
    Defect(
        "D3",
        "9594cc2",
        "fix_fully_shard_bug",
        "set_requires_all_reduce writes an attribute the reduction never reads: the HSDP all-reduce always runs",
        "revert",
        ("hyper_parallel/core/fully_shard/hsdp_scheduler.py",),
    ),
    Defect(
        "D4",
        "9594cc2",
        "fix_fully_shard_bug",
        "unshard(async_op=True) and prefetch gather synchronously one param at a time and mark the state "
        "unsharded before any wait",
        "revert",
        ("hyper_parallel/core/fully_shard/hsdp_state.py", "hyper_parallel/core/fully_shard/hsdp_param_buffer.py"),
    ),
    Defect(
        "D5",
        "3f8d5e8",
        "fix bugs",
        "gradient reductions run one after another inside each post-backward (no overlap with compute), "
        "with a reshard on held-back backwards and DTensor dispatch gaps (tuple / list arguments)",
        "parent",
        also=POLICY_DEFAULTS,
    ),
    Defect(
        "D6",
        "4f0ba61",
        "fix_all_reduce_dtype",
        "the HSDP all-reduce over the replicas runs in the param dtype, not the policy's reduce dtype, "
        "where the shard group has one rank (no reduce-scatter casts first)",
        "parent",
        also=POLICY_DEFAULTS,
    ),
    Defect(
        "D7",
        "1511306",
        "fix(fully_shard): squash v4 state_dict/load fixes from three commits",
        "upstream's get_model_state_dict / load_state_dict: dtype-unsafe reduction and loading of sharded values",
        "parent",
        also=POLICY_DEFAULTS,
        beyond="upstream's own state-dict helpers, outside the fully_shard surface the kit drives (it takes state "
        "dicts through torch's); and the policy defaults do not forward-port onto its parent",
    ),
    Defect(
        "D8",
        "e0c4227",
        "fix_main_grad",
        "the policy has no fp32 main grad (apply_grad_on_fp32_main_grad): reduced grads land in .grad in "
        "the param dtype (the fix added the option with the accumulation into main_grad)",
        "revert",
        ("hyper_parallel/platform/torch/fully_shard/param.py", "hyper_parallel/platform/torch/fully_shard/utils.py"),
    ),
    Defect(
        "D9",
        "a9e037a",
        "support fsdp sharded_param.grad to be a DTensor",
        "a sharded param's grad is its plain local tensor, not a DTensor over the mesh as its param",
        "parent",
        also=POLICY_DEFAULTS,
    ),
    Defect(
        "D10",
        "9594cc2",
        "fix_fully_shard_bug",
        "Replicate() hashes as Shard(0) does (0)",
        "revert",
        ("hyper_parallel/core/placement_types.py",),
        beyond="outside what the API promises: equal hashes are legal, equality still tells the placements "
        "apart, and no code of upstream's keys on a placement's hash alone",
    ),
)


def select(only: str | None) -> list[Defect]:
    """The defects named in ``only`` (``"D1,D3"``; None or empty: all), refusing unknown ids."""
    if not only:
        return list(DEFECTS)
    known = {d.id: d for d in DEFECTS}
    wanted = [token.strip() for token in only.split(",") if token.strip()]
    unknown = [token for token in wanted if token not in known]
    if unknown:
        raise ValueError(f"unknown defect id(s) {unknown}; known: {', '.join(known)}")
    return [known[token] for token in wanted]
