"""torch FSDP2 tests an implementation of HyperParallel's API fails on purpose: a difference the user's test
plan mandates, each a row of docs/api.md's "Differences from torch FSDP2 2.13". A failure listed here, and
failing the listed way, is shown as "differs by design" and is not owed; any other failure still is."""

from __future__ import annotations

import re
from dataclasses import dataclass

KIND = "by design"
DOCS_ROW = "docs/api.md#differences-from-torch-fsdp2-213"


@dataclass(frozen=True)
class ByDesign:
    """Why a peer test fails on purpose, and how: its failure must match ``error_type`` and ``message``."""

    reason: str  # shown on the page: what the plan asks for
    docs_row: str  # the row of the difference table, by its first words
    error_type: str
    message: str  # a regex searched in the failure's first line

    def matches(self, error_type: str, message: str) -> bool:
        """Whether a failure is the listed one (another failure of the same test is still owed)."""
        return error_type == self.error_type and re.search(self.message, message) is not None


# plan L1-09: fully_shard(list) returns one HSDPModule per module, each controlled independently
_LIST_INPUT = ByDesign(
    reason="differs by design (plan L1-09): a list input gives each module its own group, so modules "
    "of one list cannot share a param; FSDP2 makes the list one group",
    docs_row="a list input is one group, whose modules may share params",
    error_type="ValueError",
    message=r"of the list share a parameter",
)

BY_DESIGN: dict[str, ByDesign] = {
    "test_partial_group_forward_then_standalone": _LIST_INPUT,
    "test_train_shared_params_uneven_shard": _LIST_INPUT,
}


def by_design(nodeid: str, error_type: str, message: str) -> ByDesign | None:
    """The listed difference a failure of ``nodeid`` (``file::Class::test[params]``) is, or None."""
    listed = BY_DESIGN.get(nodeid.split("::")[-1].split("[")[0])
    return listed if listed is not None and listed.matches(error_type, message) else None
