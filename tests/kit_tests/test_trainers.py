"""The trainer judge's own logic (``tools/trainers``), without torchtitan: step comparison, the page,
and the attention shim's numerics (its trainer runs are never part of ``make test``)."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from tools.trainers.__main__ import CONFIGS, page
from tools.trainers.compare import compare, owed
from tools.trainers.rank import SHIMS, masked_sdpa

REFERENCE = [{"step": s, "loss": 8.0 - 0.1 * s, "grad_norm": 0.8 + 0.01 * s} for s in (1, 2, 3)]


def test_equal_runs_are_bitwise_and_owe_nothing():
    result = compare(REFERENCE, [dict(s) for s in REFERENCE], None)
    assert result.verdict == "BITWISE" and not owed(result)


def test_a_last_digit_difference_is_found_at_its_step():
    steps = [dict(s) for s in REFERENCE]
    steps[1]["grad_norm"] = float(torch.nextafter(torch.tensor(steps[1]["grad_norm"], dtype=torch.float64),
                                                  torch.tensor(2.0, dtype=torch.float64)))  # fmt: skip
    result = compare(REFERENCE, steps, None)
    assert result.verdict == "DIFFERS" and result.first_difference == 2 and owed(result)
    close = compare(REFERENCE, steps, 1e-6)
    assert close.verdict == "CLOSE" and close.first_difference == 2 and not owed(close)


def test_a_run_that_stopped_early_is_incomplete():
    result = compare(REFERENCE, REFERENCE[:2], None)
    assert result.verdict == "INCOMPLETE" and owed(result)
    assert compare([], [], None).verdict == "INCOMPLETE"


def test_the_page_shows_every_configuration_verdict_and_shim():
    runs = {"torch": {"exit": 0, "steps": REFERENCE}, "ours": {"exit": 0, "verdict": "BITWISE", "detail": ""}}
    results = {"implementations": {"ours": ""}, "shims": list(SHIMS), "fsdp2_needs": ["force-sum"], "steps": 5,
               "torch": "2.13.0", "configs": {name: runs for name in CONFIGS}}  # fmt: skip
    shown = page(results)
    assert "5 steps each" in shown and "torch 2.13.0" in shown and "#dff5df" in shown
    assert all(name.split(" (")[0] in shown for name in CONFIGS)
    assert shown.count("BITWISE") == len(CONFIGS) and shown.count("reference") == len(CONFIGS)
    assert all(shim.split(":")[0] in shown for shim in SHIMS) and "force-sum" in shown


def test_the_attention_shim_computes_flex_attentions_forward():
    """The SDPA stand-in (flex attention's backward is refused on the CPU) gives flex's causal result."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 2, 1, 16, 16, device="cpu")
    want = flex_attention(q, k, v, block_mask=mask)
    got, _ = masked_sdpa(q, k, v, block_mask=mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    unmasked, _ = masked_sdpa(q, k, v)
    assert not torch.allclose(unmasked, want, atol=1e-3)  # the mask is what makes them agree
