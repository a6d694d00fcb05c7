"""The sweep's unit of work end to end: one case through papermill on the warm cluster, then
the index that fills the precision matrix with its measured errors."""

from __future__ import annotations

import json

import nbformat

from tests.kit.notebook import select_cases
from tests.kit.sweep import run_one, write_index


def test_one_case_through_papermill_and_the_index(cluster, tmp_path):
    (spec,) = select_cases("L0", "L0-01")
    row = run_one(spec, tmp_path, cluster)
    assert row["passed"], row
    assert row["loss_tol"] == 1e-5 and row["loss_error"] is not None and row["loss_error"] <= 1e-5
    executed = nbformat.read(tmp_path / row["notebook"], as_version=4)
    printed = "".join(
        out.get("text", "") for cell in executed.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )
    assert "L0-01 test_fully_shard_none_mesh [2 ranks, FSDP 1D fp32]: PASS" in printed
    assert "all 1 case(s) passed" in printed
    index = write_index([row], tmp_path, 1.0).read_text()
    assert "FSDP 1D fp32" in index and "L0-01" in index and "1/1 cases passed" in index
    assert json.loads((tmp_path / "results.json").read_text())[0]["id"] == "L0-01"
