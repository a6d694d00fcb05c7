"""``python -m tools.peer_suite --tests DIR``: torch's FSDP2 tests against each implementation.

DIR holds torch's ``test_fully_shard_*.py`` files (or is a pytorch checkout: its
``test/distributed/_composable/fsdp`` is used). The files are only read. torch FSDP2 itself always
runs as the control. Writes ``runs/peer-<time>/index.html`` and ``peer.json``; exits 1 when an
implementation fails a public-API test that torch FSDP2 passes.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

from .classify import classify
from .report import CONTROL, summary, verdict_rows, write_json, write_page
from .run import REPO_ROOT, read_records, run_file

FSDP_TESTS = Path("test/distributed/_composable/fsdp")


def _test_files(folder: Path, pattern: str) -> list[Path]:
    if (folder / FSDP_TESTS).is_dir():
        folder = folder / FSDP_TESTS
    files = sorted(folder.glob(pattern))
    if not files:
        raise SystemExit(f"--tests {folder}: no file matches {pattern!r}")
    return files


def _implementations(items: list[str]) -> dict[str, str]:
    from tests.kit.judging.surface import parse_implementations

    named = parse_implementations(items or ["ours="])
    named.pop(CONTROL, None)
    return {CONTROL: "torch", **named}


def _implementation_paths(spec: str) -> tuple[str, ...]:
    from tests.kit.judging.surface import parse_spec

    parsed = parse_spec(spec)
    if parsed.adapter == "torch":
        return ()
    return (str(Path(parsed.path) / "hyper_parallel") if parsed.path else "hyper_parallel/", "/adapters/")


def _sort_failures(file: str, name: str, spec: str, outcomes: dict[str, dict]) -> None:
    """Each failure of an implementation other than the control, sorted (``classify``)."""
    if name == CONTROL:
        return
    paths = _implementation_paths(spec)
    for record in outcomes.values():
        if record["outcome"] in ("failed", "timeout"):
            failure = classify(file, record, paths)
            record.update(
                kind=failure.kind,
                error_type=failure.error_type,
                message=failure.message,
                internals=list(failure.internals),
            )
            if failure.design:
                record["design"] = failure.design


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.peer_suite", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tests", required=True, type=Path, help="folder of torch's test_fully_shard_*.py files")
    parser.add_argument("--files", default="test_fully_shard_*.py", help="glob of the files to run")
    parser.add_argument(
        "--implementation",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="an implementation as the kit names it (SPEC: docs/judging.md#specs, '' is ours); default ours=",
    )
    parser.add_argument("-k", dest="select", default="", help="pytest -k expression: a part of the tests")
    parser.add_argument("--timeout", type=float, default=180, help="seconds one test may run (then: TIMEOUT, stacks)")
    parser.add_argument("--file-timeout", type=float, default=3600, help="seconds one file may run in all")
    parser.add_argument("--world", type=int, default=2, help="ranks of FSDPTest's process-per-rank tests on a CPU")
    parser.add_argument(
        "--gpu-tests-on-cpu",
        action="store_true",
        help="also run tests torch skips below N accelerators (skip_if_lt_x_gpu) on the CPU, N <= --world",
    )
    parser.add_argument(
        "--rejudge", action="store_true", help="run nothing: sort and report again the outcomes recorded under --out"
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default runs/peer-<time>)")
    args = parser.parse_args(argv)

    files = _test_files(args.tests, args.files)
    names = _implementations(args.implementation)
    # absolute: each file's pytest runs in the tests' folder and writes its records under this
    out = (args.out or REPO_ROOT / "runs" / time.strftime("peer-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict]] = {name: {} for name in names}
    for index, file in enumerate(files, 1):
        for name, spec in names.items():
            work = out / "work" / name
            if args.rejudge:
                outcomes = {r["nodeid"]: r for r in read_records(work / f"{file.stem}.jsonl") if "nodeid" in r}
            else:
                print(f"[{index}/{len(files)}] {file.name} · {name} ...", end="", flush=True)
                run = run_file(
                    file,
                    spec,
                    work,
                    args.timeout,
                    args.file_timeout,
                    args.world,
                    args.select,
                    args.gpu_tests_on_cpu,
                )
                outcomes = run.outcomes
                counts = {o: sum(r["outcome"] == o for r in outcomes.values()) for o in ("passed", "failed", "timeout")}
                extra = f" ({run.restarts} restart(s) after a hang)" if run.restarts else ""
                print(
                    f" {counts['passed']} passed, {counts['failed']} failed, {counts['timeout']} timed out"
                    f" in {run.seconds:.0f} s{extra}{'; ' + run.problem if run.problem else ''}"
                )
            _sort_failures(str(file), name, spec, outcomes)
            results[name][file.name] = outcomes
    rows = verdict_rows(results)
    provenance = {
        "tests": str(args.tests),
        "torch": torch.__version__,
        "host": platform.node(),
        "python": platform.python_version(),
        "world (FSDPTest)": args.world,
        "GPU tests on the CPU": args.gpu_tests_on_cpu,
        **{f"implementation {n}": s or "ours" for n, s in names.items()},
    }
    write_json(out / "peer.json", rows, list(names), provenance)
    write_page(out / "index.html", rows, list(names), provenance)
    table = summary(rows, list(names))
    owed = sum(c["owed"] for per in table.values() for n, c in per.items() if n != CONTROL)
    print(f"page: {out / 'index.html'}  ({owed} public test(s) torch FSDP2 passes and another implementation fails)")
    return 1 if owed else 0


if __name__ == "__main__":
    sys.exit(main())
