"""The trainer judge's own logic (``tools/trainers``), without torchtitan: step comparison, the page,
and the attention shim's numerics (its trainer runs are never part of ``make test``)."""

from __future__ import annotations

import copy
import io

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from tests.kit.judging.tolerances import Tolerance
from tools.trainers.__main__ import CONFIGS, TRAINERS, collectives_text, cost_text, page
from tools.trainers.checkpoints import differences, flat
from tools.trainers.compare import after, compare, cost, first_error, owed, validation_difference
from tools.trainers.rank import SHIMS, _step_taking_microbatches, masked_sdpa

REFERENCE = [{"step": s, "loss": 8.0 - 0.1 * s, "grad_norm": 0.8 + 0.01 * s} for s in (1, 2, 3)]


def test_equal_runs_are_bitwise_and_owe_nothing():
    result = compare(REFERENCE, [dict(s) for s in REFERENCE], None)
    assert result.verdict == "BITWISE" and not owed(result)


def test_a_last_digit_difference_is_found_at_its_step():
    steps = [dict(s) for s in REFERENCE]
    steps[1]["grad_norm"] = float(torch.nextafter(torch.tensor(steps[1]["grad_norm"], dtype=torch.float64),
                                                  torch.tensor(2.0, dtype=torch.float64)))  # fmt: skip
    result = compare(REFERENCE, steps, None)
    assert result.verdict == "DIFFERS" and result.first_difference == 2 and owed(result)
    close = compare(REFERENCE, steps, Tolerance(loss=0.0, grad=1e-6))
    assert close.verdict == "CLOSE" and close.first_difference == 2 and not owed(close)
    assert compare(REFERENCE, steps, Tolerance(loss=1e-6, grad=0.0)).verdict == "DIFFERS"  # each its own tol


def test_a_run_that_stopped_early_is_incomplete():
    result = compare(REFERENCE, REFERENCE[:2], None)
    assert result.verdict == "INCOMPLETE" and owed(result)
    assert compare([], [], None).verdict == "INCOMPLETE"


def test_a_resumed_run_is_compared_with_the_reference_past_the_checkpoint():
    resumed = [dict(s) for s in REFERENCE[1:]]
    assert compare(after(REFERENCE, 1), resumed, None).verdict == "BITWISE"
    assert compare(REFERENCE, resumed, None).verdict == "INCOMPLETE"


def test_a_runs_cost_is_its_median_step_time_and_peak_rss():
    steps = [{"time": t, "rss_mib": r} for t, r in ((10.0, 500.0), (11.0, 700.0), (14.0, 650.0), (15.5, 690.0))]
    spent = cost(steps)
    assert spent.step_seconds == 1.5 and spent.peak_rss_mib == 700.0
    assert cost(steps[:1]).step_seconds is None and cost([]).peak_rss_mib is None
    reference = {"step_seconds": 1.0, "peak_rss_mib": 700.0}
    shown = cost_text({"step_seconds": spent.step_seconds, "peak_rss_mib": 350.0}, reference)
    assert shown == "1.50 s a step (1.50x), 350 MiB peak RSS (0.50x)"
    assert cost_text(reference, reference) == "1.00 s a step, 700 MiB peak RSS"


def test_checkpoints_are_compared_entry_for_entry_bit_for_bit():
    saved = {"model": {"w": torch.tensor([0.0, 1.5]), "b": torch.ones(2, dtype=torch.bfloat16)},
             "optimizer": {"state": [{"step": torch.tensor(5.0)}]}, "train_state": {"step": 5},
             "dataloader": io.BytesIO(b"position 40")}  # fmt: skip
    a = flat(saved)
    assert set(a) == {"model.w", "model.b", "optimizer.state.0.step", "train_state.step", "dataloader"}
    assert differences(a, flat(copy.deepcopy(saved))) == []
    b = flat(copy.deepcopy(saved))
    b["model.w"] = torch.tensor([-0.0, 1.5])  # equal as numbers, not as bits
    b["model.b"] = torch.ones(2)  # another dtype
    b["dataloader"] = io.BytesIO(b"position 41")
    del b["train_state.step"]
    b["extra"] = 1
    assert differences(a, b) == ["only in the first: train_state.step", "only in the second: extra",
                                 "differs: dataloader", "differs: model.b", "differs: model.w"]  # fmt: skip


