"""What one torch release runs, in its own venv: our engine tests, the plan cases for each
implementation (through ``tests.kit.front.conformance``), and optionally nbval on the notebooks.
Every step is a subprocess with a time limit and a log of its own; the results come back as data."""

from __future__ import annotations

import json
import os
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .venv import REPO_ROOT

STEP_LIMIT_S = 3600  # one step of one release; a hang ends as a failed step, never a stuck matrix
NBVAL = ["--nbval", "--nbval-sanitize-with", "notebooks/nbval_sanitize.cfg"]


def run_step(python: Path, args: list[str], log: Path, limit_s: float = STEP_LIMIT_S) -> tuple[int, float]:
    """``python args`` in the repository, output to ``log``: (exit code, seconds); 124 past the limit."""
    env = {**os.environ, "IPP_NONINTERACTIVE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    started = time.monotonic()
    with log.open("w") as out:
        try:
            code = subprocess.run(
                [str(python), *args], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=limit_s
            ).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\n[torch matrix] stopped after {limit_s:.0f} s\n")
            code = 124
    return code, time.monotonic() - started


def junit_outcomes(path: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped, from a pytest junit XML file."""
    if not path.exists():
        return {}
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        outcomes[name] = {"failure": "failed"}.get(outcome, outcome)
    return outcomes


def engine_tests(python: Path, out: Path) -> dict[str, Any]:
    """Our engine's multi-rank tests (``tests/engine``) on this release."""
    xml = out / "engine.xml"
    code, seconds = run_step(
        python,
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine", f"--junitxml={xml}"],
        out / "engine.log",
    )
    return {"exit": code, "seconds": round(seconds, 1), "tests": junit_outcomes(xml)}


def plan_cases(python: Path, out: Path, implementations: dict[str, str], cases: str = "") -> dict[str, Any]:
    """Every plan case (or ``cases``) for each implementation: name -> case id -> verdict summary."""
    args = ["-m", "tests.kit.front.conformance", "--out", str(out / "conformance")]
    for name, spec in implementations.items():
        args += ["--implementation", f"{name}={spec}"]
    if cases:
        args += ["--cases", cases]
    code, seconds = run_step(python, args, out / "conformance.log")
    found = sorted((out / "conformance").glob("*/conformance.json"))
    results = json.loads(found[-1].read_text())["results"] if found else {}
    return {"exit": code, "seconds": round(seconds, 1), "results": results}


def nbval(python: Path, out: Path) -> dict[str, Any]:
    """nbval on the committed notebooks (L3's slow cells apart, as in ``make test``)."""
    xml = out / "nbval.xml"
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "notebooks", *NBVAL, f"--junitxml={xml}"]
    code, seconds = run_step(python, args, out / "nbval.log")
    return {"exit": code, "seconds": round(seconds, 1), "tests": junit_outcomes(xml)}


_FACTS = """
import json
from hyper_parallel.platform.torch.compat import gloo_averages
from tests.kit.judging.adapters.fsdp2 import lacking_in_installed
print(json.dumps({"fsdp2_lacks": lacking_in_installed(), "gloo_averages": gloo_averages()}))
"""


def torch_facts(python: Path) -> dict[str, Any]:
    """What this release's FSDP2 lacks (feature -> names, as the adapter finds them) and whether its
    gloo averages (our engine's probe: otherwise it reduces with SUM and divides)."""
    done = subprocess.run([str(python), "-c", _FACTS], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode:
        return {"fsdp2_lacks": {"(the adapter did not load)": done.stderr.strip().splitlines()[-1:]}}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_release(
    python: Path,
    out: Path,
    implementations: dict[str, str],
    with_nbval: bool,
    cases: str = "",
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every step of one release; each step's result is kept even when another fails."""
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = torch_facts(python)
    say(f"  engine tests -> {out / 'engine.log'}")
    result["engine"] = engine_tests(python, out)
    say(f"  plan cases ({', '.join(implementations)}) -> {out / 'conformance.log'}")
    result["cases"] = plan_cases(python, out, implementations, cases)
    if with_nbval:
        say(f"  nbval on the notebooks -> {out / 'nbval.log'}")
        result["nbval"] = nbval(python, out)
    return result
