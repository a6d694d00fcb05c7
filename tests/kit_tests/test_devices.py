"""The device choice (``tests.kit.runtime.devices`` in the kit, ``hyper_parallel/platform/torch/device.py``
in the engine) is the only place that names a device type or a backend; ranks bind to the
device of their host-local index."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tests.kit.runtime import devices
from tests.kit.runtime.cluster import RankCluster

ROOT = Path(__file__).resolve().parents[2]
DEVICE_MODULES = {
    ROOT / "tests" / "kit" / "runtime" / "devices.py",
    ROOT / "hyper_parallel" / "platform" / "torch" / "device.py",
}
NAMES_A_DEVICE = re.compile(r"\"cuda\"|'cuda'|nccl|torch\.cuda\b")


def test_only_the_two_device_modules_name_a_device_type_or_backend():
    """What ``grep -rn '"cuda"\\|nccl' hyper_parallel tests/kit`` must find (adapters may name
    their implementation's devices); this test names them only in its pattern."""
    sources = [*ROOT.joinpath("hyper_parallel").rglob("*.py"), *ROOT.joinpath("tests", "kit").rglob("*.py")]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sources
        if path not in DEVICE_MODULES and "adapters" not in path.parts and path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if NAMES_A_DEVICE.search(line)
    ]
    assert not found, "\n".join(found)


def test_backends_come_from_torchs_device_map():
    assert devices.backend_of("cuda") == torch.distributed.Backend.default_device_backend_map["cuda"]
    assert devices.backend_of("cpu") == "gloo"
    assert devices.device_type_of("gloo") == "cpu"  # though torch maps mps to gloo as well
    assert devices.device_type_of(devices.backend_of("xpu")) == "xpu"


def test_a_cpu_only_host_computes_on_the_cpu_with_gloo():
    assert devices.accelerator_type() is None  # this machine, and CI
    assert devices.choose(None, 4) == ("cpu", "gloo")
    assert devices.choose("gloo", 4) == ("cpu", "gloo")


def test_host_local_indices_group_ranks_by_host_in_rank_order():
    assert devices.host_local_indices(["a", "a", "b", "b"]) == [0, 1, 0, 1]
    assert devices.host_local_indices(["a", "b", "a", "b", "a"]) == [0, 0, 1, 1, 2]
    assert devices.host_local_indices(["x"]) == [0]


def test_engines_on_two_machines_bind_by_their_host_local_index():
    """Four engines saying they are on two machines (HPKIT_NODE): ranks 0, 1 on node-a and 2, 3 on
    node-b bind to local devices 0, 1, 0, 1."""
    nodes = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
    with RankCluster.start(4, engine_env=lambda rank: {"HPKIT_NODE": nodes[rank]}) as cluster:
        from tests.kit_tests import _ranks_cluster

        cluster.run(_ranks_cluster.trivial, 4)
        runs = cluster.view().apply_sync(_ranks_cluster.last_run)
        # a restarted engine keeps its machine
        cluster.pool.restart([2])
        cluster.run(_ranks_cluster.trivial, 4)
        again = cluster.view().apply_sync(_ranks_cluster.last_run)
    assert [r["local_index"] for r in runs] == [0, 1, 0, 1], runs
    assert [r["local_index"] for r in again] == [0, 1, 0, 1], again
    assert {r["device"] for r in runs} == {"cpu"}
