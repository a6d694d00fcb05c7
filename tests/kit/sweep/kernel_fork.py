"""Fresh Jupyter kernels for the sweep without paying their imports: forked from a warm parent.

A kernel of the level notebooks spends most of its start importing Python, IPython, torch,
the kit (with every plan case) and matplotlib. The sweep starts one *zygote* process that has
imported all of that (and nothing else: no threads, no sockets), and forks it once per case;
the child becomes an ordinary ``ipykernel`` kernel on the connection file jupyter_client wrote.
Every case still gets a kernel process of its own that runs the notebook's cells from the
first, so its executed notebook is what plain ``papermill`` writes: only the module cache is
warm.

    with Zygote.start(log) as zygote:
        km = start_kernel("hyper-parallel-kit", cwd, zygote=zygote)   # None: an ordinary start
        papermill.execute_notebook(..., km=km)
        stop_kernel(km)

No process is left behind: the zygote exits when its stdin closes (the sweep ended or died),
and each kernel it forked gets SIGKILL from the OS when the zygote goes (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from jupyter_client.manager import AsyncKernelManager
from jupyter_client.provisioning import LocalProvisioner
from jupyter_core.utils import run_sync

REPO_ROOT = Path(__file__).resolve().parents[3]
# Not matplotlib_inline.backend_inline: importing it hooks figures into the running IPython shell,
# and the zygote has none (a kernel forked after it would never show a figure).
WARM_MODULES = (
    "ipykernel.kernelapp",
    "ipykernel.ipkernel",
    "ipykernel.debugger",
    "ipyparallel",
    "torch",
    "torch.distributed",
    "tests.kit.front.notebook",
    "matplotlib.pyplot",
)
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"  # what ipykernel sets before matplotlib loads
_PR_SET_PDEATHSIG = 1
_READY_TIMEOUT_S = 120.0
_FORK_TIMEOUT_S = 10.0


class Zygote:
    """The warm parent process the sweep's kernels are forked from."""

    def __init__(self, proc: subprocess.Popen) -> None:
        """Internal: use Zygote.start()."""
        self.proc = proc
        self.warm_seconds: float | None = None  # what the imports took once, instead of once per kernel

    @classmethod
    def start(cls, stderr: IO[Any] | None = None, python: str = sys.executable, wait: bool = True) -> Zygote:
        """Start the zygote with ``python``; with ``wait``, wait (bounded) until its imports are done
        (else the first fork waits: the sweep starts its cluster meanwhile)."""
        env = dict(os.environ)
        env.setdefault("MPLBACKEND", INLINE_BACKEND)
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # the debugger's note on frozen modules
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        proc = subprocess.Popen(
            [python, "-c", "from tests.kit.sweep.kernel_fork import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=str(REPO_ROOT),
            env=env,
        )
        zygote = cls(proc)
        if wait:
            zygote.wait_ready()
        return zygote

    def wait_ready(self) -> None:
        """Wait (bounded) until the zygote has imported everything; raise if it failed."""
        if self.warm_seconds is None:
            try:
                self.warm_seconds = _read_reply(self.proc, _READY_TIMEOUT_S)["seconds"]
            except BaseException:
                self.stop()
                raise

    def fork(self, connection_file: str, cwd: str, env: dict[str, str]) -> int:
        """Fork a kernel on ``connection_file`` (working in ``cwd``, with ``env``); its pid."""
        self.wait_ready()
        if self.proc.poll() is not None:
            raise RuntimeError(f"the kernel zygote exited ({self.proc.returncode})")
        request = {"connection_file": connection_file, "cwd": cwd, "env": env}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        return int(_read_reply(self.proc, _FORK_TIMEOUT_S)["pid"])

    def stop(self) -> None:
        """End the zygote (its kernels die with it)."""
        _end(self.proc)

    def __enter__(self) -> Zygote:
        """Context manager: the zygote itself."""
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Context manager exit: stop()."""
        self.stop()


def _end(proc: subprocess.Popen) -> None:
    """Close the zygote's stdin (it exits), then make sure it is gone."""
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    with contextlib.suppress(OSError):
        proc.stdout.close()


def _read_reply(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    """One JSON line from the zygote, waiting at most ``timeout`` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else b""
    if not line:
        raise RuntimeError(
            f"the kernel zygote did not answer within {timeout:g} s (exit status {proc.poll()}); see the sweep log"
        )
    reply = json.loads(line)
    if "error" in reply:
        raise RuntimeError(f"the kernel zygote failed: {reply['error']}")
    return reply


# -- the zygote process ---------------------------------------------------------------------------
def serve() -> None:
    """Zygote main: import the warm modules, then fork one kernel per request line on stdin."""
    started = time.monotonic()
    import importlib

    for name in WARM_MODULES:
        importlib.import_module(name)
    from tests.kit.front.notebook import load_plan_cases

    load_plan_cases()
    _warm_matplotlib()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes where stderr goes (the sweep's log)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernels are reaped by the OS
    out.write(json.dumps({"ready": True, "seconds": round(time.monotonic() - started, 3)}) + "\n")
    for line in sys.stdin:
        try:
            request = json.loads(line)
            pid = os.fork()
        except Exception as exc:  # noqa: BLE001 - the sweep falls back to ordinary kernels
            out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
            continue
        if pid == 0:
            out.close()  # the zygote's answers are not the kernel's to write
            _become_kernel(request, parent=os.getppid())
        out.write(json.dumps({"pid": pid}) + "\n")


def _warm_matplotlib() -> None:
    """Draw one log-scale figure off screen: fonts and the mathtext parser are cached for every fork."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([0, 1], [1e-9, 1e-3], "x--", label="warm")
    ax.set_yscale("log")
    ax.set_title("warm-up")
    ax.legend()
    fig.canvas.draw()


def _become_kernel(request: dict[str, Any], parent: int) -> None:
    """Fork child: detach from the zygote's pipes and run an ipykernel on the connection file."""
    code = 1
    try:
        os.setsid()  # its own process group: interrupts and kills reach it and its children
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the zygote died between fork and prctl
            os._exit(1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 lives as long as the process
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # as ipykernel_launcher does
        sys.argv = ["ipykernel_launcher", "-f", request["connection_file"]]
        if request["env"].get("JPY_PARENT_PID"):  # read by ipykernel at import time, in the zygote
            sys.argv.append(f"--IPKernelApp.parent_handle={request['env']['JPY_PARENT_PID']}")
        from ipykernel.kernelapp import IPKernelApp

        IPKernelApp.launch_instance(argv=sys.argv[1:])
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


# -- jupyter_client side --------------------------------------------------------------------------
class _ForkedProcess:
    """What LocalProvisioner expects of its Popen, for a kernel the zygote forked (and reaps)."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int) -> None:
        """A running kernel of pid ``pid``."""
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """None while it runs; -1 once it is gone (the zygote reaped it: its status is unknown)."""
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait until it is gone (bounded by ``timeout`` when given)."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"kernel {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Signal the kernel."""
        os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL the kernel."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM the kernel."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)


class ForkedProvisioner(LocalProvisioner):
    """LocalProvisioner whose kernels are forked by a zygote instead of started by Popen."""

    zygote: Zygote | None = None

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        """Fork the kernel for the connection file in ``cmd`` (``-f FILE``)."""
        assert self.zygote is not None
        connection_file = cmd[cmd.index("-f") + 1]
        cwd = str(kwargs.get("cwd") or Path.cwd())
        env = dict(kwargs.get("env") or os.environ)
        env["JPY_PARENT_PID"] = str(os.getpid())  # as jupyter_client's launcher sets it: the kernel polls us
        pid = self.zygote.fork(connection_file, cwd, env)
        self.process = _ForkedProcess(pid)
        self.pid = self.pgid = pid  # the child leads its own session
        self.cwd = cwd
        return self.connection_info


class SweepKernelManager(AsyncKernelManager):
    """A kernel manager that remembers the client it hands out, so its channels can be closed
    (nbclient leaves a client of a kernel manager it was given open)."""

    clients: list[Any]

    def client(self, **kwargs: Any) -> Any:
        """A new client of this kernel, remembered."""
        kc = super().client(**kwargs)
        if not hasattr(self, "clients"):
            self.clients = []
        self.clients.append(kc)
        return kc


def forkable(argv: list[str]) -> bool:
    """Whether a kernelspec's argv is an ordinary ipykernel start (what a fork can stand for)."""
    return "-f" in argv and any("ipykernel" in part for part in argv)


def start_kernel(
    kernel_name: str, cwd: str, *, zygote: Zygote | None = None, stdout: IO[Any] | None = None
) -> SweepKernelManager:
    """Start a kernel of ``kernel_name`` in ``cwd``: forked from ``zygote`` when given (and the
    kernelspec is an ipykernel), else as jupyter_client starts it (output to ``stdout``)."""
    km = SweepKernelManager(kernel_name=kernel_name)
    km.kernel_id = km.kernel_id or f"hpkit-{os.getpid()}-{time.monotonic_ns()}"
    kwargs: dict[str, Any] = {"cwd": cwd}
    if zygote is not None and forkable(km.kernel_spec.argv):
        provisioner = ForkedProvisioner(kernel_id=km.kernel_id, kernel_spec=km.kernel_spec, parent=km)
        provisioner.zygote = zygote
        km.provisioner = provisioner
    elif stdout is not None:
        kwargs.update(stdout=stdout, stderr=stdout)
    run_sync(km.start_kernel)(**kwargs)
    return km


class KernelPool:
    """Kernels of one kernelspec, one started ahead: the next notebook's kernel boots while the
    current one runs. Each kernel serves one notebook."""

    def __init__(
        self, kernel_name: str, cwd: str, *, zygote: Zygote | None = None, stdout: IO[Any] | None = None
    ) -> None:
        """Kernels of ``kernel_name`` in ``cwd``, forked from ``zygote`` when given."""
        self.kernel_name = kernel_name
        self.cwd = cwd
        self.zygote = zygote
        self.stdout = stdout
        self.spare: SweepKernelManager | None = None
        self.fallback: str | None = None  # why kernels stopped being forked, if they did

    def _start(self) -> SweepKernelManager:
        """A new kernel: forked, or (no zygote, or it failed) started the ordinary way."""
        if self.zygote is not None:
            try:
                return start_kernel(self.kernel_name, self.cwd, zygote=self.zygote)
            except RuntimeError as exc:  # the zygote died or never got ready: say so, go on without it
                self.fallback = str(exc)
                self.zygote.stop()
                self.zygote = None
        return start_kernel(self.kernel_name, self.cwd, stdout=self.stdout)

    def take(self) -> SweepKernelManager:
        """A kernel nobody used: the spare if it is alive, else a new one."""
        km, self.spare = self.spare, None
        if km is not None and run_sync(km.is_alive)():
            return km
        if km is not None:
            stop_kernel(km)
        return self._start()

    def prepare(self) -> None:
        """Start the spare for the next notebook now (it boots while this one runs)."""
        if self.spare is None:
            self.spare = self._start()

    def close(self) -> None:
        """Stop the spare."""
        if self.spare is not None:
            stop_kernel(self.spare)
            self.spare = None


def stop_kernel(km: SweepKernelManager) -> None:
    """Close the clients' channels and end the kernel at once (it served one notebook)."""
    for kc in getattr(km, "clients", []):
        with contextlib.suppress(Exception):
            kc.stop_channels()
    with contextlib.suppress(Exception):
        run_sync(km.shutdown_kernel)(now=True)
    with contextlib.suppress(Exception):
        run_sync(km.cleanup_resources)()
