"""Rank functions for tests/kit_tests/test_recorder.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.kit.judging.recorder import record_collectives


def _versions_of_gathers() -> list[int]:
    """Version counter of an all-gather output after a sync and an async gather."""
    out, inp = torch.empty(2 * dist.get_world_size()), torch.ones(2)
    dist.all_gather_into_tensor(out, inp)
    dist.all_gather_into_tensor(out, inp, async_op=True).wait()
    return [out._version]


def versions_with_and_without_recording() -> dict[str, list[int]]:
    """A collective's in-place write bumps the version counter the same whether recorded or not."""
    plain = _versions_of_gathers()
    with record_collectives():
        recorded = _versions_of_gathers()
    return {"plain": plain, "recorded": recorded}


def calls_seen() -> list[tuple[str, str, int, int, float]]:
    """Collectives issued positionally, by keyword and over a subgroup, as the recorder saw them."""
    world = dist.get_world_size()
    pair = dist.new_group([0, 1])
    with record_collectives() as rec:
        dist.all_gather_into_tensor(torch.empty(3 * world), torch.ones(3))
        dist.all_gather_into_tensor(output_tensor=torch.empty(3 * world), input_tensor=torch.ones(3))
        dist.reduce_scatter_tensor(output=torch.empty(5), input=torch.ones(5 * world))
        dist.all_reduce(torch.ones(7, dtype=torch.bfloat16), group=pair)
        dist.all_to_all_single(torch.empty(2 * world), torch.ones(2 * world))
    return [(c.op, str(c.dtype), c.numel, c.group_size, c.wire_bytes) for c in rec.calls]
