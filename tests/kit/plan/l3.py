"""The plan's assertions of its L3 (real networks) cases, row by row (data: the plan's tables)."""

from __future__ import annotations

from tests.kit.plan.assertions import DDP, L3_RULES, LLM, Assertion

L3: dict[str, tuple[Assertion, ...]] = {
    "L3-01": LLM,
    "L3-02": LLM,
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
