"""The diagnosis's accuracy on the mutants of ``tools/mutants``: does it name where each bug acts?

Each mutant below is written down with where its edit acts, from the edit alone (before any run):
the phase of a training step its wrong value first appears in, and the modules or param groups it
touches (a pattern over module paths; ``.`` where it acts on every group alike), with the traced
precision cases that use its feature. A run applies one mutant at a time to a copy of the engine,
diagnoses those cases on it (``native:COPY``) and, for every case the mutant makes FAIL, compares
the first divergence with the ground truth. Mutants whose feature no traced case exercises, or that
change no number (a prefetch order, a storage left allocated, a check of arguments), are not listed.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.kit.judging.divergence import Diagnosis
from tools.mutants.catalogue import by_id
from tools.mutants.runner import apply_mutant

REPO = Path(__file__).resolve().parents[2]
ANY = "."


@dataclass(frozen=True)
class Where:
    """Where a mutant's edit acts: the phase its wrong value first shows in, the modules it touches."""

    phase: str
    module: str  # a regular expression over module paths (``re.search``)
    cases: tuple[str, ...]
    why: str


GROUND_TRUTH: dict[str, Where] = {
    "02": Where("reduction", ANY, ("L1-02",), "the replicate all-reduce of the groups below is switched too"),
    "03": Where("reduction", ANY, ("L1-06",), "ignored params' grads are not cleared: their grads accumulate"),
    "06": Where("reduction", ANY, ("L2-01", "L1-09"), "the groups below land or hold their reductions wrongly"),
    "09": Where("forward", ANY, ("L1-10", "L1-11", "L1-12"), "inputs reach the first module uncast"),
    "10": Where("forward", ANY, ("L1-02", "L3-01"), "each rank's shard holds other rows: the first gather is wrong"),
    "11": Where("reduction", ANY, ("L1-02", "L3-01"), "the replicate all-reduce runs over the shard dim"),
    "12": Where("forward", ANY, ("L1-02", "L3-01"), "shards cut over the whole mesh: the gathered params are wrong"),
    "13": Where("forward", ANY, ("L1-07", "L3-04"), "uneven params lose their last rows when sharded"),
    "14": Where("forward", ANY, ("L1-07", "L3-04"), "uneven params' shards start at the wrong row"),
    "16": Where("reduction", ANY, ("L1-13",), "the main grad keeps stale values under a new reduction"),
    "17": Where("reduction", ANY, ("L1-13", "L1-12"), "unsynced grads accumulate in the compute dtype"),
    "19": Where("reduction", ANY, ("L2-01", "L1-09"), "a reduced grad replaces the accumulated one"),
    "21": Where("reduction", ANY, ("L2-01",), "zero_grad keeps the unsynced accumulation"),
    "22": Where("reduction", ANY, ("L1-13",), "zero_grad keeps the main grad"),
    "23": Where("reduction", ANY, ("L2-01", "L1-13"), "a no-sync backward replaces the unreduced grad"),
    "24": Where("forward", ANY, ("L1-01", "L1-05", "L1-09"), "a group kept unsharded computes with pre-step params"),
    "28": Where("reduction", ANY, ("L1-02",), "the all-reduce follows the gradient-sync flag"),
    "29": Where("reduction", ANY, ("L1-02", "L3-01"), "HSDP grads summed over the replicas"),
    "30": Where("reduction", ANY, ("L1-08", "L3-02"), "every param of a fused group reads the first's grad rows"),
    "31": Where("reduction", ANY, ("L2-10",), "sum requested, reduce-scatter averages"),
    "32": Where("reduction", ANY, ("L1-10",), "grads reduced in the compute dtype"),
    "34": Where("reduction", ANY, ("L2-01", "L1-13"), "a reduced accumulator is added again next backward"),
    "36": Where("backward", ANY, ("L2-03",), "a re-entrant recompute computes with the sharded params"),
    "38": Where("forward", ANY, ("L1-10", "L1-11", "L1-12"), "nested or keyword inputs reach modules uncast"),
    "39": Where("forward", ANY, ("L1-10", "L1-11"), "outputs keep the compute dtype"),
    "41": Where("reduction", ANY, ("L2-10",), "the groups below keep the default reduce op"),
    # the tie is lost as fully_shard sets up: the model's head has a weight of its own, a difference of structure
    "42": Where("structure", r"head|embed", ("L3-02", "L3-01"), "the tied head computes with the sharded weight"),
    "44": Where("reduction", ANY, ("L2-09",), "a pipeline's later microbatches' grads are not reduced"),
    "46": Where("backward", ANY, ("L1-01",), "backward gathers an int-resharded group over the wrong ranks"),
    "56": Where("reduction", ANY, ("L2-02", "L2-08"), "a rank that skipped a param reduces fewer grads"),
    "62": Where("reduction", ANY, ("L1-12", "L1-13"), "a force-sum reduction is never divided"),
    "63": Where("reduction", ANY, ("L1-09",), "sync off on one call turns it off below"),
    "66": Where("forward", ANY, ("L1-05",), "a gather issued before the step is taken as fresh after it"),
    "70": Where("forward", ANY, ("L1-05",), "an in-flight gather from before the step is used after it"),
}


def mutated_engine(mutant_id: str) -> Path:
    """A copy of this checkout's engine package with the mutant's edit made (the caller removes it)."""
    root = Path(tempfile.mkdtemp(prefix=f"hpkit-diagnosis-{mutant_id}-"))
    shutil.copytree(REPO / "hyper_parallel", root / "hyper_parallel")
    apply_mutant(root, by_id()[mutant_id])
    return root


def judged(where: Where, diagnosis: Diagnosis) -> tuple[bool, str]:
    """(right, what the diagnosis named) for a mutant that made the case FAIL, or raise."""
    crash = diagnosis.crash
    if crash is not None:
        named = f"{crash['step']} {crash['phase']} {crash['module'] or '(root)'} (raised {crash['error'][:60]})"
        right = crash["phase"] == where.phase and re.search(where.module, crash["module"] or "(root)") is not None
        return right, named
    first = diagnosis.first_divergence()
    if first is None:
        return False, diagnosis.line().split(": ", 1)[-1]
    named = f"{first['step']} {first['phase']} {first['module'] or '(root)'} {first['tensor']}"
    right = first["phase"] == where.phase and re.search(where.module, first["module"] or "(root)") is not None
    return right, named


def row(mutant_id: str, case_id: str, diagnosis: Diagnosis) -> dict[str, Any]:
    where = GROUND_TRUTH[mutant_id]
    # a precision failure: a check comparing a value with the baseline's fails (not a state check)
    failed = (diagnosis.status == "FAIL" and diagnosis.compared_failing) or diagnosis.crash is not None
    right, named = judged(where, diagnosis) if failed else (None, "")
    return {
        "mutant": mutant_id,
        "case": case_id,
        "status": "FAIL (no comparison)" if diagnosis.status == "FAIL" and not failed else diagnosis.status,
        "expected": f"{where.phase} {where.module if where.module != ANY else '(any group)'}",
        "named": named,
        "right": right,
        "line": diagnosis.line(),
        "seconds": round(diagnosis.seconds, 1),
    }
