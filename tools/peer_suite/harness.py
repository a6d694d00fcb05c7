"""pytest plugin of a peer-suite run: every test bounded in time, every outcome recorded as it ends.

Loaded with ``-p tools.peer_suite.harness`` in the pytest process that runs one test file. Each
outcome is appended to ``HPKIT_PEER_RECORD`` (JSON lines) the moment its test ends, so a test that
hangs loses nothing before it: the watchdog writes every thread's stack, records the test as
TIMEOUT and ends the process; the runner starts pytest again on the tests not yet recorded.
``patch_fsdp_test_for_cpu`` (applied by ``site/sitecustomize.py`` in every process, the ranks
``FSDPTest`` spawns included) runs those tests, which torch skips without one accelerator per rank,
on the CPU over gloo at ``HPKIT_PEER_WORLD`` ranks.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

RECORD_ENV = "HPKIT_PEER_RECORD"
TIMEOUT_ENV = "HPKIT_PEER_TIMEOUT"
WORLD_ENV = "HPKIT_PEER_WORLD"
GPU_ON_CPU_ENV = "HPKIT_PEER_GPU_TESTS_ON_CPU"  # run skip_if_lt_x_gpu tests on the CPU too
DONE_ENV = "HPKIT_PEER_DONE"  # a file listing the node ids already recorded: not run again


def _record(entry: dict[str, Any]) -> None:
    with open(os.environ[RECORD_ENV], "a") as out:
        out.write(json.dumps(entry) + "\n")


class Watchdog:
    """Ends the process when one test runs past its bound, with every thread's stack recorded."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._timer: threading.Timer | None = None

    def start(self, nodeid: str) -> None:
        self.cancel()
        self._timer = threading.Timer(self.seconds, self._expire, args=(nodeid,))
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, nodeid: str) -> None:
        with tempfile.TemporaryFile("w+") as dump:
            faulthandler.dump_traceback(file=dump, all_threads=True)
            dump.seek(0)
            stacks = dump.read()
        _record(
            {
                "nodeid": nodeid,
                "outcome": "timeout",
                "duration": self.seconds,
                "error_type": "Timeout",
                "message": f"ran past {self.seconds:.0f} s; every thread's stack follows",
                "longrepr": stacks[-20000:],
            }
        )
        os._exit(3)


_watchdog = Watchdog(float(os.environ.get(TIMEOUT_ENV, "120")))


def _error_of(report: pytest.TestReport) -> tuple[str, str]:
    """The exception type and first message line that failed ``report`` (the innermost raised)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    error_type, _, message = text.partition(":")
    return error_type.strip().rsplit(".", 1)[-1], message.strip()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    done_file = os.environ.get(DONE_ENV)
    if not done_file or not Path(done_file).exists():
        return
    done = set(Path(done_file).read_text().split())
    items[:] = [item for item in items if item.nodeid not in done]


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _watchdog.start(nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    failed_setup = report.when == "setup" and report.outcome != "passed"
    if report.when != "call" and not failed_setup:
        return
    entry: dict[str, Any] = {"nodeid": report.nodeid, "outcome": report.outcome, "duration": report.duration}
    if report.outcome == "skipped":
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry["message"] = str(reason)[:500]
    elif report.outcome == "failed":
        entry["error_type"], entry["message"] = _error_of(report)
        entry["longrepr"] = str(report.longrepr)[-20000:]
    _record(entry)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _watchdog.cancel()


def _run_on_cpu(cls: type, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
    """One rank of an ``FSDPTest`` on the CPU: a gloo process group over the test's file store (torch's
    own ``_run`` exits as skipped when there are fewer accelerators than ranks)."""
    import torch.distributed as dist
    from torch.testing._internal.common_utils import set_rng_seed

    self = cls(test_name)
    self.rank = rank
    self.file_name = file_name
    dist.init_process_group(init_method=f"file://{file_name}", backend="gloo", world_size=self.world_size, rank=rank)
    dist.barrier()
    set_rng_seed()
    self.run_test(test_name, pipe)
    dist.barrier()
    dist.destroy_process_group()


def patch_fsdp_test_for_cpu(world: int) -> None:
    """``FSDPTest`` at ``world`` ranks over gloo when no accelerator is there."""
    import torch

    if torch.accelerator.is_available():
        return
    from torch.testing._internal import common_fsdp

    # the spawned ranks find their entry point by its name: it must be called ``_run``
    _run_on_cpu.__name__, _run_on_cpu.__qualname__ = "_run", "FSDPTest._run"
    common_fsdp.FSDPTest.world_size = property(lambda self: world)
    common_fsdp.FSDPTest._run = classmethod(_run_on_cpu)
    if os.environ.get(GPU_ON_CPU_ENV):
        _cpu_for_gpu_tests(world)


def _cpu_for_gpu_tests(world: int) -> None:
    """torch's ``skip_if_lt_x_gpu(x)`` runs its test on the CPU when ``x`` ranks fit the world (the test
    then computes on torch's CPU device type, as its own helpers pick it). Applied before the test
    files import the decorator."""
    from functools import wraps

    from torch.testing._internal import common_distributed

    original = common_distributed.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = False) -> Any:
        if x > world:
            return original(x, allow_cpu=allow_cpu)

        def decorator(func: Any) -> Any:
            @wraps(func)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return func(*args, **kwargs)

            return wrapper

        return decorator

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu


def pytest_configure(config: pytest.Config) -> None:
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 3000))
    _record({"event": "start", "time": time.time(), "pid": os.getpid()})