def test_the_page_shows_every_configuration_verdict_and_shim():
    runs = {"torch": {"exit": 0, "steps": REFERENCE, "ranks": 4, "steps_asked": 5, "log": "c0/torch/log.txt",
                      "note": "read api.md"},
            "ours": {"exit": 0, "verdict": "BITWISE", "detail": "", "log": "c0/ours/log.txt"}}  # fmt: skip
    results = {"implementations": {"ours": ""}, "shims": list(SHIMS), "fsdp2_needs": ["force-sum"], "steps": 5,
               "torch": "2.13.0", "configs": {name: runs for name in CONFIGS}}  # fmt: skip
    shown = page(results)
    assert "4 ranks, 5 steps" in shown and "torch 2.13.0" in shown and "#dff5df" in shown
    assert "<a href='c0/ours/log.txt'>log</a>" in shown and "<em>read api.md</em>" in shown
    assert all(name.split(" (")[0] in shown for name in CONFIGS)
    assert shown.count("BITWISE") == len(CONFIGS) and shown.count("reference") == len(CONFIGS)
    assert all(shim.split(":")[0] in shown for shim in SHIMS) and "force-sum" in shown


def test_the_attention_shim_computes_flex_attentions_forward():
    """The SDPA stand-in (flex attention's backward is refused on the CPU) gives flex's causal result."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 2, 1, 16, 16, device="cpu")
    want = flex_attention(q, k, v, block_mask=mask)
    got, _ = masked_sdpa(q, k, v, block_mask=mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    unmasked, _ = masked_sdpa(q, k, v)
    assert not torch.allclose(unmasked, want, atol=1e-3)  # the mask is what makes them agree


class _Stage:
    def __init__(self, is_last: bool) -> None:
        self.is_last, self.has_backward, self.cleared, self.output_chunks = is_last, None, 0, [f"out {is_last}"]

    def clear_runtime_states(self) -> None:
        self.cleared += 1


class _Schedule:
    """A pipeline schedule's surface as torch 2.13's step uses it."""

    _has_backward = True

    def __init__(self) -> None:
        self._stages = [_Stage(False), _Stage(True)]
        self.ran: list[tuple] = []

    def step(self, *args, target=None, losses=None, return_outputs=True, loss_kwargs=None, **kwargs):
        return ("whole batch", args, target, kwargs)

    def _step_microbatches(self, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=None):
        self.ran.append((arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs))

    def _merge_outputs(self, chunks):
        return ("merged", chunks)


def test_a_pipeline_step_given_microbatches_runs_them_as_cut():
    """torchtitan's ready-cut microbatches reach the schedule's microbatch runner as they are, after
    the stages are prepared as torch's step prepares them; a whole batch still takes torch's step."""
    schedule = _Schedule()
    step = _step_taking_microbatches(_Schedule.step)
    arg_mbs, kwarg_mbs, target_mbs, losses = [(1,), (2,)], [{}, {}], ["t1", "t2"], []
    result = step(schedule, arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs, losses=losses,
                  return_outputs=False, loss_kwargs={"n": 3})  # fmt: skip
    assert result is None and schedule.ran == [(arg_mbs, kwarg_mbs, target_mbs, losses, False, {"n": 3})]
    assert all(stage.cleared == 1 and stage.has_backward is True for stage in schedule._stages)
    assert step(schedule, kwarg_mbs=kwarg_mbs, return_outputs=True) == ("merged", ["out True"])
    assert step(schedule, "batch", target="t") == ("whole batch", ("batch",), "t", {})


def test_a_runs_collectives_are_shown_from_its_last_step():
    entry = {"steps": [{"step": 1, "collectives": {"all_gather": 9}}, {"step": 2, "collectives": {"all_gather": 8,
             "reduce_scatter": 4}}]}  # fmt: skip
    assert collectives_text(entry) == "last step's collectives: all_gather 8, reduce_scatter 4"
    assert collectives_text({"steps": [{"step": 1}]}) == ""


def test_every_configuration_can_be_named_on_the_command_line():
    """``--configs`` is comma-separated: a name with a comma could never be chosen alone."""
    assert not [name for rows in TRAINERS.values() for name in rows if "," in name]
    assert {config.launch for config in TRAINERS["lightning"].values()} == {"lightning"}
    assert {config.launch for config in TRAINERS["torchtitan"].values()} == {"torchtitan"}


def test_the_page_names_the_trainer_that_ran():
    results = {"trainer": "pytorch-lightning==2.6.6", "implementations": {}, "shims": [], "fsdp2_needs": [],
               "steps": 5, "torch": "2.13.0", "configs": {}}  # fmt: skip
    shown = page(results)
    assert "<h1>pytorch-lightning 2.6.6:" in shown and "torchtitan" not in shown


def test_a_failed_runs_first_exception_is_found_in_its_log():
    log = "\n".join([
        "[titan] 2026-12-05 13:02:44,474 - root - WARNING - Error running lspci: no such file",
        "[rank1]: Traceback (most recent call last):",
        "[rank1]: AttributeError: 'DeviceMesh' object has no attribute 'mesh_shape'",
        "[rank0]: AttributeError: 'DeviceMesh' object has no attribute 'mesh_shape'",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ])  # fmt: skip
    assert first_error(log) == "AttributeError: 'DeviceMesh' object has no attribute 'mesh_shape'"
    assert first_error("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \nstep 1") == ""


def test_the_command_judges_each_row_writes_its_page_and_exits_1_on_a_difference(tmp_path, monkeypatch):
    """``main`` end to end with the trainer runs faked: one implementation equal to FSDP2, one whose
    validation differs; the page and JSON name both, with each run's log, and the exit status is 1."""
    import json

    import tools.trainers.__main__ as command

    def fake_run(python, spec, config, out, assets, steps, resume_from=None):
        # the broken checkout trains every step alike and then validates off: only the validation tells
        validations = [{"validation_at": 2, "loss": 7.5 if spec.startswith("native:") else 7.0}]
        return {"exit": 0, "seconds": 1.0, "steps": [dict(s) for s in REFERENCE], "step_seconds": 1.0,
                "peak_rss_mib": 500.0, "error": "", "validations": validations}  # fmt: skip

    monkeypatch.setattr(command, "run", fake_run)
    monkeypatch.setattr(command, "ensure_venv", lambda: tmp_path / "python")
    monkeypatch.setattr(command, "_torch_of", lambda python: "2.13.0")
    broken = tmp_path / "broken"
    broken.mkdir()
    status = command.main(["lightning", "--implementation", "ours=", "--implementation", f"broken=native:{broken}",
                           "--configs", "fp32", "--out", str(tmp_path / "out")])  # fmt: skip
    assert status == 1
    results = json.loads((tmp_path / "out" / "trainers.json").read_text())
    runs = results["configs"]["fp32"]
    assert runs["ours"]["verdict"] == "BITWISE" and runs["broken"]["verdict"] == "DIFFERS"
    assert runs["broken"]["log"] == "c0/broken/log.txt" and runs["torch"]["ranks"] == 2
    shown = (tmp_path / "out" / "index.html").read_text()
    assert "pytorch-lightning 2.6.6" in shown and "validation loss after step 2 off by 0.5" in shown
    assert runs["ours"]["detail"] == "1 validations equal"
    alone = ["lightning", "--implementation", "ours=", "--configs", "fp32", "--out", str(tmp_path / "o2")]
    assert command.main(alone) == 0


