"""What runs inside an engine (a rank): boot once, then one fresh process group per run.

The driver (``tests.kit.runtime.cluster``) ships these functions by reference, so an engine imports
this module and nothing of the driver. After a run the engine's interactive namespace holds
what a person debugging the rank wants (``cluster.view(rank).pull(name)`` or ``%%px``):

- ``_rank``: this engine's rank; ``_last_run``: the last run (function, rank, world size,
  backend); ``_last_result``: what the rank function returned (absent if it raised);
  ``_last_error`` / ``_last_traceback``: the exception it raised and its formatted text
  (None on success); anything the rank function passed to :func:`keep`.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psutil

IMPLEMENTATION_ENV = "HPKIT_IMPLEMENTATION"  # the implementation under test (see tests.kit.judging.surface)
NODE_ENV = "HPKIT_NODE"  # the machine an engine says it is on, for device binding

_ENGINE_STATE: dict[str, Any] = {}


def _user_ns() -> dict[str, Any]:
    """The engine's interactive namespace (what %%px and DirectView.pull see)."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:  # pragma: no cover - engines always have IPython
        shell = None
    if shell is not None:
        return shell.user_ns
    return sys.modules["__main__"].__dict__


def keep(**objects: Any) -> None:
    """Store objects in this engine's namespace so a person can inspect them after the run."""
    _user_ns().update(objects)


def _started_by(driver_pid: int) -> bool:
    """Whether the driver started this engine: its parent, or the parent of the warm zygote this
    engine was forked from (``engine_fork``); false once either is gone."""
    parent = os.getppid()
    if parent == driver_pid:
        return True
    try:
        return psutil.Process(parent).ppid() == driver_pid
    except psutil.Error:
        return False


def _watch_parent(driver_pid: int) -> None:
    """Engine thread: kill this engine's process group once the driver that started it is gone."""
    while _started_by(driver_pid):
        time.sleep(0.5)
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def stack_path() -> str | None:
    """This engine's faulthandler file (None outside an engine the cluster booted)."""
    return _ENGINE_STATE.get("stack_path")


def _stack_file(stack_dir: str) -> str:
    """Route faulthandler (SIGUSR1 dumps and fatal signals) to a per-engine file; its path."""
    path = _ENGINE_STATE.get("stack_path")
    if path and os.path.exists(path):  # a second driver joining keeps the first's file
        return path
    os.makedirs(stack_dir, exist_ok=True)
    path = os.path.join(stack_dir, f"engine-{os.getpid()}.txt")
    stack_file = open(path, "a", buffering=1)  # stays open: faulthandler writes to its fd
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    faulthandler.enable(file=stack_file, all_threads=True)  # segfaults land here too
    _ENGINE_STATE.update(stack_path=path, stack_file=stack_file)
    return path


def _set_implementation(implementation: str | None) -> None:
    """Record the implementation under test for this engine; ``tests.kit.judging.surface`` imports it
    (its path first on ``sys.path``) the first time a case uses it."""
    if implementation:
        os.environ[IMPLEMENTATION_ENV] = implementation
    else:
        os.environ.pop(IMPLEMENTATION_ENV, None)


def engine_boot(
    rank: int, repo_root: str, stack_dir: str, driver_pid: int | None, implementation: str | None = None
) -> dict:
    """Prepare an engine once: repo and implementation on sys.path, stack dumps, watchdog, torch."""
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)
    os.chdir(repo_root)
    _set_implementation(implementation)
    path = _stack_file(stack_dir)
    if driver_pid and _started_by(driver_pid) and not _ENGINE_STATE.get("watchdog"):
        thread = threading.Thread(target=_watch_parent, args=(driver_pid,), name="hpkit-driver-watch", daemon=True)
        thread.start()
        _ENGINE_STATE["watchdog"] = thread
    import torch  # warm-up: runs must not pay the import
    import torch.distributed  # noqa: F401

    _ENGINE_STATE["rank"] = rank
    _user_ns()["_rank"] = rank
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        # the machine for device binding: ranks of one node bind to its devices in rank order
        # (HPKIT_NODE stands in for another machine in tests; a real cluster leaves it unset)
        "node": os.environ.get(NODE_ENV) or socket.gethostname(),
        "stack_path": path,
        "main_thread": threading.main_thread().ident,
        "implementation": os.environ.get(IMPLEMENTATION_ENV, ""),
    }


def current_implementation() -> str:
    """The implementation spec this engine was booted with ('' = the repository's own)."""
    return os.environ.get(IMPLEMENTATION_ENV, "")


