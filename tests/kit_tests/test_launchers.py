"""Clusters launched the way clusters on several machines are, running the cases from papermill:

- engines started by an MPI launcher (ipyparallel's ``MPI`` engine launcher over ``mpiexec``;
  MPICH from PyPI), ranks following the engine ids MPI gives;
- engines started apart from the controller, each joining through the controller's connection
  file as ``ipengine --file`` does on another machine, two of them saying they are on two machines
  (``HPKIT_NODE``): each rank binds to the device of its host-local index.

Each cluster runs L1-03 and L2-02 through papermill with ``cluster_id`` / ``profile`` (the
multi-machine recipe of docs/multi_host_and_accelerators.md), then is stopped; no process of it is
left behind.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import papermill
import pytest

from tests.kit.runtime.cluster import RankCluster
from tests.kit.runtime.engines import still_running

pytestmark = pytest.mark.slow  # clusters of their own through other launchers: make test-slow

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
CASES = (("L1_interface.ipynb", "L1-03"), ("L2_coupling.ipynb", "L2-02"))

GONE_TIMEOUT_S = 20.0  # seconds a stopped cluster's processes get to end


def _ipp():
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    import ipyparallel

    return ipyparallel


def _run_cases_from_papermill(cluster_id: str, profile: str, tmp_path: Path) -> list[str]:
    """Each case's notebook through papermill on the running cluster; the verdict lines printed."""
    printed = []
    for notebook, case_id in CASES:
        out = tmp_path / f"{case_id}.ipynb"
        papermill.execute_notebook(
            str(NOTEBOOKS / notebook),
            str(out),
            parameters={"cases": case_id, "cluster_id": cluster_id, "profile": profile},
            kernel_name="hyper-parallel-kit",
            cwd=str(NOTEBOOKS),
            progress_bar=False,
            execution_timeout=300,
        )
        text = out.read_text()
        assert f"{case_id} " in text and ": PASS" in text, f"{case_id} did not pass on the cluster"
        printed.append(case_id)
    return printed


@pytest.mark.timeout(600)
def test_mpi_launched_engines_run_the_cases_from_papermill(tmp_path):
    ipp = _ipp()
    cluster_id = f"hpkit-mpi-{secrets.token_hex(4)}"
    cluster = ipp.Cluster(engines="mpi", n=2, cluster_id=cluster_id, log_level=40)
    cluster.start_cluster_sync()
    pids: list[int] = []
    try:
        client = cluster.connect_client_sync()
        client.wait_for_engines(2, timeout=120)
        ranks = client[:].apply_sync(lambda: (__import__("os").getpid(), __import__("os").environ.get("PMI_RANK")))
        pids = [pid for pid, _ in ranks] + [cluster.controller.pid]
        launcher = next(iter(cluster.engines.values()))
        pids.append(launcher.pid)  # mpiexec itself
        assert sorted(rank for _, rank in ranks) == ["0", "1"], ranks  # engines under MPI
        client.close()
        assert _run_cases_from_papermill(cluster_id, "default", tmp_path) == ["L1-03", "L2-02"]
    finally:
        cluster.stop_cluster_sync()
    assert still_running(pids, GONE_TIMEOUT_S) == [], "engines, mpiexec or the controller outlived the cluster"


@pytest.mark.timeout(600)
def test_engines_started_apart_join_through_the_connection_file(tmp_path):
    ipp = _ipp()
    cluster_id = f"hpkit-apart-{secrets.token_hex(4)}"
    cluster = ipp.Cluster(n=0, cluster_id=cluster_id, log_level=40)
    cluster.start_controller_sync()
    engine_file = Path(cluster.profile_dir) / "security" / f"ipcontroller-{cluster_id}-engine.json"
    engines: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 60
        while not engine_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert engine_file.exists(), engine_file
        for node in ("node-a", "node-b"):  # what `ipengine --file <engine.json>` does on each machine
            env = {**os.environ, "HPKIT_NODE": node, "IPP_NONINTERACTIVE": "1"}
            engines.append(
                subprocess.Popen(
                    [sys.executable, "-m", "ipyparallel.engine", f"--file={engine_file}", f"--work-dir={ROOT}"],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        client = cluster.connect_client_sync()
        client.wait_for_engines(2, timeout=120)
        client.close()
        rc = RankCluster.join(cluster_id)
        try:
            from tests.kit_tests import _ranks_cluster

            rc.run(_ranks_cluster.trivial, 2)
            runs = rc.view().apply_sync(_ranks_cluster.last_run)
        finally:
            rc.stop()
        assert [r["local_index"] for r in runs] == [0, 0], runs  # one rank on each machine: device 0 each
        assert {r["device"] for r in runs} == {"cpu"}, runs
        assert _run_cases_from_papermill(cluster_id, "default", tmp_path) == ["L1-03", "L2-02"]
    finally:
        for engine in engines:
            engine.kill()
            engine.wait(timeout=30)
        cluster.stop_cluster_sync()
    assert still_running([e.pid for e in engines], GONE_TIMEOUT_S) == []
