"""One virtual environment per torch release, under ``.venvs/torch-<release>`` (git-ignored): that
torch from the package registry (2.13.0 from local disk), this project with its test extras, the
hypothesis pin, and the Jupyter kernelspec, each installed once and reused while
``pyproject.toml`` and ``constraints.txt`` are unchanged."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
VENVS = REPO_ROOT / ".venvs"
STAMP = ".hpkit-installed"
RELEASE = re.compile(r"^\d+\.\d+\.\d+$")


def check_release(release: str) -> str:
    """A torch release as pip names it (``2.9.1``); anything else is refused before any install."""
    if not RELEASE.match(release):
        raise ValueError(f"torch release {release!r}: expected MAJOR.MINOR.PATCH, e.g. 2.9.1")
    return release


def venv_path(release: str) -> Path:
    return VENVS / f"torch-{check_release(release)}"


def python_of(release: str) -> Path:
    return venv_path(release) / "bin" / "python"


def _pins(release: str) -> str:
    """The project's constraints with torch held at ``release``."""
    lines = (REPO_ROOT / "constraints.txt").read_text().splitlines()
    kept = [line for line in lines if line.strip() and not line.lstrip().startswith(("#", "torch=="))]
    return "\n".join([f"torch=={release}", *kept]) + "\n"


def _fingerprint(release: str) -> str:
    """What the installed project depends on: a change reinstalls it."""
    text = _pins(release) + (REPO_ROOT / "pyproject.toml").read_text()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ensure(release: str, say: Callable[[str], None] = print) -> tuple[Path, float]:
    """The venv of ``release``, made and installed if it is not yet: (its python, seconds spent)."""
    started = time.monotonic()
    root = venv_path(release)
    stamp = root / STAMP
    if stamp.exists() and stamp.read_text().strip() == _fingerprint(release):
        return python_of(release), 0.0
    if not python_of(release).exists():
        say(f"torch {release}: making {root.relative_to(REPO_ROOT)}")
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    pins = root / "constraints.txt"
    pins.write_text(_pins(release))
    pip = [str(python_of(release)), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-c", str(pins)]
    say(f"torch {release}: installing torch (a build from the registry can be several GB)")
    _run(pip + [f"torch=={release}"], f"pip install torch=={release}")
    say(f"torch {release}: installing this project with its test extras")
    _run(pip + ["-e", f"{REPO_ROOT}[test]"], "pip install -e .[test]")
    _run([str(python_of(release)), str(REPO_ROOT / "kernels" / "install.py")], "kernels/install.py")
    stamp.write_text(_fingerprint(release) + "\n")
    return python_of(release), time.monotonic() - started


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{tail}")


def installed_torch(python: Path) -> str:
    """The torch version that ``python`` imports."""
    done = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def registry_releases(python: str = sys.executable) -> list[str]:
    """torch releases the registry offers, newest first (``pip index versions torch``)."""
    done = subprocess.run(
        [python, "-m", "pip", "index", "versions", "torch", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
    )
    found = re.search(r"Available versions:\s*(.+)", done.stdout)
    if not found:
        return []
    return [v.strip() for v in found.group(1).split(",") if RELEASE.match(v.strip())]


def resolves(release: str, python: str = sys.executable) -> tuple[bool, str]:
    """Whether pip here would install ``torch==release`` (a dry run: metadata only), and why not."""
    done = subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-deps",
            "--disable-pip-version-check",
            f"torch=={release}",
        ],
        capture_output=True,
        text=True,
    )
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    # why, in pip's words: its first error, and the requests in conflict (a machine's cap among them)
    why = [line for line in lines if line.startswith("ERROR:")][:1] + [
        line for line in lines if line.startswith("The user requested")
    ]
    return done.returncode == 0, "; ".join(why) or (lines[-1] if lines else "")


def newest_installable(candidates: list[str], say: Callable[[str], None] = print) -> tuple[str | None, list[str]]:
    """The newest of ``candidates`` pip resolves here, and why each newer one did not."""
    refused = []
    for release in candidates:
        ok, why = resolves(release)
        if ok:
            return release, refused
        refused.append(f"{release}: {why}")
        say(f"torch {release} does not install here: {why}")
    return None, refused