def _resolve_fn(ref: tuple[str, str]) -> Callable:
    """Import module.qualname on the engine."""
    module, qualname = ref
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def fn_reference(fn: Callable) -> tuple[tuple[str, str] | None, Callable | None, str]:
    """(module, qualname) if fn can be imported on the engines, else ship fn itself."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    name = f"{module}.{qualname}" if module and qualname else repr(fn)
    if module and qualname and module != "__main__" and "<" not in qualname:
        try:
            if _resolve_fn((module, qualname)) is fn:
                return (module, qualname), None, name
        except (ImportError, AttributeError):
            pass
    return None, fn, name


def _choose_backend(requested: str | None, world_size: int, local_ranks: int | None = None) -> str:
    """The backend of a run's rank (``tests.kit.runtime.devices.choose``): the accelerator's where this host
    has a device for each of its ranks, else gloo."""
    from tests.kit.runtime.devices import choose

    return choose(requested, local_ranks or world_size)[1]


def _wait_until_every_rank_joined(backend: str) -> None:
    """Barrier right after joining: a rank whose fn ends at once (an UNSUPPORTED refusal, a bad
    argument) would otherwise tear the group down while a slower peer is still inside gloo's
    connectFullMesh, and that peer fails with "Connection closed by peer" instead of its own verdict."""
    import torch.distributed as dist

    from tests.kit.runtime.devices import barrier_args

    dist.barrier(**barrier_args(backend))


LEAVE_WAIT_S = 10.0  # how long a rank that is done waits for its peers to be done before tearing down


def _leave_together(store: Any, rank: int, world_size: int, wait: bool = True) -> None:
    """Bounded rendezvous before the groups go: a rank whose fn returned early (its sub-meshes made)
    would otherwise tear them down while a slower peer is still inside gloo's connectFullMesh for one of
    them, and that peer fails with "Connection closed by peer" (seen once in CI, a 4-rank mesh slice).
    A rank that raised says it left and does not wait (``wait=False``): its error must reach the driver
    at once, which then stops the peers still waiting on it in a collective; one that died outright is
    waited on no longer than ``LEAVE_WAIT_S`` (the driver names it meanwhile)."""
    try:
        store.set(f"left/{rank}", "1")
        if wait:
            store.wait([f"left/{peer}" for peer in range(world_size)], timedelta(seconds=LEAVE_WAIT_S))
    except Exception:  # noqa: BLE001 - a peer gone or the store closed: tear down anyway
        pass


THREADS_ENV = "HPKIT_RANK_THREADS"  # torch threads per rank; unset: the cores shared by the ranks


def threads_per_rank(world_size: int) -> int:
    """``HPKIT_RANK_THREADS`` if set (another thread count changes the last digits of CPU
    arithmetic: the kit's test of machine-independent notebook text uses it), else the cores
    shared evenly by the run's ranks."""
    wanted = os.environ.get(THREADS_ENV, "").strip()
    if wanted:
        return max(1, int(wanted))
    return max(1, (os.cpu_count() or 1) // world_size)


def _store_key(spec: dict) -> str:
    return spec.get("store_id") or f"{spec['host']}:{spec['port']}"


def _store_client(spec: dict, timeout: timedelta) -> Any:
    """This engine's client of the driver's TCPStore, connected once per store and kept.

    A fresh client per run stalls about one connect in ten for 5 s (seen on 2 cores, gloo, torch
    2.13); every run of a driver shares its store anyway (each under its own key prefix). Keyed by
    the store's id, not its port: a port a dead driver held may come back for another store."""
    import torch.distributed as dist

    stores: dict[str, Any] = _ENGINE_STATE.setdefault("stores", {})
    key = _store_key(spec)
    store = stores.get(key)
    if store is None:
        store = dist.TCPStore(spec["host"], spec["port"], is_master=False, timeout=timeout)
        while len(stores) >= 4:  # stores of drivers that have moved on: drop the oldest
            stores.pop(next(iter(stores)))
        stores[key] = store
    store.set_timeout(timeout)
    return store


def rank_entry(rank: int, spec: dict, fn_obj: Callable | None, args: tuple, kwargs: dict) -> Any:
    """Engine side of a run: join a fresh process group, call fn, always destroy the group."""
    import torch
    import torch.distributed as dist

    ns = _user_ns()
    world_size = spec["world_size"]
    fn = fn_obj if fn_obj is not None else _resolve_fn(spec["fn_ref"])
    ns.pop("_last_result", None)
    ns["_last_error"] = ns["_last_traceback"] = None
    ns["_rank"] = rank
    from tests.kit.runtime.devices import bind, choose, deterministic, host_local_indices
    from tests.kit.runtime.torch_compat import forget_dtensor_specs, forget_sub_meshes

    torch.set_num_threads(threads_per_rank(world_size))
    hosts = spec.get("hosts") or ["localhost"] * world_size  # each rank's host, from the driver
    local_index = host_local_indices(hosts)[rank]
    device_type, backend = choose(spec["backend"], hosts.count(hosts[rank]))
    ns["_last_run"] = {
        "fn": spec["fn_name"],
        "rank": rank,
        "world_size": world_size,
        "backend": backend,
        "device": device_type,
        "local_index": local_index,
        "run": spec["prefix"],
    }
    if dist.is_initialized():  # left over from an interrupted run
        dist.destroy_process_group()
    timeout = timedelta(seconds=spec["timeout"])
    run_store = None
    raised = False
    try:
        bind(device_type, local_index)  # before the process group exists
        forget_dtensor_specs()  # a mesh equal to an earlier run's must not bring back its groups
        forget_sub_meshes()  # nor count as the sub-mesh an earlier run cut
        ns["_last_run"]["determinism"] = deterministic(device_type)
        run_store = dist.PrefixStore(spec["prefix"], _store_client(spec, timeout))
        dist.init_process_group(backend, store=run_store, rank=rank, world_size=world_size, timeout=timeout)
        _wait_until_every_rank_joined(backend)
        torch.manual_seed(0)
        result = fn(*args, **kwargs)
    except BaseException as exc:
        # an interrupted request may still have its answer in flight on the store's socket
        _ENGINE_STATE.get("stores", {}).pop(_store_key(spec), None)
        ns["_last_error"] = exc
        ns["_last_traceback"] = traceback.format_exc()
        raised = True
        raise
    finally:
        if run_store is not None:
            _leave_together(run_store, rank, world_size, wait=not raised)
        if dist.is_initialized():
            dist.destroy_process_group()
    ns["_last_result"] = result
    return result
