"""A warm ipyparallel cluster whose engine i is torch.distributed rank i.

One ``RankCluster`` serves many runs (pytest cases now, notebooks later)::

    cluster = RankCluster.start(4)              # controller + 4 engines, torch imported once
    out = cluster.run(_ranks_cluster.allreduce_sum, 2)   # on ranks 0, 1; out[i] from rank i
    cluster.view(1)                             # DirectView on rank 1 (pull, apply, execute)
    cluster.view().activate()                   # then %%px --targets 1 in a notebook
    cluster.stop()                              # or `with RankCluster.start(4) as cluster:`

``RankCluster.join(cluster_id, profile)`` attaches to a cluster someone else started
(its engines, sorted by id, are ranks 0..n-1) and never stops it.

A run: the rank function is sent by reference (module + qualname, imported on the
engine: keep rank functions in importable modules such as ``tests.engine._ranks_*``);
a function of ``__main__`` (a notebook cell) is shipped by value instead. Each run
builds a fresh process group on engines ``0..world_size-1`` from a rendezvous that
cannot collide (one TCPStore on a free port opened by this driver, with a key prefix
unique to the run), sets ``torch.set_num_threads(max(1, cores // world_size))`` and
``torch.manual_seed(0)``, calls the function and always destroys the group. Backend:
nccl when the engine sees a GPU per rank, else gloo (or ``backend=``). Engines run in
the repo root with it on ``sys.path``. ``HPKIT_STORE_HOST`` (default 127.0.0.1) is the
address engines use to reach the driver's TCPStore.

Every wait is bounded: an error on one rank, a timeout, or a dead engine ends in
``RankFailure`` naming each failing rank with its remote traceback, its Python stack
(faulthandler on SIGUSR1) or its death; ranks still running are interrupted (SIGINT)
and, when that does not free them, killed and restarted with the same engine id, so
the next run works.

Engine namespace after a run (``cluster.view(rank).pull(name)`` or ``%%px``):

- ``_rank``: this engine's rank.
- ``_last_run``: dict describing the last run (function, rank, world size, backend).
- ``_last_result``: what the rank function returned (absent if it raised).
- ``_last_error``: the exception it raised, with ``__traceback__`` (None on success);
  ipyparallel re-raises exceptions it transfers, so look at it with ``%%px`` or pull
  ``_last_traceback`` (the formatted traceback text) instead.
- anything the rank function passed to :func:`keep`.

Leftovers: ``stop()``, interpreter exit (atexit) and a driver killed outright all
leave no process behind. Engines poll their parent (the driver) and kill their own
process group when it is gone; a watchdog process (``_watchdog.py``, own session)
SIGKILLs every process carrying the cluster's ``HPKIT_OWNER`` token when the driver
dies, removes the cluster's connection, log and stack files, and does the same sweep
on ``stop()``.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import importlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil

REPO_ROOT = Path(__file__).resolve().parents[2]
OWNER_ENV = "HPKIT_OWNER"  # token in the environment of every process a started cluster owns
STORE_HOST_ENV = "HPKIT_STORE_HOST"  # address engines use to reach the driver's TCPStore

_POLL_S = 0.25  # how often a run checks engine liveness while it waits
_PEER_GRACE_S = 3.0  # after one rank fails, how long its peers get to finish or fail too
_INTERRUPT_GRACE_S = 2.0  # after SIGINT, how long a stuck rank gets before it is killed
_STACK_WAIT_S = 2.0  # how long to wait for faulthandler to write a signalled stack
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _ipp() -> Any:
    """Import ipyparallel with IPP_NONINTERACTIVE=1 (no progress widgets, no streaming)."""
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    import ipyparallel

    return ipyparallel


class RankFailure(AssertionError):
    """A distributed run failed: message names each failing rank with its traceback or Python stack."""

    failures: dict[int, str]  # rank -> traceback, Python stack or death notice
    elapsed_s: float | None  # seconds from the start of the run until the failure was seen

    def __init__(self, summary: str, failures: dict[int, str], elapsed_s: float | None = None) -> None:
        """Build the message from a one-line summary and rank -> text."""
        self.summary = summary
        self.failures = dict(sorted(failures.items()))
        self.elapsed_s = elapsed_s
        parts = [summary]
        for rank, text in self.failures.items():
            parts.append(f"\n===== rank {rank} =====\n{text.rstrip()}")
        super().__init__("\n".join(parts))

    def __reduce__(self) -> tuple:
        """Pickle support (pytest-xdist, ipyparallel) despite the two-argument constructor."""
        return (type(self), (self.summary, self.failures, self.elapsed_s))


# --------------------------------------------------------------------------------------
# engine side: these functions run inside the engines (shipped by ipyparallel as code,
# with this module imported on the engine for their globals)
# --------------------------------------------------------------------------------------

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


def _watch_parent(driver_pid: int) -> None:
    """Engine thread: kill this engine's process group once the driver (our parent) is gone."""
    while os.getppid() == driver_pid:
        time.sleep(0.5)
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _engine_boot(rank: int, repo_root: str, stack_dir: str, driver_pid: int | None) -> dict:
    """Prepare an engine once: repo on sys.path, stack dumps on SIGUSR1, watchdog, torch."""
    import faulthandler

    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)
    os.chdir(repo_root)
    path = _ENGINE_STATE.get("stack_path")
    if not path or not os.path.exists(path):  # a second driver joining keeps the first's file
        os.makedirs(stack_dir, exist_ok=True)
        path = os.path.join(stack_dir, f"engine-{os.getpid()}.txt")
        stack_file = open(path, "a", buffering=1)  # stays open: faulthandler writes to its fd
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
        faulthandler.enable(file=stack_file, all_threads=True)  # segfaults land here too
        _ENGINE_STATE.update(stack_path=path, stack_file=stack_file)
    if driver_pid and os.getppid() == driver_pid and not _ENGINE_STATE.get("watchdog"):
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
        "stack_path": path,
        "main_thread": threading.main_thread().ident,
    }


