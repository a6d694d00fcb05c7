"""What differs between torch releases and backends, on our engine: each fallback of
``hyper_parallel.platform.torch.compat`` driven whatever the installed torch takes, and a backend
without ``ReduceOp.AVG`` training alike on the ranks. Rank bodies in ``_ranks_releases.py``."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.platform.torch import compat
from hyper_parallel.platform.torch.fully_shard.collectives import ReduceSettings, split_division
from tests.engine import _ranks_releases as ranks
from tests.kit_tests._gloo import RefusingGloo, public_gloo_avg


class _Mesh:
    """A mesh of a release whose DeviceMesh has no ``_get_root_mesh``."""


def test_root_mesh_from_the_method_where_the_release_has_it():
    root = object()
    mesh = SimpleNamespace(_get_root_mesh=lambda: root)
    assert compat.root_mesh(mesh) is root


def test_root_mesh_from_mesh_resources_on_older_releases(monkeypatch):
    mesh, root = _Mesh(), _Mesh()
    resources = SimpleNamespace(get_root_mesh=lambda m: root if m is mesh else None)
    monkeypatch.setattr(compat.device_mesh_module, "_mesh_resources", resources, raising=False)
    assert compat.root_mesh(mesh) is root


def test_root_mesh_refused_naming_the_release_where_neither_exists(monkeypatch):
    monkeypatch.delattr(compat.device_mesh_module, "_mesh_resources", raising=False)
    with pytest.raises(compat.TorchReleaseLacks, match=re.escape(f"torch {torch.__version__} lacks")):
        compat.root_mesh(_Mesh())


def test_accelerator_index_from_the_2_6_name(monkeypatch):
    monkeypatch.setattr(torch, "accelerator", SimpleNamespace(current_device_idx=lambda: 3))
    assert compat.accelerator_index() == 3


def test_backend_of_a_group_with_one_backend_per_device(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group: "cpu:gloo,cuda:nccl")
    assert (compat.backend_of(None, "cuda"), compat.backend_of(None, "cpu")) == ("nccl", "gloo")


@pytest.mark.parametrize(("backend", "averages"), [("hccl", False), ("nccl", True)])
def test_backends_that_average_and_those_that_do_not(monkeypatch, backend, averages):
    monkeypatch.setattr(dist, "get_backend", lambda group: backend)
    assert compat.backend_averages(None, "npu") is averages


def test_gloo_asked_once_whether_it_averages(monkeypatch):
    """The probe says what a gloo world of this torch does with AVG, then a gloo that refuses AVG
    as torch 2.7's does is found so."""
    public = public_gloo_avg()

    compat.gloo_averages.cache_clear()
    try:
        assert compat.gloo_averages() is (public == "averages")
        compat.gloo_averages.cache_clear()
        monkeypatch.setattr(dist, "ProcessGroupGloo", RefusingGloo)
        assert compat.gloo_averages() is False
    finally:
        compat.gloo_averages.cache_clear()


def test_a_gloo_whose_reduce_scatter_sums_under_avg_is_not_trusted(monkeypatch):
    """torch 2.7's gloo reduce-scatter returns the sum under AVG without a word: the probe reads
    values, so such a gloo is reduced with SUM and a division."""
    done = SimpleNamespace(wait=lambda: None)

    class Summing:
        def __init__(self, *args):
            pass

        def allreduce(self, tensors, options):
            tensors[0].fill_(2.0)  # the mean of 1 and 3, as asked
            return done

        def _reduce_scatter_base(self, output, input, options):
            output.fill_(4.0)  # their sum
            return done

    compat.gloo_averages.cache_clear()
    try:
        monkeypatch.setattr(dist, "ProcessGroupGloo", Summing)
        assert compat.gloo_averages() is False
        monkeypatch.setattr(
            Summing, "_reduce_scatter_base", lambda self, output, input, options: output.fill_(2.0) and done
        )
        compat.gloo_averages.cache_clear()
        assert compat.gloo_averages() is True
    finally:
        compat.gloo_averages.cache_clear()


def _fsdp2_division(world: int, dtype: torch.dtype) -> tuple[float | None, float | None]:
    """(before, after) the SUM that the installed torch FSDP2 divides by under force-sum; torch 2.6
    and 2.7's have no force-sum and split fp16 only (they average fp32 and bf16 inside the collective)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fsdp2

    divide = fsdp2._get_gradient_divide_factors
    group = SimpleNamespace(size=lambda: world)
    parameters = inspect.signature(divide).parameters
    if "force_sum_reduction_for_comms" in parameters:
        before, after, _, _ = divide(group, None, dtype, "cpu", None, True)
        return before, after
    # torch 2.6 and 2.7: (rs group, ar group, dtype[, device type])
    before, after = divide(group, None, dtype, *(["cpu"] if "device_type" in parameters else []))
    return (None, float(world)) if before is None else (before, after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reduce_arithmetic_matches_fsdp2_force_sum(dtype):
    """Without AVG (or under force-sum) ours divides as torch FSDP2 does under force-sum: the same
    factors before and after the SUM, for every world size up to 16."""
    for world in range(1, 17):
        ours = ReduceSettings().arithmetic(world, dtype, averages=False)
        assert ours.op == dist.ReduceOp.SUM
        assert (ours.divide_before, ours.divide_after) == _fsdp2_division(world, dtype), world


def test_one_settings_answers_each_reduction_apart():
    """A group keeps its ReduceSettings across backwards, and they remember each arithmetic they made:
    every answer is a fresh settings' answer, whatever was asked before."""
    kept = ReduceSettings()
    for world in (1, 2, 3, 8):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for averages in (True, False):
                assert kept.arithmetic(world, dtype, averages) == ReduceSettings().arithmetic(world, dtype, averages)


@pytest.mark.parametrize("divisor", [1, 2, 3, 4, 6, 8, 12, 16, 1024])
def test_split_division_keeps_the_divisor(divisor):
    before, after = split_division(float(divisor))
    assert before * after == divisor and before == 2 ** round(torch.log2(torch.tensor(before)).item())


@pytest.mark.engine
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_sum_only_backend_trains_alike(cluster, dtype):
    """3 steps on a backend without AVG = the baseline, and = the AVG run bit for bit where torch has AVG."""
    cluster.run(ranks.sum_only_backend_trains_alike, 2, dtype)
