"""The diagnosis (``tests.kit.judging.trace``, ``tests.kit.judging.divergence``): its arithmetic and
its tracer in this process, then two planted bugs and an honest run diagnosed on the cluster."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import tests.kit_tests._test_kit_faults  # noqa: F401 - registers the KIT cases
from tests.kit.judging.divergence import (
    AGREES,
    DIVERGES,
    NOT_RUN,
    Diagnosis,
    Tensor,
    _diverged_so_far,
    diagnose,
    diagnose_runs,
    merge,
    threshold,
)
from tests.kit.judging.tolerances import DIAGNOSIS
from tests.kit.judging.trace import Key, Tracer, aligned, relative_error, tracing
from tests.kit.judging.verdict import judge_case

EPS32 = torch.finfo(torch.float32).eps
ROOT = Path(__file__).resolve().parents[2]


def test_relative_error_is_zero_for_equal_tensors_and_infinite_for_nan() -> None:
    a = torch.tensor([3.0, 4.0])
    assert relative_error(a, a.clone()) == 0.0
    assert relative_error(a + torch.tensor([0.0, 0.5]), a) == pytest.approx(0.1)
    assert relative_error(torch.tensor([float("nan"), 1.0]), a) == math.inf
    assert relative_error(torch.ones(2), torch.zeros(2)) == math.inf


def test_a_whole_batch_baseline_is_cut_to_the_rank_rows() -> None:
    ref = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(aligned(ref[2:4], ref, rank=1, world=3), ref[2:4])
    assert aligned(torch.zeros(4, 2), ref, rank=0, world=3) is None  # nothing lines up


def test_threshold_is_k_noises_and_never_under_one_rounding() -> None:
    assert threshold(1e-3, "float32") == pytest.approx(DIAGNOSIS.k * 1e-3)
    assert threshold(0.0, "float32") == EPS32
    assert threshold(None, "bfloat16") == pytest.approx(DIAGNOSIS.k * torch.finfo(torch.bfloat16).eps)


def _rows(errors: list[tuple[str, str, str, float | None]]) -> list[dict]:
    return [
        {"step": step, "phase": phase, "module": module, "tensor": "output", "error": error, "dtype": "float32"}
        for step, phase, module, error in errors
    ]


def test_the_first_divergence_is_the_earliest_in_execution_order_over_every_rank() -> None:
    rank0 = _rows([("step 0", "forward", "a", 0.0), ("step 0", "backward", "a", 1.0), ("step 1", "forward", "a", 1.0)])
    rank1 = _rows([("step 0", "forward", "a", 0.5), ("step 0", "backward", "a", 1.0), ("step 1", "forward", "a", 1.0)])
    noise = [[{**r, "noise": 1e-6} for r in rows] for rows in (rank0, rank1)]
    diagnosis = Diagnosis("X", "", status="FAIL", tensors=merge([rank0, rank1], noise))
    first = diagnosis.first_divergence()
    assert (first["step"], first["phase"], first["module"], first["ranks"]) == ("step 0", "forward", "a", [1])
    assert first["error"] == 0.5 and first["threshold"] == pytest.approx(DIAGNOSIS.k * 1e-6)
    assert "everything before this agrees" in diagnosis.line() and diagnosis.exit_status == DIVERGES
    data = json.loads(json.dumps(diagnosis.to_json()))
    assert set(data) >= {"case", "implementation", "first_divergence", "modules"}
    assert [m["phase"] for m in data["modules"]] == ["forward", "backward", "forward"]


def test_no_divergence_and_not_run_have_their_own_exit_status() -> None:
    agreeing = Tensor("step 0", "forward", "a", "output", {0: 1e-7}, {0: 1e-6})
    assert Diagnosis("X", "", tensors=[agreeing]).exit_status == AGREES
    assert Diagnosis("X", "", reason="it raised").exit_status == NOT_RUN
    failing = Diagnosis("X", "", status="FAIL", tensors=[agreeing], first_failing_check="a check (rank 0)")
    assert "fails outside them" in failing.line() and failing.first_divergence() is None


def test_a_check_failing_before_anything_is_traced_is_located_there_not_undiagnosed() -> None:
    """An L4 configuration whose layout check fails after sharding stops before training: the diagnosis
    names that check (exit status 1), with no noise run; a passing run that traced nothing is still
    not diagnosed (exit status 2)."""
    check = {"name": "after sharding: bytes kept", "rank": 0, "measured": 8.0, "reference": 0.0, "tol": None}
    check |= {"kind": "true", "extra": None}
    runs: list[str] = []

    def run(mode: str, passed: bool) -> list[dict]:
        runs.append(mode)
        return [{"result": {"checks": [check | {"passed": passed}]}, "rows": [], "structure": None}]

    failed = diagnose_runs(Diagnosis("L4 x", ""), lambda mode: run(mode, False))
    assert failed.exit_status == DIVERGES and runs == ["trace"], failed.line()
    assert failed.line() == (
        "L4 x: failed before any traced tensor (the set-up's checks): first at after sharding: bytes kept (rank 0)"
    )
    passed = diagnose_runs(Diagnosis("L4 x", ""), lambda mode: run(mode, True))
    assert passed.exit_status == NOT_RUN and "trains no model" in passed.line()


def _train_one_step(model: nn.Module, reference: nn.Module, tracer: Tracer, x: torch.Tensor) -> None:
    tracer.attach(model, reference)
    tracer.begin("step 0")
    for side in (reference, model):
        side(x).square().mean().backward()
    tracer.grads(dict(model.named_parameters()), dict(reference.named_parameters()))
    tracer.begin(None)


def _trace_then_noise(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> tuple[Tracer, Tracer]:
    """One step traced, then the same step as a noise run of that trace."""
    trace = Tracer("trace")
    with tracing(trace):
        _train_one_step(model, reference, trace, x)
    model.zero_grad(), reference.zero_grad()
    noise = Tracer("noise", earlier=trace)
    with tracing(noise):
        _train_one_step(model, reference, noise, x)
    return trace, noise


def test_the_tracer_finds_a_planted_forward_bug_and_measures_noise_of_the_baseline() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = copy.deepcopy(reference)
    model[1].register_forward_hook(lambda module, args, out: out * (1 + 1e-4))  # the bug: after layer 0
    x = torch.randn(5, 6)
    trace, noise = _trace_then_noise(model, reference, x)
    errors = {(r["phase"], r["module"], r["tensor"]): r["error"] for r in trace.rows()}
    assert errors[("forward", "0", "output")] == 0.0
    assert errors[("forward", "1", "output")] > 0.0
    noises = {(r["phase"], r["module"]): r["noise"] for r in noise.rows()}
    assert 0 < noises[("forward", "0")] <= 2 * EPS32  # one rounding, measured
    diagnosis = Diagnosis("X", "", tensors=merge([trace.rows()], [noise.rows()]))
    first = diagnosis.first_divergence()
    assert (first["phase"], first["module"]) == ("forward", "1")


class _Checkpointed(nn.Module):
    """A block run under a not re-entrant activation checkpoint: backward recomputes its children."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def test_a_noise_run_through_a_not_reentrant_checkpoint_recomputes_what_it_saved() -> None:
    """The noise run moves the baseline's outputs inside the checkpoint in its recomputation too: torch
    checks that the recomputation saves as many tensors as the forward (it raised CheckpointError, and
    an L4 replay's diagnosis was lost to it)."""
    torch.manual_seed(0)
    reference = nn.Sequential(_Checkpointed(), nn.Linear(6, 3))
    model = copy.deepcopy(reference)
    x = torch.randn(5, 6, requires_grad=True)
    trace, noise = _trace_then_noise(model, reference, x)
    noises = {(r["phase"], r["module"]): r["noise"] for r in noise.rows()}
    assert 0 < noises[("forward", "0.inner.0")] <= 2 * EPS32
    assert _diverged_so_far(noise) is None  # a noise run that raises reads its rows: noise, no error
    assert all(r["error"] == 0.0 for r in trace.rows() if r["phase"] == "forward"), trace.rows()