def _resolve_fn(ref: tuple[str, str]) -> Callable:
    """Import module.qualname on the engine."""
    module, qualname = ref
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _rank_entry(rank: int, spec: dict, fn_obj: Callable | None, args: tuple, kwargs: dict) -> Any:
    """Engine side of run(): join a fresh process group, call fn, always destroy the group."""
    import torch
    import torch.distributed as dist

    ns = _user_ns()
    world_size = spec["world_size"]
    fn = fn_obj if fn_obj is not None else _resolve_fn(spec["fn_ref"])
    ns.pop("_last_result", None)
    ns["_last_error"] = ns["_last_traceback"] = None
    ns["_rank"] = rank
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    # nccl needs a GPU per rank (one GPU shared by two ranks is an nccl error): else gloo
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    backend = spec["backend"] or ("nccl" if use_nccl else "gloo")
    ns["_last_run"] = {
        "fn": spec["fn_name"],
        "rank": rank,
        "world_size": world_size,
        "backend": backend,
        "run": spec["prefix"],
    }
    if dist.is_initialized():  # left over from an interrupted run
        dist.destroy_process_group()
    timeout = timedelta(seconds=spec["timeout"])
    try:
        if backend == "nccl" and torch.cuda.device_count():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore(spec["host"], spec["port"], is_master=False, timeout=timeout)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(spec["prefix"], store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        torch.manual_seed(0)
        result = fn(*args, **kwargs)
    except BaseException as exc:
        ns["_last_error"] = exc
        ns["_last_traceback"] = traceback.format_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    ns["_last_result"] = result
    return result


# --------------------------------------------------------------------------------------
# driver side
# --------------------------------------------------------------------------------------


@dataclass
class _Engine:
    """What the driver knows about the engine serving one rank."""

    rank: int
    eid: int
    pid: int
    host: str
    stack_path: str
    main_thread: int
    proc: psutil.Process | None = field(default=None, repr=False)  # None if not on this host


def _fn_reference(fn: Callable) -> tuple[tuple[str, str] | None, Callable | None, str]:
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


def _format_remote_error(exc: BaseException) -> str:
    """Traceback text of an ipyparallel RemoteError (ANSI colours removed)."""
    tb = getattr(exc, "traceback", None)
    if tb:
        text = tb if isinstance(tb, str) else "\n".join(tb)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return _ANSI.sub("", text)


def _error_line(exc: BaseException) -> str:
    """'EName: evalue' of a remote (or local) exception."""
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None)
    if evalue is None:
        evalue = str(exc)
    first = str(evalue).strip().splitlines()
    return f"{ename}: {first[0] if first else ''}"


