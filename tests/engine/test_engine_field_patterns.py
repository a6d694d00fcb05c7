"""Usage patterns from torch FSDP2's tracker that crash or mistrain FSDP2 (issue 52): ours trains as the
plain model does, or refuses at the optimizer step naming the param and the fix. Rank bodies live in
``_ranks_field_patterns.py``; docs/api.md lists each pattern with FSDP2 2.13's result beside ours."""

from __future__ import annotations

import pytest

from tests.engine import _ranks_field_patterns as ranks

pytestmark = pytest.mark.engine

# (where, reshard_after_forward, bf16, input needs grad): pytorch#173709 and the variants around it
STORED = [
    ("root", None, False, True),
    ("root", None, False, False),
    ("root", True, False, True),
    ("root", True, True, False),
    ("root", False, False, False),
    ("adds only", None, False, False),
    ("adds only", True, False, False),
    ("child", True, False, True),
    ("child", True, True, True),
    ("child", True, False, False),
    ("child", False, False, True),
    ("checkpointed child", True, False, True),
    ("checkpointed child", True, True, False),
]


def test_loss_from_a_stored_intermediate(cluster):
    """A loss read from a tensor the forward stored on the module: grads land (no silent None) and the
    resharded params are gathered again for backward (no freed storage), root or child, = the baseline."""
    cluster.run(ranks.stored_intermediate_loss, 2, configs=STORED)


def test_loss_from_a_stored_intermediate_4_ranks_post_forward_mesh(cluster):
    """The same at 4 ranks, the child keeping its rows over 2 ranks after forward (an int reshard)."""
    cluster.run(ranks.stored_intermediate_loss, 4, configs=[("child", 2, False, True), ("root", True, False, False)])


def test_outputs_hidden_from_the_hooks(cluster):
    """An in-place op on a view a sharded child returned (pytorch#181832), an output in a container no
    engine opens: = the baseline."""
    configs = [("inplace", True, False), ("inplace", True, True), ("inplace", False, False), ("box", True, False)]
    cluster.run(ranks.outputs_hidden_from_hooks, 2, configs=configs)


@pytest.mark.parametrize("comm_fusion, opt_in", [(True, False), (False, False), (True, True)])
def test_params_some_ranks_skip(cluster, comm_fusion, opt_in):
    """A param used on rank 0 alone (pytorch#158719): no collective mismatch, = DDP(find_unused_parameters)."""
    cluster.run(ranks.params_some_ranks_skip, 2, comm_fusion=comm_fusion, opt_in=opt_in)


def test_params_some_ranks_skip_4_ranks(cluster):
    cluster.run(ranks.params_some_ranks_skip, 4, comm_fusion=True, opt_in=False)


@pytest.mark.parametrize("reshard", [True, False])
def test_grad_dtype_kept(cluster, reshard):
    """``grad_dtype`` set before ``fully_shard`` (pytorch#170648): fp32 grads of bf16 params, accumulated in fp32."""
    cluster.run(ranks.grad_dtype_kept, 2, reshard=reshard)


def test_grad_dtype_of_params_frozen_while_sharded(cluster):
    """``grad_dtype`` on params frozen at ``fully_shard``, unfrozen after: their grads still fp32 (L4, 690dd2680a)."""
    cluster.run(ranks.grad_dtype_kept, 2, reshard=True, frozen_then=True)


def test_optimizer_built_after_a_forward(cluster):
    """An optimizer over the copies a root keeps gathered after forward: refused at its step, with the fix."""
    cluster.run(ranks.optimizer_after_a_forward, 2)


def test_optimizer_built_after_a_forward_over_the_rows_kept(cluster):
    """An optimizer over the rows a child keeps after forward (reshard_after_forward=2, 4 ranks; L4's find,
    replay 213a314616): refused at its step, with the fix, not stepped silently."""
    cluster.run(ranks.optimizer_after_a_forward, 4, rows=True)


@pytest.mark.parametrize("built", ["before the first forward", "between steps"])
def test_param_registered_again(cluster, built):
    """A plain param registered again: the forward uses it; an optimizer over the replaced tensor is refused."""
    cluster.run(ranks.param_registered_again, 2, built=built)


@pytest.mark.parametrize("bf16, gathered", [(True, False), (False, False), (False, True)])
def test_frozen_through_the_first_forward(cluster, bf16, gathered):
    """All params frozen through lazy init, then unfrozen (pytorch#186998), also while gathered: = the baseline."""
    cluster.run(ranks.frozen_through_first_forward, 2, bf16=bf16, gathered=gathered)


@pytest.mark.parametrize("reshard", [True, False])
def test_a_list_calls_module_called_again(cluster, reshard):
    """A list call's module called inside another's forward and again outside, its first output stored
    and read by the loss (pytorch#183702): = DDP."""
    cluster.run(ranks.list_member_called_again, 2, reshard=reshard)


def test_a_module_frozen_while_its_rows_are_kept_gets_no_grad(cluster):
    """Frozen between a forward and the next while its call keeps its rows, unused params reduced: no grad."""
    cluster.run(ranks.frozen_while_rows_kept, 4)
