"""Run torch's FSDP2 test files against one implementation, a pytest process per file, resumed past
a test that hangs, and collect every test's outcome."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .harness import DONE_ENV, GPU_ON_CPU_ENV, RECORD_ENV, TIMEOUT_ENV, WORLD_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "site"
SPEC_ENV = "HPKIT_PEER_SPEC"
WATCHDOG_EXIT = 3


@dataclass
class FileRun:
    """One test file's outcomes under one implementation."""

    file: str
    outcomes: dict[str, dict] = field(default_factory=dict)  # node id -> its record
    restarts: int = 0
    seconds: float = 0.0
    problem: str = ""  # the file could not be collected, or its process was killed


def _env(spec: str, record: Path, done: Path, test_timeout: float, world: int, gpu_tests: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(GPU_ON_CPU_ENV, None)
    if gpu_tests:
        env[GPU_ON_CPU_ENV] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env[SPEC_ENV] = spec
    env[RECORD_ENV] = str(record)
    env[DONE_ENV] = str(done)
    env[TIMEOUT_ENV] = str(test_timeout)
    env[WORLD_ENV] = str(world)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    return env


def read_records(record: Path) -> list[dict]:
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines() if line.strip()]


def run_file(
    test_file: Path,
    spec: str,
    work: Path,
    test_timeout: float = 120,
    file_timeout: float = 1800,
    world: int = 2,
    select: str = "",
    gpu_tests_on_cpu: bool = False,
) -> FileRun:
    """Every test of ``test_file`` under ``spec``; a hang costs its own test only (pytest starts again on
    the tests not yet recorded), and the whole file is bounded by ``file_timeout``."""
    work.mkdir(parents=True, exist_ok=True)
    record, done, config = work / f"{test_file.stem}.jsonl", work / f"{test_file.stem}.done", work / "pytest.ini"
    for stale in (record, done):
        stale.unlink(missing_ok=True)
    config.write_text("[pytest]\naddopts =\n")  # none of this repository's pytest settings
    run = FileRun(test_file.name)
    started = time.monotonic()
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "tools.peer_suite.harness",
        "-p",
        "no:cacheprovider",
        "-c",
        str(config),
        "--rootdir",
        str(test_file.parent),
        str(test_file),
    ]
    if select:
        command += ["-k", select]
    while True:
        left = file_timeout - (time.monotonic() - started)
        try:
            proc = subprocess.run(
                command,
                cwd=test_file.parent,
                env=_env(spec, record, done, test_timeout, world, gpu_tests_on_cpu),
                capture_output=True,
                text=True,
                timeout=max(left, 1),
            )
        except subprocess.TimeoutExpired:
            run.problem = f"the file ran past {file_timeout:.0f} s; the tests not recorded are missing"
            break
        records = [r for r in read_records(record) if "nodeid" in r]
        done.write_text("\n".join(r["nodeid"] for r in records))
        if proc.returncode == WATCHDOG_EXIT and run.restarts < 50:
            run.restarts += 1
            continue
        if proc.returncode not in (0, 1, 5, WATCHDOG_EXIT):
            run.problem = f"pytest exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}"
        break
    for entry in read_records(record):
        if "nodeid" in entry:
            run.outcomes[entry["nodeid"]] = entry
    run.seconds = time.monotonic() - started
    return run