def test_a_tensor_rounds_as_the_model_computes_it_unless_the_baseline_says_less_departs() -> None:
    from tests.kit.judging.reference import SameDtypeReference

    class Cast(nn.Module):  # what a mixed-precision policy does at a module's edges
        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            self.dtype = dtype

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.to(self.dtype)

    bf16_block = nn.Sequential(Cast(torch.bfloat16), nn.Linear(4, 4).bfloat16(), Cast(torch.float32))
    model = nn.Sequential(nn.Linear(4, 4), bf16_block)
    any_arithmetic = copy.deepcopy(model).float()  # another batch or mesh: the compute dtype's rounding
    reduction_only = SameDtypeReference(nn.Linear(4, 4), torch.bfloat16, torch.float32)  # the reduce dtype's
    for reference, fp32_part, bf16_part in (
        (any_arithmetic, torch.float32, torch.bfloat16),
        (reduction_only, torch.float32, torch.float32),
    ):
        trace = Tracer("trace")
        with tracing(trace):
            trace.attach(model, reference)
            trace.begin("step 0")
            model(torch.ones(2, 4))
        dtypes = {key.module: dtype for key, dtype in trace.dtypes.items()}
        assert dtypes["0"] == fp32_part  # computed in fp32 before any bf16
        assert dtypes["1.2"] == dtypes["1"] == dtypes[""] == bf16_part  # fp32 outputs of bf16 compute


