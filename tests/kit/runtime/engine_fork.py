"""A cluster's engines forked from a warm parent instead of started cold (a zygote role).

An engine started cold imports ipyparallel's engine and torch (3.5 s of CPU each here); four
engines sharing two cores took ~9 s to register. The engine set launcher of a RankCluster
(``ForkedEngineSetLauncher``) asks a zygote (``tests.kit.runtime.zygote``) that has imported
them once per driver to fork each engine, which then runs ipyparallel's engine program on the
arguments ipyparallel gave it, as ``python -m ipyparallel.engine`` would: its own process, session,
environment, working directory and log file. Only the module cache is warm.

A fork stands for a start only where the start's difference would be read after the fork: an
engine's environment may differ from its zygote's only in variables read at run time
(``RUN_TIME_PREFIXES``, ``RUN_TIME_VARIABLES``); any other difference (``OMP_NUM_THREADS``, read
as torch's OpenMP library loads) gets a zygote of its own. ``HPKIT_FORK_ENGINES=0`` starts every
engine cold.
"""

from __future__ import annotations

import atexit
import os
import shlex
import sys
import warnings
from typing import Any

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher, ProcessStateError

from tests.kit.runtime.zygote import Zygote

# torch's, never an implementation's: an engine judging another one imports that one first
WARM_MODULES = (
    "ipyparallel.engine.app",
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.pipelining",
    "tests.kit.runtime.rank_runtime",
)
FORK_ENV = "HPKIT_FORK_ENGINES"  # "0": engines start cold
# Read after an engine starts, never while its modules load: these may differ from its zygote's.
RUN_TIME_PREFIXES = ("HPKIT_", "IPP_", "JPY_", "PYTEST_", "GLOO_")
RUN_TIME_VARIABLES = (
    "PYTHONUNBUFFERED",  # the fork's output is line-buffered anyway
    # torch reads it at its first CPU kernel, not at import: the notebooks' engines fork from the
    # tests' zygote and still compute otherwise (test_the_notebooks_engines_really_compute_otherwise)
    "ATEN_CPU_CAPABILITY",
)
_MAX_ZYGOTES = 2  # idle ones beyond it are stopped (each holds torch's modules: ~400 MB)
_ZYGOTES: dict[frozenset[tuple[str, str]], Zygote] = {}


def become(request: dict[str, Any]) -> None:
    """Zygote role, in the forked child: run ipyparallel's engine on ``request["argv"]``."""
    from ipyparallel.engine.app import main

    sys.argv = list(request["argv"])
    main(argv=sys.argv[1:])


def load_time_environment(env: dict[str, str]) -> frozenset[tuple[str, str]]:
    """The part of ``env`` a process may read while its modules load: what its zygote must share."""
    return frozenset(
        (key, value)
        for key, value in env.items()
        if not key.startswith(RUN_TIME_PREFIXES) and key not in RUN_TIME_VARIABLES
    )


def zygote_for(env: dict[str, str]) -> Zygote | None:
    """The warm engine zygote for an engine started with ``env`` (started on first use), or None
    when engines start cold (``HPKIT_FORK_ENGINES=0``) or the zygote cannot start."""
    if os.environ.get(FORK_ENV, "1") == "0":
        return None
    key = load_time_environment(env)
    zygote = _ZYGOTES.get(key)
    if zygote is not None and zygote.alive:
        return zygote
    _ZYGOTES.pop(key, None)
    _stop_idle_zygotes(keep=_MAX_ZYGOTES - 1)
    try:
        zygote = Zygote.start(__name__, env=dict(key))
    except RuntimeError as exc:  # e.g. an import failed in it: engines start cold, slower
        warnings.warn(f"engines start cold: {exc}", RuntimeWarning, stacklevel=2)
        return None
    _ZYGOTES[key] = zygote
    return zygote


def _stop_idle_zygotes(keep: int) -> None:
    """Stop the oldest zygotes without a living engine until ``keep`` are left (or only busy ones:
    a zygote's engines die with it)."""
    for key, zygote in list(_ZYGOTES.items()):
        if len(_ZYGOTES) <= keep:
            return
        try:
            busy = bool(psutil.Process(zygote.proc.pid).children())
        except psutil.Error:
            busy = False
        if not busy:
            del _ZYGOTES[key]
            zygote.stop()


def forget_zygote(zygote: Zygote) -> None:
    """Stop a zygote that failed to fork and drop it (the next engine starts another or goes cold)."""
    for key, known in list(_ZYGOTES.items()):
        if known is zygote:
            del _ZYGOTES[key]
    zygote.stop()


@atexit.register
def stop_zygotes() -> None:
    """End every engine zygote of this driver (their engines were stopped with their clusters)."""
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].stop()


class ForkedEngineLauncher(LocalEngineLauncher):
    """One engine: forked from the warm zygote when it can be, else started cold by ipyparallel."""

    def start(self) -> None:
        """Fork the engine on ipyparallel's arguments; a cold start when no zygote can fork it."""
        if self.state != "before":
            raise ProcessStateError(f"The process was already started and has state: {self.state}")
        argv = list(self.args)
        env = {**os.environ, **self.get_env()}
        zygote = zygote_for(env) if argv[1:3] == ["-m", "ipyparallel.engine"] else None
        if zygote is None:
            return super().start()
        try:
            request = {"argv": argv, "env": env, "cwd": self.work_dir, "title": shlex.join(argv)}
            pid = zygote.fork({**request, "output": self.output_file, "status_prefix": self.output_file})
        except RuntimeError:
            forget_zygote(zygote)
            return super().start()
        self.pid = pid
        self.process = psutil.Process(pid)  # not our child: psutil waits on it by polling
        self.notify_start(pid)
        self._start_waiting()
        return None


class ForkedEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine set, each engine forked (``ForkedEngineLauncher``)."""

    launcher_class = ForkedEngineLauncher
