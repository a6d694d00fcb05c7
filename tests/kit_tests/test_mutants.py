"""The mutation harness's own logic, without a cluster: catalogue, edits, outcomes, matrix, report."""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from tools.mutants import cli, matrix, runner
from tools.mutants.catalogue import ENGINE_FILES, MUTANTS, Mutant, MutantError, select
from tools.mutants.locate import ENGINE_ROOT, engine_sources
from tools.mutants.report import render_html, write_report
from tools.mutants.runner import (
    REPO_ROOT,
    TOKEN_ENV,
    RunConfig,
    apply_mutant,
    check_applies,
    child_env,
    key_of_junit,
    key_of_nodeid,
    make_scratch,
    parse_junit,
    parse_progress,
    pytest_command,
    resolve_cases,
    run_pytest,
    snapshot_tree,
    sweep_leftovers,
    to_columns,
)

SuiteRun = matrix.SuiteRun


@functools.cache
def _head_text(path: str) -> str:
    """The file at HEAD (the catalogue's reference), or the working tree outside a git checkout."""
    shown = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=REPO_ROOT, capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else (REPO_ROOT / path).read_text(encoding="utf-8")


# -- the catalogue ----------------------------------------------------------------------------
def test_catalogue_ids_are_consecutive_two_digit_numbers():
    ids = [m.id for m in MUTANTS]
    assert len(ids) >= 32
    assert ids == [f"{n:02d}" for n in range(1, len(ids) + 1)]


def test_every_engine_file_has_at_least_two_mutants():
    per_file = Counter(m.file for m in MUTANTS)
    assert set(per_file) == set(ENGINE_FILES)
    assert min(per_file.values()) >= 2, per_file
    assert len({m.feature for m in MUTANTS}) >= 20


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_mutant_is_well_formed(mutant: Mutant):
    for text in (mutant.feature, mutant.description, mutant.equivalent):
        assert "\n" not in text
    assert mutant.feature and mutant.description and mutant.find
    assert mutant.find != mutant.replace


@functools.cache
def _head_engine() -> dict[str, str]:
    """The engine's files at HEAD (the working tree's outside a git checkout): relative path -> text."""
    listed = subprocess.run(["git", "ls-files", ENGINE_ROOT], cwd=REPO_ROOT, capture_output=True, text=True)
    files = [f for f in listed.stdout.split() if f.endswith(".py")] if listed.returncode == 0 else []
    if not files:
        return engine_sources(REPO_ROOT)
    return {f: _head_text(f) for f in files}


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_mutant_applies_once_at_head_and_compiles(mutant: Mutant):
    sources = _head_engine()
    file, mutated = mutant.apply_in(sources)
    assert mutated != sources[file]
    compile(mutated, file, "exec")


def _renamed_reindented_and_moved(sources: dict[str, str]) -> tuple[dict[str, str], dict[str, str], str]:
    """The engine as a refactor leaves it, behaviour unchanged: every function a mutant edits renamed
    (unless a mutant's own code calls it), one module-level function moved into a block of another
    file (one level deeper), and every file's layout changed (blank lines, comments). (new sources, old name ->
    new name, the moved function's name)."""
    where = {m.id: m.locate(sources) for m in MUTANTS}
    in_mutated_code = " ".join(m.find for m in MUTANTS)
    names = {loc.qualname.split(".")[-1] for loc in where.values() if loc.qualname}
    renames = {n: n + "_moved" for n in names if not re.search(rf"\b{n}\b", in_mutated_code) and n != "__init__"}
    moved = next(  # a private module-level helper of core/ that a mutant edits, defined once there
        loc
        for loc in where.values()
        if loc.qualname.startswith("_")
        and "." not in loc.qualname
        and "/core/" in loc.file
        and not loc.file.endswith("utils.py")
        and sources[loc.file].count(f"def {loc.qualname}(") == 1
    )
    moved_name = moved.qualname
    changed = {}
    for file, text in sources.items():
        for old, new in renames.items():
            text = re.sub(rf"\b{old}\b", new, text)
        changed[file] = text
    home = moved.file
    utils = next(f for f in changed if f.endswith("core/fully_shard/utils.py"))
    node = next(
        n
        for n in ast.parse(changed[home]).body
        if isinstance(n, ast.FunctionDef) and n.name == renames.get(moved_name, moved_name)
    )
    lines = changed[home].splitlines(keepends=True)
    body = "".join(lines[node.lineno - 1 : node.end_lineno])
    changed[home] = "".join(lines[: node.lineno - 1] + lines[node.end_lineno :])
    # moved one level deeper too: defined under a block of utils.py's, so its code is re-indented
    deeper = "".join("    " + line if line.strip() else line for line in body.splitlines(True))
    changed[utils] += "\n\nif True:\n" + deeper
    return {f: _reflowed(t) for f, t in changed.items()}, renames, moved_name


