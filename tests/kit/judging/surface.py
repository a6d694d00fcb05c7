"""The implementation surface: the one way the kit reaches the implementation under test.

Cases, references and helpers never import ``hyper_parallel`` (nor torch FSDP2) themselves;
they use ``impl``, the implementation this process runs, loaded on first use from the spec in
``HPKIT_IMPLEMENTATION`` (set on every engine of a cluster, see ``tests.kit.runtime.rank_runtime``)::

    from tests.kit.judging.surface import impl
    impl.fully_shard(model.layers[0], mesh=ctx.mesh)
    impl.full(param)           # the whole tensor, whatever the implementation's tensor type

A spec is ``[adapter:]path``: ``native:/src/hyper_parallel-checkout`` (a ``hyper_parallel``
package on torch's DeviceMesh/DTensor; a bare path means native), ``torch`` (torch FSDP2),
``upstream:/src/hyper-parallel`` (upstream HyperParallel with its own mesh and tensor types), or
``file:/path/adapter.py`` (an adapter module of your own). The empty spec is our own engine,
from this repository. Adapters only translate (names, types, how to build a mesh, how to read a
sharded tensor); they never fix behaviour, and a feature an implementation lacks is either left
out of ``features`` (the case is UNSUPPORTED before it runs) or refused at run time with
``NotImplementedError`` / an unknown keyword (UNSUPPORTED, naming it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tests.kit.judging.levels import LEVELS

IMPLEMENTATION_ENV = "HPKIT_IMPLEMENTATION"
REPO_ROOT = Path(__file__).resolve().parents[3]
# adapter name in a spec -> its module under tests.kit.judging.adapters ("file" loads a module by path)
ADAPTERS = {"native": "native", "torch": "fsdp2", "upstream": "upstream", "file": ""}

# The plan features a case may need; an adapter declares those its implementation has.
FEATURES: dict[str, str] = {
    "fully_shard": "fully_shard on a 1-D mesh, nested groups, training like DDP",
    "mesh_none": "fully_shard(mesh=None): a 1-D mesh over the world",
    "hsdp": "a 2-D (replicate, shard) mesh",
    "submesh": "fully_shard on a named sub-mesh of a larger mesh (pp, ep beside dp)",
    "reshard_after_forward": "reshard_after_forward=True/False at construction",
    "uneven": "params whose sharded dim does not divide by the ranks (padded shards)",
    "uneven_other_dims": "uneven shards on a dim other than 0 (Shard(1) of an odd width)",
    "cpu_offload": "CPUOffloadPolicy",
    "replicate_params": "fully_shard(replicate_params=...)",
    "comm_fusion": "fully_shard(comm_fusion=True/False)",
    "list_input": "fully_shard([module, module]) as independent groups",
    "gradient_sync": "set_requires_gradient_sync",
    "all_reduce_control": "set_requires_all_reduce (HSDP)",
    "reshard_controls": "set_reshard_after_forward / set_reshard_after_backward",
    "reduce_op_type": "set_reduce_op_type('sum' | 'avg')",
    "last_backward": "set_is_last_backward",
    "prefetch": "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch",
    "unshard_reshard": "unshard(async_op) / reshard()",
    "zero_grad": "HSDPModule.zero_grad clearing unreduced and main grads",
    "recurse_false": "recurse=False on the HSDPModule setters",
    "ignored_params": "fully_shard(ignored_params=...)",
    "ignored_params_nested": "a param a nested call ignores left alone by the calls above (reached via a tied module)",
    "shard_placement_fn": "shard_placement_fn returning Shard(d)",
    "placement_replicate": "shard_placement_fn returning Replicate()",
    "mixed_precision": "MixedPrecisionPolicy param/reduce/output dtypes",
    "cast_forward_inputs": "MixedPrecisionPolicy(cast_forward_inputs=False)",
    "main_grad": "MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True)",
    "argument_checks": "bad arguments refused with TypeError/ValueError before any change",
    "tensor_parallel": "params that are torch tensor-parallel DTensors on another mesh dim",
    "dcp": "torch.distributed.checkpoint round trips of the sharded model",
    "clip_grad_norm": "torch.nn.utils.clip_grad_norm_ on the sharded grads",
    "activation_checkpointing": "torch.utils.checkpoint (re-entrant forwards inside backward)",
    "pipeline": "torch.distributed.pipelining stages over sharded modules",
    "expert_parallel": "experts on an ep sub-mesh beside dense params on the dp mesh",
    # FSDP2 usages as torch 2.13 users call them (the L0-FSDP2-* cases)
    "deferred_init": "fully_shard on a meta-device model, to_empty, then a full or sharded state dict loaded",
    "reset_parameters": "reset_parameters() of a sharded module after to_empty: sharded random init",
    "reshard_int": "reshard_after_forward=k (int): a 1/k share kept after forward, backward gathers over k ranks",
    "to_dtype": "module.to(dtype) / .double() after sharding: sharded params and grads in that dtype",
    "to_dtype_after_forward": "module.to(dtype) after a forward or unshard(), groups gathered: all-gathers follow it",
    "forward_method": "register_fsdp_forward_method(module, name): another method runs like forward",
    "all_reduce_hook": "HSDPModule.set_all_reduce_hook(hook): called on each group's reduced grads",
    "unshard_in_backward": "HSDPModule.set_unshard_in_backward(False): no all-gather of that group in backward",
    "gradient_divide_factor": "HSDPModule.set_gradient_divide_factor(f): reduced grads = sum over ranks / f",
    "force_sum_reduction": "HSDPModule.set_force_sum_reduction_for_comms(True): sum-only collectives, same grads",
    "gradient_scaling_factor": "HSDPModule.set_gradient_scaling_factor(s): reduced grads times s (None: off)",
    "reset_iter_state": "HSDPModule.reset_iter_state() on the root after a failed forward: resharded, trains on",
    "module_slicing": "slicing a sharded container (Sequential, ModuleList) builds the original class",
    "share_comm_ctx": "share_comm_ctx(modules): accepts sharded roots, refuses other modules",
    "reduce_scatter_unused_params": "set_reduce_scatter_unused_params(True): params unused on a rank reduce zeros",
    "separate_reduce_scatter_group": "set_separate_reduce_scatter_group(): reduce-scatters on a group of their own",
    "post_accumulate_grad_hooks": "register_post_accumulate_grad_hook on a sharded param: called as its grad lands",
    "hooks_through_sharding": "hooks put on a param before fully_shard (register_hook, post-accumulate) still called",
    "reregister_plain": "a plain full-shape param registered in a sharded one's place: sharded at the first forward",
    "all_reduce_accumulation": "set_requires_all_reduce(False) on all micro-batches but the last: it all-reduces all",
    "unshard_across_step": "unshard(async_op=True) issued before an optimizer step, waited after or met in flight: "
    "the stepped params",
    # usage patterns of FSDP2's users (L4's tests/kit/explore/patterns.py)
    "freeze_through_lazy_init": "every param frozen (requires_grad_(False)) through the first forward, then unfrozen",
    "freeze_across_steps": "a module's params frozen (requires_grad_(False)) before a step, trainable again later",
    "two_forwards_one_backward": "two forwards (two batches) before one backward of their summed losses, "
    "as DPO's chosen and rejected, with or without activation checkpointing",
    "first_grad_on_synced_microbatch": "a param used only on a step's last micro-batch: its first grad comes synced",
    "ranks_skip_params": "a param of a sharded call used on some ranks and not others in a step (a routed "
    "expert, a conditional branch): the grads of DDP(find_unused_parameters=True)",
    "tied_params_split_groups": "the halves of a tied weight in two fully_shard calls (fully_shard(embed), "
    "then the head's): refused naming the weight, at a call or the first forward, or trained as one tied param",
    "grad_dtype": "param.grad_dtype = float32 set on bf16 params before fully_shard (pure bf16 training): "
    "grads computed, reduced and accumulated in fp32",
    "state_dict_assign": "a meta-built sharded model given its tensors by load_state_dict(sharded_sd, assign=True) "
    "(the sharded state dict made from a full one): the loaded tensors are what trains",
    "state_dict_before_forward": "model.state_dict() taken before the first forward, its tensors read after "
    "training: the trained params, as a plain model's state dict (it holds the params' storage)",
    "unit_skips_nosync_microbatches": "a sharded module run only on a step's last micro-batch, not the held ones",
    "inplace_on_output_view": "a sharded module returns a view of its output, a module above modifies it in place",
    "stored_intermediate_loss": "a module stores an intermediate on itself in forward, the loss adds a term read there",
    "optimizer_after_forward": "the optimizer built after a first forward (a warm-up): it trains the params, or its "
    "step is refused naming the param",
    "list_module_called_again": "a list call's module calls another inside its forward, stores that output for the "
    "loss, and the callee runs again (the list's modules one group, or each their own)",
}


@dataclass(frozen=True)
class Spec:
    """Which adapter, and where the implementation's package lives ('' = wherever it imports from)."""

    adapter: str
    path: str

    def __str__(self) -> str:
        return f"{self.adapter}:{self.path}" if self.path else self.adapter


