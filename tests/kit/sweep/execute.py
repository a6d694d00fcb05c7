"""Executing one notebook for the sweep: papermill on a kernel from the pool (forked from a warm
parent, ``tests.kit.sweep.kernel_fork``), the notebook kept when its kernel dies; the ``Runner``
holds the pool and renders pages in the background."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import nbformat
import papermill
from papermill.engines import NBClientEngine, papermill_engines

from tests.kit.front.evidence import KERNEL

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS = ROOT / "notebooks"
_PAGE_TIMEOUT_S = 300  # rendering one HTML page
_ENGINE = "hpkit-sweep"


class _RecordingEngine(NBClientEngine):
    """papermill's nbclient engine, remembering the notebook it executes: the sweep saves it once at
    the end (not after every cell), and still has what ran when a kernel dies or a cell times out."""

    current: Any = None

    @classmethod
    def execute_managed_notebook(cls, nb_man: Any, kernel_name: str, **kwargs: Any) -> Any:
        """Execute as papermill does, remembering the notebook."""
        cls.current = nb_man
        return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)


papermill_engines.register(_ENGINE, _RecordingEngine)


@dataclass
class Runner:
    """How the sweep executes notebooks: kernels (forked from a zygote, one started ahead), and HTML
    pages rendered in the background while the next case runs."""

    kernel: str = KERNEL
    zygote: Any = None  # tests.kit.runtime.zygote.Zygote (kernel_fork's role), or None: kernels start the ordinary way
    log: IO[Any] | None = None  # kernel output of ordinary starts (None: the terminal)
    ahead: bool = False  # start the next notebook's kernel while this one runs
    pages: ThreadPoolExecutor | None = None  # None: render each page before run_one returns
    pending: list[Future] = field(default_factory=list)
    _pool: Any = None

    def kernel_pool(self) -> Any:
        """The pool this runner takes kernels from."""
        from tests.kit.sweep.kernel_fork import KernelPool

        if self._pool is None:
            self._pool = KernelPool(self.kernel, str(NOTEBOOKS), zygote=self.zygote, stdout=self.log)
        return self._pool

    def finish(self) -> None:
        """Wait for every page."""
        for future in self.pending:
            future.result(timeout=_PAGE_TIMEOUT_S)
        self.pending.clear()

    def close(self) -> str | None:
        """Stop the spare kernel and the zygote (pages are waited for by finish()); why kernels
        stopped being forked, if they did."""
        fallback = None
        if self._pool is not None:
            self._pool.close()
            fallback = self._pool.fallback
        if self.zygote is not None:
            self.zygote.stop()
        return fallback


def execute(
    source: Path, notebook: Path, parameters: dict[str, Any], runner: Runner, timeout: int
) -> tuple[str | None, float]:
    """Run the notebook ``source`` into ``notebook`` on a fresh kernel, each cell bounded by ``timeout``
    seconds: (error, kernel start s)."""
    from tests.kit.sweep.kernel_fork import stop_kernel

    started = time.monotonic()
    pool = runner.kernel_pool()
    km = None
    error = None
    kernel_start = 0.0
    _RecordingEngine.current = None
    try:
        km = pool.take()
        kernel_start = time.monotonic() - started
        if runner.ahead:
            pool.prepare()
        papermill.execute_notebook(
            str(source),
            str(notebook),
            parameters=parameters,
            engine_name=_ENGINE,
            request_save_on_cell_execute=False,
            kernel_name=runner.kernel,
            km=km,
            cwd=str(NOTEBOOKS),
            execution_timeout=timeout,
            progress_bar=False,
        )
    except Exception as exc:  # noqa: BLE001 - a failed case is recorded, the sweep goes on
        text = str(exc).strip()
        error = f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
        executing = _RecordingEngine.current
        if executing is not None and not isinstance(exc, papermill.PapermillExecutionError):
            nbformat.write(executing.nb, notebook)  # the kernel died or a cell timed out: keep what ran
    finally:
        if km is not None:
            stop_kernel(km)
    return error, kernel_start
