"""Runs one tree (the unmutated baseline or one mutant) through pytest in a scratch copy.

The repository's files (tracked, and untracked but not ignored) are snapshotted once per
harness run; every tree is a fresh copy of that snapshot under the system temp dir, with the
mutant's edit made, removed afterwards whatever happens. pytest runs in its own session and
process group with a bounded wait: on a timeout or Ctrl-C the group is interrupted, then
killed, and every process that carries the tree's token (or works inside it) is swept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .catalogue import Mutant, MutantError
from .matrix import SuiteRun, worse
from .pytest_progress import PROGRESS_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
CASE_MARKERS = "L0 or L1 or L2 or L3"
CASE_TESTS = "tests/torch"
L4_TESTS = "tests/kit_tests/test_explore.py"
ENGINE_TESTS = "tests/engine"
PLUGIN = "tools.mutants.pytest_progress"
TOKEN_ENV = "MUTANTS_RUN_TOKEN"  # in the environment of every process a tree's runs start
STOP_GRACE_S = 10.0  # after SIGINT, how long pytest gets to tear its cluster down
LEFTOVER_GRACE_S = 5.0  # how long a tree's leftovers get to exit on their own before SIGKILL
IMPORT_TIMEOUT_S = 120.0
# a joined cluster would run its own (unmutated) code; extra options would change the matrix
_SCRUBBED_ENV = ("HPKIT_CLUSTER_ID", "HPKIT_PROFILE", "PYTEST_ADDOPTS")


@dataclass(frozen=True)
class RunConfig:
    """What every tree's runs share: suites, selection, time bound, where evidence goes."""

    suites: tuple[str, ...]
    out: Path
    timeout: float
    case_targets: tuple[str, ...] = (CASE_TESTS,)
    engine_k: str = ""
    names: Mapping[str, str] = field(default_factory=dict)  # plan name -> case id


# -- the tree ---------------------------------------------------------------------------------
def tree_files(repo: Path) -> list[str]:
    """The repository's files: tracked, and untracked but not ignored (``git ls-files -co``)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, capture_output=True, check=True
    ).stdout
    return sorted({name for name in listed.decode().split("\0") if name})


def snapshot_tree(repo: Path, files: Sequence[str], dest: Path) -> Path:
    """Copy ``files`` of ``repo`` into ``dest`` (files deleted meanwhile are skipped)."""
    for name in files:
        source = repo / name
        if not source.is_file() and not source.is_symlink():
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    return dest


def make_scratch(snapshot: Path, label: str) -> Path:
    """A fresh copy of the snapshot under the system temp dir."""
    root = Path(tempfile.mkdtemp(prefix=f"hpkit-mutant-{label}-"))
    shutil.copytree(snapshot, root, symlinks=True, dirs_exist_ok=True)
    return root


def apply_mutant(root: Path, mutant: Mutant) -> None:
    """Make the mutant's edit in the tree at ``root``, in whichever file holds its code now
    (``MutantError`` unless the code occurs exactly once)."""
    path, _, mutated = mutant.apply_in_tree(root)
    path.write_text(mutated, encoding="utf-8")


def check_applies(root: Path, mutants: Sequence[Mutant]) -> list[str]:
    """One message per mutant whose edit does not apply exactly once to the tree at ``root``."""
    problems = []
    for mutant in mutants:
        try:
            mutant.apply_in_tree(root)
        except (MutantError, OSError) as exc:
            problems.append(str(exc))
    return problems


def child_env(root: Path, token: str) -> dict[str, str]:
    """The environment of every process run in the tree: its code first on the path, our token."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    env["IPP_NONINTERACTIVE"] = "1"
    env["HPKIT_DIAGNOSE"] = "0"  # a kill is a kill: no diagnosis runs of the failing cases
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env[TOKEN_ENV] = token
    return env


def import_error(root: Path, env: Mapping[str, str]) -> str | None:
    """None if ``import hyper_parallel`` works in the tree and comes from it; else why not."""
    probe = "import hyper_parallel; print(hyper_parallel.__file__)"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe],
            cwd=root,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return f"import hyper_parallel took over {IMPORT_TIMEOUT_S:g} s"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return "import hyper_parallel failed: " + (lines[-1] if lines else f"exit {done.returncode}")
    origin = Path(done.stdout.strip()).resolve()
    if not origin.is_relative_to(root.resolve()):
        return f"hyper_parallel imported from {origin}, not from the scratch tree"
    return None


# -- processes --------------------------------------------------------------------------------
@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Let cleanup finish even if Ctrl-C is pressed again (main thread only)."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the child has exited, without reaping it: while unreaped, its pid (the id of the
    group it leads) cannot be reused, so signalling the group reaches only our processes."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """Interrupt pytest's process group (its cluster tears down), then kill whatever is left."""
    with sigint_ignored():
        if not _exited(proc):
            _signal_group(proc.pid, signal.SIGINT)
            end = time.monotonic() + grace
            while not _exited(proc) and time.monotonic() < end:
                time.sleep(0.05)
        if proc.returncode is None:  # not reaped yet: the group id is still ours
            _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


