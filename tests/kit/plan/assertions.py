"""What a plan assertion is (``Assertion``: what the plan asks, the checks that judge it, their
baseline, where the kit reads the plan differently) and how a verdict answers it (``Judged``); the
baselines and rows several cases share."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.kit.judging.checks import Check

CHECKS, TIMEOUT, CLEAN = "checks", "timeout", "clean run"


@dataclass(frozen=True)
class Assertion:
    """One assertion of a plan row and what judges it."""

    says: str  # what the plan asks, in English
    checks: str  # regex searched in the names of the checks that judge it ('' for a run property)
    baseline: str  # what the checks compare with
    judged_by: str = CHECKS  # CHECKS; TIMEOUT: the run ended within the case's timeout; CLEAN: it raised nothing
    tol: str = (
        "row"  # "row" (the case's precision-matrix row), a case-specific name of the registry, "exact", "property"
    )
    reading: str = ""  # where the kit reads the plan differently, and why
    device: bool = False  # judged only on an accelerator; on a CPU-only host the case notes it as not run

    def matches(self, check: Check) -> bool:
        return bool(self.checks) and re.search(self.checks, check.name) is not None


@dataclass
class Judged:
    """One assertion as a verdict answers it."""

    assertion: Assertion
    status: str  # "pass", "FAIL", "not run" (a device part on a CPU-only host), "no check"
    checks: int = 0  # checks (over ranks) that judge it
    failed: int = 0
    worst_error: float | None = None  # the largest error of its error-measuring checks
    tol: float | None = None  # the tolerance of that check
    detail: str = ""  # what a run property measured (seconds against the timeout)
    names: list[str] = field(default_factory=list)  # a few of the check names, for the page
    kinds: set[str] = field(default_factory=set)  # how its checks judge (tests.kit.judging.checks.Check.kind)
    seen: str = ""  # one property check's measured value against its reference (rank 0), for the page


SINGLE = "the single-device fp32 model on the global batch"
DDP = "torch DDP over the same ranks (fp32)"
LAYOUT = "the torch.chunk layout: full numel unsharded, ceil(n / world) rows sharded"

L3_RULES = (
    Assertion(
        "two steps at least: step 1's loss and grads, after the optimizer's update of the sharded params",
        r"^step 1 (loss|grad)",
        "the same steps of the baseline",
    ),
    Assertion(
        "dual metrics: element-wise grads pass as well as the norm (a norm can hide cancelling errors)",
        r"^step \d+ grad (?!norm)\S",
        "the baseline's grads",
    ),
    Assertion(
        "fixed seed: rerun in the same processes on the same ranks, bitwise identical",
        r"^bitwise rerun",
        "the first run's losses, grads and params",
        tol="exact",
    ),
)

AC = (
    Assertion("loss atol=1e-5", r"step \d+ loss$", SINGLE + ", without AC"),
    Assertion("per-layer grad norm atol=1e-5", r"step \d+ grad norm blocks\.\d+$", SINGLE + ", without AC"),
    Assertion("first and last layer grad tensors atol=1e-5 vs single card", r"step \d+ grad blocks\.[05]\.", SINGLE),
)

LLM = (
    Assertion("step 0 loss atol=1e-5; step 1 loss (after the optimizer update) atol=1e-5", r"^step [01] loss$", DDP),
    Assertion("global grad norm atol=1e-5", r"^step \d+ grad norm$", DDP),
    Assertion("first layer attention weight grad atol=1e-5", r"^step \d+ grad layers\.0\.attn\.\w+\.weight$", DDP),
    Assertion("last layer FFN weight grad atol=1e-5", r"^step \d+ grad layers\.3\.ffn\.\w+\.weight$", DDP),
    *L3_RULES,
)

BF16_STORED = (
    'the plan\'s "params stored as bf16" is read as the compute params (the unsharded ones forward '
    "uses, and the all-gathers) in bf16; the sharded params stay fp32 master weights, as in FSDP2 and "
    "HyperParallel's policy"
)
SINGLE_BF16 = "the plan's single card in bf16 on the global batch (SameDtypeReference(global_batch=True))"
SAME_DTYPE_EXTRA = (
    "kept beside it as an extra: the same-dtype data-parallel reference, which repeats the engine's "
    "arithmetic (worst error 0)"
)
