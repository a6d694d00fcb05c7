"""The plan's assertions of its L1 (the interface) cases, row by row (data: the plan's tables)."""

from __future__ import annotations

from tests.kit.plan.assertions import BF16_STORED, DDP, LAYOUT, SAME_DTYPE_EXTRA, SINGLE, SINGLE_BF16, Assertion

L1: dict[str, tuple[Assertion, ...]] = {
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
            reading=BF16_STORED,
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
            SINGLE_BF16,
            reading=SAME_DTYPE_EXTRA,
        ),
    ),
    "L1-11": (
        Assertion(
            "bf16 throughout",
            r"vs single card (compute param|all-gather|reduction|compute grad) dtype",
            "torch.bfloat16",
            reading=BF16_STORED,
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
            SINGLE_BF16,
            reading=SAME_DTYPE_EXTRA,
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
}
