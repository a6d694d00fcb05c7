"""Ranks hosted as threads of one process, as torch's own FSDP2 tests host them (issue 30): the engine
keeps its iteration per root, not per process, so each thread's model trains as a single device would.
Runs ``tests/engine/_threads_body.py`` in a process of its own (the threaded process group replaces
c10d's world for the whole process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def test_ranks_as_threads_of_one_process():
    """Two ranks as threads: both finish within the body's bound, with grads equal to a single device's."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine._threads_body"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("rank ") == 2, proc.stdout
