"""The peer-suite runner's own logic (``tools/peer_suite``): the import swap, the time bound that turns a
hang into one TIMEOUT and goes on with the next test, and the sorting of failures. torch's test files
are never here: synthetic ones in ``tmp_path`` stand in for them."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tools.peer_suite.by_design import BY_DESIGN
from tools.peer_suite.classify import classify, innermost_error
from tools.peer_suite.report import summary, verdict_rows
from tools.peer_suite.run import run_file
from tools.peer_suite.swap import replacements

PEER_TEST = '''
import time
import torch.distributed.fsdp as fsdp


class TestPeer:
    def test_swapped(self):
        assert fsdp.fully_shard.__module__.startswith("hyper_parallel"), fsdp.fully_shard.__module__

    def test_hangs(self):
        time.sleep(600)

    def test_after_the_hang(self):
        assert fsdp.FSDPModule.__name__ == "HSDPModule"

    def test_reads_internals(self):
        fsdp.fully_shard.state(None)
'''


@pytest.mark.slow
def test_a_hang_costs_its_own_test_and_the_swap_reaches_the_tests(tmp_path):
    """Under ours, FSDP2's names are ours; the hanging test is recorded as a timeout with every thread's
    stack, pytest starts again and the test after it still runs."""
    test_file = tmp_path / "test_fully_shard_peer.py"
    test_file.write_text(PEER_TEST)
    run = run_file(test_file, "", tmp_path / "work", test_timeout=5, file_timeout=240)
    outcomes = {nodeid.split("::")[-1]: record for nodeid, record in run.outcomes.items()}
    assert run.restarts == 1, run
    assert outcomes["test_swapped"]["outcome"] == "passed", outcomes["test_swapped"]
    assert outcomes["test_hangs"]["outcome"] == "timeout"
    assert "time.sleep" in outcomes["test_hangs"]["longrepr"] or "test_hangs" in outcomes["test_hangs"]["longrepr"]
    assert outcomes["test_after_the_hang"]["outcome"] == "passed", outcomes["test_after_the_hang"]
    failure = classify(str(test_file), outcomes["test_reads_internals"], ("hyper_parallel/",))
    assert (failure.kind, failure.error_type) == ("private", "AttributeError"), failure


def test_torch_as_the_control_swaps_nothing():
    """The spec ``torch`` is FSDP2 itself: nothing to swap."""
    assert replacements("torch") is None


def _record(nodeid: str, error: str, longrepr: str = "", outcome: str = "failed") -> dict:
    error_type, _, message = error.partition(": ")
    return {"nodeid": nodeid, "outcome": outcome, "error_type": error_type, "message": message, "longrepr": longrepr}


def test_failures_are_sorted_private_message_behaviour(tmp_path):
    source = textwrap.dedent('''
        class TestX:
            def test_state(self):
                fully_shard.state(model)
            def test_regex(self):
                pass
            def test_numbers(self):
                pass
    ''')
    test_file = tmp_path / "test_x.py"
    test_file.write_text(source)
    state = _record("test_x.py::TestX::test_state", "AttributeError: 'function' object has no attribute 'state'")
    regex = _record("test_x.py::TestX::test_regex", 'AssertionError: "FSDP does not" does not match "ours"')
    numbers = _record("test_x.py::TestX::test_numbers", "AssertionError: Tensor-likes are not close!")
    inside = _record("test_x.py::TestX::test_state", "TypeError: boom", "File \"/x/hyper_parallel/api.py\", line 1")
    assert classify(str(test_file), state, ("hyper_parallel/",)).kind == "private"
    assert classify(str(test_file), regex).kind == "message"
    assert classify(str(test_file), numbers).kind == "behaviour"
    assert classify(str(test_file), inside, ("hyper_parallel/",)).kind == "behaviour"  # raised by the implementation


def test_a_rank_thread_error_is_unwrapped():
    message = "Thread 1 exited with exception:\nTraceback (most recent call last):\n  File x\nValueError: bad mesh"
    assert innermost_error("RuntimeError", message, "") == ("ValueError", "bad mesh")


def test_owed_counts_only_public_failures_where_torch_passed():
    results = {
        "torch": {"f.py": {"a": {"outcome": "passed"}, "b": {"outcome": "passed"}, "c": {"outcome": "failed"}}},
        "ours": {
            "f.py": {
                "a": {"outcome": "failed", "kind": "behaviour"},
                "b": {"outcome": "failed", "kind": "private"},
                "c": {"outcome": "failed", "kind": "behaviour"},
            }
        },
    }
    counts = summary(verdict_rows(results), ["torch", "ours"])["f.py"]["ours"]
    assert (counts["owed"], counts["private"], counts["behaviour"]) == (1, 1, 2), json.dumps(counts)


def test_a_listed_difference_is_not_owed_and_any_other_failure_is(tmp_path):
    """A failure docs/api.md lists as a difference by design (plan L1-09: a list input is a group per
    module), failing the listed way, is shown as such and not owed; the same test failing another way,
    and a test not listed failing the listed way, are still owed."""
    test_file = tmp_path / "test_f.py"
    test_file.write_text("class TestX:\n    def test_other(self):\n        pass\n")
    listed = "test_f.py::TestX::test_train_shared_params_uneven_shard"
    refusal = "ValueError: modules 0 and 1 of the list share a parameter of shape (17, 16); shard their parent"
    ours = {
        "by design": _record(listed, refusal),
        "listed, failing otherwise": _record(listed + "[x]", "AssertionError: Tensor-likes are not close!"),
        "not listed": _record("test_f.py::TestX::test_other", refusal),
    }
    for record in ours.values():
        failure = classify(str(test_file), record, ("hyper_parallel/",))
        record.update(kind=failure.kind, design=failure.design)
    assert "test_train_shared_params_uneven_shard" in BY_DESIGN
    assert ours["by design"]["kind"] == "by design" and "plan L1-09" in ours["by design"]["design"], ours
    assert [ours[k]["kind"] for k in ("listed, failing otherwise", "not listed")] == ["behaviour"] * 2, ours
    results = {
        "torch": {"f.py": {k: {"outcome": "passed"} for k in ours}},
        "ours": {"f.py": ours},
    }
    counts = summary(verdict_rows(results), ["torch", "ours"])["f.py"]["ours"]
    assert (counts["owed"], counts["by design"], counts["failed"]) == (2, 1, 3), json.dumps(counts)


def test_every_listed_difference_is_a_row_of_the_difference_table():
    """The registry names docs/api.md's rows by their first words: each must still be there."""
    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    table = api[api.index("## Differences from torch FSDP2 2.13") :].split("\n## ")[0]
    missing = {name: d.docs_row for name, d in BY_DESIGN.items() if f"| {d.docs_row}" not in table}
    assert not missing, missing
