"""The evidence a sweep leaves: provenance of every verdict, HTML pages of the executed
notebooks, the Jupyter kernel they run on, and the comparison of two sweeps.

Provenance (``provenance``): which implementation ran on the ranks (its package file as rank 0
imported it, that checkout's git commit and whether its tree was dirty), torch version,
backend, world size, host and Python of rank 0, the date, and the kit's own commit. The level
notebooks attach it to every verdict (``Verdict.origin``), so it reaches the executed notebook,
the case's JSON and the sweep's index.
"""

from __future__ import annotations

import datetime
import functools
import html
import json
import os
import platform
import re
import socket
import sys
from pathlib import Path
from typing import Any

from tests.kit.judging.surface import git_state

REPO_ROOT = Path(__file__).resolve().parents[3]
KERNEL = "hyper-parallel-kit"
FALLBACK_KERNEL = "python3"
STATUS_COLOURS = {  # background, text
    "PASS": ("#dafbe1", "#1a7f37"),
    "FAIL": ("#ffd8d3", "#cf222e"),
    "UNSUPPORTED": ("#eeeeee", "#57606a"),
    "ERROR": ("#ffd8d3", "#a40e26"),
    "TIMEOUT": ("#fff1c2", "#9a6700"),
    "DIED": ("#f3e1ff", "#8250df"),
}
_QUERY_TIMEOUT_S = 30.0


# -- provenance --------------------------------------------------------------------------------
@functools.cache
def kit_state() -> dict[str, Any]:
    """The kit's checkout (this repository): where, commit, dirty (once per process)."""
    state = git_state(REPO_ROOT)
    return {"kit": str(REPO_ROOT), "kit_commit": state["commit"], "kit_dirty": state["dirty"]}


def rank_provenance(requested_backend: str | None, world_size: int) -> dict[str, Any]:
    """Engine side: what this rank runs: implementation origin, torch, backend, host, Python."""
    import torch

    from tests.kit.judging.surface import current
    from tests.kit.runtime.rank_runtime import _choose_backend, _user_ns

    last = _user_ns().get("_last_run") or {}
    if last.get("world_size") == world_size:
        backend = last["backend"]  # what the case's run really used
    else:  # the engine was restarted since (a rank died): what a run would choose
        backend = _choose_backend(requested_backend, world_size)
    return {
        **current().origin,
        "torch": torch.__version__,
        "backend": backend,
        "device": last.get("device"),  # the device type the case's ranks computed on
        "determinism": last.get("determinism"),  # tests.kit.runtime.devices.deterministic: the settings in force
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "pid": os.getpid(),
    }


