"""The plan's assertions of its L2 (feature coupling) cases, row by row (data: the plan's tables)."""

from __future__ import annotations

from tests.kit.plan.assertions import AC, CLEAN, SINGLE, TIMEOUT, Assertion

L2: dict[str, tuple[Assertion, ...]] = {
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
    "L2-03": AC,
    "L2-04": (
        *AC,
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
        *AC,
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
}
