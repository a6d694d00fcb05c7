"""Joining a running cluster: every engine its controller lists must answer, in bounded time."""

from __future__ import annotations

import os
import time
from typing import Any

# how long each engine gets to answer, and how long an engine that died may stay listed (the controller
# drops it after its missed heartbeats: 60 x 0.5 s, as the kit starts its clusters)
JOIN_ANSWER_S = 10.0
JOIN_SETTLE_S = 45.0


def answering_engines(client: Any, cluster_id: str) -> list[int]:
    """The ids of the cluster's engines, once every engine the controller lists answers. An engine that
    died stays listed until the controller misses its heartbeats: its id is asked again until then, and
    one that never answers is named in the error, never waited on without end."""
    deadline = time.monotonic() + JOIN_SETTLE_S
    while True:
        eids = sorted(client.ids)
        if not eids:
            raise RuntimeError(f"cluster {cluster_id!r} has no engines")
        pending = {eid: client[eid].apply_async(os.getpid) for eid in eids}
        silent = []
        for eid, answer in pending.items():
            try:
                answer.get(timeout=max(0.1, min(JOIN_ANSWER_S, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - a timeout, or the engine's death reported
                silent.append(eid)
        if not silent:
            return eids
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"cluster {cluster_id!r}: engines {silent} do not answer within {JOIN_SETTLE_S:.0f} s "
                "(dead or busy): restart them, or join once the controller has dropped them"
            )
        time.sleep(1.0)
