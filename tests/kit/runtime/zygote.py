"""Warm processes to fork from: a *zygote* imports the heavy modules once and forks a child per request.

A new Jupyter kernel or ipyparallel engine spends most of its start importing Python, IPython,
ipyparallel and torch. A zygote has imported all of that (and nothing else runs in it: no threads,
no sockets), so a child forked from it starts with a warm module cache and nothing more: it still
runs its own program from the start (a kernel on its connection file, an engine on its arguments).

What a child becomes is the zygote's *role*: a module with ``WARM_MODULES`` (imported before the
first fork), optionally ``warm_up()`` (run once after them) and ``become(request)`` (run in each
child; ``request`` is the JSON object the driver sent). Roles: ``tests.kit.runtime.engine_fork``
(the cluster's engines) and ``tests.kit.sweep.kernel_fork`` (the sweep's kernels).

    zygote = Zygote.start("tests.kit.runtime.engine_fork", env=env)
    pid = zygote.fork({"env": env, "cwd": cwd, "title": "python -m ...", "output": log_path,
                       "status_prefix": log_path, ...})

A child is not its driver's child, so the zygote reaps it, and writes its exit code to
``exit_status_file(status_prefix, pid)`` when the request named a prefix (how an engine died).
No process is left behind: the zygote exits when its stdin closes (its driver stopped it or died),
and each child gets SIGKILL from the OS when the zygote goes (``PR_SET_PDEATHSIG``). An interrupt
is not an end: the zygote runs in a session of its own and ignores SIGINT (interrupting a kernel in
Jupyter signals its whole process group), while its children take SIGINT as usual.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, NoReturn

import setproctitle

REPO_ROOT = Path(__file__).resolve().parents[3]
_PR_SET_PDEATHSIG = 1
_READY_TIMEOUT_S = 120.0
_FORK_TIMEOUT_S = 10.0


class Zygote:
    """A warm parent process of one role, and the pipe its driver asks it to fork through."""

    def __init__(self, proc: subprocess.Popen, role: str) -> None:
        """Internal: use Zygote.start()."""
        self.proc = proc
        self.role = role
        self.warm_seconds: float | None = None  # what the imports took once, instead of once per child

    @classmethod
    def start(
        cls,
        role: str,
        *,
        env: dict[str, str] | None = None,
        stderr: IO[Any] | None = None,
        python: str = sys.executable,
        wait: bool = True,
    ) -> Zygote:
        """Start a zygote of ``role`` (a module name) with ``python`` and ``env`` (default: this
        process's); with ``wait``, wait (bounded) until its imports are done (else the first fork waits)."""
        env = dict(os.environ if env is None else env)
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # the debugger's note on frozen modules
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        proc = subprocess.Popen(
            [python, "-c", "from tests.kit.runtime.zygote import serve; serve()", role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=str(REPO_ROOT),
            env=env,
            start_new_session=True,  # an interrupt of the driver's group (Jupyter's, a terminal's) is not its
        )
        zygote = cls(proc, role)
        if wait:
            zygote.wait_ready()
        return zygote

    def wait_ready(self) -> None:
        """Wait (bounded) until the zygote has imported everything; raise if it failed."""
        if self.warm_seconds is None:
            try:
                self.warm_seconds = self._reply(_READY_TIMEOUT_S)["seconds"]
            except BaseException:
                self.stop()
                raise

    @property
    def alive(self) -> bool:
        """Whether the zygote still runs."""
        return self.proc.poll() is None

    def fork(self, request: dict[str, Any]) -> int:
        """Fork a child that becomes what ``request`` asks of the role; its pid."""
        self.wait_ready()
        if not self.alive:
            raise RuntimeError(f"the {self.role} zygote exited ({self.proc.returncode})")
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            raise RuntimeError(f"the {self.role} zygote is gone: {exc}") from exc
        return int(self._reply(_FORK_TIMEOUT_S)["pid"])

    def stop(self) -> None:
        """End the zygote (its children die with it): close its stdin, then make sure it is gone."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            self.proc.stdout.close()

    def _reply(self, timeout: float) -> dict[str, Any]:
        """One JSON line from the zygote, waiting at most ``timeout`` seconds."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(
                f"the {self.role} zygote did not answer within {timeout:g} s (exit status {self.proc.poll()})"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the {self.role} zygote failed: {reply['error']}")
        return reply

    def __enter__(self) -> Zygote:
        """Context manager: the zygote itself."""
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Context manager exit: stop()."""
        self.stop()


# -- the zygote process ---------------------------------------------------------------------------
def serve() -> None:
    """Zygote main (``sys.argv[1]``: the role): import the role's warm modules, then fork one child
    per request line on stdin until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a server: it ends when its stdin closes, not on ^C
    started = time.monotonic()
    role = importlib.import_module(sys.argv[1])
    for name in role.WARM_MODULES:
        importlib.import_module(name)
    if hasattr(role, "warm_up"):
        role.warm_up()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes where stderr goes (the driver's log)
    status_files: dict[int, str] = {}  # child pid -> where its exit status goes
    signal.signal(signal.SIGCHLD, lambda *_: _reap(status_files))
    out.write(json.dumps({"ready": True, "seconds": round(time.monotonic() - started, 3)}) + "\n")
    for line in sys.stdin:
        # a child that dies at once is reaped only after its status file is known
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
        except Exception as exc:  # noqa: BLE001 - the driver falls back to an ordinary start
            out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            continue
        if pid == 0:
            out.close()  # the zygote's answers are not the child's to write
            _become(role, request, parent=os.getppid())
        if request.get("status_prefix"):
            status_files[pid] = exit_status_file(request["status_prefix"], pid)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        out.write(json.dumps({"pid": pid}) + "\n")


def exit_status_file(prefix: str, pid: int) -> str:
    """Where the zygote writes the exit code of child ``pid`` forked with ``status_prefix``: a dead
    child is not its driver's, so only its zygote can tell how it ended."""
    return f"{prefix}.{pid}.exit"


def _reap(status_files: dict[int, str]) -> None:
    """SIGCHLD in the zygote: reap every dead child; write the exit code of those that asked for it
    (negative: the signal that killed it)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = status_files.pop(pid, None)
        if path:
            with contextlib.suppress(OSError):
                with open(path + ".part", "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))
                os.replace(path + ".part", path)


def _become(role: Any, request: dict[str, Any], parent: int) -> NoReturn:
    """Fork child: detach from the zygote (own session, its stdin, its environment, its working
    directory, its output file), then run the role's ``become``; never returns to the zygote's loop."""
    code = 1
    try:
        os.setsid()  # its own process group: interrupts and kills reach it and its children
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the zygote died between fork and prctl
            os._exit(1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # interrupts reach kernels and engines
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        _redirect(0, os.devnull, os.O_RDONLY)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 lives as long as the process
        if request.get("output"):
            for fd in (1, 2):
                _redirect(fd, request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(line_buffering=True)
        if request.get("title"):  # what ps shows: the command it stands for (before environ changes)
            setproctitle.setproctitle(request["title"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        role.become(request)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - print it to the log, then leave without the zygote's atexit
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _redirect(fd: int, path: str, flags: int) -> None:
    """Point file descriptor ``fd`` at ``path`` opened with ``flags``."""
    target = os.open(path, flags, 0o644)
    os.dup2(target, fd)
    os.close(target)
