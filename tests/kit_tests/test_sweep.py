"""The sweep end to end: one case through papermill on the warm cluster, its HTML page and the
index that links it; a sweep of two implementations in a subprocess as a user runs it (quiet
terminal, the layout per implementation, pages whose links resolve and whose plots are there, a
failing case's rows first, provenance that names what the ranks really imported); ``--compare``;
the kernel the notebooks fall back to when the kit's kernelspec is missing."""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import nbformat
import pytest
import torch
from jupyter_client.kernelspec import KernelSpecManager

from tests.kit.front.evidence import KernelMissing, compare, resolve_kernel
from tests.kit.front.notebook import select_cases
from tests.kit.judging.tolerances import tolerance
from tests.kit.sweep.index import write_index
from tests.kit.sweep.run import main, run_one

ROOT = Path(__file__).resolve().parents[2]
SWEEP_TIMEOUT_S = 900


class _Page(HTMLParser):
    """Links, images and ids of an HTML page, in document order."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.images: list[str] = []
        self.ids: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "a" and found.get("href"):
            self.links.append(found["href"])
        if tag == "img" and found.get("src"):
            self.images.append(found["src"])
        if found.get("id"):
            self.ids.append(found["id"])


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _local_links(page: Path) -> list[Path]:
    """Every relative link of a page, as a path (anchors and remote links left out)."""
    hrefs = [h for h in _parse(page).links if not re.match(r"^(https?:|#|mailto:)", h)]
    return [(page.parent / h.split("#")[0]).resolve() for h in hrefs]


def _git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=True).stdout


def _printed(notebook: Path) -> str:
    executed = nbformat.read(notebook, as_version=4)
    return "".join(
        out.get("text", "") for cell in executed.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )


def test_one_case_through_papermill_its_page_and_the_index(cluster, tmp_path):
    (spec,) = select_cases("L0", "L0-01")
    row = run_one(spec, tmp_path, cluster)
    assert row["passed"], row
    fp32 = tolerance("FSDP 1D fp32").loss
    assert row["loss_tol"] == fp32 and row["loss_error"] is not None and row["loss_error"] <= fp32
    printed = _printed(tmp_path / row["notebook"])
    assert "L0-01 test_fully_shard_none_mesh [2 ranks, FSDP 1D fp32]: PASS" in printed
    assert "all 1 case(s) passed" in printed
    # provenance: the package file rank 0 really imported, in the notebook and the summary
    imported = cluster.view(0).apply_sync(lambda: __import__("sys").modules["hyper_parallel"].__file__)
    assert row["origin"]["file"] == imported == str(ROOT / "hyper_parallel" / "__init__.py")
    assert f"L0-01: implementation native:{ROOT}: {imported} @ " in printed
    page = tmp_path / row["page"]
    assert page == tmp_path / "L0" / "L0-01.html" and page.exists()
    assert sum(src.startswith("data:image/png;base64,") for src in _parse(page).images) >= 2  # loss + errors
    assert "hpkit-banner" in _parse(page).ids
    index = write_index([row], tmp_path, 1.0)
    text = index.read_text()
    assert "FSDP 1D fp32" in text and "1/1 cases passed" in text
    assert all(link.exists() for link in _local_links(index)), _local_links(index)
    assert {tmp_path / "L0" / "L0-01.html", tmp_path / "L0" / "L0-01.ipynb"} <= set(_local_links(index))
    assert all(link.exists() for link in _local_links(page))
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["cases"][0]["id"] == "L0-01"
    assert results["run"]["kit_commit"] == _git(ROOT, "rev-parse", "HEAD").strip()


SKEWED = '''"""A skewed implementation for the sweep's test: this repository's engine, with the output of every
module it shards scaled by 1 + 1e-3 (so the losses and grads miss DDP's)."""

import os
from pathlib import Path

__path__.append({engine!r})  # noqa: F821  (the engine's subpackages resolve under this package)
exec((Path({engine!r}) / "__init__.py").read_text())  # the engine's public surface, nothing deeper
_fully_shard = fully_shard  # noqa: F821

with open({marker!r}, "a") as record:  # who imported this file, from where
    record.write(f"{{os.getpid()}} {{Path(__file__).resolve()}}\\n")


def fully_shard(module, **kwargs):
    sharded = _fully_shard(module, **kwargs)
    module.register_forward_hook(lambda mod, args, out: out * (1 + 1e-3))
    return sharded
'''


def _skewed_checkout(root: Path) -> tuple[Path, Path]:
    """A git checkout of the skewed implementation, left dirty; its folder and the import record."""
    package = root / "checkout" / "hyper_parallel"
    package.mkdir(parents=True)
    marker = root / "imported.txt"
    (package / "__init__.py").write_text(SKEWED.format(engine=str(ROOT / "hyper_parallel"), marker=str(marker)))
    checkout = package.parent
    _git(checkout, "init", "-q")
    _git(checkout, "add", ".")
    _git(checkout, "-c", "user.name=kit", "-c", "user.email=kit@localhost", "commit", "-q", "-m", "skewed")
    (package / "notes.txt").write_text("uncommitted\n")  # the tree is dirty
    return checkout, marker


@pytest.fixture(scope="module")
def two_implementations(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One sweep of L0-01 against ours and a skewed checkout, run as a user runs it."""
    root = tmp_path_factory.mktemp("sweep")
    checkout, marker = _skewed_checkout(root)
    env = {**os.environ, "IPP_NONINTERACTIVE": "1"}
    env.pop("HPKIT_IMPLEMENTATION", None)
    command = [sys.executable, "-m", "tests.kit.sweep", "--levels", "L0", "--cases", "L0-01", "--engines", "2"]
    command += ["--implementation", "ours=", "--implementation", f"skewed={checkout}", "--out", str(root / "runs")]
    command += ["--l4-examples", "3", "--l4-no-cover"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
    (run,) = (root / "runs").iterdir()
    return {"done": done, "run": run, "checkout": checkout, "marker": marker}


@pytest.mark.slow
def test_the_sweep_runs_l4_per_implementation_and_the_index_links_its_page(two_implementations):
    run = two_implementations["run"]
    index = (run / "index.html").read_text()
    assert "<h2>L4 generalization</h2>" in index
    for name in ("ours", "skewed"):
        page, notebook = run / name / "L4" / "L4_generalization.html", run / name / "L4" / "L4_generalization.ipynb"
        assert page.exists() and notebook.exists(), name
        assert f"href='{name}/L4/L4_generalization.html'" in index, index[-2000:]
    results = json.loads((run / "results.json").read_text())
    rows = {row["implementation"]: row for row in results["l4"]}
    assert rows["ours"]["status"] == "PASS" and "0 covering + 3 drawn configurations" in rows["ours"]["summary"], rows


@pytest.mark.slow
def test_the_sweep_is_quiet_and_says_what_failed(two_implementations):
    done, run = two_implementations["done"], two_implementations["run"]
    assert done.returncode == 1, done.stdout + done.stderr  # the skewed implementation fails
    verdict = re.compile(r"^(PASS|FAIL|ERROR|UNSUPPORTED|TIMEOUT|DIED) ")
    lines = [line for line in done.stdout.splitlines() if verdict.match(line)]
    # per implementation: its case, then its L4 exploration (the skewed engine fails both)
    assert len(lines) == 4, done.stdout
    assert lines[0].startswith("PASS") and "[ours] L0-01" in lines[0], done.stdout
    assert lines[1].startswith("PASS") and "[ours] L4 generalization" in lines[1], done.stdout
    assert lines[2].startswith("FAIL") and "[skewed] L0-01" in lines[2], done.stdout
    assert lines[3].startswith("FAIL") and "[skewed] L4 generalization" in lines[3], done.stdout
    assert "1/2 cases passed, L4 1/2 passed" in done.stdout
    assert "not passed: skewed/L0-01, skewed/L4" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert "IPKernelApp" not in done.stdout + done.stderr and "WARNING" not in done.stdout + done.stderr
    assert re.search(r"overhead \d+\.\d\d s/case", done.stdout)
    assert (run / "sweep.log").exists() and (run / "sweep.log").stat().st_size > 0


@pytest.mark.slow
def test_each_implementation_has_its_evidence_and_the_index_links_it(two_implementations):
    run = two_implementations["run"]
    for name in ("ours", "skewed"):
        for ext in (".ipynb", ".html", ".json"):
            assert (run / name / "L0" / f"L0-01{ext}").exists(), (name, ext)
    index = run / "index.html"
    links = _local_links(index)
    assert all(link.exists() for link in links), [link for link in links if not link.exists()]
    for name in ("ours", "skewed"):
        assert {run / name / "L0" / "L0-01.html", run / name / "L0" / "L0-01.ipynb"} <= set(links)
    text = index.read_text()
    assert "1/2 cases passed" in text and ">FAIL</span>" in text and ">PASS</span>" in text
    for name in ("ours", "skewed"):
        page = run / name / "L0" / "L0-01.html"
        parsed = _parse(page)
        assert "hpkit-banner" in parsed.ids
        assert sum(src.startswith("data:image/png;base64,") for src in parsed.images) >= 2, name
        assert all(link.exists() for link in _local_links(page)), name
        assert index.resolve() in _local_links(page) and (run / name / "L0" / "L0-01.ipynb") in _local_links(page)
        assert not re.search(r"<script[^>]+src=\"https?://", page.read_text())  # opens offline


@pytest.mark.slow
def test_a_failing_page_shows_its_failing_rows_first(two_implementations):
    page = (two_implementations["run"] / "skewed" / "L0" / "L0-01.html").read_text()
    banner = page.index("id='hpkit-banner'")
    failing = page.index("class='hpkit-failing'")
    first_cell = re.search(r"<div[^>]*class=\"jp-Cell[ \"]", page).start()
    assert banner < failing < first_cell
    table = page[failing : page.index("</table>", failing)]
    verdicts = re.findall(r"<td>(pass|FAIL)</td></tr>", table)
    assert verdicts and verdicts[0] == "FAIL" and verdicts == sorted(verdicts, key=lambda v: v != "FAIL")


@pytest.mark.slow
def test_provenance_names_what_the_ranks_imported(two_implementations):
    run, checkout, marker = (two_implementations[k] for k in ("run", "checkout", "marker"))
    results = json.loads((run / "results.json").read_text())
    rows = {row["implementation"]: row for row in results["cases"]}
    head = _git(ROOT, "rev-parse", "HEAD").strip()
    ours, skewed = rows["ours"]["origin"], rows["skewed"]["origin"]
    assert ours["file"] == str(ROOT / "hyper_parallel" / "__init__.py") and ours["commit"] == head
    assert ours["dirty"] == bool(_git(ROOT / "hyper_parallel", "status", "--porcelain", "--", ".").strip())
    # the skewed package was imported by the engines (not the driver), from the file the verdict names
    imports = [line.split(" ", 1) for line in marker.read_text().splitlines()]
    assert imports and all(int(pid) != os.getpid() for pid, _ in imports)
    assert {where for _, where in imports} == {skewed["file"]} == {str(checkout / "hyper_parallel" / "__init__.py")}
    assert skewed["commit"] == _git(checkout, "rev-parse", "HEAD").strip() and skewed["dirty"] is True
    for origin in (ours, skewed):
        assert origin["torch"] == torch.__version__ and origin["backend"] == "gloo" and origin["world_size"] == 2
        assert origin["host"] == socket.gethostname() and origin["kit_commit"] == head
        assert datetime.datetime.fromisoformat(origin["date"]).tzinfo is not None
    # the same in the case's JSON, the executed notebook and the index header
    (case_json,) = json.loads((run / "skewed" / "L0" / "L0-01.json").read_text())
    assert case_json["origin"]["file"] == skewed["file"]
    assert f"L0-01: implementation native:{checkout}: {skewed['file']} @ " in _printed(run / "skewed/L0/L0-01.ipynb")
    assert results["run"]["implementations"]["skewed"]["file"] == skewed["file"]
    header = (run / "index.html").read_text().split("<h3>")[0]
    assert skewed["file"] in header and ours["file"] in header and head[:12] in header


@pytest.mark.slow
def test_compare_lists_changed_verdicts_and_errors(two_implementations, tmp_path, capsys):
    run = two_implementations["run"]
    results = json.loads((run / "results.json").read_text())
    assert compare(run, run) == [] and main(["--compare", str(run), str(run)]) == 0
    changed = json.loads(json.dumps(results))
    for row in changed["cases"]:
        if row["implementation"] == "ours":
            row["status"], row["passed"] = "FAIL", False
        else:
            row["loss_error"] = row["loss_error"] * 2
    changed["cases"].append({**changed["cases"][0], "id": "L0-99", "implementation": "ours"})
    other = tmp_path / "results.json"
    other.write_text(json.dumps(changed))
    lines = compare(run, other)
    assert lines[0] == "ours/L0-01: PASS -> FAIL"
    assert lines[1] == "ours/L0-99: only in B (FAIL)"
    assert lines[2].startswith("skewed/L0-01: worst loss error ") and len(lines) == 3
    assert compare(run, other, rtol=1.0) == lines[:2]  # a doubled error is within rtol 1
    capsys.readouterr()
    assert main(["--compare", str(run / "results.json"), str(other)]) == 1
    assert capsys.readouterr().out.splitlines() == lines


def test_a_missing_kernelspec_falls_back_to_python3_or_names_the_fix(tmp_path):
    empty = tmp_path / "kernels"
    empty.mkdir()
    with_native = KernelSpecManager(kernel_dirs=[str(empty)], ensure_native_kernel=True)
    kernel, note = resolve_kernel("hyper-parallel-kit", with_native)
    assert kernel == "python3" and "python kernels/install.py" in note and "\n" not in note
    nothing = KernelSpecManager(kernel_dirs=[str(empty)], ensure_native_kernel=False)
    with pytest.raises(KernelMissing) as missing:
        resolve_kernel("hyper-parallel-kit", nothing)
    assert "python kernels/install.py" in str(missing.value) and "\n" not in str(missing.value)
    assert resolve_kernel("hyper-parallel-kit") == ("hyper-parallel-kit", None)  # installed by make setup


def test_the_sweep_refuses_bad_arguments_in_one_line(capsys):
    assert main(["--levels", "L9"]) == 2
    assert main(["--cases", "L0-77", "--levels", "L0"]) == 2
    assert main(["--implementation", "noname"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("sweep: ") for line in err), err
