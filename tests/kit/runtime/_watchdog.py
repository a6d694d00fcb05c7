"""Watchdog process of a RankCluster: kills the cluster's processes when its driver dies.

Run as a script (never imported by engines):
``python _watchdog.py DRIVER_PID TOKEN [GLOB ...]``.
It is started in its own session, so signals aimed at the driver's process group do
not reach it. Every process the cluster starts (controller and its helpers, engines,
nannies, and whatever a rank function spawns) carries ``HPKIT_OWNER=TOKEN`` in its
environment, but an engine forked from a warm zygote (``engine_fork.py``) shows its zygote's
start environment there: the driver names each one on a ``pid PID`` line. On driver death
(stdin EOF or the pid gone) or on a ``stop`` line from the driver, the watchdog SIGKILLs every
process carrying that token and every named one still running, removes the files matching the
GLOBs (the cluster's connection, log and stack files) and exits.
Only psutil and the standard library are imported, so it starts in well under a second.
"""

from __future__ import annotations

import contextlib
import glob
import os
import select
import shutil
import signal
import sys
import time
from collections.abc import Iterable

import psutil

OWNER_ENV = "HPKIT_OWNER"


def owned_processes(token: str, named: Iterable[psutil.Process] = ()) -> list[psutil.Process]:
    """Processes of this user whose environment carries OWNER_ENV=token (never this one), and
    those of ``named`` still running (the same process: psutil checks its start time)."""
    found = [proc for proc in named if _running(proc)]
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(OWNER_ENV) == token and proc not in found:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def sweep(token: str, rounds: int = 5, named: Iterable[psutil.Process] = ()) -> int:
    """SIGKILL every owned process until none is left (bounded); return how many were killed."""
    killed = 0
    named = list(named)
    for _ in range(rounds):
        procs = owned_processes(token, named)
        if not procs:
            break
        for proc in procs:
            try:
                proc.kill()
                killed += 1
            except psutil.Error:
                pass
        end = time.monotonic() + 2
        while any(_running(p) for p in procs) and time.monotonic() < end:
            time.sleep(0.02)
    return killed


def _running(proc: psutil.Process) -> bool:
    """Still running (a zombie counts as gone: its parent may never reap it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _driver_alive(driver: psutil.Process | None) -> bool:
    """True while the driver process (same pid and start time) exists and is not a zombie."""
    return driver is not None and _running(driver)


def main(argv: list[str]) -> int:
    """Wait for the driver to die or say ``stop``, then sweep the cluster's processes."""
    driver_pid, token = int(argv[1]), argv[2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        driver: psutil.Process | None = psutil.Process(driver_pid)
    except psutil.Error:
        driver = None
    stdin = sys.stdin
    named: list[psutil.Process] = []  # forked engines: their environment does not show the token
    while _driver_alive(driver):
        ready, _, _ = select.select([stdin], [], [], 0.5)
        if not ready:
            continue
        line = stdin.readline()
        if not line:  # EOF: the driver (the only holder of the pipe) is gone
            break
        if line.strip() == "stop":
            break
        if line.startswith("pid "):
            with contextlib.suppress(ValueError, psutil.Error):
                named.append(psutil.Process(int(line.split()[1])))
    sweep(token, named=named)
    time.sleep(0.2)
    sweep(token, rounds=2, named=named)
    for pattern in argv[3:]:
        for path in glob.glob(pattern):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
