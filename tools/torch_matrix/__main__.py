"""``python -m tools.torch_matrix --torch 2.9.1 [--torch ...] [--upstream PATH] [--nbval]``: the plan
cases and our engine tests on other torch releases, each in a venv of its own.

``--matrix`` runs the releases users run (``MATRIX``) and the newest the registry offers that pip
installs here, with nbval on one of them (``--nbval-on``). Writes ``runs/torch-matrix-<time>/index.html``
and ``matrix.json``: cases x releases x implementations (ours, torch FSDP2, and upstream with
``--upstream``), each cell the verdict. Exits 1 when our engine fails a plan case or an engine test
on a release, or a release cannot be set up; the other implementations are described, not gated.
PyPI's builds of torch are several GB: never part of ``make test`` or ``.ci/run``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

from . import report
from .run import run_release
from .venv import REPO_ROOT, check_release, ensure, installed_torch, newest_installable, registry_releases

MATRIX = ("2.6.0", "2.7.1", "2.9.1", "2.13.0", "2.14.1")


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def releases_to_run(args: argparse.Namespace, say: Any) -> tuple[list[str], list[str]]:
    """The releases asked for, and (with --matrix) why newer ones than the matrix's did not install."""
    releases = [check_release(r) for r in args.torch]
    refused: list[str] = []
    if args.matrix:
        releases = list(dict.fromkeys([*MATRIX, *releases]))
        newer = [r for r in registry_releases() if _key(r) > max(map(_key, MATRIX))]
        newest, refused = newest_installable(sorted(newer, key=_key, reverse=True), say)
        if newest:
            releases.append(newest)
    return sorted(set(releases), key=_key), refused


def _ours_failed(result: dict[str, Any]) -> list[str]:
    """What our engine did not pass on one release: plan cases and engine tests."""
    if "error" in result:
        return [result["error"]]
    failed = [
        f"{cid}: {row['status']}"
        for cid, row in result["cases"]["results"].get("ours", {}).items()
        if row["status"] != "PASS"
    ]
    failed += [name for name, outcome in result["engine"]["tests"].items() if outcome not in ("passed",)]
    if result["engine"]["exit"] not in (0,) and not result["engine"]["tests"]:
        failed.append(f"engine tests exited {result['engine']['exit']} (log: engine.log)")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", action="append", default=[], metavar="RELEASE", help="repeatable, e.g. 2.9.1")
    parser.add_argument("--matrix", action="store_true", help=f"{', '.join(MATRIX)} and the newest that installs")
    parser.add_argument("--upstream", default="", metavar="PATH", help="judge upstream HyperParallel too")
    parser.add_argument(
        "--upstream-on", default="", metavar="RELEASES", help="with --upstream: only on these (comma-separated)"
    )
    parser.add_argument("--nbval", action="store_true", help="nbval on the notebooks on every release run")
    parser.add_argument("--nbval-on", default="2.9.1", metavar="RELEASE", help="with --matrix: nbval on this one")
    parser.add_argument("--cases", default="", help="only these plan case ids (comma-separated)")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs"))
    args = parser.parse_args(argv)
    if not args.torch and not args.matrix:
        parser.error("name a release (--torch 2.9.1) or --matrix")
    if args.upstream and not Path(args.upstream).is_dir():
        parser.error(f"--upstream {args.upstream}: not a folder")

    def say(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    releases, refused = releases_to_run(args, say)
    implementations = {"ours": "", "fsdp2": "torch"}
    if args.upstream:
        implementations["upstream"] = f"upstream:{Path(args.upstream).resolve()}"
    out = Path(args.out) / f"torch-matrix-{time.strftime('%Y%m%d-%H%M%S')}"
    matrix: dict[str, Any] = {
        "python": platform.python_version(),
        "implementations": implementations,
        "not_installable": refused,
        "releases": {},
    }
    for release in releases:
        say(f"torch {release}")
        try:
            python, install_s = ensure(release, say)
            started = time.monotonic()
            with_nbval = args.nbval or (args.matrix and release == args.nbval_on)
            judged = dict(implementations)
            if args.upstream_on and release not in args.upstream_on.split(","):
                judged.pop("upstream", None)
            result = run_release(python, out / release, judged, with_nbval, args.cases, say)
            result["torch"] = installed_torch(python)
            result["seconds"] = {
                "install": round(install_s, 1),
                "engine": result["engine"]["seconds"],
                "cases": result["cases"]["seconds"],
                **({"nbval": result["nbval"]["seconds"]} if "nbval" in result else {}),
                "total_run": round(time.monotonic() - started, 1),
            }
        except (RuntimeError, OSError) as exc:
            result = {"error": f"torch {release} could not be set up: {exc}"}
        matrix["releases"][release] = result
        page = report.write(out, matrix)  # after every release: a long matrix shows what it has so far
        say(f"  ours: {'passes everything' if not _ours_failed(result) else _ours_failed(result)[:5]} ({page})")
    failures = {release: _ours_failed(result) for release, result in matrix["releases"].items()}
    failures = {release: failed for release, failed in failures.items() if failed}
    print(f"torch matrix: {report.write(out, matrix)}")
    for release, failed in failures.items():
        print(f"torch {release}: ours did not pass {len(failed)}: {failed[:8]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
