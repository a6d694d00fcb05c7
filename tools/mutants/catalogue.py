"""The mutant catalogue: bugs a developer of this engine could plausibly make, one edit each.

Every mutant names the engine file it was written against, the feature it breaks, the bug in one
line, and the edit: the code ``find`` is replaced by ``replace``. The code is found by its Python
tokens in whichever engine file holds it now (``locate.py``: indentation, line breaks, comments and
the names around it do not count), and must occur exactly once in the engine, so moving, renaming or
reflowing the code around it carries a mutant along. A mutant that no test can kill says why in
``equivalent`` (one line); every other one must be killed by a plan case, and by the cases and engine
tests together, or, for the field defects' classes a plan case cannot reach (docs/field_defects.md:
lifetimes, a user's hooks), by L4 at CI's budget (``--suite l4``). Ids are two digits, in order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tools.mutants.locate import Location, engine_sources, locate, rewrite

API = "hyper_parallel/core/fully_shard/api.py"
INIT = "hyper_parallel/core/fully_shard/init.py"
UTILS = "hyper_parallel/core/fully_shard/utils.py"
_PLATFORM = "hyper_parallel/platform/torch/fully_shard/"
MESH_INFO = _PLATFORM + "mesh_info.py"
PARAM = _PLATFORM + "param.py"
PARAM_GRADS = _PLATFORM + "param_grads.py"
LAYOUT = _PLATFORM + "layout.py"
ALL_GATHER = _PLATFORM + "all_gather.py"
PARAM_GROUP = _PLATFORM + "param_group.py"
COLLECTIVES = _PLATFORM + "collectives.py"
STATE = _PLATFORM + "state.py"
SAVED_PARAMS = _PLATFORM + "saved_params.py"
OPTIMIZER_GUARD = _PLATFORM + "optimizer_guard.py"
ENGINE_FILES = (
    API,
    INIT,
    UTILS,
    MESH_INFO,
    LAYOUT,
    PARAM,
    PARAM_GRADS,
    PARAM_GROUP,
    ALL_GATHER,
    COLLECTIVES,
    STATE,
    SAVED_PARAMS,
    OPTIMIZER_GUARD,
)


class MutantError(ValueError):
    """A mutant that cannot be applied, or a selection naming no mutant."""


@dataclass(frozen=True)
class Mutant:
    """One bug: where, which feature, what the developer got wrong, and the exact edit."""

    id: str
    file: str
    feature: str
    description: str
    find: str
    replace: str
    equivalent: str = ""  # why no test can kill it; empty: it must be killed

    def locate(self, sources: Mapping[str, str]) -> Location:
        """Where the code to mutate is among ``sources`` (file -> text); ``MutantError`` unless once."""
        try:
            return locate(self.find, sources, f"mutant {self.id}")
        except LookupError as exc:
            raise MutantError(str(exc)) from None

    def apply_in(self, sources: Mapping[str, str]) -> tuple[str, str]:
        """(the file holding the code, its text with the edit made), re-indented to where the code is."""
        where = self.locate(sources)
        return where.file, rewrite(self.find, self.replace, sources[where.file], where)

    def apply_to(self, text: str) -> str:
        """``text`` (one file's) with the edit made; ``MutantError`` unless the code occurs once in it."""
        return self.apply_in({self.file: text})[1]

    def apply_in_tree(self, root: Path) -> tuple[Path, str, str]:
        """(the file under ``root`` holding the code, its text now, its text mutated)."""
        sources = tree_sources(root, self.file)
        file, mutated = self.apply_in(sources)
        return root / file, sources[file], mutated


def tree_sources(root: Path, *also: str) -> dict[str, str]:
    """The engine's files under ``root`` where a mutant's code may be, and ``also`` (a catalogue
    file outside the engine package, as the harness's own tests use)."""
    sources = engine_sources(root)
    for extra in also:
        if extra not in sources and (root / extra).is_file():
            sources[extra] = (root / extra).read_text(encoding="utf-8")
    return sources


# mutant 65 swaps these two blocks of Reduction.wait (collectives.py)
_REPLICA_ALL_REDUCE = (
    "        held: set[int] = set()\n"
    "        if self.mesh_info.is_hsdp and self.mesh_info.replicate_size > 1:\n"
    "            if self.keeps_replica_parts:\n"
    "                self._keep_replica_parts()\n"
    "            else:\n"
    "                held = self._add_replica_parts()\n"
    "                works = [\n"
    "                    dist.all_reduce(\n"
    "                        piece.output, op=piece.arithmetic.op, "
    "group=self.mesh_info.replicate_group, async_op=True\n"
    "                    )\n"
    "                    for piece in self.pieces\n"
    "                ]\n"
    "                for work in works:\n"
    "                    _wait(work)\n"
)
_FINISH = "        for piece in self.pieces:\n            self._finish(piece.output, piece.arithmetic.divide_after)\n"

MUTANTS: tuple[Mutant, ...] = (
    # -- core/fully_shard/api.py ---------------------------------------------------------------
    Mutant(
        "01",
        API,
        "argument checks",
        "the list's shared-parameter check runs after the modules are sharded: a refused list leaves "
        "its modules sharded",
        "    check_disjoint(modules, plans)\n"
        "    sharded = [\n"
        "        shard_module(m, plan, info, reshard_after_forward, mp_policy, offload_policy, comm_fusion, "
        "device, ignored)\n"
        "        for m, plan in zip(modules, plans, strict=True)\n"
        "    ]\n",
        "    sharded = [\n"
        "        shard_module(m, plan, info, reshard_after_forward, mp_policy, offload_policy, comm_fusion, "
        "device, ignored)\n"
        "        for m, plan in zip(modules, plans, strict=True)\n"
        "    ]\n"
        "    check_disjoint(modules, plans)\n",
    ),
    Mutant(
        "02",
        API,
        "HSDP all-reduce (recurse=False)",
        "set_requires_all_reduce ignores recurse=False and switches every group below",
        "        for group in self._groups(recurse):\n            group.requires_all_reduce = requires_all_reduce\n",
        "        for group in self._groups():\n            group.requires_all_reduce = requires_all_reduce\n",
    ),
    Mutant(
        "03",
        API,
        "zero_grad",
        "HSDPModule.zero_grad clears only the groups' grads: ignored params keep theirs",
        "        nn.Module.zero_grad(self, set_to_none)  # params the groups do not manage (ignored)\n",
        "",
    ),
    Mutant(
        "04",
        API,
        "unshard(async_op)",
        "HSDPModule.unshard drops async_op: the gather always completes before unshard returns",
        "            group.unshard(async_op=async_op)\n",
        "            group.unshard()\n",
        equivalent="the contract promises only that the params are usable after wait(); a gather already "
        "done satisfies it, and the lost overlap is not observable",
    ),
    Mutant(
        "05",
        INIT,
        "replicate params",
        "replicate_params is honoured only when a shard_placement_fn is given too",
        "    if is_replicated:\n"
        "        return Replicate()\n"
        "    placement = shard_placement_fn(param) if shard_placement_fn is not None else None\n",
        "    placement = shard_placement_fn(param) if shard_placement_fn is not None else None\n"
        "    if is_replicated and placement is not None:\n"
        "        return Replicate()\n",
    ),
    Mutant(
        "06",
        API,
        "last backward",
        "set_is_last_backward sets the flag on this module's own state only, not on the groups below",
        "        for state in self._hsdp_states():\n            state.is_last_backward = is_last_backward\n",
        "        state_of(self).is_last_backward = is_last_backward\n",
    ),
    Mutant(
        "07",
        API,
        "prefetch",
        "set_modules_to_backward_prefetch stores the list reversed (backward order applied twice)",
        '        state_of(self).backward_prefetch = _prefetch_states("modules", modules)\n',
        '        state_of(self).backward_prefetch = _prefetch_states("modules", modules)[::-1]\n',
    ),
    # -- core/fully_shard/utils.py -------------------------------------------------------------
    Mutant(
        "08",
        UTILS,
        "argument checks",
        "the policy's dtype check refuses complex dtypes only: integer dtypes are accepted",
        "    if not value.is_floating_point:\n",
        "    if value.is_complex:\n",
    ),
    Mutant(
        "09",
        UTILS,
        "mixed precision input cast",
        "cast_forward_inputs defaults to False",
        "    cast_forward_inputs: bool = True\n",
        "    cast_forward_inputs: bool = False\n",
    ),
    # -- platform/torch/fully_shard/mesh_info.py -----------------------------------------------
    Mutant(
        "10",
        MESH_INFO,
        "HSDP layout (rank offset)",
        "on a 2-D mesh the shard rank is read from the replicate dim",
        "        shard_rank=mesh.get_local_rank(1),\n",
        "        shard_rank=mesh.get_local_rank(0),\n",
    ),
    Mutant(
        "11",
        MESH_INFO,
        "HSDP all-reduce",
        "the replicate all-reduce runs on the shard dim's group",
        "        replicate_group=mesh.get_group(0),\n",
        "        replicate_group=mesh.get_group(1),\n",
    ),
    Mutant(
        "12",
        MESH_INFO,
        "HSDP layout",
        "on a 2-D mesh the shard size is the whole mesh's size, not the shard dim's",
        "        shard_size=mesh.size(1),\n",
        "        shard_size=mesh.size(),\n",
    ),
    # -- platform/torch/fully_shard/param.py ---------------------------------------------------
    Mutant(
        "13",
        LAYOUT,
        "padding",
        "shard rows rounded down (rows // world): the last rows of an uneven param are never sharded",
        "        chunk = math.ceil(total / world) if total else 0\n",
        "        chunk = total // world\n",
    ),
    Mutant(
        "14",
        LAYOUT,
        "rank offset",
        "a rank's shard starts at rank x its own row count instead of rank x chunk",
        "        start = min(rank * self.chunk, full.shape[self.dim])  # empty chunks at the end\n",
        "        start = min(rank * self.rows[rank], full.shape[self.dim])  # empty chunks at the end\n",
    ),
    Mutant(
        "15",
        PARAM_GRADS,
        "padding",
        "the padding rows of the reduce-scatter input are left uninitialised instead of zeroed",
        "            if rows < layout.chunk:\n"
        "                piece.narrow(layout.dim, rows, layout.chunk - rows).zero_()\n",
        "",
        equivalent="reduce-scatter and all-reduce are element-wise and shard_of_reduced drops the padded rows, "
        "so what the padding holds never reaches a grad",
    ),
    Mutant(
        "16",
        PARAM_GRADS,
        "main grad",
        "a reduction landing in an existing main grad (after optimizer.zero_grad) adds to its stale values",
        "            main._local_tensor.copy_(reduced)\n",
        "            main._local_tensor.add_(reduced)\n",
    ),
    Mutant(
        "17",
        PARAM_GRADS,
        "mixed precision accumulation",
        "unsynced grads accumulate in the compute dtype instead of the reduce dtype",
        "        if self.unreduced_grad.dtype != self.reduce_dtype:\n"
        "            self.unreduced_grad = self.unreduced_grad.to(self.reduce_dtype)\n"
        "        self.unreduced_grad.add_(grad)\n",
        "        self.unreduced_grad.add_(grad)\n",
    ),
    Mutant(
        "18",
        PARAM,
        "offload",
        "CPU offload pins the shards even where the compute device is the CPU (no accelerator)",
        '        self.pin_memory = offload_to_cpu is not None and offload_to_cpu.pin_memory and device.type != "cpu"\n',
        "        self.pin_memory = offload_to_cpu is not None and offload_to_cpu.pin_memory\n",
    ),
    Mutant(
        "19",
        PARAM_GRADS,
        "grad accumulation (reductions)",
        "a reduced grad overwrites param.grad instead of accumulating into it",
        "            current._local_tensor.add_(reduced.to(self.shard_device))\n",
        "            current._local_tensor.copy_(reduced.to(self.shard_device))\n",
    ),
    Mutant(
        "20",
        PARAM_GRADS,
        "mixed precision grad dtype",
        "param.grad takes the reduce dtype instead of the sharded param's dtype",
        "        target_dtype = torch.float32 if self.use_main_grad else self.grad_dtype\n",
        "        target_dtype = torch.float32 if self.use_main_grad else reduced.dtype\n",
    ),
    Mutant(
        "21",
        PARAM_GRADS,
        "zero_grad",
        "zero_grad keeps the locally accumulated (unsynced) grad",
        "        self.unreduced_grad = None\n        self.parts_landed = None\n",
        "        self.parts_landed = None\n",
    ),
    Mutant(
        "22",
        PARAM_GRADS,
        "zero_grad (main grad)",
        "zero_grad leaves the fp32 main grad's values in place",
        "        if main is not None:\n            main._local_tensor.zero_()\n",
        "",
    ),
    Mutant(
        "23",
        PARAM_GRADS,
        "grad accumulation (no sync)",
        "a no-sync backward replaces the unreduced grad instead of adding to it",
        "            self.unreduced_grad.add_(grad)\n",
        "            self.unreduced_grad = grad.to(self.reduce_dtype)\n",
    ),
    # -- platform/torch/fully_shard/param_group.py ---------------------------------------------
    Mutant(
        "24",
        PARAM_GROUP,
        "stale copy",
        "unshard of a group kept unsharded does not check for shards changed by an optimizer step",
        "        if self.state in (ShardedState.UNSHARDED, ShardedState.SHARDED_POST_FORWARD) and self.is_stale:\n"
        "            self.reshard()\n",
        "",
    ),
    Mutant(
        "25",
        PARAM_GROUP,
        "reshard",
        "reshard registers the sharded params but never frees the unsharded storage",
        "            param.use_sharded()\n            param.free_unsharded()\n",
        "            param.use_sharded()\n",
    ),
    Mutant(
        "26",
        PARAM_GROUP,
        "reshard_after_backward",
        "post-backward reshards whatever set_reshard_after_backward says",
        "        if self.reshard_after_backward:\n            self.reshard()\n",
        "        self.reshard()\n",
    ),
    Mutant(
        "27",
        PARAM_GROUP,
        "unshard idempotence",
        "unshard while an async gather is in flight starts another all-gather",
        "        elif self.state is ShardedState.SHARDED:\n",
        "        elif self.state in (ShardedState.SHARDED, ShardedState.UNSHARDING):\n",
    ),
    Mutant(
        "28",
        PARAM_GROUP,
        "HSDP all-reduce",
        "post-backward passes requires_gradient_sync where requires_all_reduce belongs",
        "            all_reduce_replicas=self.requires_all_reduce,\n",
        "            all_reduce_replicas=self.requires_gradient_sync,\n",
    ),
    # -- platform/torch/fully_shard/collectives.py ---------------------------------------------
    Mutant(
        "29",
        COLLECTIVES,
        "HSDP reduce op",
        "the replicate all-reduce is issued without op=, so it sums: HSDP grads x replicas",
        "                    piece.output, op=piece.arithmetic.op, "
        "group=self.mesh_info.replicate_group, async_op=True\n",
        "                    piece.output, group=self.mesh_info.replicate_group, async_op=True\n",
    ),
    Mutant(
        "30",
        COLLECTIVES,
        "comm fusion (reduction)",
        "the offset of each param in a fused reduce-scatter output is never advanced",
        "                yield param, param.shard_of_reduced(piece.output[offset : offset + numel]), "
        "piece.arithmetic\n"
        "                offset += numel\n",
        "                yield param, param.shard_of_reduced(piece.output[offset : offset + numel]), "
        "piece.arithmetic\n",
    ),
    Mutant(
        "31",
        COLLECTIVES,
        "reduce op",
        "the reduce-scatter always averages: set_reduce_op_type('sum') reaches only the all-reduces",
        "    work = _reduce_scatter_flat(recv, send, arithmetic.op, group)\n",
        "    work = _reduce_scatter_flat(recv, send, dist.ReduceOp.AVG, group)\n",
    ),
    Mutant(
        "32",
        COLLECTIVES,
        "mixed precision reduce dtype",
        "reduce-scatter buffers in the compute dtype instead of the reduce dtype",
        "    dtype, device, world = params[0].reduce_dtype, params[0].device, params[0].layout.world\n",
        "    dtype, device, world = params[0].param_dtype, params[0].device, params[0].layout.world\n",
    ),
    Mutant(
        "33",
        ALL_GATHER,
        "comm fusion (all-gather)",
        "comm_fusion=False is ignored by the all-gather: groups of several params always gather fused",
        "    if fused and len(sharded) > 1:\n",
        "    if len(sharded) > 1:\n",
    ),
    Mutant(
        "34",
        COLLECTIVES,
        "grad accumulation (reset)",
        "the unreduced accumulator is not cleared once its reduction starts: the next backward adds to it",
        "    for param in params:\n        param.unreduced_grad = None\n",
        "",
    ),
    # -- platform/torch/fully_shard/state.py ---------------------------------------------------
    Mutant(
        "35",
        STATE,
        "root detection",
        "the first forward marks only direct children non-root: sharded grandchildren become roots too",
        "        self.is_root = True\n        for sub in self.module.modules():\n",
        "        self.is_root = True\n        for sub in self.module.children():\n",
    ),
    Mutant(
        "36",
        STATE,
        "recompute under AC",
        "pre-forward skips the unshard while recomputing (a reentrant recompute sees the sharded params)",
        "        if self.param_group is not None:\n"
        "            if not recomputing:\n"
        "                self.param_group.adopt_registered_params(self.mp_policy)\n"
        "            self.param_group.unshard()\n"
        "            self.param_group.wait_for_unshard()\n"
        "            if grad_enabled:\n",
        "        if self.param_group is not None and not recomputing:\n"
        "            self.param_group.adopt_registered_params(self.mp_policy)\n"
        "            self.param_group.unshard()\n"
        "            self.param_group.wait_for_unshard()\n"
        "            if grad_enabled:\n",
    ),
    Mutant(
        "37",
        STATE,
        "prefetch",
        "pre-forward never acts on the forward prefetch list",
        "        if not recomputing:\n"
        "            for target in self.forward_prefetch:\n"
        "                target.prefetch()\n",
        "",
    ),
    Mutant(
        "38",
        STATE,
        "mixed precision input cast",
        "only top-level positional tensors are cast: nested containers and kwargs keep their dtype",
        "            args, kwargs = _cast_floating((args, kwargs), self.mp_policy.param_dtype)\n",
        "            args = tuple(_cast_floating(a, self.mp_policy.param_dtype) if isinstance(a, torch.Tensor) else a"
        " for a in args)\n",
    ),
    Mutant(
        "39",
        STATE,
        "mixed precision output cast",
        "forward outputs are never cast to output_dtype",
        "        output = _cast_floating(output, self.mp_policy.output_dtype)\n",
        "",
    ),
    Mutant(
        "40",
        STATE,
        "reshard_after_forward default",
        "reshard_after_forward=None reshards the root after forward too",
        "            return not self.is_root  # the root's params are needed first in backward anyway\n",
        "            return True\n",
    ),
    # -- added with the L2 / L3 cases and the engine's later changes ---------------------------------
    Mutant(
        "41",
        API,
        "reduce op (recurse)",
        "set_reduce_op_type sets only the module's own group, not the groups below it",
        "        for group in self._groups(recurse):\n            group.reduce_op = reduce_op_type.lower()\n",
        "        for group in self._groups(False):\n            group.reduce_op = reduce_op_type.lower()\n",
    ),
    Mutant(
        "42",
        INIT,
        "tied weights",
        "a param tied into two modules (embedding and output head) is swapped into its first module only",
        "        plan.slots[id(param)].append((owner, name))\n",
        "        if not plan.slots[id(param)]:\n            plan.slots[id(param)].append((owner, name))\n",
    ),
    Mutant(
        "43",
        ALL_GATHER,
        "async gathers in place (prefetch)",
        "an async in-place all-gather's write, which lands at completion, is not hidden from autograd",
        "        for keeper in self.keepers:\n            keeper.__exit__(None, None, None)\n",
        "",
    ),
    Mutant(
        "44",
        STATE,
        "pipeline microbatches",
        "a backward does not list the groups it reaches: after a pipeline's first backward, a group "
        "finished only at the end of backward is never reduced",
        "        self.iteration.states_in_iteration[self] = None\n"
        "        self.iteration.queue_final_callback()\n"
        "        self.training_state = TrainingState.PRE_BACKWARD\n"
        "        if self.param_group is not None and self.param_group.unshard_in_backward:\n",
        "        self.iteration.queue_final_callback()\n"
        "        self.training_state = TrainingState.PRE_BACKWARD\n"
        "        if self.param_group is not None and self.param_group.unshard_in_backward:\n",
    ),
    Mutant(
        "45",
        STATE,
        "implicit backward prefetch",
        "the implicit backward prefetch takes the group after this one in forward order, whose backward already ran",
        "        target = order[index - 1]\n",
        "        target = order[min(index + 1, len(order) - 1)]\n",
    ),
    # -- the FSDP2 drop-in surface (issue 22): killed by the L0-FSDP2-* cases ------------------
    Mutant(
        "46",
        PARAM_GROUP,
        "reshard_after_forward int",
        "after forward with an int, backward gathers the pieces kept over the whole shard group, not "
        "within the rows of k ranks",
        "            self._all_gather = start_all_gather(\n"
        "                self.params, self.mesh_info, self.comm_fusion, async_op, self._post_forward\n"
        "            )\n",
        "            self.reshard()\n            return self.unshard(async_op)\n",
    ),
    Mutant(
        "47",
        PARAM,
        "deferred init / to(dtype)",
        "after nn.Module._apply the unsharded copy keeps its old dtype and device",
        "        self._init_unsharded(self.sharded_param)\n        self._gathered_version = (-1, -1)\n",
        "        self._gathered_version = (-1, -1)\n",
    ),
    Mutant(
        "48",
        COLLECTIVES,
        "all-reduce hook",
        "the all-reduce hook is never called",
        "        if self.settings.all_reduce_hook is not None and not skipped_all_reduce:\n",
        "        if False:\n",
    ),
    Mutant(
        "49",
        COLLECTIVES,
        "gradient scaling factor",
        "set_gradient_scaling_factor divides instead of multiplying",
        "            output.mul_(self.settings.scaling_factor)\n",
        "            output.div_(self.settings.scaling_factor)\n",
    ),
    Mutant(
        "50",
        STATE,
        "unshard in backward",
        "set_unshard_in_backward(False) is ignored: backward gathers the group anyway",
        "        if self.param_group is not None and self.param_group.unshard_in_backward:\n",
        "        if self.param_group is not None:\n",
    ),
    Mutant(
        "51",
        COLLECTIVES,
        "gradient divide factor",
        "the divide factor is applied as the average's divisor too: grads divided by the ranks and the factor",
        "            return Arithmetic(dist.ReduceOp.SUM, scale_before=1.0 / self.divide_factor)\n",
        "            return Arithmetic(dist.ReduceOp.AVG, scale_before=1.0 / self.divide_factor)\n",
    ),
    Mutant(
        "52",
        API,
        "reshard_after_forward int",
        "set_reshard_after_forward(bool) leaves an int's smaller mesh in place: forward still keeps 1/k",
        "            state.post_forward = None  # a bool replaces an int's smaller mesh (FSDP2 does the same)\n",
        "",
    ),
    Mutant(
        "53",
        API,
        "reset_iter_state",
        "reset_iter_state forgets the iteration but leaves the groups gathered",
        "        for group in self._groups():\n            group.discard_iteration()\n",
        "",
    ),
    Mutant(
        "54",
        API,
        "container slicing",
        "slicing a sharded container builds another sharded class without state",
        "        module = original.__new__(original)\n",
        "        module = nn.Module.__new__(cls)\n",
    ),
    Mutant(
        "55",
        API,
        "share_comm_ctx",
        "share_comm_ctx accepts modules that were never sharded",
        "        if state_of(module) is None:\n            raise ValueError(",
        "        if False:\n            raise ValueError(",
    ),
    Mutant(
        "56",
        PARAM_GROUP,
        "unused params",
        "set_reduce_scatter_unused_params is ignored: a rank that skipped a param reduces fewer grads",
        "            if self.reduce_scatter_unused_params or (ready and len(ready) < len(self.params)):\n",
        "            if ready and len(ready) < len(self.params):\n",
    ),
    Mutant(
        "57",
        COLLECTIVES,
        "separate reduce-scatter group",
        "set_separate_reduce_scatter_group hands back the shard group itself",
        "        made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)\n    return made[ranks]\n",
        "        made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)\n    return group\n",
    ),
    Mutant(
        "58",
        API,
        "forward method",
        "register_fsdp_forward_method refuses a module not given to fully_shard instead of doing nothing",
        "    if state is None:\n        return\n    if not callable(getattr(module, method_name, None)):\n",
        "    if state is None:\n        raise ValueError(f'{type(module).__name__} was not given to fully_shard')\n"
        "    if not callable(getattr(module, method_name, None)):\n",
    ),
    Mutant(
        "59",
        API,
        "forward method",
        "register_fsdp_forward_method does not check the method exists: an AttributeError, not a ValueError",
        "    if not callable(getattr(module, method_name, None)):\n",
        "    if False:\n",
    ),
    Mutant(
        "60",
        INIT,
        "reshard_after_forward int",
        "an int reshard_after_forward is not checked to divide the shard size",
        "    if value < 1 or shard_size % value:\n",
        "    if value < 1:\n",
    ),
    Mutant(
        "61",
        STATE,
        "forward method",
        "a registered forward method skips the post-forward: no reshard, no backward hooks on its output",
        "        return state._post_forward(state.module, args, output)\n",
        "        return output\n",
    ),
    Mutant(
        "62",
        COLLECTIVES,
        "force-sum reduction",
        "force-sum reductions forget the division after the SUM: grads summed, not averaged",
        "            return _sum_then_divide(float(ranks), dtype)\n",
        "            return Arithmetic(dist.ReduceOp.SUM)\n",
    ),
    Mutant(
        "63",
        API,
        "recurse=False",
        "set_requires_gradient_sync ignores recurse=False: one call's sync off turns it off for the calls below",
        "        for group in self._groups(recurse):\n"
        "            group.requires_gradient_sync = requires_gradient_sync\n",
        "        for group in self._groups(True):\n            group.requires_gradient_sync = requires_gradient_sync\n",
    ),
    Mutant(
        "64",
        PARAM,
        "shard storage",
        "a shard is a view of the whole param (upstream's layout bug, fixed in its fix_main_grad): nothing is freed",
        "                local.copy_(src)\n",
        "                local = src\n",
    ),
    Mutant(
        "65",
        COLLECTIVES,
        "all-reduce hook (HSDP)",
        "the all-reduce hook (and the division after the collectives) runs as soon as the reduce-scatter "
        "is done, before the all-reduce over the replicas: the hook sees one replica group's partial sum",
        _REPLICA_ALL_REDUCE + _FINISH,
        _FINISH + _REPLICA_ALL_REDUCE,
    ),
    Mutant(
        "66",
        ALL_GATHER,
        "unshard across the optimizer step",
        "an all-gather notes the shards' version when it is waited, not when it read them: a gather issued "
        "before the optimizer step and waited after it counts as fresh, and the next forward uses the old params",
        "        for param, version in zip(self.params, self.versions, strict=True):\n"
        "            param.note_gathered(version)\n",
        "        for param in self.params:\n            param.note_gathered()\n",
    ),
    Mutant(
        "67",
        INIT,
        "ignored params (nested calls)",
        "a call skips only the params its own ignored_params names: a param a nested call ignored, reachable "
        "from the call above through a module it shares with (a tied weight), is sharded there",
        "    ignored = ignored | _ignored_below(module)\n",
        "",
    ),
    Mutant(
        "68",
        API,
        "cast while gathered",
        "to() / double() does not reshard first: on a gathered group the cast reaches the registered gathered "
        "copy, and the shards keep their old dtype",
        "            group.finish_reductions()\n"
        "            group.reshard()\n"
        "        result = super()._apply(fn, recurse)\n",
        "            group.finish_reductions()\n        result = super()._apply(fn, recurse)\n",
    ),
    Mutant(
        "69",
        STATE,
        "reset_iter_state after a failed forward",
        "forgetting an aborted iteration keeps its forward order: after a forward that raised and "
        "reset_iter_state(), the next backward's implicit prefetch follows counts from the failed forward",
        "            state.training_state = TrainingState.IDLE\n"
        "        self.states_in_iteration.clear()\n"
        "        self.forward_order.clear()\n",
        "            state.training_state = TrainingState.IDLE\n        self.states_in_iteration.clear()\n",
    ),
    Mutant(
        "70",
        PARAM_GROUP,
        "unshard across the optimizer step (in flight)",
        "an unshard meeting its own all-gather still in flight takes it as it is, though the shards changed "
        "since it was issued (an optimizer step): the next forward, or a prefetch in it, computes with the "
        "params before the step",
        "        if self.state is ShardedState.UNSHARDING and self._all_gather.is_stale:\n"
        "            self.wait_for_unshard()  # issued before the shards changed: finish it, then redo it\n",
        "",
    ),
    # -- upstream's field defects (docs/field_defects.md, by row) as slips of this engine -------------
    Mutant(
        "71",
        COLLECTIVES,
        "HSDP accumulation (all-reduce off)",
        "field defect 10: the all-reducing backward leaves out the per-replica parts kept by the micro-batches "
        "before it: their grads stay per replica group in .grad, never reduced over the replicas",
        "                held = self._add_replica_parts()\n",
        "                held = set()\n",
    ),
    Mutant(
        "72",
        PARAM_GROUP,
        "post-accumulate-grad hooks",
        "field defect 21: finishing a reduction lands the grads but never runs the user's "
        "register_post_accumulate_grad_hook hooks on the sharded params",
        "            if not reduction.keeps_replica_parts:\n"
        "                for param in reduction.params:\n"
        "                    param.run_post_accumulate_grad_hooks()\n",
        "",
    ),
    Mutant(
        "73",
        PARAM,
        "user hooks before fully_shard",
        "field defect 21: the register_hook hooks are read off the new sharded param, not the param given to "
        "fully_shard: hooks put on a param before fully_shard are never called",
        '        self.user_grad_hooks = getattr(param, "_backward_hooks", None)\n',
        '        self.user_grad_hooks = getattr(self.sharded_param, "_backward_hooks", None)\n',
    ),
    Mutant(
        "74",
        COLLECTIVES,
        "mixed precision reduce dtype (all-reduce)",
        "field defect 17: a replicated param's grad is all-reduced as it is, in the compute dtype, not cast to "
        "the reduce dtype (under HSDP over the replicas too)",
        "        flat = params[0].unreduced_in_reduce_dtype().contiguous().view(-1)\n",
        "        flat = params[0].unreduced_grad.contiguous().view(-1)\n",
    ),
    Mutant(
        "75",
        PARAM,
        "frozen params",
        "field defect 22: the unsharded param is made without the param's requires_grad: a frozen param's "
        "compute copy requires grad, and backward computes, reduces and lands a grad for it",
        "        self.unsharded_param = nn.Parameter(data, requires_grad=param.requires_grad)\n",
        "        self.unsharded_param = nn.Parameter(data)\n",
        equivalent="since issue 52, _register gives each copy the requires_grad of the param it replaces before any "
        "forward can read it; the grad accumulator built early is the one autograd uses once unfrozen (survives the "
        "cases, the engine tests and L4 at 300 draws at seeds 0-2, 2026-12-07)",
    ),
    Mutant(
        "76",
        PARAM_GROUP,
        "frozen and unused params",
        "field defect 23: post-backward reduces every param of the group, a frozen or unused one with no grad "
        "too: the reduction crashes on its missing grad",
        "            ready = [p for p in self.params if p.unreduced_grad is not None]\n"
        "            if self.reduce_scatter_unused_params or (ready and len(ready) < len(self.params)):\n",
        "            ready = list(self.params)\n"
        "            if self.reduce_scatter_unused_params or (ready and len(ready) < len(self.params)):\n",
    ),
    Mutant(
        "77",
        STATE,
        "post-backward trigger (inputs)",
        "field defect 5: pre-forward passes every positional input through the post-backward function once one "
        "needs grad: inputs that needed none come out requiring grad",
        "            wrapped = iter(_PostBackward.apply(self, *needs_grad))\n"
        "            return tuple(next(wrapped) if arg.requires_grad else arg for arg in args), kwargs\n",
        "            return _PostBackward.apply(self, *args), kwargs\n",
    ),
    Mutant(
        "78",
        PARAM,
        "deferred init (one shard rank)",
        "field defect 1: after nn.Module._apply a whole param (one shard rank, or replicated) keeps its compute "
        "copy, taken to alias the shard: after meta init and to_empty it stays on meta",
        "        self._init_unsharded(self.sharded_param)\n",
        "        if not self.is_whole:\n            self._init_unsharded(self.sharded_param)\n",
    ),
    Mutant(
        "79",
        PARAM,
        "pre-shard param kept (lifetime)",
        "the param keeps the pre-shard param object to read its register_hook hooks from: the whole "
        "param's storage stays alive beside its shard (upstream's #434, #547)",
        '        self.user_grad_hooks = getattr(param, "_backward_hooks", None)\n',
        '        self.pre_shard = param\n        self.user_grad_hooks = getattr(param, "_backward_hooks", None)\n',
    ),
    Mutant(
        "80",
        INIT,
        "module plan kept (lifetime)",
        "the module's state keeps its plan, which lists the pre-shard params: their storages stay alive "
        "beside the shards (upstream's PR #825, a policy holding the pre-shard params)",
        "    module.__dict__[STATE_ATTR] = state\n",
        "    state.plan = plan\n    module.__dict__[STATE_ATTR] = state\n",
    ),
    Mutant(
        "81",
        PARAM_GROUP,
        "post-accumulate-grad hooks (timing)",
        "the user's post-accumulate-grad hooks run before the reduction is waited for: the grad has not landed",
        "            reduction.wait()\n"
        "            if not reduction.keeps_replica_parts:\n"
        "                for param in reduction.params:\n"
        "                    param.run_post_accumulate_grad_hooks()\n",
        "            if not reduction.keeps_replica_parts:\n"
        "                for param in reduction.params:\n"
        "                    param.run_post_accumulate_grad_hooks()\n"
        "            reduction.wait()\n",
    ),
    Mutant(
        "82",
        PARAM_GROUP,
        "replicated params (reshard)",
        "field defect 8: resharding copies a replicated param's compute copy back into its shard: under a "
        "bf16 param_dtype the fp32 master is rounded to bf16 at every reshard (upstream's #212)",
        "            param.use_sharded()\n            param.free_unsharded()\n"
        "        self.state = ShardedState.SHARDED\n",
        "            if param.is_replicated:\n"
        "                param.local_shard.copy_(param.unsharded_local)\n"
        "            param.use_sharded()\n            param.free_unsharded()\n"
        "        self.state = ShardedState.SHARDED\n",
    ),
    Mutant(
        "83",
        ALL_GATHER,
        "unshard across the optimizer step (whole params)",
        "an unshard issued before the optimizer step tracks the versions of the params it gathers only: a "
        "whole param (replicated, or a one-rank shard group) copied at the issue goes stale unnoticed",
        "    gather.copied = copied\n",
        "",
    ),
    Mutant(
        "84",
        PARAM,
        "user hooks (registered per unshard)",
        "field defect 11: the dispatcher of the user's register_hook hooks is registered again each time the "
        "unsharded param is registered (as if a swap lost it): hooks pile up, one more per unshard",
        "    def use_unsharded(self) -> None:\n        self._register(self.unsharded_param)\n",
        "    def use_unsharded(self) -> None:\n"
        "        if self.user_grad_hooks and self.unsharded_param.requires_grad:\n"
        "            self.unsharded_param.register_hook(user_grad_hooks(self.user_grad_hooks))\n"
        "        self._register(self.unsharded_param)\n",
    ),
    Mutant(
        "85",
        STATE,
        "late grads (end of backward)",
        "field defect 4: the end of backward finishes only the groups backward has not reached: a weight "
        "grad that arrives after its module's post-backward (a chunked loss) stays unreduced",
        "            if group is not None and (group.used_since_post_backward or group.has_unreduced_grads):\n",
        "            if group is not None and group.used_since_post_backward:\n",
    ),
    Mutant(
        "86",
        PARAM_GROUP,
        "flat gather buffer kept (lifetime)",
        "field defect 13: a waited all-gather stays on its group until the next unshard: under comm_fusion "
        "its flat buffer, every rank's shards, stays alive beside the shards after resharding",
        "        self._all_gather.wait()\n        self._all_gather = None\n",
        "        self._all_gather.wait()\n",
    ),
    Mutant(
        "87",
        STATE,
        "grads by any backward path (end of backward)",
        "issue 52: a grad accumulating into an unsharded param does not queue the end-of-backward callback: "
        "a loss read from a tensor the forward stored, input needing no grad, leaves every grad unreduced",
        "        self.iteration.states_in_iteration[self] = None\n"
        "        self.iteration.queue_final_callback()\n\n"
        "    def post_backward(self) -> None:\n",
        "        self.iteration.states_in_iteration[self] = None\n\n    def post_backward(self) -> None:\n",
    ),
    Mutant(
        "88",
        SAVED_PARAMS,
        "params saved in forward (by any path)",
        "issue 52: the pack hook never recognises a param: a backward reaching a resharded module by a path "
        "its outputs' hooks do not see reads a freed storage",
        "            is_param = id(tensor) in param_ids or (base is not None and id(base) in param_ids)\n",
        "            is_param = False\n",
    ),
    Mutant(
        "89",
        SAVED_PARAMS,
        "params saved in forward (gather on unpack)",
        "issue 52: unpacking a saved param does not gather its group first",
        "            if type(packed) is _SavedParam and packed.owner is self:\n"
        "                unshard()\n"
        "                packed = packed.packed\n",
        "            if type(packed) is _SavedParam and packed.owner is self:\n"
        "                packed = packed.packed\n",
    ),
    Mutant(
        "90",
        PARAM_GROUP,
        "params some ranks skip",
        "issue 52: only set_reduce_scatter_unused_params gives an unused param zeros: a param used on some "
        "ranks alone makes the ranks issue different collectives (pytorch#158719)",
        "            if self.reduce_scatter_unused_params or (ready and len(ready) < len(self.params)):\n",
        "            if self.reduce_scatter_unused_params:\n",
    ),
    Mutant(
        "91",
        PARAM,
        "grad_dtype",
        "issue 52: a grad_dtype set before fully_shard is not read: bf16 grads, small accumulated terms lost "
        "(pytorch#170648)",
        "        self.user_grad_dtype = user_grad_dtype(param)\n",
        "        self.user_grad_dtype = None\n",
    ),
    Mutant(
        "92",
        OPTIMIZER_GUARD,
        "optimizers built at any time (refusal)",
        "issue 52: the optimizer step pre-hook finds a tensor the model does not train and lets it step",
        "            raise RuntimeError(entry[1])\n",
        "            pass\n",
    ),
    Mutant(
        "93",
        OPTIMIZER_GUARD,
        "optimizers built at any time (hook)",
        "issue 52: the optimizer step pre-hook is registered only if one was already (never)",
        "    if _hook_handle is None:\n",
        "    if _hook_handle is not None:\n",
    ),
    Mutant(
        "94",
        PARAM,
        "frozen and unfrozen (requires_grad)",
        "the params registered next do not take the requires_grad a user set on the registered ones: all "
        "frozen through the first forward then unfrozen never get grads (pytorch#186998's pattern)",
        "        if previous is not None and previous is not param and param.requires_grad != previous.requires_grad:\n"
        "            param.requires_grad_(previous.requires_grad)\n",
        "",
    ),
    # issue 53's two held-out bugs: L4 killed them at seed 1 before its grammar grew; its reach must hold
    Mutant(
        "95",
        STATE,
        "activation checkpointing (recompute)",
        "held out (issue 53): a forward recomputed in backward reshards its group after it, as a first "
        "forward would: backward gathers the group again (extra all-gathers, the memory of a reshard lost)",
        "        grad_enabled = torch.is_grad_enabled()\n"
        "        if not recomputing:\n"
        "            if self.param_group is not None and self._reshards_after_forward():\n",
        "        grad_enabled = torch.is_grad_enabled()\n"
        "        if recomputing and self.param_group is not None and self._reshards_after_forward():\n"
        "            self.param_group.reshard()\n"
        "        if not recomputing:\n"
        "            if self.param_group is not None and self._reshards_after_forward():\n",
    ),
    Mutant(
        "96",
        STATE,
        "implicit backward prefetch",
        "held out (issue 53): backward prefetches every group whose forward ran, not the next one "
        "backward reaches: everything gathered ahead (the memory of sharding lost, and groups gathered again)",
        "        for target in self.backward_prefetch or self.iteration.next_in_backward(self):\n",
        "        for target in self.backward_prefetch or [s for s in self.iteration.forward_order if s is not self]:\n",
    ),
)


def by_id() -> dict[str, Mutant]:
    """The catalogue keyed by mutant id."""
    return {m.id: m for m in MUTANTS}


def _ids_of(token: str) -> list[str]:
    """``"3"`` -> ``["03"]``; ``"03-05"`` -> ``["03", "04", "05"]``."""
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", token.strip())
    if not match:
        raise MutantError(f"bad mutant id {token!r}: want NN or NN-MM")
    first = int(match.group(1))
    last = int(match.group(2) or first)
    return [f"{n:02d}" for n in range(first, last + 1)]


def select(only: str | None) -> list[Mutant]:
    """The mutants named by ``only`` (``"03,07"``, ``"10-12"``; None or empty: all), in id order."""
    if not only:
        return list(MUTANTS)
    known = by_id()
    wanted = sorted({i for token in only.split(",") if token.strip() for i in _ids_of(token)})
    unknown = [i for i in wanted if i not in known]
    if unknown:
        raise MutantError(f"unknown mutant id(s) {unknown}; known: {MUTANTS[0].id}..{MUTANTS[-1].id}")
    return [known[i] for i in wanted]
