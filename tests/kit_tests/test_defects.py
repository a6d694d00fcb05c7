"""The defects harness (``tools/defects``) builds its trees right: a fix reverted onto the head
where it applies, the fix's parent where asked, refusals named; judged defect against fixed tree.
The harness itself runs upstream for hours and is never part of ``make test``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tools.defects.catalogue import DEFECTS, Defect, select
from tools.defects.judge import TreeRun, compare
from tools.defects.trees import TreeError, repository, resolve, trees


def _git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    done = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True, env={**env, "PATH": "/usr/bin:/bin"}
    )
    return done.stdout.strip()


@pytest.fixture
def history(tmp_path: Path) -> Path:
    """A repository whose second commit fixes a bug in hyper_parallel/a.py (and touches docs)."""
    repo = tmp_path / "up"
    (repo / "hyper_parallel").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "hyper_parallel" / "a.py").write_text("def reduce(x):\n    return x  # bug: no division\n")
    (repo / "README").write_text("v1\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "start")
    (repo / "hyper_parallel" / "a.py").write_text("def reduce(x):\n    return x / 2\n")
    (repo / "README").write_text("v2\n")
    _git(repo, "commit", "-qam", "fix_reduce")
    (repo / "hyper_parallel" / "b.py").write_text("LATER = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "later work")
    return repo


def test_a_fix_is_reverted_onto_the_head_and_the_head_is_the_fixed_tree(history, tmp_path):
    gitdir = repository(str(history), tmp_path)
    head = resolve(gitdir, "HEAD")
    fix = _git(history, "rev-parse", "HEAD~1")
    defect = Defect("T1", fix[:7], "fix_reduce", "no division", "revert", ("hyper_parallel",))
    broken, fixed = trees(gitdir, head, defect, tmp_path / "trees")
    assert "bug: no division" in (broken / "hyper_parallel" / "a.py").read_text()
    assert (broken / "hyper_parallel" / "b.py").exists()  # the head's later work stays
    assert (broken / "README").read_text() == "v2\n"  # outside the defect's paths: untouched
    assert "x / 2" in (fixed / "hyper_parallel" / "a.py").read_text() and (fixed / "hyper_parallel" / "b.py").exists()


def test_a_parent_build_pairs_the_fix_with_its_parent(history, tmp_path):
    gitdir = repository(str(history), tmp_path)
    fix = _git(history, "rev-parse", "HEAD~1")
    defect = Defect("T2", fix[:7], "fix_reduce", "no division", "parent")
    broken, fixed = trees(gitdir, resolve(gitdir, "HEAD"), defect, tmp_path / "trees")
    assert "bug" in (broken / "hyper_parallel" / "a.py").read_text()
    assert (
        "x / 2" in (fixed / "hyper_parallel" / "a.py").read_text() and not (fixed / "hyper_parallel" / "b.py").exists()
    )


def test_a_fix_that_touches_nothing_under_its_paths_is_refused_by_name(history, tmp_path):
    gitdir = repository(str(history), tmp_path)
    fix = _git(history, "rev-parse", "HEAD~1")
    defect = Defect("T3", fix[:7], "fix_reduce", "x", "revert", ("hyper_parallel/nowhere.py",))
    with pytest.raises(TreeError, match="T3: the fix .* changes nothing"):
        trees(gitdir, resolve(gitdir, "HEAD"), defect, tmp_path / "trees")


def test_found_means_failing_with_the_defect_and_passing_without_it():
    fail, ok = {"status": "FAIL", "first_failure": "grad x"}, {"status": "PASS", "first_failure": ""}
    refused = {"status": "UNSUPPORTED", "first_failure": "unsupported: unknown keyword 'x'"}
    with_defect = TreeRun("broken", {"L1-01": fail, "L1-02": fail, "L1-03": refused, "L1-04": refused})
    without = TreeRun("fixed", {"L1-01": ok, "L1-02": fail, "L1-03": ok, "L1-04": refused})
    with_defect.l4 = [{"signature": "a"}, {"signature": "b"}]
    without.l4 = [{"signature": "a"}]
    finding = compare({"id": "T"}, with_defect, without)
    # L1-02 fails on both; L1-03 is refused only with the defect (a feature it took away); L1-04 on both
    assert [c["id"] for c in finding.cases] == ["L1-01", "L1-03"]
    assert finding.cases[1]["first_failure"].startswith("refused with the defect")
    assert [r["signature"] for r in finding.l4] == ["b"] and finding.found
    assert not compare({"id": "T"}, without, without).found


def test_a_case_failing_on_both_trees_is_found_by_a_check_that_fails_only_with_the_defect():
    both = {"status": "FAIL", "first_failure": "loss"}
    with_defect = TreeRun("broken", {"L1-05": {**both, "failed": ["loss", "unsharded bias freed"]}})
    without = TreeRun("fixed", {"L1-05": {**both, "failed": ["loss"], "passed_names": ["unsharded bias freed"]}})
    finding = compare({"id": "T"}, with_defect, without)
    assert [c["id"] for c in finding.cases] == ["L1-05"] and "unsharded bias freed" in finding.cases[0]["first_failure"]
    same = TreeRun("broken", {"L1-05": {**both, "failed": ["loss"]}})
    assert not compare({"id": "T"}, same, without).found


def test_the_catalogue_names_each_defect_once_and_refuses_unknown_ids():
    assert len({d.id for d in DEFECTS}) == len(DEFECTS) and all(d.build in ("revert", "parent") for d in DEFECTS)
    assert [d.id for d in select("D2,D1")] == ["D2", "D1"]
    with pytest.raises(ValueError, match="unknown defect id"):
        select("D1,D99")
