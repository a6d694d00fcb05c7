"""Engine mixed-precision and offload tests: each row of the plan's mixed-precision matrix."""

from __future__ import annotations

import pytest

from tests.engine import _ranks_precision as ranks

pytestmark = pytest.mark.engine

# (param, reduce, output, cast_forward_inputs, main grad): the rows of CASES.md's MP coverage
MATRIX = {
    "fp32_default": dict(param_dtype="fp32"),
    "fp16_fp32": dict(param_dtype="fp16", reduce_dtype="fp32"),
    "bf16_fp32_fp32": dict(param_dtype="bf16", reduce_dtype="fp32", output_dtype="fp32"),
    "bf16_bf16_bf16": dict(param_dtype="bf16", reduce_dtype="bf16", output_dtype="bf16"),
    "fp16_fp32_no_input_cast": dict(param_dtype="fp16", reduce_dtype="fp32", cast_forward_inputs=False),
    "fp16_fp32_main_grad": dict(param_dtype="fp16", reduce_dtype="fp32", main_grad=True),
    "bf16_fp32_unfused": dict(param_dtype="bf16", reduce_dtype="fp32", comm_fusion=False),
}


@pytest.mark.parametrize("policy", MATRIX.values(), ids=MATRIX.keys())
def test_mixed_precision_row(cluster, policy):
    cluster.run(ranks.mixed_precision_matches_reference, 2, **policy)


def test_mixed_precision_hsdp(cluster):
    cluster.run(ranks.mixed_precision_matches_reference, 4, param_dtype="bf16", reduce_dtype="fp32", mesh_shape=(2, 2))


@pytest.mark.parametrize(
    "options",
    [dict(), dict(main_grad=True), dict(main_grad=True, sync_each_micro_step=True)],
    ids=["unreduced_fp32", "main_grad_unreduced", "main_grad_across_reductions"],
)
def test_mixed_precision_gradient_accumulation(cluster, options):
    cluster.run(ranks.mixed_precision_accumulation, 2, **options)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_mixed_precision_with_checkpointing(cluster, use_reentrant):
    cluster.run(ranks.mixed_precision_with_checkpointing, 2, use_reentrant=use_reentrant)


def test_ignored_params_never_cast(cluster):
    cluster.run(ranks.ignored_params_never_cast, 2)


@pytest.mark.parametrize("pin_memory", [True, False], ids=["pinned", "unpinned"])
def test_cpu_offload_matches_ddp(cluster, pin_memory):
    cluster.run(ranks.cpu_offload_matches_ddp, 2, pin_memory=pin_memory)
