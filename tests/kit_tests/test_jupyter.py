"""The debugging walk-through of docs/notebooks_and_sweep.md, as written, in a kernel of a real JupyterLab.

JupyterLab starts headless on a loopback port with the walk-through's command; the test opens the
notebook through the server's contents API, starts a session on the notebook's kernel, sets
``cases = "L1-03"`` in the parameters cell, runs every cell over the server's kernel websocket
(as the browser does), then runs the walk-through's code blocks, in order, and checks what they print.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.kit.runtime.engines import still_running

ROOT = Path(__file__).resolve().parents[2]
WALKTHROUGH = ROOT / "docs" / "notebooks_and_sweep.md"  # README.md links it and has the short version
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 90
CELL_TIMEOUT_S = 300
GONE_TIMEOUT_S = 30


def walkthrough() -> tuple[str, list[str]]:
    """The debugging section of docs/notebooks_and_sweep.md: its JupyterLab command and its code blocks, in order."""
    text = WALKTHROUGH.read_text()
    section = text.split("\n## Debugging a failing rank in Jupyter\n", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"`(jupyter lab [^`]+)`", section).group(1)
    blocks = [textwrap.dedent(b).strip() for b in re.findall(r"```python\n(.*?)```", section, re.S)]
    return command, blocks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Lab:
    """A headless JupyterLab on a loopback port: REST calls and code run in one kernel over its websocket."""

    def __init__(self, command: str, runtime: Path) -> None:
        """Start ``command`` (the walk-through's) headless, from the repository root; bounded wait until it serves."""
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        argv = command.split()
        assert argv[:2] == ["jupyter", "lab"], command
        argv = [str(BIN / "jupyter"), *argv[1:]] + [
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ]
        if os.geteuid() == 0:  # as the walk-through says (CI runs as root)
            argv.append("--allow-root")
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime), "IPP_NONINTERACTIVE": "1"}
        env.pop("HPKIT_IMPLEMENTATION", None)
        self.log = open(runtime / "lab.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        end = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self.get("/api/status")
                return
            except OSError as exc:
                if self.proc.poll() is not None or time.monotonic() > end:
                    self.stop()
                    log = (runtime / "lab.log").read_text()[-3000:]
                    raise RuntimeError(f"JupyterLab did not start: {log}") from exc
                time.sleep(0.3)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One REST call to the server; its JSON answer."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as answer:
            raw = answer.read()
        return json.loads(raw) if raw else None

    def get(self, path: str) -> Any:
        """GET a REST path."""
        return self.request("GET", path)

    def stop(self) -> None:
        """End the server and everything in its session (SIGTERM, then SIGKILL), bounded."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.log.close()


async def _run_cells(lab: Lab, kernel_id: str, cells: list[str]) -> list[dict[str, Any]]:
    """Execute cells one after another in the kernel over the server's websocket (as JupyterLab's
    front end does); per cell: its text (streams, results, displays), errors and reply status."""
    from tornado.websocket import websocket_connect

    session = uuid.uuid4().hex
    url = f"ws://127.0.0.1:{lab.port}/api/kernels/{kernel_id}/channels?session_id={session}&token={lab.token}"
    ws = await asyncio.wait_for(websocket_connect(url), timeout=30)
    results = []
    try:
        for code in cells:
            msg_id = uuid.uuid4().hex
            header = {
                "msg_id": msg_id,
                "username": "test",
                "session": session,
                "msg_type": "execute_request",
                "version": "5.3",
                "date": "",
            }
            content = {"code": code, "silent": False, "store_history": True, "allow_stdin": False}
            await ws.write_message(
                json.dumps(
                    {"header": header, "parent_header": {}, "metadata": {}, "content": content, "channel": "shell"}
                )
            )
            result: dict[str, Any] = {"code": code, "text": "", "errors": [], "status": None}
            idle = False
            end = time.monotonic() + CELL_TIMEOUT_S
            while not (idle and result["status"]):
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"cell did not finish in {CELL_TIMEOUT_S} s: {code[:80]!r}")
                raw = await asyncio.wait_for(ws.read_message(), timeout=left)
                if raw is None:
                    raise ConnectionError("the kernel websocket closed")
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, body = msg["msg_type"], msg["content"]
                if kind == "stream":
                    result["text"] += body["text"]
                elif kind in ("execute_result", "display_data"):
                    result["text"] += body["data"].get("text/plain", "") + "\n"
                elif kind == "error":
                    result["errors"].append(f"{body['ename']}: {body['evalue']}")
                elif kind == "status" and body["execution_state"] == "idle":
                    idle = True
                elif kind == "execute_reply":
                    result["status"] = body["status"]
            results.append(result)
    finally:
        ws.close()
    return results


@pytest.mark.timeout(1200)
def test_the_debugging_walkthrough_in_jupyterlab(tmp_path):
    command, blocks = walkthrough()
    assert command == "jupyter lab notebooks/L1_interface.ipynb"
    assert (BIN / "jupyter-lab").exists(), "JupyterLab is not installed in this environment (make setup)"
    assert len(blocks) == 4, blocks
    lab = Lab(command, tmp_path)
    kernel_pids: list[int] = []
    try:
        assert "hyper-parallel-kit" in lab.get("/api/kernelspecs")["kernelspecs"]
        # given a notebook, JupyterLab serves its folder and opens it: its path is relative to that folder
        path = Path(command.split()[2]).name
        notebook = lab.get(f"/api/contents/{path}?content=1")["content"]
        kernel = notebook["metadata"]["kernelspec"]["name"]
        assert kernel == "hyper-parallel-kit"
        cells = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in notebook["cells"]]
        kinds = [c["cell_type"] for c in notebook["cells"]]
        code = [src for src, kind in zip(cells, kinds, strict=True) if kind == "code"]
        parameters = next(i for i, c in enumerate(notebook["cells"]) if "parameters" in c["metadata"].get("tags", []))
        edited = re.sub(r'^cases = "all"', 'cases = "L1-03"', cells[parameters], count=1, flags=re.M)
        assert edited != cells[parameters]
        code[code.index(cells[parameters])] = edited
        session = lab.request(
            "POST",
            "/api/sessions",
            {"path": path, "type": "notebook", "name": "", "kernel": {"name": kernel}},
        )
        kernel_id = session["kernel"]["id"]
        pids_cell = "print(cluster.pids, __import__('os').getpid())"
        ran = asyncio.run(_run_cells(lab, kernel_id, code + blocks + [pids_cell]))
        for cell in ran:
            assert cell["status"] == "ok" and not cell["errors"], cell
        notebook_cells, (pull, activate, px, rerun, pids) = ran[: len(code)], ran[len(code) :]
        printed = "".join(c["text"] for c in notebook_cells)
        assert "1 L1 case(s): L1-03" in printed
        assert re.search(r"L1-03 \S+ \[\d ranks, [^\]]+\]: PASS", printed), printed
        assert "all 1 case(s) passed" in printed
        assert "L1-03: implementation native:" in printed  # the provenance cell
        assert pull["text"].strip() == "[]"  # no failed check on rank 1
        assert activate["errors"] == []
        assert px["text"].startswith("L1-03 dict_keys("), px  # printed by rank 1
        assert re.search(r"L1-03 \S+ \[\d ranks, [^\]]+\]: PASS", rerun["text"]), rerun
        numbers = [int(n) for n in re.findall(r"\d+", pids["text"])]
        kernel_pids = numbers  # the engines, then the kernel
        assert len(numbers) == 5
        lab.request("DELETE", f"/api/sessions/{session['id']}")
    finally:
        lab.stop()
    assert still_running(kernel_pids, GONE_TIMEOUT_S) == [], "the kernel or its engines outlived JupyterLab"