def test_a_grad_the_model_never_got_diverges() -> None:
    reference = nn.Linear(3, 2)
    model = copy.deepcopy(reference)
    trace = Tracer("trace")
    with tracing(trace):
        trace.attach(model, reference)
        trace.begin("step 0")
        reference(torch.ones(1, 3)).sum().backward()
        model(torch.ones(1, 3)).sum().backward()
        model.bias.grad = None  # the bug: its reduction never landed
        trace.grads(dict(model.named_parameters()), dict(reference.named_parameters()))
    errors = {r["tensor"]: r["error"] for r in trace.rows() if r["phase"] == "reduction"}
    assert errors == {"bias.grad": math.inf, "weight.grad": 0.0}


def test_a_paused_tracer_records_nothing_and_only_one_runs_at_a_time() -> None:
    model = nn.Linear(2, 2)
    tracer = Tracer("trace")
    with tracing(tracer):
        tracer.attach(model, copy.deepcopy(model))
        model(torch.ones(1, 2))
        with pytest.raises(RuntimeError, match="already active"), tracing(Tracer("trace")):
            pass
    assert tracer.order == [] and not model._forward_hooks  # paused, then detached on leaving
    assert Key("s", "forward", "", "output").text() == "s forward (root) output"
    with pytest.raises(ValueError, match="earlier"):
        Tracer("noise")


# -- on the cluster: the KIT cases of tests/kit_tests/_test_kit_faults.py ---------------------------
@pytest.mark.parametrize(
    ("case_id", "phase", "module", "tensor", "ranks"),
    [
        ("KIT-DIVERGE-FORWARD", "forward", "layers.1", "output", [1]),
        ("KIT-DIVERGE-GRAD", "reduction", "layers.0", "weight.grad", [0, 1]),
        ("KIT-WRONG-REF", "forward", "layers.2", "output", [0, 1]),
    ],
)
def test_a_planted_bug_is_named_where_it_acts(cluster, case_id, phase, module, tensor, ranks) -> None:
    diagnosis = diagnose(cluster, case_id)
    first = diagnosis.first_divergence()
    assert diagnosis.status == "FAIL", diagnosis.line()
    assert first is not None, diagnosis.line()
    assert (first["step"], first["phase"], first["module"], first["tensor"]) == ("step 0", phase, module, tensor)
    assert first["ranks"] == ranks


