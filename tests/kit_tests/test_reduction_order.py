"""The registry's bound on a half-precision reduction's order (``tolerances.reduction_order``), on plain
tensors: every order of a bf16 sum lies within it of every other, the precision matrix's bf16 row alone
does not hold them (the false alarm the bound removes), and ``close_each`` fails past it."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, seed, settings
from hypothesis import strategies as st

import tests.kit.explore.runner  # noqa: F401 - registers the "ci" Hypothesis profile
from tests.kit.judging.case import Case
from tests.kit.judging.checks import CaseContext
from tests.kit.judging.tolerances import reduction_order, tolerance

CASE = Case("L4-99", "test_reduction_order", 1, {"dp": 1}, "FSDP 1D bf16", body=lambda ctx: None)
BF16_ROW = tolerance("FSDP 1D bf16").grad


def _in_order(terms: list[torch.Tensor]) -> torch.Tensor:
    """Left to right, each addition rounded to the terms' dtype (as a ring's hops add)."""
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def _as_tree(terms: list[torch.Tensor]) -> torch.Tensor:
    """Pairwise halves (as a tree or a recursive-halving all-reduce adds)."""
    if len(terms) == 1:
        return terms[0]
    middle = len(terms) // 2
    return _as_tree(terms[:middle]) + _as_tree(terms[middle:])


def _orders(terms: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sum in every ring rotation, reversed, and as a tree."""
    rotations = [terms[i:] + terms[:i] for i in range(len(terms))]
    return [_in_order(t) for t in rotations] + [_in_order(terms[::-1]), _as_tree(terms)]


magnitudes = st.sampled_from([2.0**-6, 2.0**-3, 0.5, 1.0, 4.0])


@seed(0)
@settings(settings.get_profile("ci"), max_examples=40)
@given(st.integers(2, 8), st.integers(0, 2**16), magnitudes, st.floats(-1.0, 1.0))
def test_every_order_of_a_bf16_sum_lies_within_the_bound(ranks, data_seed, magnitude, shift):
    """Ranks' terms of one magnitude, centred anywhere from all negative to all positive (256 elements)."""
    generator = torch.Generator().manual_seed(data_seed)
    terms = [((torch.rand(256, generator=generator) * 2 - 1 + shift) * magnitude).bfloat16() for _ in range(ranks)]
    bound = reduction_order(sum(t.double().abs() for t in terms), ranks - 1, torch.bfloat16)
    results = _orders(terms)
    for one, other in itertools.combinations(results, 2):
        assert bool(((one.double() - other.double()).abs() <= bound).all()), (one, other, bound)


def test_the_bf16_row_alone_calls_an_order_a_failure_the_bound_does_not():
    """Four ranks' grads near 0.48 (FSDP2's 45bc3bc53c): two orders of their mean lie more than the row
    apart, and within the bound."""
    generator = torch.Generator().manual_seed(0)
    terms = [(0.47 + 0.02 * torch.rand(64, generator=generator)).bfloat16() for _ in range(4)]
    results = [r.double() / 4 for r in _orders(terms)]
    apart = max((a - b).abs().max().item() for a, b in itertools.combinations(results, 2))
    bound = reduction_order(sum(t.double() for t in terms), 3, torch.bfloat16) / 4
    assert apart > BF16_ROW, apart
    assert all(bool(((a - b).abs() <= bound).all()) for a, b in itertools.combinations(results, 2))


def test_close_each_holds_the_row_or_the_bound_whichever_is_wider():
    ctx = CaseContext(CASE, 0, 1)
    reference = torch.tensor([0.01, 0.5])
    allowed = torch.tensor([0.0, 0.004])  # the row decides the first element, the bound the second
    assert ctx.close_each("within", reference + torch.tensor([0.0009, 0.0039]), reference, BF16_ROW, allowed)
    assert not ctx.close_each("past the row", reference + torch.tensor([0.0011, 0.0]), reference, BF16_ROW, allowed)
    assert not ctx.close_each("past the bound", reference + torch.tensor([0.0, 0.0041]), reference, BF16_ROW, allowed)
    assert [c.passed for c in ctx.checks] == [True, False, False]
