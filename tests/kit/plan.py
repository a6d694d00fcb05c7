"""The plan's assertions, case by case, and the checks that judge each (plan fidelity).

Every row of the plan's L1-L3 tables lists core assertions (the plan, ``v1.1``: "核心断言" and the
"L3 assertion specs"). Each becomes an ``Assertion`` here: what the plan asks (in English), the
checks that judge it (a regular expression searched in the check names a case records), the
baseline they compare with, and where the kit reads the plan differently, with the triage. A
case's other layouts (``L3-01-FSDP``, ``L3-02-HSDP``, ...) are judged by their base case's rows.

``judge(verdict)`` turns a verdict into one row per assertion (the head of every case page, and the
table in docs/plan_fidelity.md, generated from here by ``python docs/catalogue.py``);
``tests/kit/test_plan_fidelity.py`` checks that every assertion is judged by at least one check in
a real run, so a renamed or dropped check cannot leave a plan assertion silently unchecked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.kit.checks import Check
    from tests.kit.verdict import Verdict

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
    kinds: set[str] = field(default_factory=set)  # how its checks judge (tests.kit.checks.Check.kind)
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

_AC = (
    Assertion("loss atol=1e-5", r"step \d+ loss$", SINGLE + ", without AC"),
    Assertion("per-layer grad norm atol=1e-5", r"step \d+ grad norm blocks\.\d+$", SINGLE + ", without AC"),
    Assertion("first and last layer grad tensors atol=1e-5 vs single card", r"step \d+ grad blocks\.[05]\.", SINGLE),
)

_LLM = (
    Assertion("step 0 loss atol=1e-5; step 1 loss (after the optimizer update) atol=1e-5", r"^step [01] loss$", DDP),
    Assertion("global grad norm atol=1e-5", r"^step \d+ grad norm$", DDP),
    Assertion("first layer attention weight grad atol=1e-5", r"^step \d+ grad layers\.0\.attn\.\w+\.weight$", DDP),
    Assertion("last layer FFN weight grad atol=1e-5", r"^step \d+ grad layers\.3\.ffn\.\w+\.weight$", DDP),
    *L3_RULES,
)

_BF16_STORED = (
    'the plan\'s "params stored as bf16" is read as the compute params (the unsharded ones forward '
    "uses, and the all-gathers) in bf16; the sharded params stay fp32 master weights, as in FSDP2 and "
    "HyperParallel's policy"
)
_SINGLE_BF16 = "the plan's single card in bf16 on the global batch (SameDtypeReference(global_batch=True))"
_SAME_DTYPE_EXTRA = (
    "kept beside it as an extra: the same-dtype data-parallel reference, which repeats the engine's "
    "arithmetic (worst error 0)"
)

PLAN: dict[str, tuple[Assertion, ...]] = {
    "L1-01": (
        Assertion(
            "set_reshard_after_forward(False): after forward param.data.numel() == full numel; toggled back "
            "to True: shard numel",
            r"reshard_after_forward=(True|False): after forward: local numel",
            LAYOUT,
            tol="exact",
        ),
        Assertion(
            "set_reshard_after_backward: the same after backward",
            r"reshard_after_backward=(True|False): after backward: local numel",
            LAYOUT,
            tol="exact",
        ),
        Assertion(
            "switching dynamically raises nothing",
            r"set_reshard_after_forward\(\w+\), set_reshard_after_backward\(\w+\) raise nothing",
            "no exception",
            tol="property",
        ),
    ),
    "L1-02": (
        Assertion(
            "all-reduce off: the two replica groups' grads differ",
            r"all-reduce off step \d+ grad .*: replica groups differ",
            "the other replica group's grad of the same shard (gap > 1e-6)",
            tol="replica agreement",
        ),
        Assertion(
            "all-reduce on: the replica groups' grads agree, atol=1e-6",
            r"all-reduce on step \d+ grad .*: replica groups agree",
            "the other replica group's grad of the same shard",
            tol="replica agreement",
        ),
        Assertion(
            "recurse=False affects only the top-level module",
            r"^root recurse=False",
            "DDP over the replica group (the root's own group) and over all 4 ranks (the children's)",
        ),
    ),
    "L1-03": (
        Assertion('"sum": grad == ref_grad x world_size', r" sum grad .*\(x\d+\)$", DDP + ", grads x world size"),
        Assertion('"avg": grad == ref_grad', r" (avg|default) grad .*\(x1\)$", DDP),
        Assertion(
            "switching mid-training does not pollute the optimizer state",
            r"optimizer exp_avg",
            "Adam fed DDP's grads (x world size in the sum steps)",
        ),
    ),
    "L1-04": (
        Assertion(
            "zero_grad() after N accumulated steps: param.grad is None",
            r"zero_grad\(set_to_none=\w+\): .*\.grad (is None|zeros)$",
            "None (zeros with set_to_none=False)",
            tol="exact",
        ),
        Assertion(
            "param.data equals its snapshot",
            r"zero_grad.*: .* data unchanged$",
            "the params before zero_grad",
            tol="exact",
        ),
        Assertion(
            "the next backward produces fresh grads",
            r"next step \(fresh, = one-step DDP\) grad|next step grad norm",
            "DDP's grads of that one step",
        ),
    ),
    "L1-05": (
        Assertion(
            "idempotent: repeated unshard / reshard calls raise nothing",
            r"unshard\(async_op=True\) x2, wait\(\)$|wait\(\) x4 more, unshard\(\)$|reshard\(\) x2$|"
            r"all-gathers of the repeated unshards|collectives issued by reshard",
            "no exception, no further collective",
            tol="property",
        ),
        Assertion("numel correct (shard / full)", r" (unsharded|resharded): local numel", LAYOUT, tol="exact"),
        Assertion(
            "async_op=True: the params are readable once the handle's wait() returns",
            r"right after the first handle's wait\(\)",
            "full numel, plain tensors, the reference weights",
        ),
    ),
    "L1-06": (
        Assertion(
            "the ignored param is a plain Tensor, not a DTensor",
            r"the ignored param is not sharded|ignored grad: a plain tensor|the ignored param is still the user's",
            "a plain tensor",
            tol="property",
        ),
        Assertion(
            "numel == full numel",
            r"ignored param's numel == full numel|ignored grad: numel == full numel",
            "the param's numel before fully_shard",
            tol="exact",
        ),
        Assertion(
            "its grad is not synchronised across ranks",
            r"ignored grad: differs across ranks",
            "the other rank",
            tol="property",
        ),
        Assertion(
            "the other params reduce-scatter as usual",
            r"elements reduce-scattered: the managed grads only|^step \d+ grad (norm|layers)",
            "DDP told to ignore the same param",
        ),
    ),
    "L1-07": (
        Assertion(
            "dim-1 sharding: param.shape[1] == full_shape[1] // world_size",
            r"Shard\(1\): local shape\[1\] == full_shape\[1\] // world_size",
            "the full shape",
            tol="exact",
        ),
        Assertion("loss and grads atol=1e-5 vs single card", r"^Shard\(1\) step \d+ (loss|grad)", SINGLE),
        Assertion(
            "Replicate() returned: shape == full_shape",
            r"Replicate\(\): local shape == full shape",
            "the full shape",
            tol="exact",
        ),
    ),
    "L1-08": (
        Assertion(
            "abs(loss_fusion - loss_nofusion) < 1e-6",
            r"fused vs unfused: loss$",
            "the unfused run's loss (the same data, model and seed)",
            tol="comm fusion equivalence",
        ),
        Assertion(
            "per-param grad atol=1e-6",
            r"fused vs unfused: grad (?!norm)",
            "the unfused run's grads",
            tol="comm fusion equivalence",
        ),
    ),
    "L1-09": (
        Assertion(
            "returns a list; both elements have the HSDPModule interface",
            r"^returns a list$|^element \d is an HSDPModule$|^element \d is listed module",
            "list, HSDPModule",
            tol="property",
        ),
        Assertion(
            "independent control: one does not disturb the other",
            r"^controlling layers\.\d",
            "the other group's layout and grads as without the control (DDP)",
        ),
        Assertion("both grads finite", r"grad .* finite$", "finite", tol="property"),
    ),
    "L1-10": (
        Assertion(
            "params stored as bf16",
            r"vs single card (compute param|all-gather) dtype",
            "torch.bfloat16",
            reading=_BF16_STORED,
            tol="exact",
        ),
        Assertion(
            "after the reduction the grad is fp32",
            r"vs single card (reduction dtype|step \d+ grad dtype)",
            "torch.float32",
            tol="exact",
        ),
        Assertion(
            "loss and grad norm atol=1e-3 vs the single-card bf16 reference",
            r"vs single card step \d+ (loss|grad norm)$",
            _SINGLE_BF16,
            reading=_SAME_DTYPE_EXTRA,
        ),
    ),
    "L1-11": (
        Assertion(
            "bf16 throughout",
            r"vs single card (compute param|all-gather|reduction|compute grad) dtype",
            "torch.bfloat16",
            reading=_BF16_STORED,
            tol="exact",
        ),
        Assertion("the output tensor's dtype is bf16", r"vs single card output dtype", "torch.bfloat16", tol="exact"),
        Assertion(
            "the grad dtype is bf16",
            r"vs single card compute grad dtype|vs single card reduction dtype",
            "torch.bfloat16",
            reading="the grads autograd computes and the ones on the wire are bf16 (checked); param.grad, the "
            "sharded grad, keeps the fp32 master's dtype (checked too), as FSDP2 does",
            tol="exact",
        ),
        Assertion(
            "loss atol=1e-3",
            r"vs single card step \d+ loss$",
            _SINGLE_BF16,
            reading=_SAME_DTYPE_EXTRA,
        ),
    ),
    "L1-12": (
        Assertion(
            "inputs are not cast (a forward hook sees the input dtype unchanged)",
            r"dtype its forward receives == dtype passed in|input dtype seen by the first layer",
            "the dtype the caller passed (fp32)",
            tol="exact",
        ),
        Assertion("the loss is finite", r"loss finite$", "finite", tol="property"),
        Assertion("no dtype-mismatch error", r"training raises nothing", "no exception", tol="property"),
    ),
    "L1-13": (
        Assertion(
            "grads accumulate into the fp32 main grad",
            r"accumulated grad|is one persistent buffer|is its main_grad",
            "SameDtypeReference accumulating in fp32",
            tol="fp32 main grad",
        ),
        Assertion("param.grad's dtype is fp32", r"main_grad dtype", "torch.float32", tol="exact"),
        Assertion(
            "precision atol=1e-5 vs the fp32 single-card reference",
            r"accumulated grad|^step \d+ (grad|param)",
            "the same-fp16-compute reference (fp32 accumulation and reduction)",
            reading="fp16 compute cannot meet 1e-5 of fp32 (fp16's unit roundoff is 4.9e-4): judged against "
            "the same fp16 compute at the plan's 1e-5; the gap to the fp32 single card is measured and "
            "drawn on the case's page beside what fp16 compute alone does",
            tol="fp32 main grad",
        ),
    ),
    "L2-01": (
        Assertion(
            "after N micro-steps the merged grad == the large-batch DDP grad, atol=1e-5",
            r"^(fused|unfused|kept after forward) step \d+ grad",
            "DDP accumulating the same micro-batches under no_sync",
        ),
        Assertion(
            "intermediate micro-steps: grads differ across ranks (not synchronised)",
            r"accumulated local grads differ|\(sync off\): (reduce-scatters|all-reduces)|untouched while held back",
            "no reduction; the model's grads as before the micro-step",
            reading="the ranks' held-back grads live inside the implementation: the kit checks that DDP's local "
            "grads differ (the precondition), that nothing is reduced, and that the model's grads, as the "
            "API shows them, stay untouched",
            tol="property",
        ),
    ),
    "L2-02": (
        Assertion("frozen params' grad is None", r"frozen .*: no grad$", "None", tol="exact"),
        Assertion("their data unchanged", r"frozen .* data unchanged$", "the data before training", tol="exact"),
        Assertion("the other layers' grads atol=1e-5 vs single card", r"^step \d+ grad ", SINGLE),
        Assertion(
            "FSDP starts no reduce-scatter for frozen params",
            r"elements reduce-scattered: the trainable params only",
            "the trainable params' padded shard elements",
            tol="exact",
        ),
    ),
    "L2-03": _AC,
    "L2-04": (
        *_AC,
        Assertion(
            "peak memory below the no-AC baseline",
            r"peak memory with AC < without AC",
            "the same sharded model without AC",
            reading="CPU: the peak of live storages (params, grads, activations, the recompute); an "
            "accelerator: the allocator's peak. Both figures drawn",
            tol="property",
        ),
    ),
    "L2-05": (
        *_AC,
        Assertion(
            "checkpointed layers' forward hooks fire twice per backward step, the others once",
            r"forwards \((not )?checkpointed",
            "2 (forward and recompute) / 1",
            tol="exact",
        ),
    ),
    "L2-06": (
        Assertion("loss atol=1e-5", r"^step \d+ loss$", SINGLE + ", without AC or offload"),
        Assertion("grad norm atol=1e-5", r"^step \d+ grad norm$", SINGLE + ", without AC or offload"),
        Assertion(
            "checkpointed blocks' saved tensors are swapped out and come back for the recompute",
            r"checkpointed blocks whose saved inputs went through save_on_cpu|recomputed from what save_on_cpu handed",
            "torch's save_on_cpu packing every tensor autograd keeps",
            reading="the swap is torch's own save_on_cpu around the whole forward, checkpoints included",
            tol="exact",
        ),
        Assertion(
            "after swapping back to the accelerator: no device mismatch",
            r"devices the saved tensors (were held|came back) on|host copies pinned",
            "the host while held, the compute device after",
            device=True,
            tol="exact",
        ),
        Assertion(
            "during the recompute the activations are on the accelerator",
            r"devices the recomputation ran on",
            "the compute device",
            device=True,
            tol="exact",
        ),
    ),
    "L2-07": (
        Assertion(
            "after clipping the global norm <= max_norm + 1e-6",
            r"global grad norm after clipping",
            "max_norm = half the unclipped global norm",
            tol="clip bound",
        ),
        Assertion("per-param grads atol=1e-5 vs single card", r"^step \d+ grad (?!norm)", SINGLE + ", clipped alike"),
        Assertion(
            "the global norm, not a per-shard norm",
            r"total norm clip_grad_norm_ returns",
            "the single card's total norm",
        ),
    ),
    "L2-08": (
        Assertion("5 steps of different seq_len without a hang (60 s timeout)", "", "60 s", judged_by=TIMEOUT),
        Assertion("every step's loss finite", r"loss finite$", "finite", tol="property"),
        Assertion("grad norm finite", r"grad norm finite$", "finite", tol="property"),
        Assertion(
            "param shapes unchanged", r"local and full shapes unchanged$", "the shapes before training", tol="exact"
        ),
    ),
    "L2-09": (
        Assertion(
            "loss atol=1e-5 vs 4-card DDP",
            r" step \d+ loss$",
            SINGLE + " (both dp ranks' data)",
            reading="the 4 ranks hold 2 stages x 2 data-parallel ranks: the data-parallel math is DDP over the "
            "2 dp ranks, which the single device on their global batch computes exactly",
        ),
        Assertion("stage boundary grads atol=1e-5", r"boundary grad", SINGLE + ": the grad at the stage's input"),
        Assertion("no deadlock (60 s timeout)", "", "60 s", judged_by=TIMEOUT),
    ),
    "L2-10": (
        Assertion("loss atol=1e-4", r"^step \d+ loss$", "the single-device model holding every expert"),
        Assertion(
            "per-expert grad norm atol=1e-4",
            r"grad norm layers\.\d+\.ffn\.experts\.\d+$",
            "the single-device model holding every expert",
            tol="per expert",
        ),
        Assertion("no NCCL error (no collective error)", "", "the run raises nothing", judged_by=CLEAN),
    ),
    "L3-01": _LLM,
    "L3-02": _LLM,
    "L3-03": (
        Assertion("total loss atol=1e-4", r"^step \d+ loss$", "the single-device model holding every expert"),
        Assertion(
            "dense layers' grad norm atol=1e-5",
            r"dense grad norm$",
            "the single-device model",
            tol="dense grad norm under EP",
        ),
        Assertion(
            "per-expert grad norm atol=1e-4",
            r"grad norm layers\.\d+\.ffn\.experts\.\d+$",
            "the single-device model holding every expert",
            tol="per expert",
        ),
        Assertion(
            "global grad norm (the L3 rule's second metric)",
            r"global grad norm$",
            "the single-device model's norm over every param",
            reading="the model's norm counts every expert of every ep rank once and the dense params once",
        ),
        Assertion(
            "all-to-all and all-gather do not conflict (no NCCL error)",
            r"all-to-alls over ep and all-gathers both ran",
            "both collectives in one step; the run raises nothing",
            tol="property",
        ),
        *L3_RULES,
    ),
    "L3-04": (
        Assertion("loss atol=1e-5; grad norm atol=1e-5", r"^step \d+ (loss|grad norm)$", DDP),
        Assertion(
            "patch embedding grad (not sharded): bitwise equal on all ranks and equal to the DDP reference",
            r"patch_embed\.\w+ grad: bitwise equal on all ranks|patch_embed\.\w+ grad \(kept whole\) vs DDP",
            DDP,
            reading="equal to DDP within the row's 1e-5: bitwise would need DDP's bucketed all-reduce order",
        ),
        Assertion("last block MLP weight grad atol=1e-5", r"^step \d+ grad blocks\.5\.mlp\.fc\d\.weight$", DDP),
        *L3_RULES,
    ),
    "L3-05": (
        Assertion("total loss atol=1e-5", r"^step \d+ loss$", DDP + ", computing the same chunked loss"),
        Assertion("per-chunk loss atol=1e-5", r"chunk \d+ loss$", "DDP's chunk losses"),
        Assertion(
            "sum(per_chunk_losses) == total_loss (atol=1e-6)",
            r"sum of chunk losses == total loss",
            "the cross entropy of the whole logits at once, computed apart",
            reading="1e-6 is one ulp of an fp32 loss of 10: each token's CE is fp32 and the means are summed in "
            "float64, so the check tells a wrong chunking (a dropped chunk, one divided by its own length: "
            "errors of 1e-2 and more) from rounding",
            tol="chunk sum",
        ),
        Assertion("grad norm atol=1e-5", r"^step \d+ grad norm$", DDP),
        Assertion("output layer weight grad norm atol=1e-5", r"output \(tied embedding\) weight grad norm", DDP),
        *L3_RULES,
    ),
    "L3-06": (
        Assertion("end-to-end loss atol=1e-5", r"^step \d+ loss$", DDP),
        Assertion("ViT grad norm atol=1e-5", r"vision grad norm$", DDP),
        Assertion("decoder grad norm atol=1e-5", r"language grad norm$", DDP),
        Assertion(
            "projection MLP grad (not sharded) atol=1e-5", r"projector\.\w+\.\w+ grad \(kept whole\) vs DDP", DDP
        ),
        Assertion(
            "gradient crosses the sub-model boundary: projection MLP grad != 0",
            r"projector grad norm > 0",
            "0",
            tol="property",
        ),
        *L3_RULES,
    ),
}


def base_id(case_id: str) -> str:
    """The plan row a case judges: ``L3-01-FSDP`` -> ``L3-01`` (its other layout)."""
    return "-".join(case_id.split("-")[:2])


def assertions_of(case_id: str) -> tuple[Assertion, ...]:
    """The plan's assertions of a case (none for the kit's own L0 cases)."""
    return PLAN.get(base_id(case_id), ())


def judge(verdict: Verdict) -> list[Judged]:
    """One row per plan assertion of the verdict's case."""
    return [_judge_one(assertion, verdict) for assertion in assertions_of(verdict.case.id)]


