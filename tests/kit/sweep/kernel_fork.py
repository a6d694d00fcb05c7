"""Fresh Jupyter kernels for the sweep without paying their imports: forked from a warm parent.

A kernel of the level notebooks spends most of its start importing Python, IPython, torch,
the kit (with every plan case) and matplotlib. The sweep starts one *zygote* of this role
(``tests.kit.runtime.zygote``) that has imported all of that, and forks it once per case; the
child becomes an ordinary ``ipykernel`` kernel on the connection file jupyter_client wrote.
Every case still gets a kernel process of its own that runs the notebook's cells from the
first, so its executed notebook is what plain ``papermill`` writes: only the module cache is
warm.

    with kernel_zygote(log) as zygote:
        km = start_kernel("hyper-parallel-kit", cwd, zygote=zygote)   # None: an ordinary start
        papermill.execute_notebook(..., km=km)
        stop_kernel(km)
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from jupyter_client.manager import AsyncKernelManager
from jupyter_client.provisioning import LocalProvisioner
from jupyter_core.utils import run_sync

from tests.kit.runtime.zygote import Zygote

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


def kernel_zygote(stderr: IO[Any] | None = None, wait: bool = True) -> Zygote:
    """The sweep's kernel zygote (its output to ``stderr``, the sweep's log); with ``wait``, once
    its imports are done (else the first fork waits: the sweep starts its cluster meanwhile)."""
    env = dict(os.environ)
    env.setdefault("MPLBACKEND", INLINE_BACKEND)
    return Zygote.start(__name__, env=env, stderr=stderr, wait=wait)


def warm_up() -> None:
    """Zygote role, once after the imports: the plan's cases loaded, one figure drawn off screen
    (fonts and the mathtext parser are cached for every fork)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from tests.kit.front.notebook import load_plan_cases

    load_plan_cases()
    fig = Figure(figsize=(2, 2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([0, 1], [1e-9, 1e-3], "x--", label="warm")
    ax.set_yscale("log")
    ax.set_title("warm-up")
    ax.legend()
    fig.canvas.draw()


def become(request: dict[str, Any]) -> None:
    """Zygote role, in the forked child: an ipykernel on ``request["connection_file"]``."""
    sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # as ipykernel_launcher does
    sys.argv = ["ipykernel_launcher", "-f", request["connection_file"]]
    if request["env"].get("JPY_PARENT_PID"):  # read by ipykernel at import time, in the zygote
        sys.argv.append(f"--IPKernelApp.parent_handle={request['env']['JPY_PARENT_PID']}")
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(argv=sys.argv[1:])


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
        request = {"connection_file": connection_file, "cwd": cwd, "env": env, "title": shlex.join(cmd)}
        pid = self.zygote.fork(request)
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