def parse_spec(text: str | None) -> Spec:
    """``''`` (ours), ``torch``, ``native:PATH``, ``upstream:PATH``, ``file:ADAPTER.py``, or a bare PATH."""
    text = (text or "").strip()
    if not text:
        return Spec("native", str(REPO_ROOT))
    adapter, sep, path = text.partition(":")
    if not sep:
        if text in ADAPTERS:
            return Spec(text, "")
        adapter, path = "native", text
    if adapter not in ADAPTERS:
        raise ValueError(f"implementation spec {text!r}: adapter must be one of {sorted(ADAPTERS)}")
    if path:
        path = str(Path(path).expanduser().resolve())
        if not Path(path).exists():
            raise ValueError(f"implementation spec {text!r}: {path} does not exist")
    elif adapter in ("upstream", "file"):
        raise ValueError(f"implementation spec {text!r}: the {adapter} adapter needs a path")
    return Spec(adapter, path)


def parse_implementations(items: list[str]) -> dict[str, str]:
    """``NAME=SPEC`` items -> name -> normalised spec ('' = ours)."""
    named: dict[str, str] = {}
    for item in items:
        name, sep, spec = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--implementation {item!r}: expected NAME=SPEC (SPEC '' = ours)")
        if name in named:
            raise ValueError(f"--implementation {item!r}: the name {name!r} is given twice")
        if "/" in name or name in LEVELS:
            raise ValueError(f"--implementation {item!r}: {name!r} cannot name a folder of the run")
        named[name] = str(parse_spec(spec)) if spec.strip() else ""
    return named