def _owned(token: str, root: Path) -> list:
    """Processes (not this one) carrying the tree's token, or working inside the tree."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a test dependency
        return []
    inside, found = str(root.resolve()), []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error, OSError):
            cwd = proc.cwd()
            if proc.environ().get(TOKEN_ENV) == token or cwd == inside or cwd.startswith(inside + os.sep):
                found.append(proc)
    return found


def sweep_leftovers(token: str, root: Path, grace: float = LEFTOVER_GRACE_S) -> int:
    """Give a tree's leftover processes ``grace`` seconds to exit, then SIGKILL them; how many."""
    with sigint_ignored():
        end = time.monotonic() + grace
        left = _owned(token, root)
        while left and time.monotonic() < end:
            time.sleep(0.2)
            left = _owned(token, root)
        for proc in left:
            with contextlib.suppress(Exception):
                proc.kill()
        return len(left)


def run_pytest(
    cmd: Sequence[str], cwd: Path, env: Mapping[str, str], log: Path, timeout: float
) -> tuple[str, int | None, float]:
    """Run ``cmd`` in its own process group, output to ``log``; (status, exit code, seconds)."""
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return "timeout", None, time.monotonic() - started
        except BaseException:
            stop_group(proc)
            raise
    return ("ok" if code in (0, 1) else "crashed"), code, time.monotonic() - started


# -- outcomes ---------------------------------------------------------------------------------
def key_of_nodeid(nodeid: str) -> str:
    """``tests/engine/test_x.py::test_y[p]`` -> ``test_x::test_y[p]``."""
    path, sep, rest = nodeid.partition("::")
    stem = Path(path).stem
    return f"{stem}::{rest}" if sep else f"(collection) {nodeid}"


def key_of_junit(classname: str, name: str) -> str:
    """junit's ``tests.engine.test_x`` / ``test_y[p]`` -> ``test_x::test_y[p]``."""
    if not classname:
        return f"(collection) {name}"
    return f"{classname.rsplit('.', 1)[-1]}::{name}"


def parse_junit(path: Path) -> dict[str, str]:
    """Test key -> passed/failed/error/skipped, from a pytest junit XML file."""
    outcomes: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("skipped", "failure", "error"):
            if case.find(tag) is not None:
                outcome = worse(outcome, "failed" if tag == "failure" else tag)
        key = key_of_junit(case.get("classname", ""), case.get("name", ""))
        outcomes[key] = worse(outcomes.get(key), outcome)
    return outcomes


def _phase_outcome(when: str, outcome: str) -> str | None:
    if outcome == "failed":
        return "failed" if when == "call" else "error"
    if outcome == "skipped":
        return "skipped"
    return "passed" if when == "call" else None


def parse_progress(path: Path) -> dict[str, str]:
    """Test key -> outcome from the progress plugin's log; a test started and never finished
    was running when the run was stopped: ``timeout``."""
    outcomes: dict[str, str] = {}
    started: set[str] = set()
    finished: set[str] = set()
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    for line in lines:
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            nodeid, kind = event.get("nodeid", ""), event.get("event")
            if kind == "start":
                started.add(nodeid)
            elif kind == "finish":
                finished.add(nodeid)
            elif kind == "collect":
                outcomes[f"(collection) {nodeid}"] = "error"
            elif kind == "report":
                outcome = _phase_outcome(event.get("when", ""), event.get("outcome", ""))
                if outcome:
                    key = key_of_nodeid(nodeid)
                    outcomes[key] = worse(outcomes.get(key), outcome)
    for nodeid in started - finished:
        key = key_of_nodeid(nodeid)
        outcomes[key] = worse(outcomes.get(key), "timeout")
    return outcomes


def to_columns(outcomes: Mapping[str, str], suite: str, names: Mapping[str, str]) -> dict[str, str]:
    """Plan cases are named by their case id (``test_fully_shard_module::test_zero_grad`` -> L1-04);
    engine tests keep their pytest ids."""
    if suite != "cases":
        return dict(outcomes)
    result: dict[str, str] = {}
    for key, outcome in outcomes.items():
        column = names.get(key.partition("::")[2], key)
        result[column] = worse(result.get(column), outcome)
    return result


L4_CI_BUDGET = "28"
L4_SUITE = ("test_the_explorer_finds_nothing_within_its_budget", "test_regressions_and_replays_pass")


