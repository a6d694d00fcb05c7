"""Every fallback of ``tests.kit.runtime.torch_compat``, driven whatever the installed torch takes:
the shapes of DTensor's sharding caches in torch 2.6-2.9 and 2.13+, and releases without a name."""

from __future__ import annotations

import functools
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.kit.runtime import torch_compat
from tests.kit_tests import _ranks_compat as ranks
from tests.kit_tests._gloo import RefusingGloo, public_gloo_avg


class _ThreadLocalLru(threading.local):
    """Shaped like torch 2.6-2.9's ``LocalLRUCache``: no ``cache_clear`` of its own, an LRU in ``.cache``."""

    def __init__(self) -> None:
        self.cache = functools.lru_cache(None)(lambda key: object())

    def __call__(self, key):
        return self.cache(key)


def _with_propagator(monkeypatch, cache) -> None:
    from torch.distributed.tensor import DTensor

    dispatcher = SimpleNamespace(sharding_propagator=SimpleNamespace(propagate_op_sharding=cache))
    monkeypatch.setattr(DTensor, "_op_dispatcher", dispatcher)


def test_the_installed_torchs_caches_are_cleared():
    cleared = torch_compat.forget_dtensor_specs()
    native = hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache")
    assert cleared == (["native", "python"] if native else ["python"])


def test_a_2_9_thread_local_cache_is_cleared_through_its_lru(monkeypatch):
    cache = _ThreadLocalLru()
    first = cache("mesh")
    monkeypatch.delattr(torch._C, "_clear_DTensor_sharding_propagator_cache", raising=False)
    _with_propagator(monkeypatch, cache)
    assert torch_compat.forget_dtensor_specs() == ["python"]
    assert cache("mesh") is not first  # a fresh entry: the old spec is forgotten


def test_a_2_13_lru_cache_is_cleared_directly(monkeypatch):
    cache = functools.lru_cache(None)(lambda key: object())
    first = cache("mesh")
    _with_propagator(monkeypatch, cache)
    torch_compat.forget_dtensor_specs()
    assert cache("mesh") is not first


def test_a_cache_without_a_way_to_clear_it_is_warned_about(monkeypatch):
    monkeypatch.delattr(torch._C, "_clear_DTensor_sharding_propagator_cache", raising=False)
    _with_propagator(monkeypatch, lambda key: key)
    with pytest.warns(RuntimeWarning, match="no way to clear DTensor's sharding cache"):
        assert torch_compat.forget_dtensor_specs() == []


def test_process_groups_resolved_without_the_python_name(monkeypatch):
    from torch.distributed import distributed_c10d

    seen = []
    monkeypatch.delattr(distributed_c10d, "_resolve_process_group")
    monkeypatch.setattr(torch._C._distributed_c10d, "_resolve_process_group", lambda name: seen.append(name) or name)
    assert torch_compat.resolve_process_group("7") == "7" and seen == ["7"]


def test_dispatch_without_the_key_guard_runs_the_op_and_warns(monkeypatch):
    monkeypatch.delattr(torch._C, "_ForceDispatchKeyGuard")
    with pytest.warns(RuntimeWarning, match="_ForceDispatchKeyGuard"):
        assert torch_compat.dispatch_with_inplace_view(lambda a, b=0: a + b, (2,), {"b": 3}) == 5


