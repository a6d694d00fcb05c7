"""The CPU memory probe: peak bytes saved for backward, lower under activation checkpointing."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from tests.kit.memory import peak_memory


def _layers() -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(64, 64) for _ in range(4)]


def test_peak_counts_saved_activations_and_drops_under_checkpointing():
    layers = _layers()
    x = torch.randn(32, 64, requires_grad=True)
    with peak_memory() as plain:
        y = x
        for layer in layers:
            y = torch.relu(layer(y))
        y.sum().backward()
    with peak_memory() as checkpointed:
        y = x
        for layer in layers:
            y = checkpoint(lambda t, layer=layer: torch.relu(layer(t)), y, use_reentrant=False)
        y.sum().backward()
    activation = 32 * 64 * 4
    assert plain.bytes >= 4 * activation, plain  # at least one saved activation per layer
    assert checkpointed.bytes < plain.bytes, (checkpointed, plain)