def test_validation_losses_are_compared_after_the_same_steps():
    reference = [{"validation_at": 2, "loss": 7.5}, {"validation_at": 4, "loss": 7.25}]
    assert validation_difference(reference, [dict(v) for v in reference], None) == ""
    off = [dict(v) for v in reference]
    off[1]["loss"] = 7.2500001
    assert validation_difference(reference, off, None) == "validation loss after step 4 off by 1e-07"
    assert validation_difference(reference, off, Tolerance(loss=1e-6, grad=0.0)) == ""
    assert "after steps [2]" in validation_difference(reference, reference[:1], None)


def test_the_checkpoint_row_compares_both_saves_and_both_resumes(tmp_path, monkeypatch):
    """The checkpoint row with the runs and the checkpoint reader faked: an implementation whose
    saves and resumes agree is BITWISE with its entry count; one whose step-5 save differs, and one
    whose resume from FSDP2's save diverges, DIFFER and say where."""
    import tools.trainers.__main__ as command

    ten = [{"step": s, "loss": 8.0 - 0.1 * s, "grad_norm": 1.0} for s in range(1, 11)]
    resumed_runs = []

    def fake_run(python, spec, config, out, assets, steps, resume_from=None):
        steps_run = [dict(s) for s in (command.after(ten, 5) if resume_from else ten)]
        if resume_from is not None:
            resumed_runs.append((out.name, resume_from.parent.parent.name))
            if out.name == "diverges-from-torch":
                steps_run[-1]["loss"] += 1.0
        return {"exit": 0, "steps": steps_run, "validations": [], "error": ""}

    def fake_report(python, first, second):
        differs = second.parent.parent.name == "saves-off" and first.name == "step-5"
        return {"entries": 783, "differences": ["differs: model.w"] if differs else []}

    monkeypatch.setattr(command, "run", fake_run)
    monkeypatch.setattr(command, "checkpoint_report", fake_report)
    config, folder = command.CONFIGS[command.CHECKPOINTED], tmp_path
    reference = fake_run(None, "torch", config, folder / "torch", None, 10)
    good = command.judged(None, config, folder, "ours", "", None, reference, 10)
    assert good["verdict"] == "BITWISE" and "(783 entries)" in good["detail"], good
    assert ("ours-from-torch", "torch") in resumed_runs and ("torch-from-ours", "ours") in resumed_runs
    off = command.judged(None, config, folder, "saves-off", "", None, reference, 10)
    assert off["verdict"] == "DIFFERS" and "step-5 checkpoint: 1 entries differ (differs: model.w)" in off["detail"]
    diverges = command.judged(None, config, folder, "diverges", "", None, reference, 10)
    assert diverges["verdict"] == "DIFFERS" and "diverges resumed from torch's step 5: DIFFERS" in diverges["detail"]
