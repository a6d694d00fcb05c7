"""Engine lifecycle of a RankCluster: launch one engine per rank, boot it, tell whether it is
alive, read its Python stack, interrupt, kill and restart it, and the watchdog that leaves no
process behind when the driver dies.

Engines are launched as ipyparallel engine sets ``rank<i>`` requesting engine id ``i``; each
leads its own process group, so killing it kills whatever it spawned. Every process a started
cluster owns carries ``HPKIT_OWNER=<token>`` in its environment, which is how the watchdog
(``_watchdog.py``, own session) finds them when the driver is gone.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.kit.runtime.diagnosis import RankFailure, exit_text, format_stack, read_site, site_text, tail, task_output
from tests.kit.runtime.rank_runtime import engine_boot
from tests.kit.runtime.zygote import exit_status_file

REPO_ROOT = Path(__file__).resolve().parents[3]
OWNER_ENV = "HPKIT_OWNER"  # token in the environment of every process a started cluster owns
_STACK_WAIT_S = 2.0  # how long to wait for faulthandler to write a signalled stack
_INTERRUPT_GRACE_S = 2.0  # after SIGINT, how long a stuck rank gets before it is killed


@dataclass
class Engine:
    """What the driver knows about the engine serving one rank."""

    rank: int
    eid: int
    pid: int
    host: str
    stack_path: str
    main_thread: int
    implementation: str = ""
    proc: psutil.Process | None = field(default=None, repr=False)  # None if not on this host
    node: str = ""  # the machine it reports for device binding (HPKIT_NODE, else its host name)


def process(pid: int) -> psutil.Process | None:
    """psutil handle of pid, or None if it is gone."""
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def proc_alive(proc: psutil.Process | None) -> bool:
    """True while the process exists and is not a zombie (unknown remote engines count as alive)."""
    if proc is None:
        return True
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def still_running(pids: Iterable[int], within: float) -> list[int]:
    """Of ``pids``, those still running (zombies count as gone) after waiting up to ``within``
    seconds for them to end: what a test that stops processes asserts is empty."""
    end = time.monotonic() + within
    left = list(pids)
    while left and time.monotonic() < end:
        left = [pid for pid in left if (proc := process(pid)) is not None and proc_alive(proc)]
        time.sleep(0.2)
    return left


def forget(client: Any, ars: Iterable[Any]) -> None:
    """Drop finished results from the client's caches (long sweeps must not grow memory)."""
    msg_ids = {mid for ar in ars if ar.done() for mid in ar.msg_ids}  # pending ones still need theirs
    for mid in msg_ids:
        client.results.pop(mid, None)
        client.metadata.pop(mid, None)
    with contextlib.suppress(Exception):
        client.history[:] = [m for m in client.history if m not in msg_ids]