def _reflowed(text: str) -> str:
    """A blank line after every line ending a block's header, a comment after every line ending inside
    brackets with a comma: the layout changes, the tokens do not."""
    out = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\n")
        if body.endswith(":"):
            out.append(line + "\n")
        elif body.endswith(",") and not body.lstrip().startswith("#"):
            out.append(body + "  # reflowed\n")
        else:
            out.append(line)
    return "".join(out)


def test_every_mutant_survives_a_rename_a_move_and_a_reflow():
    """A refactor that renames the functions mutants edit, moves one to another file one level deeper
    and changes the engine's layout changes no behaviour, so every mutant must still apply once there
    and compile, and be found in its function under the new name and in the new file."""
    sources = _head_engine()
    refactored, renames, moved_name = _renamed_reindented_and_moved(sources)
    assert renames and refactored != sources
    for file, text in refactored.items():
        compile(text, file, "exec")  # the refactor itself is valid Python
    for mutant in MUTANTS:
        before, after = mutant.locate(sources), mutant.locate(refactored)
        file, mutated = mutant.apply_in(refactored)
        assert mutated != refactored[file], mutant.id
        compile(mutated, file, "exec")
        old_name = before.qualname.split(".")[-1]
        assert after.qualname.split(".")[-1] == renames.get(old_name, old_name), (mutant.id, after.qualname)
        if before.qualname == moved_name:
            assert after.file.endswith("utils.py") and not before.file.endswith("utils.py"), mutant.id


def test_select_parses_ids_and_ranges():
    assert [m.id for m in select("03,7")] == ["03", "07"]
    assert [m.id for m in select("10-12,11")] == ["10", "11", "12"]
    assert len(select(None)) == len(select("")) == len(MUTANTS)
    with pytest.raises(MutantError, match="99"):
        select("99")
    with pytest.raises(MutantError, match="bad mutant id"):
        select("x1")


# -- trees and edits --------------------------------------------------------------------------
def _toy_mutant(find: str, replace: str = "y = 2\n") -> Mutant:
    return Mutant("01", "pkg/mod.py", "toy", "toy bug", find, replace)


def test_snapshot_scratch_and_apply(tmp_path: Path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "mod.py").write_text("x = 1\ny = 1\n")
    (repo / "README.md").write_text("hi\n")
    snapshot = snapshot_tree(repo, ["pkg/mod.py", "README.md", "gone.py"], tmp_path / "snap")
    root = make_scratch(snapshot, "toy")
    try:
        apply_mutant(root, _toy_mutant("y = 1\n"))
        assert (root / "pkg" / "mod.py").read_text() == "x = 1\ny = 2\n"
        assert (root / "README.md").read_text() == "hi\n"
        assert not (root / "gone.py").exists()
        assert (snapshot / "pkg" / "mod.py").read_text() == "x = 1\ny = 1\n"  # the snapshot is untouched
    finally:
        shutil.rmtree(root)


