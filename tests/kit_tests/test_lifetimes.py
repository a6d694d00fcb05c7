"""L4's lifetime invariants (``tests/kit/explore/lifetimes.py``) on plain tensors, no cluster: each
check fails on the defect it guards (a storage kept, a hook added per step, a grad of another dtype
or aliasing a param) and passes without it."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import torch
from torch import nn

from tests.kit.explore.lifetimes import KeptStorages, Lifetimes, registered_hooks
from tests.kit.judging.case import Case
from tests.kit.judging.checks import CaseContext

CASE = Case("L4-99", "test_lifetimes", 1, {"dp": 1}, "FSDP 1D fp32", body=lambda ctx: None)


class _Probe(Lifetimes):
    """The mixin on a plain model: its "local shards" are the params themselves."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.ctx = CaseContext(CASE, 0, 1)
        self.reference = SimpleNamespace(keeps_replica_parts=False)

    def failed(self) -> list[str]:
        return [check.name for check in self.ctx.checks if not check.passed]


def test_a_storage_kept_beside_the_shard_is_reported_until_it_is_dropped():
    model = nn.Linear(4, 4)
    probe = _Probe(model)
    probe._watch_before_sharding()
    kept = model.weight  # the pre-shard param, still held: as an engine keeping it would
    model.weight = nn.Parameter(model.weight.detach()[:2].clone())  # "sharded": a new, smaller storage
    probe._check_kept_storages("after sharding")
    assert probe.failed() == [
        "after sharding: bytes of storage kept beyond the shards (held before sharding, or by an earlier shard)"
    ]
    del kept
    gc.collect()
    probe.ctx.checks.clear()
    probe._check_kept_storages("later")
    assert probe.failed() == []


def test_a_param_that_is_its_own_shard_is_not_kept():
    model = nn.Linear(4, 4)
    probe = _Probe(model)
    probe._watch_before_sharding()
    probe._check_kept_storages("after sharding")  # a whole param may be its own shard
    assert probe.failed() == []
    assert KeptStorages().kept([]) == {}


def test_a_hook_added_per_step_fails_from_the_second_step():
    model = nn.Sequential(nn.Linear(2, 2))
    probe = _Probe(model)
    probe._watch_before_sharding()
    before = registered_hooks(model)
    handle = model.register_forward_hook(lambda *a: None)
    assert registered_hooks(model) == before + 1
    handle.remove()
    probe._check_hooks_flat("step 0 end")
    probe._check_hooks_flat("step 1 end")
    assert probe.failed() == []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: None)  # one more, never removed
    probe._check_hooks_flat("step 2 end")
    assert probe.failed() == [  # the hook is an object held beyond step 0's too
        "step 2 end: objects the implementation holds on the host beyond step 0 end's",
        "step 2 end: modules and params at the step's end: hooks registered (as in step 0)",
    ]


def test_hooks_on_unsharded_params_are_counted_per_call():
    model = nn.Linear(2, 2)
    probe = _Probe(model)
    probe._watch_before_sharding()
    unsharded = nn.Parameter(torch.zeros(2, 2))  # registered only while its call is unsharded
    probe._note_unsharded_hooks((0, ""), [unsharded])
    probe._check_hooks_flat("step 0 end")
    unsharded.register_hook(lambda g: None)
    probe._note_unsharded_hooks((0, ""), [unsharded])
    probe._check_hooks_flat("step 1 end")
    assert probe.failed() == ["step 1 end: call 0 root: hooks on its params while unsharded (as in step 0)"]


def test_a_grad_of_another_dtype_or_aliasing_a_param_fails():
    model = nn.Linear(2, 2)
    probe = _Probe(model)
    weight = model.weight
    fp32 = torch.float32
    probe._check_grad_kind("ok", "weight", weight, torch.zeros_like(weight), fp32)
    probe._check_grad_kind("dtype", "weight", weight, torch.zeros(2, 2, dtype=torch.float64), fp32)
    probe._check_grad_kind("alias", "weight", weight, model.bias.detach(), fp32)
    leaf = torch.ones(2, 2, requires_grad=True)
    probe._check_grad_kind("graph", "weight", weight, leaf * 2, fp32)
    # grad_dtype: an fp32 grad of a bf16 param is right where fp32 is promised, wrong where it is not
    half = nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))
    probe._check_grad_kind("grad dtype kept", "weight", half, torch.zeros(2, 2), fp32)
    probe._check_grad_kind("grad dtype lost", "weight", half, torch.zeros(2, 2, dtype=torch.bfloat16), fp32)
    assert probe.failed() == [
        "dtype grad weight: a leaf tensor of the param's grad dtype",
        "alias grad weight: aliases no param's data",
        "graph grad weight: a leaf tensor of the param's grad dtype",
        "grad dtype lost grad weight: a leaf tensor of the param's grad dtype",
    ]


def test_what_forward_created_and_kept_is_reported_but_grads():
    model = nn.Linear(4, 4)
    probe = _Probe(model)
    probe._watch_before_sharding()
    with probe._creating():
        buffer = torch.empty(64)  # a flat buffer an engine keeps past its use
        model(torch.ones(2, 4)).sum().backward()  # the grads it leaves are the step's
    probe._check_created_freed("step 0 after backward")
    assert probe.failed() == [
        "step 0 after backward: bytes still held of what forward and backward created (but grads)"
    ]
    del buffer  # dropped: the next step's check no longer sees it
    probe.ctx.checks.clear()
    with probe._creating():
        torch.empty(64)  # freed at once
    probe._check_created_freed("step 1 after backward")
    assert probe.failed() == []


def test_objects_the_implementation_holds_on_the_host_fail_where_they_grow_per_step():
    """``host_objects``: a record appended per step to a list the model holds (as an engine keeping each
    step's handles would) fails from the step it grows; a step's end with an unshard pending is not
    judged, and nothing held alike from step to step fails."""
    model = nn.Sequential(nn.Linear(2, 2))
    model.records = []  # the engine's state: a list on the module
    probe = _Probe(model)
    probe._watch_before_sharding()
    probe._check_hooks_flat("step 0 end")
    probe._check_hooks_flat("step 1 end")
    assert probe.failed() == []
    model.records.append({"step": 2})  # kept, never dropped
    probe._check_hooks_flat("step 2 end", pending=True)
    assert probe.failed() == []
    probe._check_hooks_flat("step 3 end")
    assert probe.failed() == ["step 3 end: objects the implementation holds on the host beyond step 0 end's"]
    failed = next(c for c in probe.ctx.checks if not c.passed)
    assert "builtins.dict" in str(failed.measured), failed


def test_the_walk_of_what_is_held_stops_at_other_modules_globals_and_the_kits_objects():
    from tests.kit.explore.host_objects import held_objects

    model = nn.Linear(2, 2)
    alone = held_objects(model, ())
    model.register_forward_hook(lambda *a: probe)  # a kit hook's closure reaches the kit's objects
    probe = _Probe(model)
    with_hook = held_objects(model, ())
    assert sum(with_hook.values()) - sum(alone.values()) < 10, sorted((with_hook - alone).items())
    assert not any(kind.startswith("tests.") for kind in with_hook)