class EnginePool:
    """The engines of one cluster, by rank: boot, liveness, stacks, signals, restarts."""

    def __init__(
        self,
        client: Any,
        cluster: Any | None,
        stack_dir: str,
        env: dict[str, str],
        startup_timeout: float,
        implementation: str | None,
        rank_env: Callable[[int], dict[str, str]] | None = None,
    ) -> None:
        """``cluster`` is the ipyparallel Cluster this driver started (None when joined);
        ``rank_env(rank)``: what one rank's engine starts with besides ``env`` (restarts too)."""
        self.client = client
        self.cluster = cluster
        self.stack_dir = stack_dir
        self.env = env
        self.rank_env = rank_env
        self.startup_timeout = startup_timeout
        self.implementation = implementation
        self.engines: dict[int, Engine] = {}
        self.views: dict[int, Any] = {}
        self.watchdog: subprocess.Popen | None = None  # told each engine's pid (started clusters)

    def env_of(self, rank: int) -> dict[str, str]:
        """The environment the engine of ``rank`` starts with."""
        return {**self.env, **(self.rank_env(rank) if self.rank_env else {})}

    # ---------------------------------------------------------------- boot
    def launch_and_boot(self, ranks: list[int], launched: bool = False) -> None:
        """Launch one engine per rank (unless launched already), wait for them, boot them."""
        deadline = time.monotonic() + self.startup_timeout
        if launched:
            pids = {r: engine_set_pid(self.cluster, r) for r in ranks}
        else:
            pids = {r: launch_engine(self.cluster, r, self.env_of(r), self.watchdog) for r in ranks}
        in_use = {eng.eid for r, eng in self.engines.items() if r not in ranks}
        mapping = self._await_engines(pids, in_use, deadline)
        self.boot(mapping, deadline=deadline)

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
                        pid = ar.get(timeout=min(2.0, _left(deadline)))
                    except Exception:  # a registration the hub has not dropped yet: ask again
                        continue
                    settled.add(eid)
                    if pid in by_pid:
                        mapping[by_pid[pid]] = eid
                forget(self.client, asked.values())
                continue
            for r, pid in pids.items():
                proc = process(pid)
                if r not in mapping and (proc is None or not proc_alive(proc)):
                    raise RuntimeError(f"engine for rank {r} (pid {pid}) exited during startup:\n" + self.log_tail(r))
            if time.monotonic() > deadline:
                missing = sorted(set(pids) - set(mapping))
                raise TimeoutError(f"engines for ranks {missing} did not register within {self.startup_timeout} s")
            time.sleep(0.05)
        return mapping

    def boot(self, mapping: dict[int, int], deadline: float | None = None) -> None:
        """Run ``engine_boot`` on each engine and record it as the engine of its rank."""
        if deadline is None:
            deadline = time.monotonic() + self.startup_timeout
        driver_pid = os.getpid() if self.cluster is not None else None
        ars = {
            r: self.client[eid].apply_async(
                engine_boot, r, str(REPO_ROOT), self.stack_dir, driver_pid, self.implementation
            )
            for r, eid in mapping.items()
        }
        here = socket.gethostname()
        for r, ar in ars.items():
            info = ar.get(timeout=_left(deadline))
            proc = None
            if info["host"] == here:
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(info["pid"])
            self.engines[r] = Engine(
                rank=r,
                eid=mapping[r],
                pid=info["pid"],
                host=info["host"],
                stack_path=info["stack_path"],
                main_thread=info["main_thread"],
                implementation=info["implementation"],
                proc=proc,
                node=info.get("node") or info["host"],
            )
            view = self.client[mapping[r]]
            view.block = False
            self.views[r] = view
        forget(self.client, ars.values())

    # ---------------------------------------------------------------- liveness, restarts
    def alive(self, rank: int) -> bool:
        """Whether the engine of ``rank`` is running (remote engines: assumed so)."""
        return proc_alive(self.engines[rank].proc)

    def ensure_alive(self, ranks: list[int]) -> None:
        """Restart engines that died between runs (started clusters), or fail clearly."""
        gone = [r for r in ranks if not self.alive(r)]
        if gone:
            note = self.restart(gone)
            if self.cluster is None:
                raise RankFailure(
                    f"engines of ranks {gone} are gone [{note}]",
                    {r: f"rank {r} (engine pid {self.engines[r].pid}) is gone" for r in gone},
                )

    def restart(self, ranks: list[int]) -> str:
        """Kill the engines of these ranks and start fresh ones with the same engine ids."""
        if self.cluster is None:
            return f"engines of ranks {ranks} are dead or stuck; this cluster was joined, so restart it yourself"
        for r in ranks:
            kill_engine(self.engines[r])
        for r in ranks:
            with contextlib.suppress(Exception):
                self.engines[r].proc.wait(timeout=5)
            with contextlib.suppress(Exception):
                self.cluster.stop_engines_sync(f"rank{r}")
        # the nanny of a dead engine unregisters it; wait so that its id can be reused
        end = time.monotonic() + 10
        old = {self.engines[r].eid for r in ranks}
        while old & set(self.client.ids) and time.monotonic() < end:
            time.sleep(0.05)
        self.launch_and_boot(ranks)
        return f"restarted engines of ranks {ranks}"

    def kill_all(self) -> None:
        """SIGKILL every local engine (they hold nothing worth a graceful exit)."""
        for eng in self.engines.values():
            kill_engine(eng)

    # ---------------------------------------------------------------- stacks & signals
    def stack_size(self, rank: int) -> int:
        """Current size of the engine's faulthandler file."""
        try:
            return os.path.getsize(self.engines[rank].stack_path)
        except OSError:
            return 0

    def read_stack(self, rank: int, start: int) -> str:
        """faulthandler text written since byte offset start."""
        try:
            with open(self.engines[rank].stack_path, errors="replace") as f:
                f.seek(start)
                return format_stack(f.read(), self.engines[rank].main_thread)
        except OSError:
            return ""

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every thread's Python stack of each rank's engine (SIGUSR1 -> faulthandler file)."""
        marks: dict[int, int] = {}
        for r in ranks:
            eng = self.engines[r]
            if eng.proc is None:
                continue
            marks[r] = self.stack_size(r)
            with contextlib.suppress(OSError):
                os.kill(eng.pid, signal.SIGUSR1)
        end = time.monotonic() + _STACK_WAIT_S
        sizes = dict(marks)
        stable_since = time.monotonic()
        while time.monotonic() < end:
            time.sleep(0.05)
            now_sizes = {r: self.stack_size(r) for r in marks}
            if now_sizes != sizes:
                sizes, stable_since = now_sizes, time.monotonic()
            elif all(sizes[r] > marks[r] for r in marks) and time.monotonic() - stable_since > 0.1:
                break
        return {r: self.read_stack(r, marks[r]) for r in marks}

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT the engines (KeyboardInterrupt in Python code; C calls ignore it)."""
        remote = []
        for r in ranks:
            eng = self.engines[r]
            if eng.proc is None:
                remote.append(eng.eid)
                continue
            with contextlib.suppress(OSError):
                os.kill(eng.pid, signal.SIGINT)
        if remote:
            with contextlib.suppress(Exception):
                self.client.send_signal(signal.SIGINT, targets=remote, block=False)

    def log_path(self, rank: int) -> str:
        """The launcher's log file of this rank's engine ('' for a joined cluster)."""
        if self.cluster is None:
            return ""
        return os.path.join(self.cluster.profile_dir, "log", f"ipengine-{self.cluster.cluster_id}-rank{rank}-0.log")

    def log_tail(self, rank: int) -> str:
        """Tail of the launcher's log file for this rank's engine (started clusters only)."""
        return tail(self.log_path(rank)) if self.cluster is not None else ""

    def exit_text(self, rank: int) -> str:
        """How the engine of a dead rank ended, ' (exit code N)' / ' (killed by SIGX)', or '' when
        unknown (a forked engine's zygote writes it beside the engine's log)."""
        eng = self.engines[rank]
        status_file = exit_status_file(self.log_path(rank), eng.pid) if self.cluster is not None else ""
        return exit_text(eng.proc, status_file)

    def settle(
        self,
        ars: dict[int, Any],
        stuck: list[int],
        texts: dict[int, str],
        *,
        elapsed: float | None = None,
        timed_out: bool = False,
        dead: Iterable[int] = (),
        sites: dict[int, dict[str, Any]] | None = None,
    ) -> str:
        """Dump stacks of stuck ranks, interrupt them, kill+restart what stays stuck or died; where a
        stuck rank's traced run was goes into ``sites`` (rank -> its published site) and its text."""
        restart = {r for r in ars if not self.alive(r)} | set(dead)
        if stuck:
            stacks = self.dump_stacks(stuck)
            for r in stuck:
                when = f" at {elapsed:.1f} s" if elapsed is not None else ""
                state = "timed out" if timed_out else "still running"
                stack = stacks.get(r) or "(no stack)"
                site = read_site(self.engines[r].stack_path, since=time.time() - (elapsed or 0.0))
                if site is not None and sites is not None:
                    sites[r] = site
                at = f" in its traced run at {site_text(site)}" if site else ""
                texts[r] = f"rank {r} {state}{at}; Python stack{when}:\n{stack}{task_output(ars[r])}"
            self.interrupt(stuck)
            end = time.monotonic() + _INTERRUPT_GRACE_S
            left = [r for r in stuck if not ars[r].done()]
            while left and time.monotonic() < end:
                concurrent.futures.wait([ars[r] for r in left], timeout=0.1)
                left = [r for r in left if not ars[r].done()]
            restart |= set(left)
            for r in stuck:
                if r not in left:
                    texts[r] += "\n(interrupted with SIGINT; engine kept)"
        restart |= {r for r in ars if not self.alive(r)}
        forget(self.client, ars.values())
        if not restart:
            return ""
        ranks = sorted(restart)
        for r in ranks:
            if r in stuck and r in texts:
                texts[r] += "\n(did not answer SIGINT: engine killed and restarted)"
        return self.restart(ranks)


