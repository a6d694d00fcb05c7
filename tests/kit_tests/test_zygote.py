"""The warm parent engines and kernels are forked from (``tests/kit/runtime/zygote.py``), with a
light role (``_zygote_role.py``): what a child gets, how its end is told, that none outlives it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.kit.runtime import engine_fork
from tests.kit.runtime.engines import still_running
from tests.kit.runtime.zygote import Zygote, exit_status_file

ROLE = "tests.kit_tests._zygote_role"


@pytest.fixture
def zygote():
    with Zygote.start(ROLE) as started:
        yield started


def _fork(zygote: Zygote, tmp_path: Path, how: str, name: str = "child") -> tuple[int, Path]:
    log = tmp_path / f"{name}.log"
    env = {**os.environ, "ROLE_VAR": name}
    request = {"how": how, "env": env, "cwd": str(tmp_path), "output": str(log), "status_prefix": str(log)}
    return zygote.fork(request), log


def _recorded(log: Path, pid: int, within: float = 10) -> str:
    path = Path(exit_status_file(str(log), pid))
    end = time.monotonic() + within
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.02)
    return path.read_text() if path.exists() else "(nothing recorded)"


@pytest.mark.parametrize(("how", "code"), [("exit", "3"), ("sigterm", "-15")])
def test_a_child_runs_as_its_request_says_and_its_end_is_recorded(zygote, tmp_path, how, code):
    pid, log = _fork(zygote, tmp_path, how)
    assert _recorded(log, pid) == code
    printed = json.loads(log.read_text().splitlines()[0])
    assert printed == {"sid": pid, "pid": pid, "cwd": str(tmp_path), "var": "child"}  # its own session


def test_an_interrupt_leaves_the_zygote_serving_and_quiet_and_reaches_its_children(tmp_path):
    """Interrupting a Jupyter kernel signals its process group: the zygote (the warm cluster's
    engines die with it) is not in it, and SIGINT sent to it anyway is ignored, with no traceback;
    a child still takes SIGINT as a KeyboardInterrupt."""
    err = tmp_path / "zygote.err"
    with err.open("w") as stderr, Zygote.start(ROLE, stderr=stderr) as zygote:
        assert os.getpgid(zygote.proc.pid) != os.getpgid(0)
        os.kill(zygote.proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert zygote.alive
        pid, log = _fork(zygote, tmp_path, "sigint")
        assert _recorded(log, pid) == "1"
        assert "KeyboardInterrupt" in log.read_text()
    assert "KeyboardInterrupt" not in err.read_text()


def test_children_die_with_their_zygote(tmp_path):
    zygote = Zygote.start(ROLE)
    pids = [_fork(zygote, tmp_path, "wait", f"child{i}")[0] for i in range(2)]
    assert still_running(pids, 0) == pids
    zygote.stop()
    assert still_running(pids, 10) == []


def test_a_zygote_with_living_engines_is_never_stopped_to_make_room(tmp_path, monkeypatch):
    busy, idle = Zygote.start(ROLE), Zygote.start(ROLE)
    try:
        pid, _ = _fork(busy, tmp_path, "wait")
        known = {frozenset({("k", "busy")}): busy, frozenset({("k", "idle")}): idle}
        monkeypatch.setattr(engine_fork, "_ZYGOTES", known)
        engine_fork._stop_idle_zygotes(keep=0)
        assert busy.alive and not idle.alive
        assert psutil.Process(pid).is_running()
    finally:
        busy.stop()
        idle.stop()
