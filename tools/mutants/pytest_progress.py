"""pytest plugin of the mutation harness: one JSON line per test event, as it happens.

Loaded with ``-p tools.mutants.pytest_progress``; writes to the file named by
``MUTANTS_PROGRESS_LOG`` (does nothing without it). A run killed at its timeout writes no
junit XML, but this log still tells which tests finished, how, and which one was running.
"""

from __future__ import annotations

import json
import os
from typing import Any

PROGRESS_ENV = "MUTANTS_PROGRESS_LOG"


def _write(event: dict[str, Any]) -> None:
    path = os.environ.get(PROGRESS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(event) + "\n")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    """A test starts."""
    _write({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report: Any) -> None:
    """One phase (setup, call, teardown) of a test ended."""
    _write({"event": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome})


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    """A test ended (all its phases)."""
    _write({"event": "finish", "nodeid": nodeid})


def pytest_collectreport(report: Any) -> None:
    """A module that failed to collect (its tests never run)."""
    if report.failed:
        _write({"event": "collect", "nodeid": report.nodeid, "outcome": "failed"})
