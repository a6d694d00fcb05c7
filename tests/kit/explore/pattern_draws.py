"""The Hypothesis strategies of L4's usage patterns (``tests.kit.explore.patterns``) and the small
helpers every strategy of ``tests.kit.explore.draws`` shares: a pattern is an option of the one grammar,
drawn where the implementation declares it, so each composes with every other feature and mesh."""

from __future__ import annotations

import functools
from typing import Any

import torch
from hypothesis import strategies as st

from tests.kit.explore.space import Config, Precision


def one_in(draw: Any, n: int) -> bool:
    """True one time in ``n``; False where Hypothesis shrinks to, so a shrunk configuration keeps
    only the options its failure needs."""
    return draw(st.integers(1, n)) == n


def mostly(draw: Any) -> bool:
    """True three times in four (2..4 of 1..4), False where Hypothesis shrinks to (1): an option the
    simplest configurations should carry too (Hypothesis draws them at the ends of every range, so
    what ``one_in`` draws tends to come only with the other rare options)."""
    return draw(st.integers(1, 4)) > 1


@functools.cache
def grad_dtype_settable() -> bool:
    """Whether this torch lets a bf16 param hold an fp32 ``.grad`` once its ``grad_dtype`` says so (2.9 has
    ``grad_dtype``, but only autograd's accumulation follows it there): the reference sets its grads so."""
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
    try:
        param.grad_dtype = torch.float32
        param.grad = torch.zeros(1)
    except (AttributeError, RuntimeError):
        return False
    return True


@st.composite
def patterns(draw: Any, config: Config, features: frozenset[str]) -> None:
    """FSDP2 users' patterns (``tests.kit.explore.patterns``), each where declared: every param frozen
    through the first forward; a head run only on each step's last micro-batch (``groups`` decides
    whether it is in a call of its own); views modified in place; intermediates the loss reads; the
    optimizer built after a first forward; a block calling the head, which runs again after it; two
    forwards before one backward; a head run on some ranks only."""
    if "freeze_through_lazy_init" in features and one_in(draw, 5):
        config.freeze_first = True
    if {"first_grad_on_synced_microbatch", "unit_skips_nosync_microbatches"} & features and one_in(draw, 4):
        config.late = True
    if "ranks_skip_params" in features and config.world > 1 and one_in(draw, 5):
        # the head on some ranks only, in the root's call: its params get no grad on the others
        ranks = st.sets(st.integers(0, config.world - 1), min_size=1, max_size=config.world - 1)
        config.late_ranks = sorted(draw(ranks))
        config.late = config.late and "first_grad_on_synced_microbatch" in features  # then in the root's call too
    config.inplace_view = "inplace_on_output_view" in features and one_in(draw, 5)
    config.stored_loss = "stored_intermediate_loss" in features and one_in(draw, 5)
    config.optimizer_late = "optimizer_after_forward" in features and one_in(draw, 6)
    config.calls_again = "list_module_called_again" in features and one_in(draw, 5)
    # the state dict's tensors hold the params' storage: a cast after sharding would leave a plain model's stale too
    config.early_state_dict = "state_dict_before_forward" in features and not config.cast and one_in(draw, 5)
    plain_fp32 = config.precision == Precision() and not config.cast and not config.init  # (to_empty swaps params)
    if "grad_dtype" in features and grad_dtype_settable() and plain_fp32 and one_in(draw, 5):
        config.grad_dtype = True  # bf16 params, fp32 grads
        config.optimizer = "sgd"  # torch's AdamW refuses a grad whose dtype is not its param's
    config.forwards = 2 if "two_forwards_one_backward" in features and one_in(draw, 5) else 1


@st.composite
def toggles(draw: Any, config: Config, owners: list[str]) -> None:
    """``freeze_across_steps``: a module's params frozen before a drawn step, and at times trainable
    again before a later one (or another module's flipped there); never the root's own param, so the
    loss always needs a grad."""
    first = draw(st.integers(0, len(config.steps) - 1))
    config.steps[first].toggle = draw(st.sampled_from(owners))
    if first + 1 < len(config.steps) and draw(st.booleans()):
        later = draw(st.sampled_from(config.steps[first + 1 :]))
        later.toggle = config.steps[first].toggle if mostly(draw) else draw(st.sampled_from(owners))
