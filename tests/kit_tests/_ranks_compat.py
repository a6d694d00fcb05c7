"""Rank functions for tests/kit_tests/test_torch_compat.py."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist

from tests.kit.runtime import torch_compat


def mean_with_and_without_avg() -> dict[str, list[float]]:
    """This rank's vector averaged over the world with AVG (where gloo has it) and as if it had not."""
    rank, world = dist.get_rank(), dist.get_world_size()
    values = torch.arange(4, dtype=torch.float32) * (rank + 1)
    results = {"expected": (torch.arange(4, dtype=torch.float32) * (world + 1) / 2).tolist()}
    for name, averages in (("avg", torch_compat.averages()), ("sum_only", False)):
        tensor = values.clone()
        with mock.patch.object(torch_compat, "averages", lambda group=None, answer=averages: answer):
            torch_compat.all_reduce_mean(tensor)
        results[name] = tensor.tolist()
    return results