def test_plain_dispatch_told_from_a_subclass_with_and_without_torchs_marker(monkeypatch):
    class Own(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return NotImplemented

    assert torch_compat.is_plain_dispatch(torch.Tensor) and not torch_compat.is_plain_dispatch(Own)
    monkeypatch.delattr(torch._C, "_disabled_torch_dispatch_impl")
    assert not torch_compat.is_plain_dispatch(Own)


def test_gloo_without_avg_found_from_its_refusal(monkeypatch):
    torch_compat.gloo_averages.cache_clear()
    try:
        assert torch_compat.gloo_averages() is (public_gloo_avg() == "averages")
        torch_compat.gloo_averages.cache_clear()
        monkeypatch.setattr(dist, "ProcessGroupGloo", RefusingGloo)
        assert torch_compat.gloo_averages() is False
    finally:
        torch_compat.gloo_averages.cache_clear()


def test_the_kits_mean_over_ranks_without_avg(cluster):
    """On the ranks: the mean with AVG and with SUM and a division (gloo before torch 2.8) agree."""
    for result in cluster.run(ranks.mean_with_and_without_avg, 3):
        assert result["sum_only"] == result["avg"] == pytest.approx(result["expected"]), result


def test_a_mesh_unflattened_from_the_worlds_and_its_fallback(cluster):
    """On 4 ranks: (a 2, b 2) unflattened from the world mesh where torch can (its root then names
    neither dim: the world), and as one named mesh where it cannot; the same dims, shape and
    coordinates either way. A sub-mesh's root is found with ``DeviceMesh._get_root_mesh`` and without it
    (torch 2.9.1 has none) alike."""
    for result in cluster.run(ranks.unflattened_meshes, 4):
        rank = result["rank"][0]
        names, shape, coordinate, root = result["installed"]
        assert (names, shape, coordinate) == (["a", "b"], [2, 2], [rank // 2, rank % 2]), result
        assert root == (["world"] if result["has_unflatten"][0] else ["a", "b"]), result
        assert result["root_of_a"] == result["root_of_a_without_the_method"] == root, result
        assert result["without"] == [["a", "b"], [2, 2], [rank // 2, rank % 2], ["a", "b"]], result


def test_a_mesh_equal_to_an_earlier_runs_sub_mesh_is_a_mesh_of_its_own(cluster):
    """One run slices dims (b, c) of (a 1, b 2, c 2); the next makes (b 2, c 2) itself and slices it.
    torch 2.6 remembers by value which meshes were cut from which, so unless the kit forgets that
    between runs the second mesh counts as the first run's sub-mesh: "Cannot create a submesh from a
    submesh" (found on 2.6.0 by the engine's TP test on an unflattened mesh after one on a 3-D mesh)."""
    assert cluster.run(ranks.sliced, 4, {"a": 1, "b": 2, "c": 2}, ("b", "c")) == [["b", "c"]] * 4
    assert cluster.run(ranks.sliced, 4, {"b": 2, "c": 2}, "c") == [["c"]] * 4


def test_what_the_installed_fsdp2_lacks_is_found_there(monkeypatch):
    """A torch whose FSDP2 has no share_comm_ctx nor set_gradient_divide_factor (torch 2.7's): those
    features, and set_reduce_op_type's shim that needs the factor, leave ``features``; the entry
    point the kit calls refuses naming itself."""
    from torch.distributed import fsdp

    from tests.kit.judging.adapters import fsdp2
    from tests.kit.judging.surface import parse_spec

    monkeypatch.delattr(fsdp, "share_comm_ctx", raising=False)
    monkeypatch.delattr(fsdp.FSDPModule, "set_gradient_divide_factor", raising=False)
    lacking = fsdp2.lacking_in_installed()
    assert lacking["share_comm_ctx"] == ["torch.distributed.fsdp.share_comm_ctx"]
    assert lacking["reduce_op_type"] == ["torch.distributed.fsdp.FSDPModule.set_gradient_divide_factor"]
    assert "force_sum_reduction" not in lacking and "prefetch" not in lacking
    adapter = fsdp2.load(parse_spec("torch"))
    assert not {"share_comm_ctx", "gradient_divide_factor", "reduce_op_type"} & adapter.features
    with pytest.raises(NotImplementedError, match="share_comm_ctx: torch .*'s FSDP2 lacks it"):
        adapter.share_comm_ctx([])


def test_torch_2_9s_first_pipeline_p2p_is_sized_alike_on_both_sides():
    ops = [SimpleNamespace(tensor=torch.tensor(1)), SimpleNamespace(tensor=torch.zeros(1))]  # 2.9's send, recv
    sized = torch_compat.init_p2p_in_float32(ops)
    assert [(op.tensor.dtype, op.tensor.nbytes) for op in sized] == [(torch.float32, 4)] * 2


def test_a_pipeline_schedule_waits_for_every_p2p_where_torch_waits_for_the_last(monkeypatch):
    """torch 2.6 and 2.7's schedules (no ``_wait_batch_p2p``) get a batch whose wait waits for every
    work; a release with it keeps its own."""
    from torch.distributed.pipelining import schedules

    own = schedules._batch_p2p
    with torch_compat.every_p2p_waited():
        patched = schedules._batch_p2p is not own
    assert patched is not hasattr(schedules, "_wait_batch_p2p")  # the installed torch's own where it waits all
    waited = []
    works = [SimpleNamespace(wait=lambda i=i: waited.append(i)) for i in range(3)]
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: list(works))
    monkeypatch.delattr(schedules, "_wait_batch_p2p")
    with torch_compat.every_p2p_waited():
        schedules._batch_p2p(["send", "recv", "recv"]).wait()
        assert schedules._batch_p2p([]) is None
    assert waited == [0, 1, 2] and schedules._batch_p2p is own
