"""A warm ipyparallel cluster whose engine i is torch.distributed rank i: the driver's run loop.

One ``RankCluster`` serves many runs (pytest cases, notebooks, the sweep)::

    cluster = RankCluster.start(4)              # controller + 4 engines, torch imported once
    out = cluster.run(_ranks_cluster.allreduce_sum, 2)   # on ranks 0, 1; out[i] from rank i
    cluster.view(1)                             # DirectView on rank 1 (pull, apply, execute)
    cluster.view().activate()                   # then %%px --targets 1 in a notebook
    cluster.stop()                              # or `with RankCluster.start(4) as cluster:`

``RankCluster.join(cluster_id, profile)`` attaches to a cluster someone else started (its
engines, sorted by id, are ranks 0..n-1) and never stops it. ``implementation=`` (a spec of
``tests.kit.judging.surface``) puts the implementation under test first on every engine's ``sys.path``.

A run: the rank function is sent by reference (module + qualname, imported on the engine:
keep rank functions in importable modules such as ``tests.engine._ranks_*``); a function of
``__main__`` (a notebook cell) is shipped by value instead. Each run builds a fresh process
group on engines ``0..world_size-1`` from a rendezvous that cannot collide (one TCPStore on a
free port opened by this driver, with a key prefix unique to the run), sets
``torch.set_num_threads(max(1, cores // world_size))`` and ``torch.manual_seed(0)``, calls the
function and always destroys the group (``tests.kit.runtime.rank_runtime``). ``HPKIT_STORE_HOST``
(default 127.0.0.1) is the address engines use to reach the driver's TCPStore.

Every wait is bounded: an error on one rank, a timeout, or a dead engine ends in
``RankFailure`` (``tests.kit.runtime.diagnosis``) naming each failing rank with its remote traceback,
its Python stack or its death; ranks still running are interrupted (SIGINT) and, when that
does not free them, killed and restarted with the same engine id, so the next run works
(``tests.kit.runtime.engines``). ``renew()`` replaces every engine by a fresh one (case isolation).

Engines are forked from a warm parent that imported ipyparallel's engine and torch once per
driver (``tests.kit.runtime.engine_fork``): a start or restart skips their imports.

Leftovers: ``stop()``, interpreter exit (atexit) and a driver killed outright all leave no
process behind: engines poll their driver and kill their own process group when it is gone,
and a watchdog process SIGKILLs every process of the cluster when the driver dies.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from tests.kit.runtime.diagnosis import (
    RankFailure,
    completed_at,
    error_line,
    error_parts,
    format_remote_error,
    task_output,
)
from tests.kit.runtime.engine_fork import ForkedEngineSetLauncher
from tests.kit.runtime.engines import (
    OWNER_ENV,
    REPO_ROOT,
    EnginePool,
    finish_watchdog,
    forget,
    launch_engine,
    start_watchdog,
)
from tests.kit.runtime.joining import JOIN_ANSWER_S, answering_engines
from tests.kit.runtime.rank_runtime import current_implementation, fn_reference, keep, rank_entry

__all__ = ["RankCluster", "RankFailure", "REPO_ROOT", "keep"]

STORE_HOST_ENV = "HPKIT_STORE_HOST"  # address engines use to reach the driver's TCPStore
_POLL_S = 0.25  # how often a run checks engine liveness while it waits
_PEER_GRACE_S = 3.0  # after one rank fails, how long its peers get to finish or fail too


def _ipp() -> Any:
    """Import ipyparallel with IPP_NONINTERACTIVE=1 (no progress widgets, no streaming)."""
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    import ipyparallel

    return ipyparallel


class RankCluster:
    """A warm ipyparallel cluster whose engine i is torch.distributed rank i."""

    def __init__(
        self,
        pool: EnginePool,
        *,
        token: str | None,
        watchdog: subprocess.Popen | None,
        own_stack_dir: bool,
    ) -> None:
        """Internal: use RankCluster.start() or RankCluster.join()."""
        self.pool = pool
        self.client = pool.client  # the ipyparallel Client
        self.cluster = pool.cluster  # the ipyparallel Cluster this object started (None if joined)
        self.token = token  # value of HPKIT_OWNER in every owned process (None if joined)
        self._watchdog = watchdog
        self._own_stack_dir = own_stack_dir
        self._store: Any = None
        self._store_id = f"{os.getpid()}-{secrets.token_hex(6)}"  # engines keep one client per store
        self._store_host = os.environ.get(STORE_HOST_ENV, "127.0.0.1")
        self._lock = threading.RLock()
        self._run_seq = 0
        self._closed = False
        self.leftover_globs: list[str] = []  # files of a started cluster the watchdog removes
        atexit.register(self.stop)

    # ---------------------------------------------------------------- construction

    @classmethod
    def start(
        cls,
        n_engines: int,
        *,
        profile: str | None = None,
        startup_timeout: float = 60,
        implementation: str | None = None,
        engine_env: dict[str, str] | Callable[[int], dict[str, str]] | None = None,
    ) -> RankCluster:
        """Start a controller and n_engines local engines (engine i = rank i); bounded by startup_timeout.
        ``engine_env``: variables the engines start with besides this process's (``ATEN_CPU_CAPABILITY``,
        read when torch is imported, must be there from the start), or a function of the rank giving
        each engine its own (``HPKIT_NODE``: engines standing in for several machines)."""
        if n_engines < 1:
            raise ValueError(f"n_engines must be >= 1, got {n_engines}")
        ipp = _ipp()
        token = f"{os.getpid()}-{secrets.token_hex(6)}"
        cluster_kwargs: dict[str, Any] = {
            "cluster_id": f"hpkit-{token}",
            "n": n_engines,
            # engines forked from a warm zygote when they can be (engine_fork.py), else started cold
            "engines": ForkedEngineSetLauncher,
            "controller": "local",
            "log_level": 40,  # we report dead engines ourselves; ipyparallel would dump their logs
            # registration waits for a heartbeat: 0.5 s instead of 3 s makes startup ~4 s
            # faster; a dead engine is reported by its nanny at once, so allow 30 s of misses
            "controller_args": ["--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=60"],
        }
        if profile is not None:
            cluster_kwargs["profile"] = profile
        cluster = ipp.Cluster(**cluster_kwargs)
        stack_dir = tempfile.mkdtemp(prefix=f"hpkit-{token}-")
        leftovers = [
            os.path.join(cluster.profile_dir, "security", f"*{cluster.cluster_id}*"),
            os.path.join(cluster.profile_dir, "log", f"*{cluster.cluster_id}*"),
            stack_dir,
        ]
        watchdog = start_watchdog(token, leftovers)
        rc = None
        try:
            env = {OWNER_ENV: token, "IPP_NONINTERACTIVE": "1", "PYTHONUNBUFFERED": "1"}
            if isinstance(engine_env, dict):
                env.update(engine_env)
            if sys.platform.startswith("linux"):
                env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")  # local ranks
            cluster.start_controller_sync(environment=dict(env))
            per_rank = engine_env if callable(engine_env) else None
            for r in range(n_engines):  # launch first: engines start while the client connects
                launch_engine(cluster, r, {**env, **(per_rank(r) if per_rank else {})}, watchdog)
            client = cluster.connect_client_sync()
            pool = EnginePool(client, cluster, stack_dir, env, startup_timeout, implementation, per_rank)
            pool.watchdog = watchdog
            rc = cls(pool, token=token, watchdog=watchdog, own_stack_dir=True)
            rc.leftover_globs = leftovers
            pool.launch_and_boot(list(range(n_engines)), launched=True)
        except BaseException:
            if rc is not None:
                rc.stop()
            else:
                with contextlib.suppress(Exception):
                    cluster.stop_cluster_sync()
                finish_watchdog(watchdog)
                shutil.rmtree(stack_dir, ignore_errors=True)
            raise
        return rc

    @classmethod
    def join(cls, cluster_id: str = "", profile: str | None = None, implementation: str | None = None) -> RankCluster:
        """Attach to a running ipyparallel cluster (its engines, sorted by id, are ranks 0..n-1); never stops it.

        ``implementation``: the spec the engines must run; None keeps what they run. A joined
        engine that already runs another implementation cannot switch: that is an error."""
        ipp = _ipp()
        kwargs: dict[str, Any] = {"cluster_id": cluster_id}
        if profile is not None:
            kwargs["profile"] = profile
        client = ipp.Client(**kwargs)
        # faulthandler files of joined engines outlive this driver: a shared directory
        stack_dir = os.path.join(tempfile.gettempdir(), "hpkit-stacks")
        pool = EnginePool(client, None, stack_dir, {}, 60, None)
        rc = cls(pool, token=None, watchdog=None, own_stack_dir=False)
        try:
            eids = answering_engines(client, cluster_id)
            root = str(REPO_ROOT)  # so the engines can import the kit's rank runtime
            setup = (
                f"__import__('sys').path.insert(0, {root!r}) "
                f"if {root!r} not in __import__('sys').path else None; "
                f"__import__('os').chdir({root!r})"
            )
            client[eids].execute(setup, block=False).get(timeout=JOIN_ANSWER_S)
            running = client[eids[0]].apply_async(current_implementation).get(timeout=JOIN_ANSWER_S)
            if implementation is not None and implementation != running:
                raise ValueError(
                    f"cluster {cluster_id!r} runs implementation {running or '(ours)'!r}, not {implementation!r}: "
                    "start a cluster of your own for it (leave cluster_id empty)"
                )
            pool.implementation = running or None
            pool.boot({rank: eid for rank, eid in enumerate(eids)})
        except BaseException:
            rc.stop()
            raise
        return rc

    # ---------------------------------------------------------------- public API

    @property
    def n_engines(self) -> int:
        """Number of engines, i.e. the largest world_size a run can use."""
        return len(self.pool.engines)

    @property
    def pids(self) -> list[int]:
        """Engine pid of each rank (index = rank)."""
        return [self.pool.engines[r].pid for r in range(self.n_engines)]

    @property
    def implementation(self) -> str:
        """The implementation spec the engines run ('' = the repository's own)."""
        return self.pool.implementation or ""

    @property
    def controller_pid(self) -> int | None:
        """Pid of the controller this object started (None if joined)."""
        if self.cluster is None or self.cluster.controller is None:
            return None
        return self.cluster.controller.pid

    def view(self, ranks: int | Iterable[int] | None = None) -> Any:
        """An ipyparallel DirectView on the engines of those ranks (all by default), for inspection."""
        engines = self.pool.engines
        if ranks is None:
            ranks = range(self.n_engines)
        if isinstance(ranks, int):
            return self.client[engines[ranks].eid]
        return self.client[[engines[r].eid for r in ranks]]

    def run(
        self,
        fn: Callable,
        world_size: int,
        *args: Any,
        timeout: float = 120.0,
        backend: str | None = None,
        **kwargs: Any,
    ) -> list:
        """Run fn(*args, **kwargs) on engines 0..world_size-1 as ranks of a fresh process group.

        Returns per-rank results (index = rank); raises RankFailure on an error, a timeout
        or a dead engine, after which the engines are usable again.
        """
        if self._closed:
            raise RuntimeError("this RankCluster is stopped")
        if not 1 <= world_size <= self.n_engines:
            raise ValueError(f"world_size {world_size} not in 1..{self.n_engines}")
        with self._lock:
            t0 = time.monotonic()
            ranks = list(range(world_size))
            self.pool.ensure_alive(ranks)
            fn_ref, fn_obj, fn_name = fn_reference(fn)
            self._run_seq += 1
            spec = {
                "fn_ref": fn_ref,
                "fn_name": fn_name,
                "world_size": world_size,
                "host": self._store_host,
                "port": self._store_port(),
                "store_id": self._store_id,
                "prefix": f"hpkit/{os.getpid()}/{id(self):x}/{self._run_seq}",
                "backend": backend,
                "timeout": float(timeout),
                "hosts": [self.pool.engines[r].node for r in ranks],  # ranks bind by host-local index
            }
            marks = {r: self.pool.stack_size(r) for r in ranks}
            views = self.pool.views
            ars = {r: views[r].apply_async(rank_entry, r, spec, fn_obj, args, kwargs) for r in ranks}
            try:
                results, errors, dead, pending = self._wait(ars, t0 + timeout)
            except BaseException:  # Ctrl-C, pytest-timeout: never leave ranks running
                self.pool.settle(ars, [r for r in ranks if not ars[r].done()], {})
                raise
            if not errors and not dead and not pending:
                forget(self.client, ars.values())
                return [results[r] for r in ranks]
            raise self._failure(fn_name, world_size, timeout, t0, ars, errors, dead, pending, marks)

    def ensure_engines(self) -> None:
        """Restart any engine that died since the last run (started clusters; joined: raise)."""
        with self._lock:
            self.pool.ensure_alive(list(range(self.n_engines)))

    def renew(self) -> None:
        """Replace every engine by a fresh one (nothing imported, no module state): case isolation."""
        if self.cluster is None:
            raise RuntimeError("a joined cluster cannot renew its engines; start one of your own")
        with self._lock:
            self.pool.restart(list(range(self.n_engines)))

    def stop(self) -> None:
        """Stop everything this object started (nothing of a joined cluster); idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        with contextlib.suppress(Exception):
            self.client.close(linger=0)
        if self.cluster is not None:
            # engines hold nothing worth a graceful exit (SIGTERM costs ~2 s each):
            # kill them, then let ipyparallel stop the controller and clean its files
            self.pool.kill_all()
            with contextlib.suppress(Exception):
                self.cluster.stop_cluster_sync()
        if self._watchdog is not None:
            finish_watchdog(self._watchdog)
        self._store = None
        if self._own_stack_dir:
            shutil.rmtree(self.pool.stack_dir, ignore_errors=True)

    def __enter__(self) -> RankCluster:
        """Context manager: the cluster itself."""
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Context manager exit: stop()."""
        self.stop()

    def __repr__(self) -> str:
        """Short description for notebooks and logs."""
        kind = "started" if self.cluster is not None else "joined"
        state = "stopped" if self._closed else f"{self.n_engines} engines"
        impl = f", implementation {self.implementation}" if self.implementation else ""
        return f"<RankCluster {kind}, {state}{impl}>"

    # ---------------------------------------------------------------- run internals

    def _store_port(self) -> int:
        """Port of the driver's TCPStore (created once; each run uses its own key prefix)."""
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore(self._store_host, 0, is_master=True, wait_for_workers=False)
        return self._store.port

    def _wait(
        self, ars: dict[int, Any], deadline: float
    ) -> tuple[dict[int, Any], dict[int, BaseException], dict[int, str], set[int]]:
        """Wait for all ranks, stopping early on the first failure (plus a short grace for peers)."""
        pending = set(ars)
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        dead: dict[int, str] = {}
        limit = deadline
        while pending:
            now = time.monotonic()
            if now >= limit:
                break
            concurrent.futures.wait(
                [ars[r] for r in pending],
                timeout=min(_POLL_S, limit - now),
                return_when=concurrent.futures.FIRST_EXCEPTION,
            )
            failed = False
            for r in sorted(pending):
                ar = ars[r]
                if ar.done():
                    pending.discard(r)
                    exc = ar.exception()
                    if exc is None:
                        results[r] = ar.get()
                    elif getattr(exc, "ename", type(exc).__name__) == "EngineError":
                        dead[r] = self.pool.exit_text(r)  # the nanny saw it die
                        failed = True
                    else:
                        errors[r] = exc
                        failed = True
                elif not self.pool.alive(r):
                    pending.discard(r)
                    dead[r] = self.pool.exit_text(r)
                    failed = True
            if failed and limit == deadline:
                limit = min(deadline, time.monotonic() + _PEER_GRACE_S)
        return results, errors, dead, pending

    def _failure(
        self,
        fn_name: str,
        world_size: int,
        timeout: float,
        t0: float,
        ars: dict[int, Any],
        errors: dict[int, BaseException],
        dead: dict[int, str],
        pending: set[int],
        marks: dict[int, int],
    ) -> RankFailure:
        """Collect stacks, recover the engines, and describe what went wrong on each rank."""
        elapsed = time.monotonic() - t0
        texts: dict[int, str] = {}
        headline: list[str] = []
        timed_out = bool(pending) and not errors and not dead
        for r, how in sorted(dead.items()):
            pid = self.pool.engines[r].pid
            headline.append(f"rank {r} (engine pid {pid}) died{how}")
            text = f"rank {r} (engine pid {pid}) died{how}"
            dump = self.pool.read_stack(r, marks.get(r, 0))
            if dump:
                text += f"\nfaulthandler output:\n{dump}"
            log = self.pool.log_tail(r)
            if log:
                text += f"\nengine log tail:\n{log}"
            texts[r] = text + task_output(ars[r])
        for r in sorted(errors, key=lambda r: (completed_at(ars[r]), r)):
            exc = errors[r]
            line = error_line(exc)
            headline.append(f"rank {r} raised {line}")
            texts[r] = f"rank {r} raised {line}\n{format_remote_error(exc)}{task_output(ars[r])}"
        stuck = sorted(pending)
        sites: dict[int, dict[str, Any]] = {}
        notes = self.pool.settle(ars, stuck, texts, elapsed=elapsed, timed_out=timed_out, dead=dead, sites=sites)
        if timed_out:
            headline.insert(0, f"timed out after {timeout:g} s with ranks {stuck} still running")
        elif stuck:
            headline.append(f"ranks {stuck} still running after a peer failed")
        summary = f"{fn_name} on {world_size} ranks failed after {elapsed:.1f} s: " + "; ".join(headline)
        if notes:
            summary += f" [{notes}]"
        raised = {r: error_parts(exc) for r, exc in errors.items()}
        return RankFailure(summary, texts, elapsed, raised=raised, dead=set(dead), timed_out=timed_out, sites=sites)