# -- suites -----------------------------------------------------------------------------------
def pytest_command(suite: str, junit: Path, config: RunConfig) -> list[str]:
    """``python -m pytest`` for one suite: plan cases (by marker) or engine tests."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", PLUGIN, f"--junitxml={junit}"]
    if suite == "cases":
        return [*cmd, "-m", CASE_MARKERS, *config.case_targets]
    if suite == "engine":
        return [*cmd, "-m", "engine", *(["-k", config.engine_k] if config.engine_k else []), ENGINE_TESTS]
    if suite == "l4":  # L4 as CI runs it: the explorer on HPKIT_L4_EXAMPLES' budget, and every committed regression
        # (the replays pin what L4 once reached, whatever the grammar draws since: tests/kit/explore/regressions/)
        return [*cmd, *(f"{L4_TESTS}::{test}" for test in L4_SUITE)]
    raise ValueError(f"unknown suite {suite!r}")


def run_suite(root: Path, env: Mapping[str, str], label: str, suite: str, config: RunConfig) -> SuiteRun:
    """One suite on the tree at ``root``; evidence (log, junit, progress) under ``config.out``."""
    logs, junits = config.out / "logs", config.out / "junit"
    logs.mkdir(parents=True, exist_ok=True)
    junits.mkdir(parents=True, exist_ok=True)
    log, junit, progress = (
        logs / f"{label}-{suite}.log",
        junits / f"{label}-{suite}.xml",
        logs / f"{label}-{suite}.jsonl",
    )
    for stale in (junit, progress):
        stale.unlink(missing_ok=True)
    cmd = pytest_command(suite, junit.resolve(), config)
    if suite == "l4":  # CI's L4 reach: the covering phase and its draws (the notebook's 20, the test's 8)
        env = {"HPKIT_L4_EXAMPLES": L4_CI_BUDGET, **env}
    status, code, seconds = run_pytest(cmd, root, {**env, PROGRESS_ENV: str(progress.resolve())}, log, config.timeout)
    note = ""
    try:
        raw = parse_junit(junit) if status != "timeout" and junit.exists() else parse_progress(progress)
    except ET.ParseError as exc:
        raw, note = parse_progress(progress), f"unreadable junit XML: {exc}"
    return SuiteRun(
        suite,
        status,
        round(seconds, 1),
        to_columns(raw, suite, config.names),
        code,
        log=log.relative_to(config.out).as_posix(),
        note=note,
    )


def run_tree(
    snapshot: Path,
    mutant: Mutant | None,
    config: RunConfig,
    on_suite: Callable[[str, str], None] | None = None,
) -> dict[str, SuiteRun]:
    """Copy the snapshot, apply ``mutant`` (None: the baseline), check it imports, run every
    suite; the scratch copy and every process it started are gone when this returns."""
    label = mutant.id if mutant is not None else "baseline"
    root = make_scratch(snapshot, label)
    token = secrets.token_hex(8)
    runs: dict[str, SuiteRun] = {}
    try:
        if mutant is not None:
            apply_mutant(root, mutant)
        env = child_env(root, token)
        problem = import_error(root, env)
        if problem:
            runs.update({suite: SuiteRun(suite, "invalid", note=problem) for suite in config.suites})
            return runs
        for suite in config.suites:
            if on_suite is not None:
                on_suite(label, suite)
            runs[suite] = run_suite(root, env, label, suite, config)
        return runs
    finally:
        with sigint_ignored():
            swept = sweep_leftovers(token, root)
            shutil.rmtree(root, ignore_errors=True)
        for run in runs.values() if swept else ():
            run.note = "; ".join(filter(None, (run.note, f"{swept} leftover process(es) killed after the runs")))


def tree_fingerprint(root: Path, *extra: str) -> str:
    """A digest of every file under ``root`` (names and bytes) and ``extra`` (the selection)."""
    digest = hashlib.sha256("\0".join(extra).encode())
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


# -- the plan's cases -------------------------------------------------------------------------
def plan_cases(repo: Path) -> dict[str, tuple[str, str]]:
    """Plan name -> (case id, pytest node id), from the kit's registry ({} if it cannot load)."""
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    try:
        from tests.kit.judging.case import LEVELS, load_plan_cases

        registry = load_plan_cases()
    except Exception as exc:  # noqa: BLE001 - the matrix then shows test names instead of ids
        print(f"warning: cannot load the plan's cases ({exc!r}); columns keep pytest names", file=sys.stderr)
        return {}
    found = {}
    for case in registry.values():
        if case.level not in LEVELS:
            continue
        package, _, stem = case.body.__module__.rpartition(".")
        path = Path(*package.split("."), f"{stem.lstrip('_')}.py").as_posix()
        found[case.name] = (case.id, f"{path}::{case.name}")
    return found


def resolve_cases(spec: str, registry: Mapping[str, tuple[str, str]]) -> tuple[str, ...]:
    """Node ids of the cases named in ``spec`` (ids or plan names, comma-separated)."""
    by_key = {name: node for name, (_, node) in registry.items()}
    by_key.update({case_id: node for case_id, node in registry.values()})
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in by_key]
    if unknown or not wanted:
        known = sorted((case_id for case_id, _ in registry.values()), key=str)
        raise ValueError(
            f"unknown case(s) {unknown or spec!r}; known: {', '.join(known) or 'none (registry not loaded)'}"
        )
    return tuple(dict.fromkeys(by_key[w] for w in wanted))