def _left(deadline: float) -> float:
    """Seconds to deadline (at least a little)."""
    return max(0.1, deadline - time.monotonic())


def launch_engine(cluster: Any, rank: int, env: dict[str, str], watchdog: subprocess.Popen | None = None) -> int:
    """Start the engine of one rank as engine set 'rank<i>' requesting engine id i; its pid (named
    to the cluster's ``watchdog``: a forked engine's environment does not show its owner)."""
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
    pid = engine_set_pid(cluster, rank)
    if watchdog is not None and pid > 0:
        with contextlib.suppress(OSError, ValueError):
            watchdog.stdin.write(f"pid {pid}\n")
            watchdog.stdin.flush()
    return pid


def engine_set_pid(cluster: Any, rank: int) -> int:
    """Pid of the engine in engine set 'rank<i>' (-1 if none)."""
    engine_set = cluster.engines.get(f"rank{rank}")
    if engine_set is None or not engine_set.launchers:
        return -1
    return next(iter(engine_set.launchers.values())).pid


def kill_engine(eng: Engine) -> None:
    """SIGKILL a local engine and its process group (it leads one: launched in a new session)."""
    proc = eng.proc
    if proc is None or not proc.is_running():  # gone (its pid may belong to someone else now)
        return
    with contextlib.suppress(OSError):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()


def start_watchdog(token: str, leftovers: list[str]) -> subprocess.Popen:
    """The watchdog process: SIGKILLs the cluster's processes and removes ``leftovers`` when the
    driver dies or says ``stop``."""
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_watchdog.py")), str(os.getpid()), token] + leftovers,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )


def finish_watchdog(watchdog: subprocess.Popen) -> None:
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