_IDLE_FRAME = re.compile(
    r'File "[^"]*(?:/threading\.py|/selectors\.py|/queue\.py'
    r'|/(?:asyncio|concurrent|tornado|zmq|ipykernel|ipyparallel)/[^"]*)"|in _watch_parent$'
)


def _format_stack(raw: str, main_thread: int | None) -> str:
    """faulthandler dump made readable: main thread first and cut at the rank entry, idle threads dropped."""
    lines = [line for line in raw.strip().splitlines() if not line.startswith("Extension modules:")]
    if not lines:
        return ""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", "\n".join(lines))
    tag = f"0x{main_thread:016x}" if main_thread else None
    preface, main, others, idle = [], [], [], 0
    for block in blocks:
        header, _, body = block.strip().partition("\n")
        if not header.startswith(("Thread 0x", "Current thread 0x")):
            preface.append(block.strip())  # e.g. "Fatal Python error: Segmentation fault"
        elif tag and tag in header:
            frames = body.splitlines()
            cut = [i for i, f in enumerate(frames) if f.endswith(" in _rank_entry")]
            if cut:  # frames below the rank entry are ipyparallel's request dispatch
                frames = frames[: cut[0] + 1] + ["  ... (ipyparallel engine frames)"]
            header = header.replace("(most recent call first)", "(main thread, most recent call first)")
            main.append("\n".join([header, *frames]))
        elif body and all(_IDLE_FRAME.search(f) for f in body.splitlines() if f.strip()):
            idle += 1
        else:
            others.append(block.strip())
    text = "\n\n".join(preface + main + others)
    if idle:
        text += f"\n\n({idle} idle ipyparallel/zmq/asyncio threads not shown)"
    return text


def _completed(ar: Any) -> float:
    """Engine-side completion time of a finished task (inf if unknown): first failure first."""
    with contextlib.suppress(Exception):
        stamp = ar.metadata["completed"]
        if isinstance(stamp, list):
            stamp = stamp[0]
        return stamp.timestamp()
    return float("inf")


