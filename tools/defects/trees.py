"""Upstream's trees with and without each defect, made from its git history at run time.

``upstream`` is a git directory (a clone or the bare mirror ``fetch`` makes) or a URL, cloned bare
under the run's folder. A fixed tree is exported once per commit and shared; a reverted tree is a
shared clone of the head with the fix's changes under the defect's paths undone by a three-way
apply, so upstream's code lives only under ``runs/``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from tools.defects.catalogue import Defect


class TreeError(RuntimeError):
    """A defect that cannot be rebuilt (the revert conflicts, a commit is missing)."""


def _git(*args: str, cwd: Path | None = None, stdin: bytes | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, timeout=600, check=False)
    if done.returncode:
        raise TreeError(f"git {' '.join(args[:3])}...: {done.stderr.decode(errors='replace').strip()[:400]}")
    return done.stdout.decode(errors="replace")


def repository(upstream: str, work: Path) -> Path:
    """A git directory holding upstream's history: ``upstream`` itself when it is one, else a bare
    clone of it (a URL) under ``work``."""
    path = Path(upstream).expanduser()
    if path.exists():
        _git("--git-dir", str(path / ".git" if (path / ".git").exists() else path), "rev-parse", "HEAD")
        return path / ".git" if (path / ".git").exists() else path
    target = work / "upstream.git"
    if not target.exists():
        _git("clone", "--bare", "-q", upstream, str(target))
    return target


def resolve(gitdir: Path, rev: str) -> str:
    """The full sha of ``rev``."""
    return _git("--git-dir", str(gitdir), "rev-parse", "--verify", f"{rev}^{{commit}}").strip()


def export(gitdir: Path, sha: str, dest: Path) -> Path:
    """Commit ``sha``'s files under ``dest`` (made once)."""
    if not (dest / "hyper_parallel").exists():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "--git-dir", str(gitdir), "archive", sha], capture_output=True, timeout=600, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, timeout=600)
    return dest


def _made(dest: Path, make: Callable[[], None]) -> Path:
    """``dest`` made by ``make`` once; a half-made one (a conflict) is removed, never reused."""
    if (dest / "hyper_parallel").exists():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    try:
        make()
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest


def reverted(gitdir: Path, head: str, defect: Defect, dest: Path) -> Path:
    """The head with the defect's fix undone under its paths (a three-way apply of the reversed diff)."""
    return _made(dest, lambda: _revert(gitdir, head, defect, dest))


def _revert(gitdir: Path, head: str, defect: Defect, dest: Path) -> None:
    fix = resolve(gitdir, defect.fix)
    _git("clone", "-q", "--shared", "--no-checkout", str(gitdir), str(dest))
    _git("checkout", "-q", head, cwd=dest)
    diff = _git("--git-dir", str(gitdir), "diff", f"{fix}^", fix, "--", *defect.paths)
    if not diff.strip():
        raise TreeError(f"{defect.id}: the fix {defect.fix} changes nothing under {', '.join(defect.paths)}")
    _git("apply", "-3", "-R", cwd=dest, stdin=diff.encode())


def patched(gitdir: Path, sha: str, also: tuple[tuple[str, tuple[str, ...]], ...], dest: Path) -> Path:
    """Commit ``sha`` with the later fixes in ``also`` applied (three-way) under their paths."""
    return _made(dest, lambda: _patch(gitdir, sha, also, dest))


def _patch(gitdir: Path, sha: str, also: tuple[tuple[str, tuple[str, ...]], ...], dest: Path) -> None:
    _git("clone", "-q", "--shared", "--no-checkout", str(gitdir), str(dest))
    _git("checkout", "-q", sha, cwd=dest)
    for later, paths in also:
        fix = resolve(gitdir, later)
        _git(
            "apply", "-3", cwd=dest, stdin=_git("--git-dir", str(gitdir), "diff", f"{fix}^", fix, "--", *paths).encode()
        )


def trees(gitdir: Path, head: str, defect: Defect, work: Path) -> tuple[Path, Path]:
    """(the tree with the defect, the same tree without it) for one defect."""
    fix = resolve(gitdir, defect.fix)
    if defect.build == "revert":
        return reverted(gitdir, head, defect, work / f"{defect.id}-defect"), export(gitdir, head, work / head[:10])
    if defect.build == "parent":
        parent = resolve(gitdir, f"{fix}^")
        if defect.also:
            suffix = "+" + "+".join(later for later, _ in defect.also)
            return patched(gitdir, parent, defect.also, work / (parent[:10] + suffix)), patched(
                gitdir, fix, defect.also, work / (fix[:10] + suffix)
            )
        return export(gitdir, parent, work / parent[:10]), export(gitdir, fix, work / fix[:10])
    raise TreeError(f"{defect.id}: unknown build {defect.build!r}")