class Implementation:
    """What the kit needs of an implementation. The defaults read torch's DeviceMesh and DTensor
    (ours and torch FSDP2 use them); adapters of other implementations override what differs."""

    name = "implementation"
    features: frozenset[str] = frozenset(FEATURES)
    # defects of the implementation found by the kit and reported: a combination of declared
    # features that fails together -> what happens (L4 leaves them out; --with-known-defects draws them)
    known_defects: dict[frozenset[str], str] = {}
    # process-global state that does not survive the kit's new process group per run: L4 then runs
    # every configuration on fresh engines
    fresh_engines: bool = False
    # whether a forward recomputed under activation checkpointing may gather its group again in that
    # backward (torch FSDP2: a recompute that runs before the module's pre-backward hook reshards after
    # it, as a first forward does): L4 then allows one more gather per module; False holds it to one
    recompute_gathers_again: bool = True
    fully_shard: Any
    register_fsdp_forward_method: Any  # (module, method_name): another method runs like forward
    share_comm_ctx: Any  # (modules): FSDP2's stream sharing between roots
    HSDPModule: type
    MixedPrecisionPolicy: type
    OffloadPolicy: type
    CPUOffloadPolicy: type
    Shard: type
    Replicate: type

    def __init__(self, spec: Spec, package: ModuleType | None) -> None:
        self.spec = spec
        self.package = package  # the imported package under test (for provenance)

    @property
    def host_packages(self) -> tuple[str, ...]:
        """The implementation's own modules, by name prefix: L4 counts what their globals hold
        (``tests.kit.explore.host_objects``)."""
        return (self.package.__name__,) if self.package is not None else ()

    # -- meshes ------------------------------------------------------------------------------
    def init_mesh(self, device_type: str, shape: tuple[int, ...], dim_names: tuple[str, ...]) -> Any:
        """A mesh over ranks ``0..prod(shape)-1`` (row-major), with named dims."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, shape, mesh_dim_names=dim_names)

    def submesh(self, mesh: Any, *dim_names: str) -> Any:
        """The sub-mesh of the named dims (this rank's slice)."""
        return mesh[dim_names[0] if len(dim_names) == 1 else dim_names]

    def process_group(self, mesh: Any, dim_name: str) -> Any:
        """The torch.distributed process group of this rank along one named mesh dim."""
        return mesh.get_group(dim_name)

    def mesh_dim_names(self, mesh: Any) -> tuple[str, ...]:
        """The mesh's dim names."""
        return tuple(mesh.mesh_dim_names or ())

    def mesh_shape(self, mesh: Any) -> tuple[int, ...]:
        """The mesh's shape."""
        return tuple(mesh.shape)

    def local_rank(self, mesh: Any, dim_name: str) -> int:
        """This rank's coordinate along one named mesh dim."""
        return mesh.get_local_rank(dim_name)

    # -- sharded tensors ---------------------------------------------------------------------
    def is_sharded(self, tensor: Any) -> bool:
        """Whether ``tensor`` is the implementation's distributed tensor type (else a plain tensor)."""
        from torch.distributed.tensor import DTensor

        return isinstance(tensor, DTensor)

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor on every rank (a collective for distributed tensors)."""
        return tensor.full_tensor() if self.is_sharded(tensor) else tensor

    def full_like(self, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The whole value of a per-param tensor laid out like its param ``like`` (an optimizer state:
        torch keeps it as a DTensor like the param; an implementation may keep the local shard)."""
        return self.full(tensor)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """What this rank holds of the tensor."""
        return tensor.to_local() if self.is_sharded(tensor) else tensor

    def placements(self, tensor: torch.Tensor) -> tuple:
        """The tensor's placements on its mesh (``()`` for a plain tensor)."""
        return tuple(tensor.placements) if self.is_sharded(tensor) else ()

    def mesh_of(self, tensor: torch.Tensor) -> Any:
        """The mesh a distributed tensor lives on (None for a plain tensor)."""
        return tensor.device_mesh if self.is_sharded(tensor) else None

    def optimizer_step(self) -> AbstractContextManager:
        """Whatever context a torch optimizer step on the sharded params needs."""
        return contextlib.nullcontext()

    # -- provenance --------------------------------------------------------------------------
    @functools.cached_property
    def origin(self) -> dict[str, Any]:
        """Where the implementation was imported from: adapter, package file, git commit, dirty."""
        where = getattr(self.package, "__file__", None) or ""
        state = git_state(Path(where).resolve().parent) if where else {"commit": None, "dirty": None}
        return {"adapter": self.spec.adapter, "spec": str(self.spec), "file": where, **state}

    def refusal(self, exc: BaseException) -> str | None:
        """The feature named by an exception the implementation raised to refuse it, else None:
        ``NotImplementedError`` raised inside the implementation (or its adapter), or a
        ``TypeError`` for an unknown keyword of an API call."""
        if isinstance(exc, TypeError):
            match = re.search(r"got an unexpected keyword argument '(\w+)'", str(exc))
            return f"unknown keyword {match.group(1)!r}" if match else None
        if isinstance(exc, NotImplementedError) and self._raised_inside(exc):
            return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None

    def _raised_inside(self, exc: BaseException) -> bool:
        """Whether the innermost frame of ``exc`` belongs to the implementation or its adapter."""
        frames = traceback.extract_tb(exc.__traceback__)
        if not frames:
            return False
        where = frames[-1].filename
        return any(where.startswith(root) for root in self.owned_paths())

    def owned_paths(self) -> list[str]:
        """Source roots that belong to the implementation (its package, its adapter module)."""
        roots = [str(Path(sys.modules[type(self).__module__].__file__).resolve())]
        if self.package is not None and getattr(self.package, "__file__", None):
            roots.append(str(Path(self.package.__file__).resolve().parent))
        return roots


def git_state(folder: str | Path) -> dict[str, Any]:
    """Commit and dirtiness of the git checkout holding ``folder`` (None where it is not one)."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(status.strip())}


def import_package(name: str, path: str) -> ModuleType:
    """Import package ``name`` from ``path`` (put first on sys.path); refuse one imported elsewhere."""
    if path:
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
    package = importlib.import_module(name)
    where = Path(package.__file__).resolve()
    if path and Path(path) not in where.parents:
        raise ImportError(
            f"{name} was already imported from {where}, not from {path}: start fresh engines "
            "(a new cluster) for another implementation"
        )
    return package


def load(spec: Spec) -> Implementation:
    """Import the implementation of ``spec`` through its adapter."""
    if spec.adapter == "file":
        module_spec = importlib.util.spec_from_file_location("hpkit_custom_adapter", spec.path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(f"tests.kit.judging.adapters.{ADAPTERS[spec.adapter]}")
    implementation = module.load(spec)
    unknown = set(implementation.features) - set(FEATURES)
    if unknown:
        raise ValueError(f"adapter {spec} declares unknown features {sorted(unknown)}; known: {sorted(FEATURES)}")
    return implementation


@functools.cache
def _load_cached(spec: Spec) -> Implementation:
    return load(spec)


def current() -> Implementation:
    """The implementation this process runs (``HPKIT_IMPLEMENTATION``, default: ours)."""
    return _load_cached(parse_spec(os.environ.get(IMPLEMENTATION_ENV, "")))


class _Current:
    """``impl``: attribute access resolves to the current implementation, loaded on first use
    (importing a case module never imports the implementation)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(current(), name)

    def __repr__(self) -> str:
        return f"<implementation under test: {os.environ.get(IMPLEMENTATION_ENV) or 'ours'}>"


impl: Any = _Current()


@contextlib.contextmanager
def using(spec: str) -> Iterator[Implementation]:
    """Make ``spec`` the current implementation inside the block (this process only)."""
    before = os.environ.get(IMPLEMENTATION_ENV)
    os.environ[IMPLEMENTATION_ENV] = spec
    try:
        yield current()
    finally:
        if before is None:
            os.environ.pop(IMPLEMENTATION_ENV, None)
        else:
            os.environ[IMPLEMENTATION_ENV] = before
