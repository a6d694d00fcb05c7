"""``tools.torch_matrix``'s own logic, without installing a torch: pins, junit outcomes, whose
failure a traceback shows, the verdicts it counts and gates on, the page it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.torch_matrix import __main__ as matrix_main
from tools.torch_matrix import report, run, venv

TORCH_FRAME = (
    "Traceback (most recent call last):\n"
    '  File "/work/main/tests/kit/judging/case.py", line 120, in run_on_rank\n'
    "    body(ctx)\n"
    '  File "/x/.venvs/torch-2.7.1/lib/python3.11/site-packages/torch/distributed/fsdp/_fully_shard/'
    '_fsdp_collectives.py", line 399, in foreach_reduce\n'
    "    dist.reduce_scatter_tensor(output, input, op=op)\n"
    "RuntimeError: Cannot use ReduceOp.AVG with Gloo\n"
)
ENGINE_FRAME = (  # what a rank's failure looks like from an engine: IPython's frames, the kit's heading
    "tests.kit.judging.case.run_on_rank on 2 ranks failed after 1.6 s\n\n===== rank 0 =====\n"
    "rank 0 raised AttributeError: 'Stream' object has no attribute 'record_event'\n"
    "File /work/main/tests/kit/judging/case.py:115, in run_on_rank(case_id, module)\n"
    "File /x/.venvs/torch-2.6.0/lib/python3.11/site-packages/torch/distributed/fsdp/_fully_shard/"
    "_fsdp_collectives.py:171, in foreach_all_gather(fsdp_params, group)\n"
    "AttributeError: 'Stream' object has no attribute 'record_event'\n"
    "\n===== rank 1 =====\nrank 1 raised ValueError: elsewhere\nFile /work/main/tests/kit/x.py:3, in f()\n"
)
KIT_FRAME = (
    "Traceback (most recent call last):\n"
    '  File "/x/site-packages/torch/nn/modules/module.py", line 1, in _call_impl\n'
    "    return forward(*args)\n"
    '  File "/work/main/tests/kit/judging/checks.py", line 9, in close\n'
    "    raise ValueError('a kit bug')\n"
    "ValueError: a kit bug\n"
)


def test_a_release_is_named_as_pip_names_it():
    assert venv.check_release("2.9.1") == "2.9.1"
    for bad in ("2.9", "latest", "2.9.1; rm -rf /"):
        with pytest.raises(ValueError, match="MAJOR.MINOR.PATCH"):
            venv.check_release(bad)


def test_a_venv_holds_torch_at_its_release_and_keeps_the_other_pins():
    pins = venv._pins("2.9.1").splitlines()
    assert pins[0] == "torch==2.9.1" and not any(p.startswith("torch==2.13") for p in pins)
    assert any(p.startswith("hypothesis==") for p in pins)
    assert venv._fingerprint("2.9.1") != venv._fingerprint("2.7.1")


def test_junit_outcomes_tell_passed_failed_and_errors(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        "<testsuites><testsuite>"
        "<testcase classname='tests.engine.t' name='a'/>"
        "<testcase classname='tests.engine.t' name='b'><failure message='x'/></testcase>"
        "<testcase classname='tests.engine.t' name='c'><error message='y'/></testcase>"
        "</testsuite></testsuites>"
    )
    assert run.junit_outcomes(xml) == {
        "tests.engine.t::a": "passed",
        "tests.engine.t::b": "failed",
        "tests.engine.t::c": "error",
    }
    assert run.junit_outcomes(tmp_path / "missing.xml") == {}


def test_a_failure_raised_inside_torch_is_shown_as_torchs():
    found = report.torchs_failure(TORCH_FRAME)
    assert found == (
        "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:399: RuntimeError: Cannot use ReduceOp.AVG with Gloo"
    )
    assert report.torchs_failure(ENGINE_FRAME) == (
        "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:171: "
        "AttributeError: 'Stream' object has no attribute 'record_event'"
    )
    assert report.torchs_failure(KIT_FRAME) is None and report.torchs_failure(None) is None
    assert report.cell_status({"status": "ERROR", "failure": TORCH_FRAME}) == "TORCH"
    assert report.cell_status({"status": "ERROR", "failure": KIT_FRAME}) == "ERROR"
    assert report.cell_status({"status": "UNSUPPORTED", "failure": TORCH_FRAME}) == "UNSUPPORTED"
    # another implementation failing inside torch (autograd finding its in-place write) keeps its verdict
    assert report.cell_status({"status": "ERROR", "failure": TORCH_FRAME}, "upstream:/src/hp") == "ERROR"


def _release(ours: str, fsdp2: str, engine: str = "passed") -> dict:
    return {
        "torch": "2.7.1+cu126",
        "fsdp2_lacks": {"share_comm_ctx": ["torch.distributed.fsdp.share_comm_ctx"]},
        "engine": {"exit": 0, "seconds": 1.0, "tests": {"tests.engine.t::a": engine}},
        "cases": {
            "exit": 0,
            "seconds": 2.0,
            "results": {
                "ours": {"L1-01": {"status": ours, "first_failure": "", "failure": None}},
                "fsdp2": {"L1-01": {"status": fsdp2, "first_failure": "boom", "failure": TORCH_FRAME}},
            },
        },
    }


def test_ours_is_gated_on_every_case_and_engine_test():
    assert matrix_main._ours_failed(_release("PASS", "ERROR")) == []
    assert matrix_main._ours_failed(_release("FAIL", "PASS")) == ["L1-01: FAIL"]
    assert matrix_main._ours_failed(_release("PASS", "PASS", engine="failed")) == ["tests.engine.t::a"]
    assert matrix_main._ours_failed({"error": "torch 9.9.9 could not be set up"}) == ["torch 9.9.9 could not be set up"]


def test_the_page_and_json_hold_every_cell(tmp_path):
    matrix = {"python": "3.11", "not_installable": ["2.15.0: no matching distribution"], "releases": {}}
    matrix["releases"]["2.7.1"] = _release("PASS", "ERROR")
    page = report.write(tmp_path, matrix)
    text = page.read_text()
    assert "2.7.1" in text and "TORCH" in text and "share_comm_ctx" in text and "2.15.0" in text
    assert json.loads((tmp_path / "matrix.json").read_text())["releases"]["2.7.1"]["torch"] == "2.7.1+cu126"
    assert report.counts(matrix["releases"]["2.7.1"]["cases"]["results"]["fsdp2"]) == {"TORCH": 1}


def test_the_newest_release_that_resolves_is_taken(monkeypatch):
    answers = {"2.16.0": (False, "ERROR: No matching distribution"), "2.15.0": (True, "")}
    monkeypatch.setattr(venv, "resolves", lambda release, python=None: answers[release])
    newest, refused = venv.newest_installable(["2.16.0", "2.15.0"], say=lambda text: None)
    assert newest == "2.15.0" and refused == ["2.16.0: ERROR: No matching distribution"]


def test_a_step_past_its_limit_ends_as_124(tmp_path):
    code, seconds = run.run_step(Path("/bin/sh").resolve(), ["-c", "sleep 5"], tmp_path / "log", limit_s=0.5)
    assert code == 124 and seconds < 4 and "stopped after" in (tmp_path / "log").read_text()


def test_nothing_asked_is_refused_before_any_install(capsys):
    with pytest.raises(SystemExit) as stopped:
        matrix_main.main([])
    assert stopped.value.code == 2 and "--matrix" in capsys.readouterr().err