@pytest.mark.parametrize(
    ("case_id", "step", "phase", "module"),
    [("KIT-CRASH-FORWARD", "step 1", "forward", "layers.1"), ("KIT-CRASH-BACKWARD", "step 0", "backward", "layers.1")],
)
def test_a_planted_crash_is_named_where_it_raised(cluster, case_id, step, phase, module) -> None:
    """A traced run that raises names step, phase, module and ranks, the error, and that what ran before
    agrees; the verdict (an ERROR) and its report lead with it; the JSON holds it beside first_divergence."""
    diagnosis = diagnose(cluster, case_id)
    crash = diagnosis.crash
    assert crash is not None and diagnosis.exit_status == DIVERGES, diagnosis.line()
    assert (crash["step"], crash["phase"], crash["module"], crash["ranks"]) == (step, phase, module, [0, 1])
    assert crash["error"].startswith("RuntimeError: deliberate crash")
    assert diagnosis.line().endswith("everything before this agrees"), diagnosis.line()
    assert diagnosis.to_json()["crash"] == crash and diagnosis.first_divergence() is None
    verdict = judge_case(cluster, case_id)
    assert verdict.status == "ERROR" and verdict.diagnosis is not None
    assert f"diagnosis: {case_id}: raised at {step}, {phase}, {module}" in verdict.report(), verdict.report()


def test_a_difference_of_structure_is_the_first_divergence_and_the_rest_is_traced_on_what_both_have(cluster) -> None:
    """KIT-UNTIED's model lost its tie: the structure is named first, with both sides' names, never a
    ``KeyError``; the trace goes on over the params both have, where the embedding's grad (the tied
    baseline's sums both uses) is the next divergence."""
    diagnosis = diagnose(cluster, "KIT-UNTIED")
    first = diagnosis.first_divergence()
    assert first is not None and first["phase"] == "structure" and diagnosis.exit_status == DIVERGES, diagnosis.line()
    assert (first["model_only"], first["reference_only"], first["ranks"]) == (["out.weight"], [], [0, 1])
    assert (first["step"], first["module"], first["tensor"]) == ("before step 0", "out", "weight")
    assert diagnosis.crash is None and diagnosis.to_json()["structure"]["model_only"] == ["out.weight"]
    after = diagnosis.first
    assert after is not None and (after.step, after.phase) == ("step 0", "reduction"), diagnosis.line()
    assert (after.module, after.tensor) == ("embed", "weight.grad"), diagnosis.line()
    assert diagnosis.line().startswith("KIT-UNTIED: first divergence at before step 0, structure: model only"), (
        diagnosis.line()
    )
    assert "then, on the params both have: first divergence at step 0, reduction, embed weight.grad" in (
        diagnosis.line()
    )


def test_a_hang_names_where_each_ranks_traced_run_was(cluster) -> None:
    """KIT-HANG-BACKWARD: rank 1 sleeps in layers.1's backward, rank 0 waits for it in a collective; the
    hang keeps its stacks (the failure's text) and the diagnosis names each rank's step, phase and module."""
    diagnosis = diagnose(cluster, "KIT-HANG-BACKWARD")
    assert diagnosis.hang is not None and sorted(diagnosis.hang) == [0, 1], diagnosis.line()
    # rank 1's place is the autograd node it sleeps in, which layers.1's forward made
    sleeping = {"step": "step 0", "phase": "backward", "module": "layers.1", "tensor": "_SleepsInBackwardBackward"}
    assert diagnosis.hang[1] == sleeping, diagnosis.line()
    assert (diagnosis.hang[0]["step"], diagnosis.hang[0]["phase"]) == ("step 0", "backward"), diagnosis.line()
    assert diagnosis.exit_status == DIVERGES and not diagnosis.reason
    assert diagnosis.line().startswith("KIT-HANG-BACKWARD: hung: rank 0 in step 0, backward, "), diagnosis.line()
    assert "rank 1 in step 0, backward, layers.1 _SleepsInBackwardBackward" in diagnosis.line()
    from tests.kit.front.diagnose import picture

    drawn = picture(diagnosis)  # a row per stuck rank, marked at the phase it was in
    assert [label.get_text() for label in drawn.axes[0].get_yticklabels()] == ["rank 0", "rank 1"]
    assert "hung" in drawn.axes[0].get_title()
    drawn.savefig(os.environ.get("HPKIT_HANG_FIGURE", os.devnull), format="png")


