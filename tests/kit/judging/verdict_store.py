"""One execution of a case serves both nbval and pytest in one test session.

``make test`` runs the level notebooks first (nbval executes every case there, on the session's
cluster); each notebook's run cell hands its verdicts to the store named by ``HPKIT_VERDICT_STORE``
(set by the root ``conftest.py`` for the session, inherited by the notebooks' kernels). The pytest
test of a case then judges that same verdict, whole (every check, the failure and its stacks)
instead of running the case a second time. Outside such a session nothing is stored and every
pytest case runs its own case.

A stored verdict is used only by a session that judges the same implementation, and never when
cases are to run on fresh engines (``--isolate``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from tests.kit.judging.case import Check, case_by_id
from tests.kit.judging.verdict import Verdict

STORE_ENV = "HPKIT_VERDICT_STORE"
_FIELDS = ("series", "figures", "failure", "failure_kind", "unsupported", "origin", "seconds", "leak", "notes")


def _path(case_id: str, implementation: str) -> Path | None:
    folder = os.environ.get(STORE_ENV, "")
    if not folder:
        return None
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", implementation or "ours")
    return Path(folder) / key / f"{case_id}.json"


def share(verdict: Verdict, implementation: str) -> None:
    """Keep ``verdict`` (of ``implementation``, '' = ours) for this session's pytest cases, if a
    store is set (else nothing)."""
    path = _path(verdict.case.id, implementation)
    if path is None:
        return
    data = {name: getattr(verdict, name) for name in _FIELDS}
    data["checks"] = [dataclasses.asdict(check) for check in verdict.checks]
    data["implementation"] = implementation
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".part")
    temporary.write_text(json.dumps(data, default=str))
    temporary.replace(path)  # a reader never sees half a verdict


def shared(case_id: str, implementation: str) -> Verdict | None:
    """The verdict a notebook of this session recorded for ``case_id`` under ``implementation``."""
    path = _path(case_id, implementation)
    if path is None or not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("implementation", "") != implementation:
        return None
    verdict = Verdict(case_by_id(case_id), checks=[Check(**check) for check in data.pop("checks")])
    for name in _FIELDS:
        setattr(verdict, name, data[name])
    return verdict
