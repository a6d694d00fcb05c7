"""A raise in backward is named at the module it belongs to: the module whose engine code raised (from
its frames), or whose forward created the autograd node that raised. Without a cluster."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd import Variable

from tests.kit.judging.crash import Site, crash_record, site_hooks
from tests.kit.judging.trace import first_tensor
from tests.kit_tests._test_kit_faults import _RaisesInBackward


class _Stores(nn.Module):
    """Leaves a loss term on itself (read by the loop, not reached from its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.stored: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stored = _RaisesInBackward.apply(x * self.scale).sum()
        return x * 2


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.side = _Stores()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(self.side(x))


class _Record:
    """An engine's per-param record: it holds the param, not the module."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param


class _Group:
    """An engine's param group, whose end-of-backward work raises (as a reduce-scatter of mixed dtypes)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.records = [_Record(p) for p in params]

    def post_backward(self) -> None:
        raise AssertionError("expects uniform gradient dtype")


def _site_and_model() -> tuple[Site, _Model, list[Any]]:
    torch.manual_seed(0)
    model = _Model()
    site = Site()
    handles = site_hooks(site, list(model.named_modules()), first_tensor)
    return site, model, handles


def _record_of_backward(site: Site, model: _Model, loss_of: Any) -> dict[str, Any]:
    site.at("forward")
    out = model(torch.randn(2, 4))
    loss = loss_of(model, out)
    site.at("backward")
    with pytest.raises((RuntimeError, AssertionError)) as info:
        loss.backward()
    return crash_record("step 0", site, info.value)


def test_a_node_raising_in_backward_is_named_at_the_module_whose_forward_made_it_stored_terms_too() -> None:
    site, model, _ = _site_and_model()
    record = _record_of_backward(site, model, lambda m, out: out.sum() + m.side.stored)
    assert (record["phase"], record["module"], record["tensor"]) == ("backward", "side", "_RaisesInBackwardBackward")
    assert record["error"] == "RuntimeError: deliberate crash in layers.1's backward"


def test_engine_code_raising_at_the_end_of_backward_is_named_at_the_params_it_handled() -> None:
    """An end-of-backward callback runs after every node: the site's last node is no witness, the
    frames are. A group of several params names the module holding them all; one param, itself."""
    for params, named in (
        (lambda m: list(m.layers[1].parameters()), ("layers.1", "hooks")),
        (lambda m: [m.layers[2].weight], ("layers.2", "weight")),
        (lambda m: [m.layers[0].weight, m.layers[2].bias], ("layers", "hooks")),
    ):
        site, model, _ = _site_and_model()
        group = _Group(params(model))

        def loss_of(m: _Model, out: torch.Tensor, group: _Group = group) -> torch.Tensor:
            out.register_hook(lambda grad: Variable._execution_engine.queue_callback(group.post_backward))
            return out.sum()

        record = _record_of_backward(site, model, loss_of)
        assert (record["phase"], record["module"], record["tensor"]) == ("backward", *named)


def test_a_raise_in_forward_keeps_the_innermost_module_entered() -> None:
    site, model, _ = _site_and_model()
    site.at("forward")
    model.layers[1].register_forward_pre_hook(lambda *_: _Group([model.layers[2].weight]).post_backward())
    with pytest.raises(AssertionError) as info:
        model(torch.randn(2, 4))
    record = crash_record("step 0", site, info.value)
    assert (record["phase"], record["module"], record["tensor"]) == ("forward", "layers.1", "output")