def _tail(path: str, lines: int = 12) -> str:
    """Last lines of a text file ('' if missing)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _exit_text(proc: psutil.Process | None) -> str:
    """' (exit code N)' / ' (killed by SIGX)' for a dead child, '' when unknown."""
    if proc is None:
        return ""
    try:
        code = proc.wait(timeout=0)
    except (psutil.Error, ChildProcessError, OSError):
        return ""
    if code is None:
        return ""
    if code < 0:
        try:
            return f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f" (killed by signal {-code})"
    return f" (exit code {code})"


def _process(pid: int) -> psutil.Process | None:
    """psutil handle of pid, or None if it is gone."""
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _proc_alive(proc: psutil.Process | None) -> bool:
    """True while the process exists and is not a zombie (unknown remote engines count as alive)."""
    if proc is None:
        return True
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class RankCluster:
    """A warm ipyparallel cluster whose engine i is torch.distributed rank i."""

    def __init__(
        self,
        client: Any,
        *,
        cluster: Any | None,
        token: str | None,
        watchdog: subprocess.Popen | None,
        startup_timeout: float,
        stack_dir: str | None = None,
    ) -> None:
        """Internal: use RankCluster.start() or RankCluster.join()."""
        self.client = client  # the ipyparallel Client
        self.cluster = cluster  # the ipyparallel Cluster this object started (None if joined)
        self.token = token  # value of HPKIT_OWNER in every owned process (None if joined)
        self.startup_timeout = startup_timeout
        self._watchdog = watchdog
        self._engines: dict[int, _Engine] = {}
        self._views: dict[int, Any] = {}
        # faulthandler files: per started cluster (removed by stop and by the watchdog), or
        # a shared directory for joined engines (their files outlive this driver)
        self._stack_dir = stack_dir or os.path.join(tempfile.gettempdir(), "hpkit-stacks")
        self._own_stack_dir = stack_dir is not None
        self._store: Any = None
        self._store_host = os.environ.get(STORE_HOST_ENV, "127.0.0.1")
        self._lock = threading.RLock()
        self._run_seq = 0
        self._closed = False
        self._env: dict[str, str] = {}
        self.leftover_globs: list[str] = []  # files of a started cluster the watchdog removes
        self.last_run_s: float | None = None  # wall time of the last run(), for overhead checks
        atexit.register(self.stop)

    # ---------------------------------------------------------------- construction

    @classmethod
    def start(cls, n_engines: int, *, profile: str | None = None, startup_timeout: float = 60) -> RankCluster:
        """Start a controller and n_engines local engines (engine i = rank i); bounded by startup_timeout."""
        if n_engines < 1:
            raise ValueError(f"n_engines must be >= 1, got {n_engines}")
        ipp = _ipp()
        token = f"{os.getpid()}-{secrets.token_hex(6)}"
        cluster_kwargs: dict[str, Any] = {
            "cluster_id": f"hpkit-{token}",
            "n": n_engines,
            "engines": "local",
            "controller": "local",
            "log_level": 40,  # we report dead engines ourselves; ipyparallel would dump their logs
            # registration waits for a heartbeat: 0.5 s instead of 3 s makes startup ~4 s
            # faster; a dead engine is reported by its nanny at once, so allow 30 s of misses
            "controller_args": [
                "--HeartMonitor.period=500",
                "--HeartMonitor.max_heartmonitor_misses=60",
            ],
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
        watchdog = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("_watchdog.py")), str(os.getpid()), token] + leftovers,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        rc = None
        try:
            env = {
                OWNER_ENV: token,
                "IPP_NONINTERACTIVE": "1",
                "PYTHONUNBUFFERED": "1",
            }
            if sys.platform.startswith("linux"):
                env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")  # local ranks
            cluster.start_controller_sync(environment=dict(env))
            for r in range(n_engines):  # launch first: engines start while the client connects
                _launch_engine(cluster, r, env)
            client = cluster.connect_client_sync()
            rc = cls(
                client,
                cluster=cluster,
                token=token,
                watchdog=watchdog,
                startup_timeout=startup_timeout,
                stack_dir=stack_dir,
            )
            rc._env = env
            rc.leftover_globs = leftovers
            rc._launch_and_boot(list(range(n_engines)), launched=True)
        except BaseException:
            if rc is not None:
                rc.stop()
            else:
                with contextlib.suppress(Exception):
                    cluster.stop_cluster_sync()
                _finish_watchdog(watchdog)
                shutil.rmtree(stack_dir, ignore_errors=True)
            raise
        return rc

    @classmethod
    def join(cls, cluster_id: str = "", profile: str | None = None) -> RankCluster:
        """Attach to a running ipyparallel cluster (its engines, sorted by id, are ranks 0..n-1); never stops it."""
        ipp = _ipp()
        kwargs: dict[str, Any] = {"cluster_id": cluster_id}
        if profile is not None:
            kwargs["profile"] = profile
        client = ipp.Client(**kwargs)
        rc = cls(client, cluster=None, token=None, watchdog=None, startup_timeout=60)
        try:
            eids = sorted(client.ids)
            if not eids:
                raise RuntimeError(f"cluster {cluster_id!r} (profile {profile!r}) has no engines")
            root = str(REPO_ROOT)
            setup = (
                f"__import__('sys').path.insert(0, {root!r}) "
                f"if {root!r} not in __import__('sys').path else None; "
                f"__import__('os').chdir({root!r})"
            )
            client[eids].execute(setup, block=True)
            rc._boot({rank: eid for rank, eid in enumerate(eids)})
        except BaseException:
            rc.stop()
            raise
        return rc

    # ---------------------------------------------------------------- public API

    @property
    def n_engines(self) -> int:
        """Number of engines, i.e. the largest world_size a run can use."""
        return len(self._engines)

    @property
    def pids(self) -> list[int]:
        """Engine pid of each rank (index = rank)."""
        return [self._engines[r].pid for r in range(self.n_engines)]

    @property
    def controller_pid(self) -> int | None:
        """Pid of the controller this object started (None if joined)."""
        if self.cluster is None or self.cluster.controller is None:
            return None
        return self.cluster.controller.pid

    def view(self, ranks: int | Iterable[int] | None = None) -> Any:
        """An ipyparallel DirectView on the engines of those ranks (all by default), for inspection."""
        if ranks is None:
            ranks = range(self.n_engines)
        if isinstance(ranks, int):
            return self.client[self._engines[ranks].eid]
        return self.client[[self._engines[r].eid for r in ranks]]

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
            self._ensure_alive(ranks)
            fn_ref, fn_obj, fn_name = _fn_reference(fn)
            self._run_seq += 1
            spec = {
                "fn_ref": fn_ref,
                "fn_name": fn_name,
                "world_size": world_size,
                "host": self._store_host,
                "port": self._store_port(),
                "prefix": f"hpkit/{os.getpid()}/{id(self):x}/{self._run_seq}",
                "backend": backend,
                "timeout": float(timeout),
            }
            marks = {r: self._stack_size(r) for r in ranks}
            deadline = t0 + timeout
            ars = {r: self._views[r].apply_async(_rank_entry, r, spec, fn_obj, args, kwargs) for r in ranks}
            try:
                outcome = self._wait(ars, deadline)
            except BaseException:  # Ctrl-C, pytest-timeout: never leave ranks running
                pending = [r for r in ranks if not ars[r].done()]
                self._settle(ars, pending, {})
                raise
            results, errors, dead, pending = outcome
            if not errors and not dead and not pending:
                self._forget(ars.values())
                self.last_run_s = time.monotonic() - t0
                return [results[r] for r in ranks]
            raise self._failure(fn_name, world_size, timeout, t0, ars, errors, dead, pending, marks)

    def ensure_engines(self) -> None:
        """Restart any engine that died since the last run (started clusters; joined: raise)."""
        with self._lock:
            self._ensure_alive(list(range(self.n_engines)))

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
            for eng in self._engines.values():
                _kill_engine(eng)
            with contextlib.suppress(Exception):
                self.cluster.stop_cluster_sync()
        if self._watchdog is not None:
            _finish_watchdog(self._watchdog)
        self._store = None
        if self._own_stack_dir:
            shutil.rmtree(self._stack_dir, ignore_errors=True)

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
        return f"<RankCluster {kind}, {state}>"

    # ---------------------------------------------------------------- run internals

    def _store_port(self) -> int:
        """Port of the driver's TCPStore (created once; each run uses its own key prefix)."""
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore(
                self._store_host,
                0,
                is_master=True,
                wait_for_workers=False,
            )
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
                        dead[r] = _exit_text(self._engines[r].proc)  # the nanny saw it die
                        failed = True
                    else:
                        errors[r] = exc
                        failed = True
                elif not _proc_alive(self._engines[r].proc):
                    pending.discard(r)
                    dead[r] = _exit_text(self._engines[r].proc)
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
            eng = self._engines[r]
            headline.append(f"rank {r} (engine pid {eng.pid}) died{how}")
            text = f"rank {r} (engine pid {eng.pid}) died{how}"
            dump = self._read_stack(r, marks.get(r, 0))
            if dump:
                text += f"\nfaulthandler output:\n{dump}"
            log = self._engine_log_tail(r)
            if log:
                text += f"\nengine log tail:\n{log}"
            texts[r] = text + self._output(ars[r])
        for r in sorted(errors, key=lambda r: (_completed(ars[r]), r)):
            exc = errors[r]
            line = _error_line(exc)
            headline.append(f"rank {r} raised {line}")
            texts[r] = f"rank {r} raised {line}\n{_format_remote_error(exc)}{self._output(ars[r])}"
        stuck = sorted(pending)
        notes = self._settle(ars, stuck, texts, elapsed=elapsed, timed_out=timed_out, dead=dead)
        if timed_out:
            headline.insert(0, f"timed out after {timeout:g} s with ranks {stuck} still running")
        elif stuck:
            headline.append(f"ranks {stuck} still running after a peer failed")
        summary = f"{fn_name} on {world_size} ranks failed after {elapsed:.1f} s: " + "; ".join(headline)
        if notes:
            summary += f" [{notes}]"
        return RankFailure(summary, texts, elapsed)

    def _settle(
        self,
        ars: dict[int, Any],
        stuck: list[int],
        texts: dict[int, str],
        *,
        elapsed: float | None = None,
        timed_out: bool = False,
        dead: Iterable[int] = (),
    ) -> str:
        """Dump stacks of stuck ranks, interrupt them, kill+restart what stays stuck or died."""
        restart = {r for r in ars if not _proc_alive(self._engines[r].proc)} | set(dead)
        if stuck:
            stacks = self._dump_stacks(stuck)
            for r in stuck:
                when = f" at {elapsed:.1f} s" if elapsed is not None else ""
                state = "timed out" if timed_out else "still running"
                texts[r] = (
                    f"rank {r} {state}; Python stack{when}:\n{stacks.get(r) or '(no stack)'}{self._output(ars[r])}"
                )
            self._interrupt(stuck)
            end = time.monotonic() + _INTERRUPT_GRACE_S
            left = [r for r in stuck if not ars[r].done()]
            while left and time.monotonic() < end:
                concurrent.futures.wait([ars[r] for r in left], timeout=0.1)
                left = [r for r in left if not ars[r].done()]
            restart |= set(left)
            for r in stuck:
                if r not in left:
                    texts[r] += "\n(interrupted with SIGINT; engine kept)"
        restart |= {r for r in ars if not _proc_alive(self._engines[r].proc)}
        self._forget(ars.values())
        if not restart:
            return ""
        ranks = sorted(restart)
        for r in ranks:
            if r in stuck and r in texts:
                texts[r] += "\n(did not answer SIGINT: engine killed and restarted)"
        note = self._restart(ranks)
        return note

    def _output(self, ar: Any) -> str:
        """Captured stdout/stderr of one rank's task (tail), if any."""
        out = []
        for name in ("stdout", "stderr"):
            with contextlib.suppress(Exception):
                text = getattr(ar, name)
                if isinstance(text, list):
                    text = text[0] if text else ""
                if text:
                    out.append(f"\n[{name}]\n" + _ANSI.sub("", text[-4000:]))
        return "".join(out)

    def _forget(self, ars: Iterable[Any]) -> None:
        """Drop finished results from the client's caches (long sweeps must not grow memory)."""
        msg_ids = {mid for ar in ars if ar.done() for mid in ar.msg_ids}  # pending ones still need theirs
        for mid in msg_ids:
            self.client.results.pop(mid, None)
            self.client.metadata.pop(mid, None)
        with contextlib.suppress(Exception):
            self.client.history[:] = [m for m in self.client.history if m not in msg_ids]

    # ---------------------------------------------------------------- stacks & signals

    def _stack_size(self, rank: int) -> int:
        """Current size of the engine's faulthandler file."""
        try:
            return os.path.getsize(self._engines[rank].stack_path)
        except OSError:
            return 0

    def _read_stack(self, rank: int, start: int) -> str:
        """faulthandler text written since byte offset start."""
        try:
            with open(self._engines[rank].stack_path, errors="replace") as f:
                f.seek(start)
                return _format_stack(f.read(), self._engines[rank].main_thread)
        except OSError:
            return ""

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every thread's Python stack of each rank's engine (SIGUSR1 -> faulthandler file)."""
        marks: dict[int, int] = {}
        for r in ranks:
            eng = self._engines[r]
            if eng.proc is None:
                continue
            marks[r] = self._stack_size(r)
            with contextlib.suppress(OSError):
                os.kill(eng.pid, signal.SIGUSR1)
        end = time.monotonic() + _STACK_WAIT_S
        sizes = dict(marks)
        stable_since = time.monotonic()
        while time.monotonic() < end:
            time.sleep(0.05)
            now_sizes = {r: self._stack_size(r) for r in marks}
            if now_sizes != sizes:
                sizes, stable_since = now_sizes, time.monotonic()
            elif all(sizes[r] > marks[r] for r in marks) and time.monotonic() - stable_since > 0.1:
                break
        return {r: self._read_stack(r, marks[r]) for r in marks}

    def _interrupt(self, ranks: list[int]) -> None:
        """SIGINT the engines (KeyboardInterrupt in Python code; C calls ignore it)."""
        remote = []
        for r in ranks:
            eng = self._engines[r]
            if eng.proc is None:
                remote.append(eng.eid)
                continue
            with contextlib.suppress(OSError):
                os.kill(eng.pid, signal.SIGINT)
        if remote:
            with contextlib.suppress(Exception):
                self.client.send_signal(signal.SIGINT, targets=remote, block=False)

    def _engine_log_tail(self, rank: int) -> str:
        """Tail of the launcher's log file for this rank's engine (started clusters only)."""
        if self.cluster is None:
            return ""
        path = os.path.join(
            self.cluster.profile_dir,
            "log",
            f"ipengine-{self.cluster.cluster_id}-rank{rank}-0.log",
        )
        return _tail(path)

    # ---------------------------------------------------------------- engines

    def _ensure_alive(self, ranks: list[int]) -> None:
        """Restart engines that died between runs (started clusters), or fail clearly."""
        gone = [r for r in ranks if not _proc_alive(self._engines[r].proc)]
        if gone:
            note = self._restart(gone)
            if self.cluster is None:
                raise RankFailure(
                    f"engines of ranks {gone} are gone [{note}]",
                    {r: f"rank {r} (engine pid {self._engines[r].pid}) is gone" for r in gone},
                )

    def _launch_and_boot(self, ranks: list[int], launched: bool = False) -> None:
        """Launch one engine per rank (unless launched already), wait for them, boot them."""
        deadline = time.monotonic() + self.startup_timeout
        if launched:
            pids = {r: _engine_set_pid(self.cluster, r) for r in ranks}
        else:
            pids = {r: _launch_engine(self.cluster, r, self._env) for r in ranks}
        in_use = {eng.eid for r, eng in self._engines.items() if r not in ranks}
        mapping = self._await_engines(pids, in_use, deadline)
        self._boot(mapping, deadline=deadline)

    def _await_engines(self, pids: dict[int, int], in_use: set[int], deadline: float) -> dict[int, int]:
        """Wait until the engine with each pid registered; rank -> engine id (matched by pid).

        Engines request id == rank and normally get it; matching by pid stays right when
        they do not (e.g. the hub still holds the id of an engine that just died).
        """
        by_pid = {pid: r for r, pid in pids.items()}
        mapping: dict[int, int] = {}
        settled = set(in_use)  # ids known to belong to other ranks or already matched
        while len(mapping) < len(pids):
            fresh = [eid for eid in self.client.ids if eid not in settled]
            if fresh:
                asked = {eid: self.client[eid].apply_async(os.getpid) for eid in fresh}
                for eid, ar in asked.items():
                    try:
                        pid = ar.get(timeout=min(2.0, self._left(deadline)))
                    except Exception:  # a registration the hub has not dropped yet: ask again
                        continue
                    settled.add(eid)
                    if pid in by_pid:
                        mapping[by_pid[pid]] = eid
                self._forget(asked.values())
                continue
            for r, pid in pids.items():
                proc = _process(pid)
                if r not in mapping and (proc is None or not _proc_alive(proc)):
                    raise RuntimeError(
                        f"engine for rank {r} (pid {pid}) exited during startup:\n" + self._engine_log_tail(r)
                    )
            if time.monotonic() > deadline:
                missing = sorted(set(pids) - set(mapping))
                raise TimeoutError(f"engines for ranks {missing} did not register within {self.startup_timeout} s")
            time.sleep(0.05)
        return mapping

    def _left(self, deadline: float) -> float:
        """Seconds to deadline (at least a little)."""
        return max(0.1, deadline - time.monotonic())

    def _boot(self, mapping: dict[int, int], deadline: float | None = None) -> None:
        """Run _engine_boot on each engine and record it as the engine of its rank."""
        if deadline is None:
            deadline = time.monotonic() + self.startup_timeout
        driver_pid = os.getpid() if self.cluster is not None else None
        ars = {
            r: self.client[eid].apply_async(_engine_boot, r, str(REPO_ROOT), self._stack_dir, driver_pid)
            for r, eid in mapping.items()
        }
        here = socket.gethostname()
        for r, ar in ars.items():
            info = ar.get(timeout=self._left(deadline))
            proc = None
            if info["host"] == here:
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(info["pid"])
            self._engines[r] = _Engine(
                rank=r,
                eid=mapping[r],
                pid=info["pid"],
                host=info["host"],
                stack_path=info["stack_path"],
                main_thread=info["main_thread"],
                proc=proc,
            )
            view = self.client[mapping[r]]
            view.block = False
            self._views[r] = view
        self._forget(ars.values())

    def _restart(self, ranks: list[int]) -> str:
        """Kill the engines of these ranks and start fresh ones with the same engine ids."""
        if self.cluster is None:
            return f"engines of ranks {ranks} are dead or stuck; this cluster was joined, so restart it yourself"
        for r in ranks:
            _kill_engine(self._engines[r])
        for r in ranks:
            with contextlib.suppress(Exception):
                self._engines[r].proc.wait(timeout=5)
            with contextlib.suppress(Exception):
                self.cluster.stop_engines_sync(f"rank{r}")
        # the nanny of a dead engine unregisters it; wait so that its id can be reused
        end = time.monotonic() + 10
        old = {self._engines[r].eid for r in ranks}
        while old & set(self.client.ids) and time.monotonic() < end:
            time.sleep(0.05)
        self._launch_and_boot(ranks)
        return f"restarted engines of ranks {ranks}"


def _launch_engine(cluster: Any, rank: int, env: dict[str, str]) -> int:
    """Start the engine of one rank as engine set 'rank<i>' requesting engine id i; its pid."""
    cluster.start_engines_sync(
        1,
        engine_set_id=f"rank{rank}",
        environment=dict(env),
        engine_args=[
            f"--IPEngine.id={rank}",
            f"--work-dir={REPO_ROOT}",
            # import torch while the engine registers, not when the first run comes
            "--IPEngine.startup_command=__import__('torch.distributed')",
        ],
    )
    return _engine_set_pid(cluster, rank)


def _engine_set_pid(cluster: Any, rank: int) -> int:
    """Pid of the engine in engine set 'rank<i>' (-1 if none)."""
    engine_set = cluster.engines.get(f"rank{rank}")
    if engine_set is None or not engine_set.launchers:
        return -1
    return next(iter(engine_set.launchers.values())).pid


def _kill_engine(eng: _Engine) -> None:
    """SIGKILL a local engine and its process group (it leads one: launched in a new session)."""
    proc = eng.proc
    if proc is None or not proc.is_running():  # gone (its pid may belong to someone else now)
        return
    with contextlib.suppress(OSError):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()


def _finish_watchdog(watchdog: subprocess.Popen) -> None:
    """Ask the watchdog to sweep leftovers and exit; kill it if it does not."""
    with contextlib.suppress(Exception):
        watchdog.stdin.write("stop\n")
        watchdog.stdin.flush()
    with contextlib.suppress(Exception):
        watchdog.stdin.close()
    try:
        watchdog.wait(timeout=15)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait(timeout=5)