def test_an_edit_that_does_not_apply_once_fails_loudly(tmp_path: Path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("a = 1\na = 1\n")
    for find in ("a = 1\n", "b = 1\n"):
        with pytest.raises(MutantError, match="occurs"):
            apply_mutant(tmp_path, _toy_mutant(find))
    problems = check_applies(tmp_path, [_toy_mutant("a = 1\n"), _toy_mutant("a = 1\na")])
    assert len(problems) == 1 and "2 times" in problems[0]
    with pytest.raises(MutantError, match="occurs 0 times"):
        apply_mutant(tmp_path, Mutant("02", "pkg/none.py", "toy", "toy", "x", "y"))


def test_child_env_runs_the_tree_never_a_joined_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HPKIT_CLUSTER_ID", "someone")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = child_env(tmp_path, "tok")
    assert "HPKIT_CLUSTER_ID" not in env
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]
    assert env[TOKEN_ENV] == "tok" and env["IPP_NONINTERACTIVE"] == "1"


def test_pytest_commands(tmp_path: Path):
    config = RunConfig(("cases", "engine"), tmp_path, 60.0, case_targets=("a.py::t",), engine_k="zero")
    cases = pytest_command("cases", tmp_path / "j.xml", config)
    assert cases[1:3] == ["-m", "pytest"] and "no:cacheprovider" in cases
    assert cases[-3:] == ["-m", "L0 or L1 or L2 or L3", "a.py::t"]
    assert pytest_command("engine", tmp_path / "j.xml", config)[-5:] == ["-m", "engine", "-k", "zero", "tests/engine"]
    with pytest.raises(ValueError):
        pytest_command("nbval", tmp_path / "j.xml", config)


def test_resolve_cases_by_id_or_name():
    registry = {"test_zero_grad": ("L1-04", "tests/torch/fully_shard/test_fully_shard_module.py::test_zero_grad")}
    node = registry["test_zero_grad"][1]
    assert resolve_cases("L1-04, test_zero_grad", registry) == (node,)
    with pytest.raises(ValueError, match="L1-99"):
        resolve_cases("L1-99", registry)


# -- processes --------------------------------------------------------------------------------
def _gone(pid: int, within: float = 5.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


# A run that starts a child in its process group and prints the child's pid, then sleeps.
SLEEPER_WITH_CHILD = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_run_past_its_timeout_is_stopped_with_its_whole_group(tmp_path: Path):
    log = tmp_path / "run.log"
    script = SLEEPER_WITH_CHILD
    status, code, seconds = run_pytest([sys.executable, "-c", script], tmp_path, dict(os.environ), log, timeout=1.0)
    assert status == "timeout" and code is None and seconds < 30
    grandchild = int(log.read_text().split()[0])
    assert _gone(grandchild), "the run's child survived its group being stopped"


def test_a_finished_run_reports_its_exit_code(tmp_path: Path):
    env = dict(os.environ)
    failed = run_pytest([sys.executable, "-c", "raise SystemExit(1)"], tmp_path, env, tmp_path / "a.log", 30)
    usage = run_pytest([sys.executable, "-c", "raise SystemExit(4)"], tmp_path, env, tmp_path / "b.log", 30)
    assert failed[:2] == ("ok", 1)  # pytest: some tests failed
    assert usage[:2] == ("crashed", 4)  # pytest could not run the tests


def test_leftovers_carrying_the_token_are_swept(tmp_path: Path):
    env = {**os.environ, TOKEN_ENV: "sweep-me"}
    escaped = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True, cwd=tmp_path
    )
    try:
        assert sweep_leftovers("sweep-me", tmp_path, grace=0.3) == 1
        assert escaped.wait(10) != 0
    finally:
        if escaped.poll() is None:
            escaped.kill()


