"""The memory probe: live-tensor peak and bytes saved for backward, both lower under activation checkpointing."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from tests.kit.judging.memory import peak_memory

MIB = 2**20


def _layers() -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(64, 64) for _ in range(4)]


def _body(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A layer whose intermediates (relu's output) checkpointing does not keep."""
    return torch.tanh(torch.relu(layer(x)))


def test_peak_counts_saved_activations_and_drops_under_checkpointing():
    layers = _layers()
    x = torch.randn(1024, 64, requires_grad=True)
    with peak_memory() as plain:
        y = x
        for layer in layers:
            y = _body(layer, y)
        y.sum().backward()
    for tensor in [x, *(p for layer in layers for p in layer.parameters())]:
        tensor.grad = None  # both blocks start alike
    with peak_memory() as checkpointed:
        y = x
        for layer in layers:
            y = checkpoint(_body, layer, y, use_reentrant=False)
        y.sum().backward()
    activation = 1024 * 64 * 4
    assert plain.saved_bytes >= 4 * activation, plain  # at least one saved activation per layer
    assert plain.bytes == plain.peak > plain.saved_bytes, plain  # the plan's measure: every live storage
    assert checkpointed.bytes < plain.bytes, (checkpointed, plain)
    assert checkpointed.saved_bytes < plain.saved_bytes, (checkpointed, plain)


def test_live_peak_follows_allocations_frees_and_storage_resizes():
    kept = torch.zeros(MIB // 4)  # 1 MiB alive before the block: held, so counted from the start
    with peak_memory(holding=[kept]) as probe:
        big = torch.empty(4 * MIB // 4)  # +4 MiB
        del big
        small = torch.empty(2 * MIB // 4)  # +2 MiB: the peak stays at 4 MiB above the start
        small.untyped_storage().resize_(0)  # freed as FSDP frees an unsharded param
        small.untyped_storage().resize_(3 * MIB)  # re-allocated: 3 MiB, below the peak
        kept.add_(1)
    assert probe.peak == 5 * MIB, probe


def test_saved_bytes_count_a_storage_once_at_its_current_size():
    weight = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(8, 256, requires_grad=True)
    with peak_memory() as probe:
        y = (x @ weight).sum() + (x * 2 @ weight).sum()  # weight saved twice, one storage
        weight_bytes = weight.untyped_storage().nbytes()
        y.backward()
    assert probe.saved_bytes >= weight_bytes + x.untyped_storage().nbytes(), probe
    assert probe.saved_bytes < 2 * weight_bytes, probe
