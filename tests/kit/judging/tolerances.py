"""The one tolerance registry: the plan's precision matrix (docs/cases.md), plus its case-specific rows.

Cases and tests name a configuration; they never write an ``atol=`` of their own. A change
here is a visible diff, with its triage in the commit message. Tolerances are absolute:
a check passes when ``|measured - reference| <= tol``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """Absolute tolerances of one configuration: loss, and grad norm / element-wise grads."""

    loss: float
    grad: float


PRECISION_MATRIX: dict[str, Tolerance] = {
    "FSDP 1D fp32": Tolerance(loss=1e-5, grad=1e-5),
    "FSDP 1D bf16": Tolerance(loss=1e-3, grad=1e-3),
    # L0-10 "as L1-10 with fp16": the half-precision compute row, read for fp16
    "FSDP 1D fp16": Tolerance(loss=1e-3, grad=1e-3),
    "HSDP 2D fp32": Tolerance(loss=1e-5, grad=1e-5),
    "TP + FSDP fp32": Tolerance(loss=1e-5, grad=1e-5),
    "EP + FSDP fp32": Tolerance(loss=1e-4, grad=1e-4),
    "AC + FSDP fp32": Tolerance(loss=1e-5, grad=1e-5),
    "AC + swap + FSDP fp32": Tolerance(loss=1e-5, grad=1e-5),
    "PP + FSDP fp32": Tolerance(loss=1e-5, grad=1e-5),
}

# Case-specific rows of the plan, part of the same registry.
SPECIFIC: dict[str, float] = {
    "comm fusion equivalence": 1e-6,  # L1-08: fused vs unfused loss and grads
    "replica agreement": 1e-6,  # L1-02: grads of the replica groups with all-reduce on
    "clip bound": 1e-6,  # L2-07: norm after clipping <= max_norm + this
    "chunk sum": 1e-6,  # L3-05: sum of per-chunk losses == total loss
    "custom placement": 1e-5,  # L1-07
    "fp32 main grad": 1e-5,  # L1-13
    "per expert": 1e-4,  # L2-10 / L3-03 per-expert grad norm
    "dense grad norm under EP": 1e-5,  # L3-03: the dense layers' grad norm
    # the kit's own tests of its networks, one process: the same fp32 math in another order
    # (chunked cross entropy, expert dispatch against a per-token loop)
    "reordered fp32": 1e-6,
}


# A reduction in a half-precision dtype is defined only up to the order of its sum: a ring, a tree
# or a flat buffer of several params adds the ranks' terms in its own order, and each of the
# ranks - 1 additions rounds to the dtype. One rounding of a sum can exceed a half-precision row's
# absolute tolerance (one bf16 ulp of 1.9 is 7.8e-3), so a reduced half-precision grad is held to the
# row or to this many roundings of its sum per addition, whichever is larger (measured 2026-12-07:
# gloo's bf16 all-reduce of the same 16 values on 4 ranks, alone and inside a 64-element buffer,
# differs in 5 or 6 of the 16 by one rounding). It is an order's bound, not a looser row: where
# the sum is small enough that its rounding is under the row, the row alone decides.
ROUNDINGS_PER_ADDITION = 1.0


def reduction_order(sum_magnitude: torch.Tensor, additions: int, dtype: torch.dtype) -> torch.Tensor:
    """Per element, how far two orders of a sum of ``additions + 1`` terms may lie apart in ``dtype``
    (``sum_magnitude``: the sum's magnitude, as a bound on every partial sum's): an ulp of the sum
    per addition, ``ROUNDINGS_PER_ADDITION`` times."""
    magnitude = sum_magnitude.detach().double().abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2**exponent, m in [0.5, 1)
    ulp = torch.ldexp(torch.full_like(magnitude, torch.finfo(dtype).eps), exponent - 1)
    return torch.where(magnitude > 0, ulp, torch.zeros_like(ulp)) * (ROUNDINGS_PER_ADDITION * max(additions, 0))


def tolerance(config: str) -> Tolerance:
    """The tolerances of one configuration of the precision matrix (KeyError names it)."""
    try:
        return PRECISION_MATRIX[config]
    except KeyError:
        raise KeyError(f"no precision-matrix row {config!r}; rows: {sorted(PRECISION_MATRIX)}") from None


def specific(name: str) -> float:
    """A case-specific tolerance of the plan."""
    try:
        return SPECIFIC[name]
    except KeyError:
        raise KeyError(f"no case-specific tolerance {name!r}; known: {sorted(SPECIFIC)}") from None


@dataclass(frozen=True)
class DivergenceThreshold:
    """How the diagnosis (``tests.kit.judging.divergence``) tells a bug from round-off, per traced tensor.

    The baseline is run a second time with each module output and output grad moved by
    ``perturbation`` roundings (``finfo(dtype).eps``) of the dtype the model under test computes
    that tensor in; how far the baseline's tensor then moves, relative to its norm, is the tensor's
    noise. A tensor diverges where its relative error against the baseline exceeds ``k`` times its
    noise, and never below ``k`` roundings of its dtype (a tensor the perturbation barely moves)."""

    perturbation: float
    k: float


# One rounding is the size of the difference an honest reordering of the arithmetic makes at
# each module. k: an honest run's error is the same order as the noise (summation order, not a
# bug), a bug's is orders above it; k is set from the measured ratios of unmutated ours and of
# torch FSDP2 over every L1-L3 precision case (docs/diagnosis.md: the largest honest ratio, and
# the smallest ratio of a bug the mutants plant).
DIAGNOSIS = DivergenceThreshold(perturbation=1.0, k=64.0)