# -- outcomes ---------------------------------------------------------------------------------
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
 <testcase classname="tests.torch.fully_shard.test_fully_shard_module" name="test_zero_grad" time="1"/>
 <testcase classname="tests.torch.fully_shard.test_fully_shard_module" name="test_set_reduce_op_type" time="1">
  <failure message="FAIL">boom</failure></testcase>
 <testcase classname="tests.engine.test_engine_controls" name="test_control_2_ranks[a]" time="1">
  <error message="teardown">x</error></testcase>
 <testcase classname="tests.engine.test_engine_controls" name="test_skip" time="0"><skipped/></testcase>
 <testcase classname="" name="tests.engine.test_broken" time="0"><error message="collection failure"/></testcase>
</testsuite></testsuites>
"""


def test_junit_outcomes(tmp_path: Path):
    path = tmp_path / "j.xml"
    path.write_text(JUNIT)
    assert parse_junit(path) == {
        "test_fully_shard_module::test_zero_grad": "passed",
        "test_fully_shard_module::test_set_reduce_op_type": "failed",
        "test_engine_controls::test_control_2_ranks[a]": "error",
        "test_engine_controls::test_skip": "skipped",
        "(collection) tests.engine.test_broken": "error",
    }


def test_progress_log_names_the_test_running_at_a_timeout(tmp_path: Path):
    a, b, c = (f"tests/torch/fully_shard/test_m.py::test_{x}" for x in "abc")
    events = [
        {"event": "start", "nodeid": a},
        {"event": "report", "nodeid": a, "when": "setup", "outcome": "passed"},
        {"event": "report", "nodeid": a, "when": "call", "outcome": "passed"},
        {"event": "report", "nodeid": a, "when": "teardown", "outcome": "failed"},
        {"event": "finish", "nodeid": a},
        {"event": "start", "nodeid": b},
        {"event": "report", "nodeid": b, "when": "call", "outcome": "failed"},
        {"event": "finish", "nodeid": b},
        {"event": "start", "nodeid": c},
        {"event": "report", "nodeid": c, "when": "setup", "outcome": "passed"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events) + "\nnot json\n")
    assert parse_progress(path) == {"test_m::test_a": "error", "test_m::test_b": "failed", "test_m::test_c": "timeout"}
    assert parse_progress(tmp_path / "missing.jsonl") == {}


def test_keys_and_case_columns():
    assert key_of_nodeid("tests/engine/test_x.py::test_y[p-q]") == "test_x::test_y[p-q]"
    assert key_of_junit("tests.engine.test_x", "test_y[p-q]") == "test_x::test_y[p-q]"
    outcomes = {"test_m::test_zero_grad": "failed", "test_m::test_unknown": "passed"}
    names = {"test_zero_grad": "L1-04"}
    assert to_columns(outcomes, "cases", names) == {"L1-04": "failed", "test_m::test_unknown": "passed"}
    assert to_columns(outcomes, "engine", names) == outcomes


# -- matrix, verdicts, scores -----------------------------------------------------------------
def _mutant(mutant_id: str, equivalent: str = "") -> Mutant:
    return Mutant(mutant_id, "hyper_parallel/x.py", "feature", f"bug {mutant_id}", "a", "b", equivalent)


def _run(suite: str, status: str = "ok", **outcomes: str) -> SuiteRun:
    return SuiteRun(suite, status, 1.5, dict(outcomes), 0, log=f"logs/{suite}.log")


def _results() -> tuple[list[Mutant], matrix.Results]:
    mutants = [_mutant("01"), _mutant("02"), _mutant("03"), _mutant("04", "cannot be seen"), _mutant("05")]
    results = {
        "01": {"cases": _run("cases", L1_03="failed"), "engine": _run("engine", t="passed")},
        "02": {"cases": _run("cases", L1_03="passed"), "engine": _run("engine", t="error")},
        "03": {"cases": _run("cases", "timeout"), "engine": _run("engine", t="passed")},
        "04": {"cases": _run("cases", L1_03="passed"), "engine": _run("engine", t="passed")},
        "05": {"cases": SuiteRun("cases", "invalid", note="ImportError"), "engine": SuiteRun("engine", "invalid")},
    }
    return mutants, results


def test_verdicts():
    mutants, results = _results()
    verdicts = [matrix.verdict(m, results[m.id]) for m in mutants]
    assert verdicts == ["KILLED", "KILLED", "KILLED", "EQUIVALENT", "INVALID"]
    assert matrix.verdict(_mutant("09"), {}) == "NOT RUN"
    assert results["03"]["cases"].killers() == ["(timeout)"]
    assert matrix.verdict(_mutant("02"), {"cases": results["02"]["cases"]}) == "SURVIVED"


def test_scores_leave_out_equivalent_and_unjudged_mutants():
    mutants, results = _results()
    cases = matrix.score(mutants, results, ("cases",))
    assert (cases["killed"], cases["judged"], cases["survivors"]) == (2, 3, ["02"])
    both = matrix.score(mutants, results, ("cases", "engine"))
    assert (both["killed"], both["judged"], both["fraction"]) == (3, 3, 1.0)
    assert matrix.score([], {}, ("cases",))["fraction"] is None
    results["04"]["engine"] = _run("engine", t="failed")
    assert matrix.contradicted_equivalents(mutants, results) == ["04"]


def test_columns_follow_the_plan_order():
    baseline = {"cases": _run("cases", **{c: "passed" for c in ("L1-03", "L0-TP", "L0-10", "L0-02", "test_m::x")})}
    results = {"01": {"cases": _run("cases", **{"L2-01": "failed"})}}
    assert matrix.columns("cases", baseline, results) == ["L0-02", "L0-10", "L0-TP", "L1-03", "L2-01", "test_m::x"]


def test_report_json_and_html(tmp_path: Path):
    mutants, results = _results()
    baseline = {"cases": _run("cases", L1_03="passed"), "engine": _run("engine", t="passed")}
    built = matrix.build({"started": "now", "timeout_per_run": 900}, mutants, baseline, results, ("cases", "engine"))
    write_report(tmp_path, built)
    assert json.loads((tmp_path / "matrix.json").read_text()) == json.loads(json.dumps(built))
    html = (tmp_path / "index.html").read_text()
    assert html.startswith("<!doctype html>") and "<style>" in html and "src=" not in html
    assert "2/3 = 66.7%" in html and "3/3 = 100.0%" in html
    assert "EQUIVALENT: cannot be seen" in html and "INVALID: ImportError" in html
    assert "class='kill' title='failed'>F<" in html and "href='logs/cases.log'" in html
    row = {r["id"]: r for r in built["mutants"]}["01"]
    assert row["killed_by"] == {"cases": ["L1_03"], "engine": []} and row["verdict"] == "KILLED"


def test_report_without_baseline_or_runs():
    built = matrix.build({"no_baseline": True}, [_mutant("01")], {}, {}, ("cases",))
    html = render_html(built)
    assert "skipped (--no-baseline)" in html and "NOT RUN" in html


def test_summary_line_names_the_killers():
    mutants, results = _results()
    line = cli.summary_line(mutants[0], results["01"])
    assert line.startswith("[01] KILLED") and "cases: killed by 1 (L1_03)" in line and "engine: killed by 0" in line


# -- interruption and the baseline ------------------------------------------------------------
class _InterruptedPopen(subprocess.Popen):
    """A Popen whose wait for the run (timeout 123) is cut short by Ctrl-C once the run has
    started a child of its own (its pid is the first line of the log)."""

    log: Path

    def wait(self, timeout=None):
        if timeout == 123:
            end = time.monotonic() + 10
            while not self.log.read_text().strip() and time.monotonic() < end:
                time.sleep(0.02)
            raise KeyboardInterrupt
        return super().wait(timeout)


def test_ctrl_c_stops_the_run_with_its_whole_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    log = tmp_path / "run.log"
    script = SLEEPER_WITH_CHILD
    monkeypatch.setattr(_InterruptedPopen, "log", log, raising=False)
    monkeypatch.setattr(runner.subprocess, "Popen", _InterruptedPopen)
    with pytest.raises(KeyboardInterrupt):
        run_pytest([sys.executable, "-c", script], tmp_path, dict(os.environ), log, timeout=123)
    assert _gone(int(log.read_text().split()[0])), "the run's child survived Ctrl-C"


def _args(tmp_path: Path, **overrides) -> argparse.Namespace:
    args = cli.parse_args(["--out", str(tmp_path / "out"), "--suite", "cases"])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def test_ctrl_c_writes_the_partial_report_and_exits_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def fake_run_tree(snapshot, mutant, config, on_suite=None):
        if mutant.id == "02":
            raise KeyboardInterrupt
        return {"cases": _run("cases", L1_03="failed")}

    monkeypatch.setattr(cli, "run_tree", fake_run_tree)
    monkeypatch.setattr(cli, "plan_cases", lambda repo: {})
    status = cli.run(_args(tmp_path, no_baseline=True), list(MUTANTS[:3]), tmp_path)
    assert status == 130
    built = json.loads((tmp_path / "out" / "matrix.json").read_text())
    assert built["meta"]["state"] == "interrupted"
    assert [row["verdict"] for row in built["mutants"]] == ["KILLED", "NOT RUN", "NOT RUN"]
    assert (tmp_path / "out" / "index.html").exists()


def test_a_passing_baseline_is_reused_for_the_same_tree_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    calls: list[str] = []
    verdicts = {"outcome": "passed"}

    def fake_run_tree(snapshot, mutant, config, on_suite=None):
        calls.append("baseline")
        return {"cases": _run("cases", L1_03=verdicts["outcome"])}

    monkeypatch.setattr(cli, "run_tree", fake_run_tree)
    monkeypatch.setattr(cli, "BASELINE_CACHE", tmp_path / "cache.json")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.py").write_text("x = 1\n")
    config = RunConfig(("cases",), tmp_path / "out", 60.0)
    progress = cli.Progress(0)

    def passes(fresh: bool = False) -> bool:
        session = cli.Session({}, [], ("cases",), tmp_path / "out")
        return cli._baseline_passes(session, tree, config, progress, fresh)

    assert passes() and passes() and calls == ["baseline"]  # the second one is cached
    assert passes(fresh=True) and len(calls) == 2
    (tree / "a.py").write_text("x = 2\n")
    verdicts["outcome"] = "failed"
    assert not passes() and not passes() and len(calls) == 4  # a changed tree runs; failures are not cached
    progress.close()


def test_reach_reads_only_as_the_harness_and_names_the_unmutated_tree_first():
    from tools.mutants.reach import mutant_ids

    assert mutant_ids("83,none,75") == ["none", "75", "83"]
    assert mutant_ids("71-73") == ["71", "72", "73"]
    with pytest.raises(MutantError, match="999"):
        mutant_ids("75,999")


def test_reach_table_tells_a_covering_kill_from_a_draw_kill_and_a_survivor():
    from tools.mutants.reach import table

    rows = [
        {"mutant": "83", "seed": 0, "killed": False, "ran": 351, "covering": 51, "at": None},
        {"mutant": "83", "seed": 1, "killed": True, "ran": 68, "covering": 51, "at": 68},
        {"mutant": "20", "seed": 0, "killed": True, "ran": 9, "covering": 51, "at": 9},
        {"mutant": "20", "seed": 1, "error": "no outcome within 1800 s"},
    ]
    lines = table(rows, [0, 1, 2]).splitlines()
    assert lines[2] == "| 83 | survives 351 | killed d17 | - |"
    assert lines[3] == "| 20 | killed c9 | error | - |"