def test_an_honest_run_has_no_divergence_and_a_failing_verdict_leads_with_its_diagnosis(cluster) -> None:
    honest = diagnose(cluster, "L0-01")
    assert honest.status == "PASS" and honest.exit_status == AGREES, honest.line()
    assert len(honest.tensors) > 10
    verdict = judge_case(cluster, "KIT-DIVERGE-FORWARD")
    assert verdict.diagnosis is not None
    assert verdict.report().splitlines()[1].startswith("diagnosis: KIT-DIVERGE-FORWARD: first divergence at step 0")
    assert diagnose(cluster, "KIT-OK").exit_status == NOT_RUN  # nothing traced: not diagnosed


def test_an_l4_configuration_is_traced_and_ours_agrees_with_its_promise(cluster) -> None:
    from tests.kit.explore.diagnosis import diagnose_config
    from tests.kit.explore.runner import load

    config = load(sorted((ROOT / "tests/kit/explore/regressions").glob("*.json"))[0])
    diagnosis = diagnose_config(cluster, config, "regression")
    assert diagnosis.status == "PASS" and diagnosis.exit_status == AGREES, diagnosis.line()
    assert {t.phase for t in diagnosis.tensors} == {"forward", "backward", "reduction", "optimizer"}


def test_on_fresh_engines_the_noise_run_is_handed_the_trace_run(cluster, monkeypatch) -> None:
    """An implementation that needs fresh engines per run (upstream's) gets them: the trace run's
    baseline is shipped to the noise run, which finds the same divergence."""
    import tests.kit.judging.divergence as divergence

    warm = diagnose(cluster, "KIT-DIVERGE-GRAD").first_divergence()
    monkeypatch.setattr(divergence, "needs_fresh_engines", lambda cluster: True)
    renewed = []
    monkeypatch.setattr(cluster, "renew", lambda renew=cluster.renew: renewed.append(renew()))
    first = diagnose(cluster, "KIT-DIVERGE-GRAD").first_divergence()
    assert len(renewed) == 2 and first is not None
    assert (first["phase"], first["module"], first["tensor"]) == ("reduction", "layers.0", "weight.grad")
    assert first == warm  # the same noise measured: the thresholds too


def test_a_crash_under_a_reduction_collective_is_the_reduction_phase_and_ranks_merge_by_site() -> None:
    """Without a cluster: the site the tracer kept, turned into a record (a raise under c10d's
    reduce-scatter is the reduction, wherever backward was); records of several ranks merge by site."""
    from tests.kit.judging.crash import Site, as_traced_crash, crash_record, merged, records_of

    def reduce_scatter_tensor() -> None:  # the name c10d's frame has
        raise RuntimeError("connection reset\nmore")

    site = Site()
    site.at("forward")
    site.enter("layers")
    site.enter("layers.1")
    site.leave("layers.1")
    assert site.where() == ("forward", "layers", "output")
    site.backward_reached("layers.0")
    try:
        reduce_scatter_tensor()
    except RuntimeError as error:
        record = crash_record("step 2", site, error)
        wire = as_traced_crash(record, error)
    assert record == {
        "step": "step 2",
        "phase": "reduction",
        "module": "layers.0",
        "tensor": "grads",
        "error": "RuntimeError: connection reset",
    }
    other = {**record, "module": "layers.1"}
    found = records_of({0: ("TracedCrash", str(wire).splitlines()[0]), 1: ("TracedCrash", str(wire).splitlines()[0])})
    assert merged(found)["ranks"] == [0, 1]
    assert merged({0: record, 1: other})["ranks"] == [0]
    assert records_of({0: ("RuntimeError", "not ours")}) == {}


def test_the_command_line_takes_a_case_or_an_l4_configuration_and_names_what_it_is_not(capsys) -> None:
    """``python -m tests.kit.diagnose`` diagnoses a plan case or a saved L4 configuration (a regression's
    id here), on as many ranks as it needs; anything else is refused in one line, exit status 2."""
    from tests.kit.front.diagnose import _diagnosis_of, main

    assert _diagnosis_of("30e947c334", 0)[1] == 2
    assert _diagnosis_of("L3-01", 0)[1] == 4
    assert main(["L9-99"]) == NOT_RUN
    assert "'L9-99' is neither a case id (e.g. L3-01) nor a saved L4 configuration" in capsys.readouterr().err