def provenance(cluster: Any, world_size: int, backend: str | None, origin: dict[str, Any]) -> dict[str, Any]:
    """Provenance of one verdict: ``origin`` (what the case's ranks imported) completed by rank 0
    of ``cluster``, plus the world size, the date and the kit's commit."""
    answer: dict[str, Any]
    try:
        answer = cluster.view(0).apply_async(rank_provenance, backend, world_size).get(timeout=_QUERY_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a rank that cannot answer leaves a note, not a crash
        answer = {"provenance_error": f"rank 0 did not answer: {type(exc).__name__}: {exc}"[:300]}
    return {
        **answer,
        **origin,  # the case's own record of what it imported wins over a later query
        "world_size": world_size,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **kit_state(),
    }


def provenance_text(origin: dict[str, Any]) -> str:
    """One line: implementation file @ commit (dirty), torch, backend, ranks, host, date, kit."""
    if not origin:
        return "provenance unknown"

    def commit(sha: Any, dirty: Any) -> str:
        if not sha:
            return "not in git"
        return f"{str(sha)[:12]}{' (dirty)' if dirty else ''}"

    parts = [
        f"implementation {origin.get('spec') or origin.get('adapter', '?')}: {origin.get('file') or '?'} "
        f"@ {commit(origin.get('commit'), origin.get('dirty'))}",
        f"torch {origin.get('torch', '?')}",
        f"backend {origin.get('backend', '?')} on {origin.get('device') or '?'}",
        f"{origin.get('world_size', '?')} ranks",
        f"host {origin.get('host', '?')}",
        str(origin.get("date", "")),
        f"kit {commit(origin.get('kit_commit'), origin.get('kit_dirty'))}",
    ]
    if origin.get("provenance_error"):
        parts.append(origin["provenance_error"])
    return "; ".join(parts)


def engines_fresh(cluster: Any) -> bool:
    """Whether no engine of ``cluster`` has run anything yet (just started or renewed)."""
    ran = cluster.view().apply_async(_has_run).get(timeout=_QUERY_TIMEOUT_S)
    return not any(ran)


def _has_run() -> bool:
    """Engine side: whether a run happened on this engine."""
    from tests.kit.runtime.rank_runtime import _user_ns

    return "_last_run" in _user_ns()


# -- the kernel the notebooks run on ------------------------------------------------------------
class KernelMissing(RuntimeError):
    """No Jupyter kernel can run the notebooks (the message is one line naming the fix)."""


def resolve_kernel(name: str = KERNEL, manager: Any = None) -> tuple[str, str | None]:
    """The kernel to run the notebooks on, and a one-line note when it is not ``name``: this
    environment's python3 kernel stands in for a missing kit kernelspec."""
    from jupyter_client.kernelspec import KernelSpecManager

    manager = manager or KernelSpecManager()
    specs = manager.find_kernel_specs()
    if name in specs:
        return name, None
    fix = "python kernels/install.py"
    if FALLBACK_KERNEL in specs:
        argv = manager.get_kernel_spec(FALLBACK_KERNEL).argv
        if argv and _same_python(argv[0]):
            return FALLBACK_KERNEL, (
                f"kernelspec {name!r} is not installed ({fix} installs it); "
                f"running the notebooks on this environment's {FALLBACK_KERNEL} kernel"
            )
    raise KernelMissing(f"no Jupyter kernel {name!r} for the notebooks: run `{fix}` (part of `make setup`)")


def _same_python(executable: str) -> bool:
    """Whether a kernelspec's interpreter is this one (``python`` is: jupyter_client resolves it so)."""
    if executable in ("python", f"python{sys.version_info[0]}", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        return True
    try:
        return Path(executable).resolve() == Path(sys.executable).resolve() or os.path.samefile(
            executable, sys.executable
        )
    except OSError:
        return False


# -- HTML pages of executed notebooks -------------------------------------------------------------
@functools.cache
def _exporter() -> Any:
    """One nbconvert HTML exporter (JupyterLab's look) for the whole process."""
    from nbconvert import HTMLExporter

    return HTMLExporter(template_name="lab")


_PASSING_ROW = re.compile(r"<tr[^>]*>(?:(?!</tr>).)*<td>pass</td></tr>", re.S)  # a row of Verdict.html()
_REMOTE_SCRIPT = re.compile(r"<script[^>]*\ssrc=\"https?://[^\"]*\"[^>]*>\s*</script>", re.IGNORECASE)


def render_notebook(notebook: Path, page: Path, banner: str = "") -> Path:
    """Write the executed ``notebook`` as a self-contained HTML ``page`` (plots embedded, no remote
    scripts), with ``banner`` (HTML) at the top of its body."""
    import nbformat

    body, _ = _exporter().from_notebook_node(nbformat.read(notebook, as_version=4))
    body = _REMOTE_SCRIPT.sub("", body)  # mathjax and require.js from a CDN: nothing here needs them
    if banner:
        at = re.search(r"<body[^>]*>", body)
        cut = at.end() if at else 0
        body = body[:cut] + banner + body[cut:]
    page.write_text(body, encoding="utf-8")
    return page


def tagged_output_html(notebook: Path, tag: str) -> str:
    """The HTML outputs of the cells tagged ``tag`` in an executed notebook, joined: their text/html,
    and their PNG pictures as embedded images."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    parts = []
    for cell in nb.cells:
        if cell.cell_type == "code" and tag in cell.metadata.get("tags", []):
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                if data.get("text/html"):
                    parts.append(
                        data["text/html"] if isinstance(data["text/html"], str) else "".join(data["text/html"])
                    )
                elif data.get("image/png"):
                    png = "".join(data["image/png"]).replace("\n", "")
                    parts.append(f"<img style='max-width:100%' src='data:image/png;base64,{png}'>")
    return "".join(parts)


def status_badge(status: str) -> str:
    """A coloured status label."""
    back, fore = STATUS_COLOURS.get(status, ("#ffffff", "#000000"))
    return (
        f"<span class='hpkit-status' style='background:{back};color:{fore};padding:1px 6px;"
        f"border-radius:3px;font-weight:bold'>{html.escape(status)}</span>"
    )


def case_banner(row: dict[str, Any], links: dict[str, str], failing_rows: str, plan: str = "") -> str:
    """The top of a case's page: status, links, provenance, for a case that did not pass its first
    failure and its failing rows (the verdict table puts them first), then ``plan``: the plan's
    assertions and the figures it names (the notebook's plan cells), so the page leads with them."""
    anchors = " | ".join(f"<a href='{html.escape(href)}'>{html.escape(text)}</a>" for text, href in links.items())
    parts = [
        "<div id='hpkit-banner' style='font-family:sans-serif;margin:12px 24px;padding:10px 14px;"
        "border:1px solid #d0d7de;border-radius:6px;background:#f6f8fa'>",
        f"<div style='font-size:18px'>{html.escape(row['id'])} {html.escape(row['name'])} "
        f"[{row['world_size']} ranks, {html.escape(row['config'])}] {status_badge(row['status'])}</div>",
        f"<div style='font-size:12px;margin-top:4px'>{anchors}</div>",
        f"<div class='hpkit-provenance' style='font-size:12px;color:#57606a;margin-top:4px'>"
        f"{html.escape(provenance_text(row.get('origin') or {}))}</div>",
    ]
    if row["status"] != "PASS":
        first = row.get("first_failure") or row.get("failure") or ""
        if row.get("diagnosis") and "hpkit-diagnosis" not in failing_rows:  # else the notebook's block says it
            first = f"diagnosis: {row['diagnosis']['line']}\nfirst failing check: {first}"
        parts.append(f"<pre style='white-space:pre-wrap;margin:8px 0'>{html.escape(first)}</pre>")
        failing_rows = failing_rows.split("<details>", 1)[0]  # the folded list of every check stays below
        if failing_rows:
            only = _PASSING_ROW.sub("", failing_rows)
            parts.append(f"<div class='hpkit-failing'>{only}</div>")
            if only != failing_rows:
                parts.append("<div style='font-size:12px'>passing rows: in the verdict table below</div>")
    if plan:
        parts.append(f"<div class='hpkit-plan-head' style='margin-top:8px'>{plan}</div>")
    parts.append("</div>")
    return "".join(parts)


# -- comparing two sweeps --------------------------------------------------------------------------
def load_results(path: str | Path) -> dict[tuple[str, str], dict[str, Any]]:
    """A sweep's results.json (or its run folder): (implementation, case id) -> summary row."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    data = json.loads(path.read_text())
    rows = data["cases"] if isinstance(data, dict) else data  # a list: the format before provenance
    return {(row.get("implementation", ""), row["id"]): row for row in rows}


def _changed(a: float | None, b: float | None, rtol: float) -> bool:
    if a is None or b is None:
        return (a is None) != (b is None)
    return abs(a - b) > rtol * max(abs(a), abs(b))


def compare(a: str | Path, b: str | Path, rtol: float = 0.0) -> list[str]:
    """Lines naming every case whose verdict or worst loss / grad error changed from ``a`` to ``b``
    (errors compared within relative ``rtol``; 0: any change), and cases only one sweep ran."""
    old, new = load_results(a), load_results(b)
    lines = []
    for key in sorted(old.keys() | new.keys()):
        name = f"{key[0]}/{key[1]}" if key[0] else key[1]
        if key not in new:
            lines.append(f"{name}: only in A ({old[key]['status']})")
            continue
        if key not in old:
            lines.append(f"{name}: only in B ({new[key]['status']})")
            continue
        x, y = old[key], new[key]
        what = []
        if x["status"] != y["status"]:
            what.append(f"{x['status']} -> {y['status']}")
        for kind in ("loss", "grad"):
            ea, eb = x.get(f"{kind}_error"), y.get(f"{kind}_error")
            if _changed(ea, eb, rtol):
                tol = y.get(f"{kind}_tol") if y.get(f"{kind}_tol") is not None else x.get(f"{kind}_tol")
                what.append(f"worst {kind} error {_num(ea)} -> {_num(eb)} (tol {_num(tol)})")
        if what:
            lines.append(f"{name}: " + "; ".join(what))
    return lines


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3e}"