def _judge_one(assertion: Assertion, verdict: Verdict) -> Judged:
    if assertion.judged_by == TIMEOUT:
        done = verdict.failure_kind != "TIMEOUT" and verdict.failure_kind != "DIED"
        detail = f"{verdict.seconds:.1f} s of {verdict.case.timeout:g} s"
        return Judged(assertion, "pass" if done and verdict.status != "UNSUPPORTED" else "FAIL", detail=detail)
    if assertion.judged_by == CLEAN:
        clean = verdict.failure is None
        return Judged(assertion, "pass" if clean else "FAIL", detail="raised nothing" if clean else "the run failed")
    matched = [c for c in verdict.checks if assertion.matches(c)]
    if not matched:
        noted = assertion.device and any(note.startswith("device part: not run") for note in verdict.notes)
        return Judged(assertion, "not run" if noted else "no check")
    failed = [c for c in matched if not c.passed]
    scored = [c for c in matched if c.error is not None]
    top = max(scored, key=_margin) if scored else None
    names = sorted({c.name for c in (failed or matched)})
    first = (failed or matched)[0]
    seen = f"{_number(first.measured)} vs {_number(first.reference)}" if len(names) == 1 and not scored else ""
    return Judged(
        assertion,
        "FAIL" if failed else "pass",
        checks=len(matched),
        failed=len(failed),
        worst_error=top.error if top else None,
        tol=top.tol if top else None,
        names=names[:3],
        kinds={c.kind for c in matched},
        seen=seen,
    )


def _number(value: float | str) -> str:
    if isinstance(value, float):
        return f"{int(value):,}" if value.is_integer() else f"{value:.4g}"
    return str(value)


def _margin(check: Check) -> float:
    """How close a check came to its tolerance (exact checks: only when they missed)."""
    if check.tol:
        return check.error / check.tol
    return float("inf") if check.error else 0.0
